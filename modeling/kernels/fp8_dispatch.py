"""DeepSeek-V3's FP8 dispatch on Megatron's alltoall dispatcher: the megatron-te option
``fp8_dispatch`` (not a Megatron-LM flag; ``--recipe deepseek-v3`` sets it).

The scheme (arXiv 2412.19437 section 3.3.3, "Low-Precision Communication"): "we quantize the
activation before MoE up-projections into FP8 and then apply dispatch components, which is
compatible with FP8 Fprop in MoE up-projections ... A similar strategy is applied to the
activation gradient before MoE down-projections. For both the forward and backward combine
components, we retain them in BF16." So the tokens travel to the experts in FP8 in forward,
and the output gradient travels to the experts in FP8 in backward (the combine's backward);
the experts' output (the combine) and the tokens' gradient (the dispatch's backward) travel in
bf16.

The payload is DeepEP's FP8 dispatch tuple (deepseek-ai/DeepEP ebfe47e, the first public
commit, ``deep_ep/buffer.py`` ``Buffer.dispatch``: ``x`` "the first element of the tuple must
be shaped as [num_tokens, hidden] with type torch.float8_e4m3fn, the second must be
[num_tokens, hidden // 128] (requiring divisible) with type torch.float"): ``Payload`` holds a
``(rows, h)`` uint8 tensor (one byte a value, as float8_e4m3fn) and ``(rows, h / 128)`` fp32
scales, one per 1x128 tile (3.3.2).

Where the paper is silent (assumptions, named in ``tracemem.recipes``):
- the rows are Megatron's alltoall dispatcher's: the ``(T, h)`` tokens are quantised, then
  permuted to one row per (token, expert) slot, all-to-all'd and sorted by local expert, each
  hop a new payload (DeepEP sends one row per token and destination rank instead);
- the up-projection (fc1) consumes the received payload without quantising again and keeps it,
  row-wise, for its weight gradient, which converts it to 128x1 tiles in backward (as 3.3.3
  says of the attention output's cached input): ``modeling.kernels.moe._Fp8GroupedLinear``;
- in backward, the combine's unpermute quantises the ``(T, h)`` output gradient and permutes
  it, the all-to-all, the chunk unsort and the FP8 unpadding move the payload, and the down-
  projection (fc2) takes its row-wise data for the dgrad GEMM and converts a column-wise copy
  for the wgrad (TE's W store, where weight gradients are deferred, keeps both, as it keeps
  both usages of a gradient it quantised itself).

Autograd sees a bf16 tensor of no bytes (``placeholder``) where the payload travels, so the
graph keeps its shapes; the ``Payload`` box carries the real buffers from hop to hop.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

from modeling.parallel.collectives import active_tracer
from tracemem.categories import Category

__all__ = ["TILE", "Payload", "placeholder", "permute", "hop", "unpermute"]

TILE = 128  # values per scale: 1x128 tiles (arXiv 2412.19437 3.3.2; DeepEP hidden // 128)


class Payload:
    """The FP8 payload travelling in one direction through one MoE layer's dispatch:
    ``parts`` = (data ``(rows, h)`` uint8, scales ``(rows, h / 128)`` fp32), or None before it
    is made and after its consumer took it."""

    def __init__(self) -> None:
        self.parts: tuple[Tensor, Tensor] | None = None

    def make(self, rows: int, h: int, device, comm: bool = False) -> tuple[Tensor, Tensor]:
        """New buffers for ``rows`` rows, replacing (and so freeing) the previous ones;
        ``comm``: an all-to-all's receive buffers (category ``comm_buffer``)."""
        parts = _payload(rows, h, device, comm)
        self.parts = parts
        return parts

    def take(self) -> tuple[Tensor, Tensor]:
        parts, self.parts = self.parts, None
        assert parts is not None, "an FP8 payload was consumed before it was made"
        return parts


