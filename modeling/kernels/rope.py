"""Rotary position embedding kernels.

- eager / torch: ``modeling.common.attention.mla.apply_rope`` (rotate-half form on
  ``(b, s, n, d_r)``).
- megatron-te: Megatron-Core's unfused RoPE, the same torch ops in the same order
  (megatron/core/models/common/embeddings/rope_utils.py ``_apply_rotary_pos_emb_bshd`` with
  ``mla_rotary_interleaved=True``, and ``_rotate_half``, at Megatron-LM d98e8a6): the even and
  odd channels are concatenated, cos and sin are computed in fp32 from the frequencies, scaled
  by mscale and cast to the input dtype; autograd keeps the two casts. Megatron's
  ``--apply-rope-fusion`` (TE's fused MLA RoPE) is not emulated: docs/kernels.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["megatron_rope"]


def megatron_rope(t: Tensor, inv_freq: Tensor, mscale: float = 1.0) -> Tensor:
    """MCore's unfused MLA RoPE of ``t`` ``(b, s, n, d_r)``; positions 0..s-1, ``inv_freq``
    ``(d_r / 2,)`` fp32. Returns ``(b, s, n, d_r)`` in ``t``'s dtype."""
    s = t.shape[1]
    positions = torch.arange(s, device=t.device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # (s, d_r / 2)
    freqs = torch.cat((freqs, freqs), dim=-1)[None, :, None, :]  # (1, s, 1, d_r) fp32
    x1, x2 = t[..., 0::2], t[..., 1::2]
    t = torch.cat((x1, x2), dim=-1)
    cos_ = (torch.cos(freqs) * mscale).to(t.dtype)
    sin_ = (torch.sin(freqs) * mscale).to(t.dtype)
    h1, h2 = torch.chunk(t, 2, dim=-1)
    return (t * cos_) + (torch.cat((-h2, h1), dim=-1) * sin_)
