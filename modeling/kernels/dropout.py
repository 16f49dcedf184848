"""Dropout as each stack's device runs it (real torch ops, so autograd's saves are PyTorch's own).

``torch.nn.functional.dropout`` (torch 2.13 ``aten/src/ATen/native/Dropout.cpp`` ``dropout``)
takes one of two paths by device:

- CUDA (``is_fused_kernel_acceptable``: a CUDA / XPU / lazy / PrivateUse1 input, 0 < p < 1, at
  least one element): ``aten::native_dropout`` returns the output and a **bool** mask of the
  input's shape (1 B per element); ``NativeDropoutBackward0`` saves the mask only (and the
  scale 1 / (1 - p), a double). ``native_dropout`` traces this path on meta (its meta kernel
  returns the same two tensors): the torch and megatron-te profiles.
- CPU and meta (every other input): ``_dropout_impl``: ``noise = empty_like(input).bernoulli_(1
  - p).div_(1 - p)`` and ``input * noise``; ``MulBackward0`` saves the noise, a tensor of the
  input's **dtype** (2 B per element in bf16, 4 in fp32). ``torch_dropout`` runs it: the eager
  profile, byte-exact against a real CPU step.

With p == 0 (tracemem's default) or outside training both return the input itself
(``_dropout_impl``: ``if (p == 0 || !train || input.sym_numel() == 0) return input``): nothing is
allocated or saved, as in Megatron-Core, which calls dropout with p == 0 all the same
(``fusions/fused_bias_dropout.py`` ``_bias_dropout_add_func``, ``torch.nn.Dropout`` in
``LanguageModelEmbedding`` and ``DotProductAttention``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["native_dropout", "torch_dropout"]


def torch_dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """``F.dropout(x, p, training)`` on ``x``'s own device (CPU and meta: the noise tensor of
    ``x``'s shape and dtype is kept by the multiply)."""
    return F.dropout(x, p, training)


def native_dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """CUDA's ``F.dropout``: ``aten::native_dropout``, which keeps a bool mask of ``x``'s shape
    (1 B per element) and returns a new output of ``x``'s shape and dtype; ``x`` itself when
    ``p == 0`` or not training."""
    if p == 0 or not training or x.numel() == 0:
        return x
    return torch.ops.aten.native_dropout(x, p, True)[0]
