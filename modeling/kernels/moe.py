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

__all__ = ["te_permute", "te_sort_chunks", "te_unpermute", "te_grouped_linear"]


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, probs: Tensor, slots: int, num_experts: int):
        tokens, h = x.shape
        out = x.new_empty((slots, h))
        row_id_map = torch.empty((tokens, 2 * num_experts + 1), dtype=torch.int32,
                                 device=x.device)
        permuted_probs = probs.new_empty((slots,))
        ctx.save_for_backward(row_id_map)
        ctx.shape, ctx.probs_shape = x.shape, probs.shape
        ctx.mark_non_differentiable(row_id_map)
        return out, permuted_probs, row_id_map

    @staticmethod
    def backward(ctx, grad_out: Tensor, grad_probs: Tensor, _grad_map):
        (row_id_map,) = ctx.saved_tensors
        grad_x = grad_out.new_empty(ctx.shape)
        grad_p = torch.empty(ctx.probs_shape, dtype=torch.float32, device=grad_out.device)
        return grad_x, grad_p, None, None


def te_permute(x: Tensor, probs: Tensor, slots: int) -> tuple[Tensor, Tensor, Tensor]:
    """``x`` ``(tokens, h)``, dense ``probs`` ``(tokens, experts)`` fp32 -> permuted tokens
    ``(slots, h)``, their probabilities ``(slots,)`` and the row_id_map (int32)."""
    return _Permute.apply(x, probs, slots, probs.shape[1])


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
