"""SwiGLU activation kernels on a fused fc1 output ``(..., 2f)`` = [gate | up].

- megatron-te: Megatron-Core's fused SwiGLU (megatron/core/fusions/fused_bias_swiglu.py at
  Megatron-LM d98e8a6): ``SwiGLUFunction`` saves its input (the fc1 output) and recomputes
  SiLU in backward; ``WeightedSwiGLUFunction`` (routed experts, the router probabilities
  applied here) saves the input and the probabilities ``(rows, 1)`` fp32. Forward allocates
  the ``(..., f)`` output; backward the ``(..., 2f)`` input gradient (and ``(rows, 1)`` fp32 for
  the probabilities). The functions are ``jit_fuser``-compiled, so their pointwise
  intermediates are not materialised.
- eager / torch: ``silu(w1 x) * w3 x`` in ``modeling.common.mlp``, which keeps both projections and
  the SiLU output.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["fused_swiglu", "fused_weighted_swiglu"]


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor) -> Tensor:
        ctx.save_for_backward(y)
        return y.new_empty((*y.shape[:-1], y.shape[-1] // 2))

    @staticmethod
    def backward(ctx, grad: Tensor):
        (y,) = ctx.saved_tensors
        return torch.empty_like(y)


class _WeightedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor, probs: Tensor) -> Tensor:
        ctx.save_for_backward(y, probs)
        return y.new_empty((*y.shape[:-1], y.shape[-1] // 2))

    @staticmethod
    def backward(ctx, grad: Tensor):
        y, probs = ctx.saved_tensors
        return torch.empty_like(y), torch.empty_like(probs)


def fused_swiglu(y: Tensor) -> Tensor:
    """``silu(gate) * up`` of ``y`` ``(..., 2f)``; returns ``(..., f)``."""
    return _SwiGLU.apply(y)


def fused_weighted_swiglu(y: Tensor, probs: Tensor) -> Tensor:
    """``silu(gate) * up * probs`` of ``y`` ``(rows, 2f)``, ``probs`` ``(rows, 1)`` fp32."""
    return _WeightedSwiGLU.apply(y, probs)
