"""Rotary position embedding kernels.

- eager / torch: ``modeling.common.rope.apply_rope`` (rotate-half form on
  ``(b, s, n, d_r)``).
- megatron-te, MLA: Megatron-Core's unfused RoPE, the same torch ops in the same order
  (megatron/core/models/common/embeddings/rope_utils.py ``_apply_rotary_pos_emb_bshd`` with
  ``mla_rotary_interleaved=True``, and ``_rotate_half``, at Megatron-LM d98e8a6): the even and
  odd channels are concatenated, cos and sin are computed in fp32 from the frequencies, scaled
  by mscale and cast to the input dtype; autograd keeps the two casts. Megatron's
  ``--apply-rope-fusion`` (TE's fused MLA RoPE) is not emulated: docs/kernels.md.
- torch, grouped-query attention: torchtitan 0.3.0's ``ComplexRoPE``
  (torchtitan/models/common/rope.py, the RoPE of its llama3 and deepseek_v3 configs):
  ``complex_rope_cache`` is its ``_precompute_cache`` (a complex64 ``freqs_cis`` buffer of the
  attention module, ``(max_seq_len, d / 2)``), ``complex_rope`` its ``apply_rotary_emb`` on q
  and k together: fp32 copies viewed as complex, multiplied by the cache's first s rows,
  viewed back as real and cast to the input dtype. Autograd keeps only the cache (module
  state) for backward: no per-layer activation, unlike the rotate-half form's bf16 cos / sin
  casts. Not modelled: qwen3's and gpt_oss's ``CosSinRoPE`` (it keeps nothing either, but
  its fp32 temporaries differ).
- megatron-te, grouped-query attention (Llama, Qwen): ``megatron_rope_bshd``, the same function with
  ``rotary_interleaved=False`` and no MLA interleaving: the first d_r channels rotated
  (rotate-half), the rest passed through, and the two concatenated (a copy even when the
  rest is empty).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["megatron_rope", "megatron_rope_bshd", "complex_rope_cache", "complex_rope"]


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


def complex_rope_cache(inv_freq: Tensor, max_seq_len: int) -> Tensor:
    """torchtitan's ``ComplexRoPE._precompute_cache`` (no scaling): ``polar(1, outer(t,
    inv_freq))`` for positions t < ``max_seq_len``; ``inv_freq`` ``(d / 2,)`` fp32. Returns
    ``(max_seq_len, d / 2)`` complex64, on ``inv_freq``'s device."""
    t = torch.arange(max_seq_len, device=inv_freq.device, dtype=inv_freq.dtype)
    freqs = torch.outer(t, inv_freq).float()  # (max_seq_len, d / 2)
    return torch.polar(torch.ones_like(freqs), freqs)


def complex_rope(q: Tensor, k: Tensor, cache: Tensor) -> tuple[Tensor, Tensor]:
    """torchtitan's ``ComplexRoPE.forward`` without positions: ``q`` ``(b, s, n, d)`` and
    ``k`` ``(b, s, n_kv, d)`` rotated by adjacent channel pairs with ``cache``'s first s rows
    (``_reshape_for_broadcast``: a view ``(1, s, 1, d / 2)``). Returns q and k in their
    dtypes."""
    s = q.shape[1]
    freqs_cis = cache[0:s].view(1, s, 1, cache.shape[-1])  # (1, s, 1, d / 2)
    xq_ = torch.view_as_complex(q.float().reshape(*q.shape[:-1], -1, 2))  # (b, s, n, d / 2)
    xk_ = torch.view_as_complex(k.float().reshape(*k.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)  # (b, s, n, d) fp32
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(q), xk_out.type_as(k)
