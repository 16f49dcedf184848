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

from modeling.common import cpu_offload
from modeling.kernels import fp8
from modeling.kernels.wgrad import current_store

__all__ = ["te_permute", "te_sort_chunks", "te_unpermute", "te_grouped_linear", "te_fp8_pad",
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
        ctx.saved_tensors  # the kernel reads the row map (unpacked: a saved-tensor hook sees it)
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
        ctx.saved_tensors  # the kernel reads the row map (unpacked: a saved-tensor hook sees it)
        return grad.new_empty((ctx.rows, grad.shape[1])), None, None


def te_unpermute(x: Tensor, row_id_map: Tensor, tokens: int) -> Tensor:
    """Bring the ``(slots, h)`` expert outputs back to ``(tokens, h)``."""
    return _Unpermute.apply(x, row_id_map, tokens)


class _GroupedLinear(torch.autograd.Function):
    """``_GroupedLinear`` in bf16: the input split per expert (``_split_quantize`` without a
    quantiser: ``torch.split``, views of the input's storage), the views saved; one ``(rows,
    out)`` output."""

    @staticmethod
    def forward(ctx, x: Tensor, out_features: int, fuse_wgrad: bool, counts: tuple[int, ...],
                *weights: Tensor):
        parts = x.split(list(counts))
        ctx.num_parts, ctx.in_shape = len(parts), tuple(x.shape)
        ctx.save_for_backward(*parts, *weights)
        ctx.fuse_wgrad = fuse_wgrad
        return x.new_empty((x.shape[0], out_features))

    @staticmethod
    def backward(ctx, grad: Tensor):
        tensors = ctx.saved_tensors
        parts, weights = tensors[:ctx.num_parts], tensors[ctx.num_parts:]
        dgrad = parts[0].new_empty(ctx.in_shape)
        store = current_store()
        if store is not None:  # delay_wgrad_compute: keep the inputs and the output gradient
            store.append(((*parts, grad), weights, ctx.fuse_wgrad))
            return (dgrad, None, None, None, *[None] * len(weights))
        wgrads = [None if ctx.fuse_wgrad else torch.empty_like(w) for w in weights]
        return (dgrad, None, None, None, *wgrads)


class _Fp8GroupedLinear(torch.autograd.Function):
    """``_GroupedLinear`` under an FP8 recipe: TE d0067d0 ``module/grouped_linear.py``
    ``_GroupedLinear.forward`` / ``backward`` on the split-quantise path (the default:
    ``use_grouped_tensor`` is off unless ``NVTE_GROUPED_LINEAR_USE_FUSED_GROUPED_GEMM=1``).
    Forward: the input split-quantised per expert (``fp8.split_quantize``; row-wise for the
    GEMM, column-wise for the wgrad unless ``save_original_input``), the experts' FP8 weights
    from TE's cached workspaces (static memory), one ``(rows, out)`` output; the inputs are
    saved column-wise only (``update_usage(rowwise_usage=False, columnwise_usage=True)``).
    Backward: the output gradient split-quantised with both usages, one ``(rows, in)`` dgrad,
    weight gradients into ``main_grad`` (or one per weight without fusion); under
    ``save_original_input`` the saved bf16 input is split-quantised again for the wgrad
    (per-tensor FP8 with both usages, the others column-wise).

    DeepSeek-V3's FP8 dispatch (``modeling.kernels.fp8_dispatch``, megatron-te option
    ``fp8_dispatch``): with ``wire_in`` (fc1) the input arrives as an FP8 payload, is not
    quantised again and is kept row-wise for the wgrad, converted to a column-wise copy in
    backward; with ``wire_grad`` (fc2) the output gradient arrives as one, its row-wise data
    feeding the dgrad and a column-wise copy converted for the wgrad (a deferred W step keeps
    both, as TE keeps both usages of a gradient it quantised)."""

    @staticmethod
    def forward(ctx, x: Tensor, out_features: int, fuse_wgrad: bool, recipe: str, arch: str,
                counts: tuple[int, ...], save_original: bool, wire_in, wire_grad,
                *weights: Tensor):
        ctx.fuse_wgrad, ctx.recipe, ctx.arch, ctx.counts = fuse_wgrad, recipe, arch, counts
        ctx.save_original, ctx.wire_in, ctx.wire_grad = save_original, wire_in, wire_grad
        ctx.in_shape = tuple(x.shape)
        # TE's CPU offloading (modeling.common.cpu_offload): no bulk allocation (forward and
        # the backward's re-quantisation: disable_bulk_allocation=cpu_offloading)
        ctx.bulk = not cpu_offload.enabled()
        if wire_in is not None:  # the FP8 dispatch's payload: no quantisation, kept row-wise
            saved = list(wire_in.take())
            ctx.num_saved = len(saved)
            ctx.save_for_backward(*saved, *weights)
            return x.new_empty((x.shape[0], out_features))
        inputs = fp8.split_quantize(x, list(counts), recipe, arch, True, not save_original,
                                    bulk=ctx.bulk)
        out = x.new_empty((x.shape[0], out_features))
        if save_original:
            del inputs
            ctx.layout = None
            ctx.save_for_backward(x, *weights)
        else:
            for q in inputs:
                q.update_usage(rowwise=False, columnwise=True)
            ctx.layout = [(q.shape, list(q.parts)) for q in inputs]
            saved = [t for q in inputs for t in q.tensors]
            del inputs
            ctx.num_saved = len(saved)
            ctx.save_for_backward(*saved, *weights)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        tensors = list(ctx.saved_tensors)
        recipe, arch, counts = ctx.recipe, ctx.arch, list(ctx.counts)
        if ctx.wire_grad is not None:  # the FP8 combine-backward's payload: the row-wise data
            # for the dgrad, a column-wise (128x1) copy converted from it for the wgrad
            grads = [*ctx.wire_grad.take(), *[t for q in fp8.split_quantize(
                grad, counts, recipe, arch, False, True, role="grad") for t in q.tensors]]
        else:
            grads = [t for q in fp8.split_quantize(grad, counts, recipe, arch, True, True,
                                                   role="grad") for t in q.tensors]
        if ctx.save_original:
            x, *weights = tensors
        else:
            weights = tensors[ctx.num_saved:]
        dgrad = grad.new_empty(ctx.in_shape)
        if ctx.save_original:
            per = fp8.per_tensor(recipe)
            inputs = [t for q in fp8.split_quantize(x, counts, recipe, arch, per, True,
                                                    bulk=ctx.bulk) for t in q.tensors]
            del x
        elif ctx.wire_in is not None:  # the kept payload converted to 128x1 tiles for the
            # wgrad (arXiv 2412.19437 3.3.3); the payload dies with the saved tensors
            inputs = [t for q in fp8.split_quantize(dgrad, counts, recipe, arch, False, True,
                                                    bulk=ctx.bulk) for t in q.tensors]
        else:
            inputs = tensors[:ctx.num_saved]
        del tensors
        store = current_store()
        if store is not None:
            store.append(((*inputs, *grads), weights, ctx.fuse_wgrad))
            wgrads = [None] * len(weights)
        else:
            wgrads = [None if ctx.fuse_wgrad else torch.empty_like(w) for w in weights]
        del inputs, grads
        return (dgrad, None, None, None, None, None, None, None, None, *wgrads)


class _Fp8Padding(torch.autograd.Function):
    """TE ``module/fp8_padding.py`` ``_Fp8Padding`` / ``fp8_unpadding.py`` ``_Fp8Unpadding``:
    a new ``(rows_out, h)`` buffer (``fused_multi_row_padding`` / ``_unpadding`` into
    ``torch.empty``), nothing saved; backward a new ``(rows_in, h)`` gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, rows: int) -> Tensor:
        ctx.rows = x.shape[0]
        return x.new_empty((rows, *x.shape[1:]))

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.new_empty((ctx.rows, *grad.shape[1:])), None


def te_fp8_pad(x: Tensor, rows: int) -> Tensor:
    """``x`` ``(rows_in, ...)`` copied into ``rows`` rows (padding per expert, or back)."""
    return _Fp8Padding.apply(x, rows)


def te_grouped_linear(x: Tensor, weights: list[Tensor], out_features: int,
                      fuse_wgrad: bool = True, fp8_recipe: str = "none",
                      fp8_arch: str = "sm90", counts: list[int] | None = None,
                      save_original_input: bool = False, wire_in=None,
                      wire_grad=None) -> Tensor:
    """TE GroupedLinear on ``x`` ``(rows, in)`` sorted by expert; ``weights`` are the local
    experts' weights (any layout: only their gradients' shapes are used); returns
    ``(rows, out_features)``. Under an FP8 recipe (``fp8_recipe``, ``fp8_arch``:
    ``modeling.kernels.fp8``) each expert's ``counts`` rows are quantised apart
    (``_Fp8GroupedLinear``); ``counts`` None: the rows split evenly over the leading
    dimension of ``weights[0]`` (the local experts), the remainder on the first.
    ``wire_in`` / ``wire_grad``: FP8-dispatch payloads (``modeling.kernels.fp8_dispatch``)
    carrying the input / the output gradient, under an FP8 recipe only."""
    if counts is None:
        n = weights[0].shape[0] if weights[0].dim() == 3 else len(weights)
        counts = [x.shape[0] // n] * n
        counts[0] += x.shape[0] - sum(counts)
    if fp8_recipe == "none":  # save_original_input: TE saves the whole input
        return _GroupedLinear.apply(x, out_features, fuse_wgrad,
                                    (x.shape[0],) if save_original_input else tuple(counts),
                                    *weights)
    return _Fp8GroupedLinear.apply(x, out_features, fuse_wgrad, fp8_recipe, fp8_arch,
                                   tuple(counts), save_original_input, wire_in, wire_grad,
                                   *weights)


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
