"""Megatron-Core's router GEMM in fp32 (``--moe-router-dtype fp32``, the DeepSeek recipes').

megatron/core/transformer/moe/moe_utils.py ``RouterGatingLinearFunction`` at Megatron-LM
d98e8a6: forward saves the bf16 input and weight and returns fp32 logits ``(tokens, experts)``;
backward casts the weight and the input to fp32 for the two GEMMs and casts both gradients
back. Run here as the same torch ops (the ``torch.mm`` branch allocates what the
``te_general_gemm`` branch does: fp32 GEMM outputs, then the casts).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["router_gating_linear"]


class _RouterGatingLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        return torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32, device=x.device)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad_input = torch.mm(grad, weight.to(torch.float32)).to(x.dtype)
        grad_weight = torch.mm(grad.t(), x.to(torch.float32)).to(weight.dtype)
        return grad_input, grad_weight


def router_gating_linear(x: Tensor, weight: Tensor) -> Tensor:
    """fp32 logits ``(tokens, experts)`` of ``x`` ``(tokens, h)`` and ``weight`` ``(experts, h)``."""
    return _RouterGatingLinear.apply(x, weight)
