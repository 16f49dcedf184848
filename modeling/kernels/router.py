"""Megatron-Core's router GEMM, in fp32 (``--moe-router-dtype fp32``, the DeepSeek recipes') or
in the input's dtype (no ``--moe-router-dtype``).

megatron/core/transformer/moe/moe_utils.py ``RouterGatingLinearFunction`` at Megatron-LM
d98e8a6: forward saves the bf16 input and weight and returns the logits ``(tokens, experts)``
in the router dtype; backward casts the weight and the input to it for the two GEMMs and casts
both gradients back. Run here as the same torch ops (the ``torch.mm`` branch allocates what the
``te_general_gemm`` branch does: fp32 GEMM outputs, then the casts).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["router_gating_linear"]


class _RouterGatingLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, dtype: torch.dtype) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.dtype = dtype
        return torch.empty((x.shape[0], weight.shape[0]), dtype=dtype, device=x.device)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad_input = torch.mm(grad, weight.to(ctx.dtype)).to(x.dtype)
        grad_weight = torch.mm(grad.t(), x.to(ctx.dtype)).to(weight.dtype)
        return grad_input, grad_weight, None


def router_gating_linear(x: Tensor, weight: Tensor, dtype: torch.dtype = torch.float32
                         ) -> Tensor:
    """Logits ``(tokens, experts)`` in ``dtype`` of ``x`` ``(tokens, h)`` and ``weight``
    ``(experts, h)``: ``router_dtype`` of Megatron's ``Router.gating`` (fp32 with
    ``--moe-router-dtype fp32``, else the input's dtype, where the casts are no-ops that
    allocate nothing: ``Tensor.to`` returns ``self``)."""
    return _RouterGatingLinear.apply(x, weight, dtype)
