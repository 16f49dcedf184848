"""Rotary position embedding kernels.

- eager / torch: ``modeling.common.rope.apply_rope`` (rotate-half form on
  ``(b, s, n, d_r)``).
- megatron-te, MLA: Megatron-Core's unfused RoPE, the same torch ops in the same order
  (megatron/core/models/common/embeddings/rope_utils.py ``_apply_rotary_pos_emb_bshd`` with
  ``mla_rotary_interleaved=True``, and ``_rotate_half``, at Megatron-LM d98e8a6): the even and
  odd channels are concatenated, cos and sin are computed in fp32 from the frequencies, scaled
  by mscale and cast to the input dtype; autograd keeps the two casts. Megatron's
  ``--apply-rope-fusion`` (TE's fused MLA RoPE) is not emulated: docs/kernels.md.
- megatron-te, grouped-query attention (Llama, Qwen): ``megatron_rope_bshd``, the same function with
  ``rotary_interleaved=False`` and no MLA interleaving: the first d_r channels rotated
  (rotate-half), the rest passed through, and the two concatenated (a copy even when the
  rest is empty).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["megatron_rope", "megatron_rope_bshd"]


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


def megatron_rope_bshd(t: Tensor, inv_freq: Tensor, mscale: float = 1.0) -> Tensor:
    """MCore's unfused RoPE of ``t`` ``(b, s, n, d)`` for grouped-query attention
    (``_apply_rotary_pos_emb_bshd`` with ``rotary_interleaved=False``,
    ``mla_rotary_interleaved=False``): the first d_r = 2 * len(inv_freq) channels rotated,
    the rest passed through, ``torch.cat((t, t_pass), dim=-1)``. Returns ``(b, s, n, d)``."""
    s = t.shape[1]
    positions = torch.arange(s, device=t.device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # (s, d_r / 2)
    freqs = torch.cat((freqs, freqs), dim=-1)[None, :, None, :]  # (1, s, 1, d_r) fp32
    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    cos_ = (torch.cos(freqs) * mscale).to(t.dtype)
    sin_ = (torch.sin(freqs) * mscale).to(t.dtype)
    x1, x2 = torch.chunk(t, 2, dim=-1)  # _rotate_half
    t = (t * cos_) + (torch.cat((-x2, x1), dim=-1) * sin_)
    return torch.cat((t, t_pass), dim=-1)