def _payload(rows: int, h: int, device, comm: bool = False) -> tuple[Tensor, Tensor]:
    data = torch.empty((rows, h), dtype=torch.uint8, device=device)
    scales = torch.empty((rows, -(-h // TILE)), dtype=torch.float32, device=device)
    tracer = active_tracer()
    if comm and tracer is not None:
        tracer.tag(data, Category.COMM_BUFFER)
        tracer.tag(scales, Category.COMM_BUFFER)
    return data, scales


def placeholder(rows: int, h: int, dtype: torch.dtype, device) -> Tensor:
    """A ``(rows, h)`` tensor of ``dtype`` holding no bytes: what autograd sees where the
    payload travels. Made with the dispatch modes off and its storage emptied at once, so no
    tracer records an allocation that does not happen."""
    with _disable_current_modes():
        t = torch.empty((rows, h), dtype=dtype, device=device)
        t.untyped_storage().resize_(0)
    return t


class _Dispatch(torch.autograd.Function):
    """TE's fused permute (``modeling.kernels.moe._Permute``) of tokens quantised first: the
    ``(T, h)`` tokens to an FP8 payload, permuted to ``(slots, h)`` with the row_id_map and
    the permuted probabilities; the ``(T, h)`` payload dies. Backward as TE's permute: the
    bf16 token gradient ``(T, h)`` and the fp32 probability gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, probs: Tensor, slots: int, num_experts: int,
                wire: Payload):
        tokens, h = x.shape
        quantised = _payload(tokens, h, x.device)
        wire.make(slots, h, x.device)
        row_id_map = torch.empty((tokens, 2 * num_experts + 1), dtype=torch.int32,
                                 device=x.device)
        permuted_probs = probs.new_empty((slots,))
        del quantised
        ctx.save_for_backward(row_id_map)
        ctx.shape, ctx.probs_shape = x.shape, probs.shape
        ctx.mark_non_differentiable(row_id_map)
        return placeholder(slots, h, x.dtype, x.device), permuted_probs, row_id_map

    @staticmethod
    def backward(ctx, grad_out: Tensor, grad_probs: Tensor, _grad_map):
        ctx.saved_tensors  # the kernel reads the row map
        grad_x = grad_out.new_empty(ctx.shape)
        grad_p = torch.empty(ctx.probs_shape, dtype=torch.float32, device=grad_out.device)
        return grad_x, grad_p, None, None, None


def permute(x: Tensor, probs: Tensor, slots: int, num_experts: int, wire: Payload
            ) -> tuple[Tensor, Tensor, Tensor]:
    """``x`` ``(T, h)`` bf16 quantised and permuted into ``wire`` (``(slots, h)``); returns
    the placeholder tokens, the permuted probabilities ``(slots,)`` and the row_id_map."""
    return _Dispatch.apply(x, probs, slots, num_experts, wire)


class _Hop(torch.autograd.Function):
    """One move of the tokens or of their gradient: ``kind`` "a2a" (the EP all-to-all, a
    receive buffer), "sort" (TE's ``moe_sort_chunks_by_index``: a new buffer and a ``(rows,)``
    int32 map it saves; with ``probs`` their sorted copy) or "pad" (TE's ``Fp8Padding`` /
    ``Fp8Unpadding``: a new buffer of ``rows_out`` rows). Forward moves ``fwd``'s payload when
    given, else the bf16 tensor; backward moves ``bwd``'s payload when given, else the bf16
    gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, probs: Tensor | None, rows_out: int, kind: str,
                fwd: Payload | None, bwd: Payload | None):
        rows_in, h = x.shape
        ctx.rows_in, ctx.h, ctx.kind, ctx.bwd = rows_in, h, kind, bwd
        comm = kind == "a2a"
        if fwd is not None:
            fwd.make(rows_out, h, x.device, comm)  # the received / moved payload
            out = placeholder(rows_out, h, x.dtype, x.device)
        else:
            out = x.new_empty((rows_out, h))
            tracer = active_tracer()
            if comm and tracer is not None:
                tracer.tag(out, Category.COMM_BUFFER)
        out_probs = None if probs is None else torch.empty_like(probs)
        if kind == "sort":
            row_map = torch.empty((rows_in,), dtype=torch.int32, device=x.device)
            ctx.save_for_backward(row_map)
        return out, out_probs

    @staticmethod
    def backward(ctx, grad: Tensor, grad_probs: Tensor | None):
        if ctx.kind == "sort":
            ctx.saved_tensors  # the kernel reads the row map
        comm = ctx.kind == "a2a"
        if ctx.bwd is not None:
            ctx.bwd.make(ctx.rows_in, ctx.h, grad.device, comm)
            grad_x = placeholder(ctx.rows_in, ctx.h, grad.dtype, grad.device)
        else:
            grad_x = grad.new_empty((ctx.rows_in, ctx.h))
            tracer = active_tracer()
            if comm and tracer is not None:
                tracer.tag(grad_x, Category.COMM_BUFFER)
        grad_p = None if grad_probs is None else torch.empty_like(grad_probs)
        return grad_x, grad_p, None, None, None, None


def hop(x: Tensor, rows_out: int, kind: str, fwd: Payload | None = None,
        bwd: Payload | None = None, probs: Tensor | None = None
        ) -> tuple[Tensor, Tensor | None]:
    """``x`` ``(rows, h)`` (a placeholder where ``fwd`` carries it) moved by ``kind`` to
    ``rows_out`` rows; returns the moved tokens and, with ``probs``, their sorted copy."""
    return _Hop.apply(x, probs, rows_out, kind, fwd, bwd)


class _Combine(torch.autograd.Function):
    """TE's unpermute (``modeling.kernels.moe._Unpermute``) in bf16, whose backward quantises
    the ``(T, h)`` output gradient and permutes it into ``wire``'s ``(slots, h)`` payload (the
    ``(T, h)`` one dies) for the combine's backward all-to-all."""

    @staticmethod
    def forward(ctx, x: Tensor, row_id_map: Tensor, tokens: int, wire: Payload) -> Tensor:
        ctx.save_for_backward(row_id_map)
        ctx.rows, ctx.wire = x.shape[0], wire
        return x.new_empty((tokens, x.shape[1]))

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.saved_tensors  # the kernel reads the row map
        tokens, h = grad.shape
        quantised = _payload(tokens, h, grad.device)
        ctx.wire.make(ctx.rows, h, grad.device)
        del quantised
        return placeholder(ctx.rows, h, grad.dtype, grad.device), None, None, None


def unpermute(x: Tensor, row_id_map: Tensor, tokens: int, wire: Payload) -> Tensor:
    """The experts' ``(slots, h)`` output back to ``(T, h)`` (bf16); in backward the
    gradient leaves in FP8 through ``wire``."""
    return _Combine.apply(x, row_id_map, tokens, wire)
