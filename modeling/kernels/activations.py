"""The non-gated MLP activation kernels Megatron-Core's GPT runs on ``linear_fc1``'s output
``(..., f)`` under megatron-te (megatron/core/transformer/mlp.py ``MLP.forward`` at
Megatron-LM d98e8a6; ``linear_fc1`` is built with ``skip_bias_add=True``, so its bias comes
back apart and is added here):

- GELU with biases and ``--bias-gelu-fusion`` (Megatron's default; ``validate_args`` turns it
  off with ``--disable-bias-linear``): ``bias_gelu_impl``, megatron/core/fusions/
  fused_bias_gelu.py ``GeLUFunction``: forward saves its input (fc1's output, without the
  bias) and the bias, and returns ``bias_gelu(bias, input)`` (a ``jit_fuser`` pointwise
  kernel: one ``(..., f)`` output, no intermediates); backward ``bias_gelu_back`` allocates
  one ``(..., f)`` tensor and returns it for both the input and the bias, which autograd
  reduces to the bias's ``(f,)`` (the engine's ``sum_to``).
- squared ReLU (``--squared-relu``): megatron/core/activations.py ``squared_relu``
  (``torch.pow(F.relu(x), 2)`` under ``jit_fuser``, which is ``torch.compile`` on torch >=
  2.2: megatron/core/jit.py). Megatron-Core runs it unfused (TransformerConfig.__post_init__
  refuses ``bias_activation_fusion`` with any activation but gelu, silu and quick_gelu, so a
  squared-ReLU job sets ``--no-bias-gelu-fusion``): ``MLP.forward`` adds the bias first
  (``intermediate_parallel + bias_parallel``: a torch op, run as such by the caller). The
  compiled function keeps one ``(..., f)`` tensor of x's dtype for backward (AOTAutograd's
  min-cut partitioner saves the input and recomputes the pointwise relu; relu(x) would be
  the same size), allocates its output, and in backward one ``(..., f)`` gradient.
- GELU without biases (or with ``--no-bias-gelu-fusion``): ``F.gelu`` itself, a torch op (it
  saves its input): not a kernel here.

The eager and torch profiles run the activations as torch ops (``modeling.common.mlp``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["fused_bias_gelu", "compiled_squared_relu"]


class _BiasGeLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, bias: Tensor) -> Tensor:
        ctx.save_for_backward(x, bias)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, _bias = ctx.saved_tensors
        tmp = torch.empty_like(x)  # bias_gelu_back: one tensor, the input's and the bias's
        return tmp, tmp


class _SquaredReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (x,) = ctx.saved_tensors
        return torch.empty_like(x)


def fused_bias_gelu(x: Tensor, bias: Tensor) -> Tensor:
    """``gelu(x + bias)`` (tanh approximation) of fc1's output ``x`` ``(..., f)`` and its bias
    ``(f,)``; returns ``(..., f)``."""
    return _BiasGeLU.apply(x, bias)


def compiled_squared_relu(x: Tensor) -> Tensor:
    """``relu(x) ** 2`` of ``x`` ``(..., f)`` (fc1's output with its bias added); returns
    ``(..., f)``."""
    return _SquaredReLU.apply(x)
