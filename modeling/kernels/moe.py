"""MoE token kernels of Megatron-Core's alltoall dispatcher with permute fusion, and TE's
grouped linear.

Mirrors, at TransformerEngine d0067d0 (2.20.0.dev0) and Megatron-LM d98e8a6:
- permute: TE ``transformer_engine/pytorch/permutation.py`` ``moe_permute_mask_map_forward``
  (register_fake and setup_context there): outputs the permuted tokens ``(slots, h)``, a
  ``row_id_map`` ``(tokens, 2 * experts + 1)`` int32 and the permuted probabilities
  ``(slots,)`` fp32; saves the row_id_map only. Backward: the token gradient ``(tokens, h)``
  and the probability gradient ``(tokens, experts)`` fp32.
- chunk sort (when a rank holds several experts): TE ``moe_sort_chunks_by_index`` (with
  probabilities): a new ``(rows, h)`` buffer (and ``(rows,)`` probabilities), saves a
  ``(rows,)`` int32 map; backward a ``(rows, h)`` gradient.
- unpermute without merging probabilities (they were applied in the weighted SwiGLU):
  ``moe_unpermute_mask_map_forward``: a ``(tokens, h)`` output, saves the row_id_map (the
  permute's, the same storage); backward a ``(slots, h)`` gradient.
- grouped linear: TE ``module/grouped_linear.py`` ``_GroupedLinear``: one ``(rows, out)``
  output, saves its input (split views of one storage); backward one ``(rows, in)`` dgrad and,
  without ``--gradient-accumulation-fusion``, a weight gradient per expert.
The dispatcher's order is Megatron-Core's ``MoEAlltoAllTokenDispatcher`` (megatron/core/
transformer/moe/token_dispatcher.py): ``dispatch_preprocess`` (permute), ``token_dispatch``
(all-to-all of tokens and of probabilities), ``dispatch_postprocess`` (chunk sort),
``combine_preprocess`` (chunk unsort), ``token_combine`` (all-to-all), ``combine_postprocess``
(unpermute).
"""

from __future__ import annotations

import torch
from torch import Tensor

from modeling.kernels.wgrad import current_store

__all__ = ["te_permute", "te_sort_chunks", "te_unpermute", "te_grouped_linear",
           "megatron_permute", "megatron_unpermute", "megatron_sort_chunks", "masked_select"]


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, probs: Tensor | None, slots: int, num_experts: int):
        tokens, h = x.shape
        out = x.new_empty((slots, h))
        row_id_map = torch.empty((tokens, 2 * num_experts + 1), dtype=torch.int32,
                                 device=x.device)
        permuted_probs = None if probs is None else probs.new_empty((slots,))
        ctx.save_for_backward(row_id_map)
        ctx.shape = x.shape
        ctx.probs_shape = None if probs is None else probs.shape
        ctx.mark_non_differentiable(row_id_map)
        return out, permuted_probs, row_id_map

    @staticmethod
    def backward(ctx, grad_out: Tensor, grad_probs: Tensor | None, _grad_map):
        (row_id_map,) = ctx.saved_tensors
        grad_x = grad_out.new_empty(ctx.shape)
        grad_p = None if ctx.probs_shape is None else torch.empty(
            ctx.probs_shape, dtype=torch.float32, device=grad_out.device)
        return grad_x, grad_p, None, None


def te_permute(x: Tensor, probs: Tensor | None, slots: int, num_experts: int | None = None
               ) -> tuple[Tensor, Tensor | None, Tensor]:
    """``x`` ``(tokens, h)``, dense ``probs`` ``(tokens, experts)`` fp32 -> permuted tokens
    ``(slots, h)``, their probabilities ``(slots,)`` and the row_id_map (int32). Without
    ``probs`` (``num_experts`` given): TE ``moe_permute`` with a mask map (the allgather
    dispatcher's), the same tokens and map, no probabilities."""
    return _Permute.apply(x, probs, slots, probs.shape[1] if num_experts is None
                          else num_experts)


class _SortChunks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, probs: Tensor | None):
        out = torch.empty_like(x)
        row_id_map = torch.empty((x.shape[0],), dtype=torch.int32, device=x.device)
        ctx.save_for_backward(row_id_map)
        ctx.mark_non_differentiable(row_id_map)
        return out, (None if probs is None else torch.empty_like(probs)), row_id_map

    @staticmethod
    def backward(ctx, grad: Tensor, grad_probs: Tensor | None, _grad_map):
        return torch.empty_like(grad), (None if grad_probs is None
                                        else torch.empty_like(grad_probs))


