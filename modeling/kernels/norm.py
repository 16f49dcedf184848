"""RMSNorm and LayerNorm kernels.

- eager: ``nn.RMSNorm`` (``F.rms_norm``'s composite: on a bf16 input autograd keeps the fp32
  upcast of x and of x * rstd, see ``tracemem inventory --kernels eager``).
- torch: ``aten::_fused_rms_norm`` (torch 2.13 ``aten/src/ATen/native/layer_norm.cpp``,
  ``_fused_rms_norm``; derivatives.yaml entry ``_fused_rms_norm``: saves input, rstd, weight),
  rstd ``(..., 1)`` fp32.
- megatron-te: Transformer Engine's ``RMSNorm`` (``transformer_engine/pytorch/ops/basic/
  rmsnorm.py``, ``RMSNorm.op_forward`` / ``op_backward`` at TE d0067d0): saves the input x and
  rstdevs ``(tokens,)`` fp32; its backward's dgamma partial-sum workspace is not modelled
  (docs/kernels.md).

LayerNorm (``modeling.common.norm.LayerNorm``, weight and bias):

- eager and torch: ``nn.LayerNorm``'s own forward (``aten::native_layer_norm``, already the
  fused kernel; derivatives.yaml entry ``native_layer_norm``: saves input, weight, bias,
  mean and rstd, ``(..., 1)``, fp32 for a bf16 input on CUDA and meta).
- megatron-te: Transformer Engine's ``LayerNorm`` (``transformer_engine/pytorch/ops/basic/
  layer_norm.py`` ``LayerNorm.op_forward`` / ``op_backward`` at TE d0067d0, the op behind
  ``module/layernorm.py`` ``LayerNorm`` and Megatron's ``TENorm`` with ``normalization=
  "LayerNorm"``): saves the contiguous input x, means and rstdevs, ``(tokens,)`` fp32 each
  (``csrc/extensions/normalization.cpp`` ``layernorm_fwd``: ``mu``, ``rsigma``
  ``at::empty({outer_size}, kFloat)``); backward (``layernorm_bwd``) allocates dx, dgamma and
  dbeta. Its dgamma / dbeta partial-sum workspace is not modelled (docs/kernels.md).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["fused_rms_norm", "te_rms_norm", "te_layer_norm"]


class _RMSNorm(torch.autograd.Function):
    """A fused RMSNorm: forward allocates y (x's dtype) and an fp32 rstd (``(..., 1)`` when
    ``keepdim``, else ``(...)``) and saves x, rstd and the weight (a parameter); backward
    allocates dx and dweight."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, keepdim: bool) -> Tensor:
        y = torch.empty_like(x)
        shape = (*x.shape[:-1], 1) if keepdim else x.shape[:-1]
        rstd = torch.empty(shape, dtype=torch.float32, device=x.device)
        ctx.save_for_backward(x, rstd, weight)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, _rstd, weight = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight), None


def fused_rms_norm(norm: nn.RMSNorm, x: Tensor) -> Tensor:
    """torch-native fused RMSNorm of ``x`` ``(..., h)`` (torchtitan's ``nn.RMSNorm`` on CUDA)."""
    return _RMSNorm.apply(x, norm.weight, True)


def te_rms_norm(norm: nn.RMSNorm, x: Tensor) -> Tensor:
    """TE RMSNorm of ``x`` ``(..., h)`` with ``norm``'s weight. TE makes its input contiguous
    first and saves that (``RMSNorm.op_forward``: ``input_.contiguous()``): a strided input,
    such as Megatron's key split out of ``linear_qkv`` for the qk layernorm, is copied."""
    return _RMSNorm.apply(x.contiguous(), norm.weight, False)


class _LayerNorm(torch.autograd.Function):
    """TE's LayerNorm: forward allocates means and rstdevs ``(tokens,)`` fp32 and y (x's
    dtype, in ``layernorm_fwd``'s order) and saves x, means and rstdevs (and the weight and
    bias, parameters: no bytes of their own); backward allocates dx, dgamma and dbeta."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
        means = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        rstdevs = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        y = torch.empty_like(x)
        ctx.save_for_backward(x, means, rstdevs, weight, bias)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, _means, _rstdevs, weight, bias = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias)


def te_layer_norm(norm: nn.LayerNorm, x: Tensor) -> Tensor:
    """TE LayerNorm of ``x`` ``(..., h)`` with ``norm``'s weight and bias ``(h,)``; returns
    ``(..., h)``. TE makes its input contiguous first and saves that (``LayerNorm.op_forward``:
    ``input_.contiguous()``): a strided input (Megatron's key for the qk layernorm) is
    copied."""
    return _LayerNorm.apply(x.contiguous(), norm.weight, norm.bias)
