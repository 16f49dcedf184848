"""Core attention kernels (causal, no dropout).

- eager: the ``(b, n, s, s)`` scores and fp32 softmax probabilities are materialised and kept.
- flash (eager and torch profiles): ``aten::_scaled_dot_product_efficient_attention`` on meta:
  output ``(b, n, s, d_v)`` and logsumexp ``(b, n, ceil(s / 32) * 32)`` fp32 are kept (MLA's
  value head is narrower than its query head, which aten's FlashAttention-2 op rejects).
- megatron-te: TE ``DotProductAttention`` with the fused (cuDNN) backend,
  ``transformer_engine/pytorch/attention/dot_product_attention/backends.py``
  ``FusedAttnFunc.forward`` at TE d0067d0: saves q, k, v, out and the auxiliary tensors of
  ``fused_attn_fwd`` (softmax statistics ``(b, n, s, 1)`` fp32 and the rng state, two int64);
  backward allocates dq, dk, dv. cuDNN's workspace is below what this models (docs/kernels.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["eager_attention", "sdpa_attention", "te_fused_attention"]


def eager_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Scores, causal mask, fp32 softmax, weighted sum. ``q``, ``k`` ``(b, n, s, d)``, ``v``
    ``(b, n, s, d_v)``; returns ``(b, n, s, d_v)``."""
    scores = (q @ k.transpose(-2, -1)) * scale  # (b, n, s_q, s_k)
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1, dtype=torch.float32)
    return probs.to(v.dtype) @ v


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """aten's fused memory-efficient attention, ``(b, n, s, d)`` layout."""
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, True, scale=scale)[0]


class _TEFusedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        b, s, n, _ = q.shape
        out = v.new_empty((b, s, n, v.shape[-1]))
        stats = torch.empty((b, n, s, 1), dtype=torch.float32, device=q.device)
        rng_state = torch.empty((2,), dtype=torch.int64, device=q.device)
        ctx.save_for_backward(q, k, v, out, stats, rng_state)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, *_ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def te_fused_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """TE fused attention on contiguous ``q``, ``k`` ``(b, s, n, d_qk)`` and ``v``
    ``(b, s, n, d_v)`` (Megatron's ``[s, b, n, d]``, b-major here: same bytes); k and v may
    have fewer heads (grouped-query attention). Returns ``(b, s, n * d_v)``.

    Strided inputs are copied as TE does: ``get_qkv_layout``
    (attention/dot_product_attention/utils.py) finds a layout it supports, else makes q, k and
    v contiguous. Simplification: the packed layouts it accepts without a copy (q, k, v
    interleaved views of one buffer with equal strides) never reach it from Megatron's
    attentions here (RoPE makes q and k fresh tensors), so any strided input means a copy."""
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        q, k, v = (t.contiguous() for t in (q, k, v))
    out = _TEFusedAttention.apply(q, k, v)
    return out.view(*out.shape[:2], -1)