def te_sort_chunks(x: Tensor, probs: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Reorder the received ``(rows, h)`` tokens (and ``(rows,)`` probabilities) by local
    expert; a new buffer of the same shape."""
    out, out_probs, _ = _SortChunks.apply(x, probs)
    return out, out_probs


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, row_id_map: Tensor, tokens: int) -> Tensor:
        ctx.save_for_backward(row_id_map)
        ctx.rows = x.shape[0]
        return x.new_empty((tokens, x.shape[1]))

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.new_empty((ctx.rows, grad.shape[1])), None, None


def te_unpermute(x: Tensor, row_id_map: Tensor, tokens: int) -> Tensor:
    """Bring the ``(slots, h)`` expert outputs back to ``(tokens, h)``."""
    return _Unpermute.apply(x, row_id_map, tokens)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, out_features: int, fuse_wgrad: bool, *weights: Tensor):
        ctx.save_for_backward(x, *weights)
        ctx.fuse_wgrad = fuse_wgrad
        return x.new_empty((x.shape[0], out_features))

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, *weights = ctx.saved_tensors
        dgrad = torch.empty_like(x)
        store = current_store()
        if store is not None:  # delay_wgrad_compute: keep the inputs and the output gradient
            store.append(((x, grad), weights, ctx.fuse_wgrad))
            return (dgrad, None, None, *[None] * len(weights))
        wgrads = [None if ctx.fuse_wgrad else torch.empty_like(w) for w in weights]
        return (dgrad, None, None, *wgrads)


def te_grouped_linear(x: Tensor, weights: list[Tensor], out_features: int,
                      fuse_wgrad: bool = True) -> Tensor:
    """TE GroupedLinear on ``x`` ``(rows, in)`` sorted by expert; ``weights`` are the local
    experts' weights (any layout: only their gradients' shapes are used); returns
    ``(rows, out_features)``."""
    return _GroupedLinear.apply(x, out_features, fuse_wgrad, *weights)


# --- Megatron's unfused token permutation (no --moe-permute-fusion) -------------------------
#
# megatron/core/transformer/moe/moe_utils.py ``permute`` / ``unpermute`` with ``fused=False``
# and ``drop_and_pad=False`` at Megatron-LM d98e8a6 are plain torch ops; they run here as the
# same ops, so the trace keeps what autograd keeps. One op reads values: ``masked_select``
# (the allgather dispatcher's probabilities), whose size is the routing's; ``_MaskedSelect``
# stands for it with its saved tensors.


def megatron_permute(tokens: Tensor, routing_map: Tensor, num_out: int,
                     probs: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor]:
    """``moe_utils.permute(tokens, routing_map, probs, num_out_tokens=num_out, fused=False)``:
    ``tokens`` ``(T, h)``, ``routing_map`` ``(T, E)`` bool, ``probs`` ``(T, E)`` or None.
    Returns the permuted tokens ``(num_out, h)`` (``index_select``, which saves its int64
    index), the permuted probabilities ``(num_out,)`` (an index into ``probs.T.contiguous()``,
    which saves the index: the first ``num_out`` of the ``(E * T,)`` int64 argsort, a view of
    it) and ``sorted_indices`` ``(num_out,)`` int64 (``flat_sorted % T``)."""
    num_tokens = tokens.shape[0]
    routing_map = routing_map.bool().T.contiguous()  # (E, T)
    flat_sorted = routing_map.reshape(-1).argsort(descending=True, stable=True)  # (E * T,)
    flat_sorted = flat_sorted[:num_out]
    sorted_indices = flat_sorted % num_tokens  # (num_out,) int64
    permuted_probs = None
    if probs is not None:
        permuted_probs = probs.T.contiguous().reshape(-1)[flat_sorted]  # (num_out,)
    del routing_map, flat_sorted
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


def megatron_unpermute(permuted: Tensor, sorted_indices: Tensor, tokens: int) -> Tensor:
    """``moe_utils.unpermute(permuted, sorted_indices, restore_shape=(tokens, h),
    fused=False)`` without probabilities (the experts applied them): a zero ``(tokens, h)``
    buffer, ``scatter_add_`` of the ``(num_out, h)`` rows at the expanded index (which it
    saves: a view of ``sorted_indices``), ``.to`` its own dtype (no copy). Under
    ``torch.use_deterministic_algorithms`` (``--deterministic-mode``) Megatron runs
    ``index_add_`` instead, which keeps the same index and allocates the same."""
    hidden = permuted.shape[1]
    out = torch.zeros((tokens, hidden), dtype=permuted.dtype, device=permuted.device)
    out.scatter_add_(0, sorted_indices.unsqueeze(1).expand(-1, hidden), permuted)
    return out.to(dtype=permuted.dtype)


class _MaskedSelect(torch.autograd.Function):
    """``Tensor.masked_select`` with ``rows`` results (meta cannot count them): saves
    ``self`` and ``mask`` as aten's ``MaskedSelectBackward0`` does; backward
    ``masked_select_backward``: a zero tensor of ``self``'s shape filled by
    ``masked_scatter_``."""

    @staticmethod
    def forward(ctx, x: Tensor, mask: Tensor, rows: int) -> Tensor:
        ctx.save_for_backward(x, mask)
        return x.new_empty((rows,))

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, _mask = ctx.saved_tensors
        return torch.zeros_like(x), None, None


def masked_select(x: Tensor, mask: Tensor, rows: int) -> Tensor:
    """``x.masked_select(mask)`` holding ``rows`` elements (the True entries of ``mask``)."""
    return _MaskedSelect.apply(x, mask, rows)


def megatron_sort_chunks(x: Tensor, probs: Tensor | None = None
                         ) -> tuple[Tensor, Tensor | None]:
    """``moe_utils.sort_chunks_by_idxs(..., fused=False)``: ``torch.split`` then
    ``torch.cat`` in the local experts' order: one new buffer of ``x``'s shape (and of
    ``probs``'), nothing saved (``CatBackward0`` keeps sizes only)."""
    return torch.cat([x]), (None if probs is None else torch.cat([probs]))
