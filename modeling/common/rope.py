"""Rotary position embedding (RoPE), eager form: the inverse frequencies and the rotate-half
rotation, on ``(b, s, n, d)`` tensors. The megatron-te profile's form is
``modeling.kernels.rope``."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["apply_rope", "inv_freq"]


def inv_freq(rotary_dim: int, theta: float = 10000.0) -> Tensor:
    """``1 / theta^(2i / rotary_dim)`` for i < rotary_dim / 2, fp32 ``(rotary_dim / 2,)``
    (transformers' ``_compute_default_rope_parameters``)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


def apply_rope(x: Tensor, inv_freq: Tensor) -> Tensor:
    """Rotate ``x`` ``(b, s, n, d)`` by position (rotate-half form, transformers'
    ``apply_rotary_pos_emb``). Positions are 0..s-1; ``inv_freq`` is ``(d_r / 2,)``. With
    d_r < d (partial RoPE, ``partial_rotary_factor``) the first d_r channels are rotated and
    the rest passed through (transformers' ``q_rot, q_pass`` split, as in ``modeling_phi``)."""
    rotary = 2 * inv_freq.shape[0]
    if rotary < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rotary], inv_freq), x[..., rotary:]], dim=-1)
    s = x.shape[1]
    positions = torch.arange(s, device=x.device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # (s, d_r / 2)
    cos = angles.cos().repeat(1, 2)[None, :, None, :].to(x.dtype)  # (1, s, 1, d_r)
    sin = angles.sin().repeat(1, 2)[None, :, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
