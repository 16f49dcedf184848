"""Core attention kernels (causal; attention dropout with probability ``dropout``).

- eager: the ``(b, n, s, s)`` scores and fp32 softmax probabilities are materialised and kept;
  with dropout > 0 the bf16 probabilities go through the profile's dropout
  (``modeling.kernels.dropout``) before the weighted sum, as transformers' eager attention does.
- flash (eager and torch profiles): ``aten::_scaled_dot_product_efficient_attention`` on meta:
  output ``(b, n, s, d_v)`` and logsumexp ``(b, n, ceil(s / 32) * 32)`` fp32 are kept (MLA's
  value head is narrower than its query head, which aten's FlashAttention-2 op rejects); with
  dropout > 0 it keeps the philox seed and offset (two int64 scalars), no mask.
- megatron-te, "flash": TE ``DotProductAttention`` with the fused (cuDNN) backend,
  ``transformer_engine/pytorch/attention/dot_product_attention/backends.py``
  ``FusedAttnFunc.forward`` at TE d0067d0: saves q, k, v, out and the auxiliary tensors of
  ``fused_attn_fwd`` (softmax statistics ``(b, n, s, 1)`` fp32 and the rng state, two int64);
  backward allocates dq, dk, dv. cuDNN's workspace is below what this models (docs/kernels.md).
  Attention dropout changes nothing here: ``cpp_extensions/fused_attn.py`` ``fused_attn_fwd``
  returns ``aux_ctx_tensors = [softmaxStats, rng_state]`` whatever ``dropout`` is (backward
  regenerates the mask from the ``[seed, offset]`` rng state), and ``FusedAttnFunc`` saves
  exactly those.
- megatron-te, "unfused" and "local": the unfused attention of Megatron's ``--attention-backend
  unfused`` (TE's ``UnfusedDotProductAttention``) and ``--attention-backend local``
  (Megatron-Core's ``DotProductAttention``): ``megatron_unfused_attention``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from modeling.kernels.dropout import torch_dropout

__all__ = ["eager_attention", "sdpa_attention", "te_fused_attention", "megatron_unfused_attention",
           "UNFUSED_IMPLS"]


def eager_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, dropout: float = 0.0,
                    dropout_fn: Callable[[Tensor, float], Tensor] = torch_dropout) -> Tensor:
    """Scores, causal mask, fp32 softmax, its bf16 cast, dropout (``dropout_fn`` with
    probability ``dropout``: the profile's, ``modeling.kernels.dropout``), weighted sum. ``q``,
    ``k`` ``(b, n, s, d)``, ``v`` ``(b, n, s, d_v)``; returns ``(b, n, s, d_v)``."""
    scores = (q @ k.transpose(-2, -1)) * scale  # (b, n, s_q, s_k)
    mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1, dtype=torch.float32)
    return dropout_fn(probs.to(v.dtype), dropout) @ v


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, scale: float,
                   dropout: float = 0.0) -> Tensor:
    """aten's fused memory-efficient attention, ``(b, n, s, d)`` layout; ``dropout`` its
    ``dropout_p`` (the mask is regenerated in backward from the philox seed and offset)."""
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, dropout, True, scale=scale)[0]


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


# ------------------------------------------------------------------------------------------------
# Unfused attention under megatron-te: TE's UnfusedDotProductAttention (Megatron's
# --attention-backend unfused: the TE spec keeps TEDotProductAttention, which TE's backend
# selection then runs unfused) and Megatron-Core's own DotProductAttention
# (--attention-backend local: megatron/training/models/gpt.py swaps it into the TE spec's
# core_attention). Both run the same torch ops around one fused (or torch) softmax.

UNFUSED_IMPLS = ("unfused", "local")


def _batch_per_block(sk: int) -> int:
    """Batches per CUDA block of the fused softmax kernels for ``sk`` keys: TE
    ``attention/dot_product_attention/softmax.py`` ``FusedScaleMaskSoftmax.get_batch_per_block``
    and Apex ``csrc/megatron/scaled_masked_softmax.h`` ``get_batch_per_block`` (which
    Megatron-Core's ``fusions/fused_softmax.py`` asks) compute it alike: 128 threads per block,
    warps of min(next power of two >= sk, 32) threads, two batches per warp up to 128 keys."""
    pow2 = 1 << (sk - 1).bit_length()
    return (128 // min(pow2, 32)) * (2 if pow2 <= 128 else 1)


def fused_softmax_available(impl: str, batches: int, sq: int, sk: int, dtype: torch.dtype,
                            fusion: bool = True) -> bool:
    """Whether the causal softmax of ``impl`` runs its fused CUDA kernel on ``batches`` (b x
    heads) score matrices of ``sq`` x ``sk`` in ``dtype``, else the torch fallback.

    - "local": Megatron-Core ``fusions/fused_softmax.py`` ``FusedScaleMaskSoftmax.
      is_kernel_available``: ``--masked-softmax-fusion`` (``fusion``), fp16 / bf16 input,
      16 < sk <= 4096, sq, sk and b x heads multiples of 4, and (causal) b x heads a multiple
      of the batches per block.
    - "unfused": TE's ``FusedScaleMaskSoftmax.is_kernel_available``: ``NVTE_MASKED_SOFTMAX_
      FUSION`` (``fusion``), fp16 / bf16 input, 16 < sk < 16384, sk a multiple of 8, sq > 1,
      sq == sk (causal), sq and b x heads multiples of 4, sq a multiple of the batches per
      block.
    """
    half = dtype in (torch.float16, torch.bfloat16)
    if impl == "local":
        return (fusion and half and 16 < sk <= 4096 and sq % 4 == 0 and sk % 4 == 0
                and batches % 4 == 0 and batches % _batch_per_block(sk) == 0)
    return (fusion and half and 16 < sk < 16384 and sk % 8 == 0 and sq > 1 and sq == sk
            and sq % 4 == 0 and batches % 4 == 0 and sq % _batch_per_block(sk) == 0)


class _ScaledUpperTriangMaskedSoftmax(torch.autograd.Function):
    """Megatron-Core ``fusions/fused_softmax.py`` ``ScaledUpperTriangMaskedSoftmax`` over Apex's
    ``scaled_upper_triang_masked_softmax_cuda`` (``csrc/megatron/
    scaled_upper_triang_masked_softmax_cuda.cu`` ``fwd_cuda`` / ``bwd_cuda``): forward allocates
    ``softmax_results`` ``[b * np, sq, sk]`` in the input's dtype and saves it (with
    ``scale_t``, a CPU tensor: no device bytes); backward writes the input gradient into the
    (contiguous) output gradient in place and returns it."""

    @staticmethod
    def forward(ctx, scores: Tensor) -> Tensor:
        out = torch.empty_like(scores, memory_format=torch.contiguous_format)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.contiguous()


class _TEScaledMaskedSoftmax(torch.autograd.Function):
    """TE ``attention/dot_product_attention/softmax.py`` ``scaled_masked_softmax_forward`` (the
    ``te_softmax::scaled_masked_softmax_fwd`` custom op: its ``register_autograd``
    setup_context saves the output only) over ``csrc/extensions/softmax.cpp``
    ``scaled_masked_softmax_forward`` / ``_backward``: forward allocates ``softmax_results``
    ``[b, np, sq, sk]`` in the input's dtype; backward a new input gradient of that shape. The
    mask ``[1, 1, sq, sk]`` bool is read, not saved."""

    @staticmethod
    def forward(ctx, scores: Tensor, mask: Tensor) -> Tensor:
        out = torch.empty_like(scores, memory_format=torch.contiguous_format)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        return torch.empty_like(grad), None


def _te_causal_mask(sq: int, sk: int, device) -> Tensor:
    """TE ``attention/dot_product_attention/utils.py`` ``get_full_mask`` for ``attn_mask_type``
    "causal", no attention mask, ``window_size`` (-1, 0) -> (sk, 0): its torch ops, int32
    position differences and their comparisons; returns the bool ``[1, 1, sq, sk]`` mask
    (True = masked)."""
    mask = (torch.arange(sq, dtype=torch.int32, device=device).view(1, 1, sq, 1)
            - torch.arange(sk, dtype=torch.int32, device=device).view(1, 1, 1, sk))
    swa_left = mask - sk
    swa_right = mask + 0
    return torch.logical_not((swa_left <= 0) & ~(swa_right < 0))


def _softmax(impl: str, scores: Tensor, te_mask: Tensor | None, fused: bool) -> Tensor:
    """``FusedScaleMaskSoftmax.forward`` of ``impl`` on the causal ``scores`` ``[b, np, sq,
    sk]`` (scale None: no ``apply_query_key_layer_scaling``); returns the probabilities in the
    scores' dtype."""
    b, n, sq, sk = scores.shape
    if fused and impl == "local":  # forward_fused_softmax, causal: the 3-D upper-triang kernel
        return _ScaledUpperTriangMaskedSoftmax.apply(scores.view(-1, sq, sk)).view(b, n, sq, sk)
    if fused:  # TE forward_fused_softmax: a mask and a mask type other than no_mask
        return _TEScaledMaskedSoftmax.apply(scores, te_mask)
    # forward_torch_softmax: fp32 softmax (attention_softmax_in_fp32, TE's softmax_in_fp32)
    half = scores.dtype in (torch.float16, torch.bfloat16)
    x = scores.float() if half else scores
    if impl == "local":  # transformer/utils.py get_default_causal_mask: fp32 ones, triu, bool
        mask = torch.triu(torch.ones(sq, sk, device=scores.device), diagonal=1).bool()
    else:  # softmax.py _get_default_causal_mask (a cached bool triu; made here each call)
        causal = torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=scores.device),
                            diagonal=1)
        mask = torch.logical_or(te_mask, causal)
        del causal
    x.masked_fill_(mask, -10000.0)  # attention_mask_func, in place: the mask is saved
    probs = torch.softmax(x, dim=-1)  # fp32, saved
    return probs.to(scores.dtype) if half else probs


def megatron_unfused_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, impl: str,
                               dropout: float = 0.0,
                               dropout_fn: Callable[[Tensor, float], Tensor] = torch_dropout,
                               softmax_fusion: bool = True) -> Tensor:
    """Unfused causal attention as Megatron runs it with ``--attention-backend unfused``
    (``impl`` "unfused": TE d0067d0 ``attention/dot_product_attention/backends.py``
    ``UnfusedDotProductAttention._forward``) or ``local`` (``impl`` "local": Megatron-LM
    d98e8a6 ``megatron/core/transformer/dot_product_attention.py``
    ``DotProductAttention.forward``), on ``q``, ``k`` ``(b, s, n, d_qk)`` and ``v`` ``(b, s,
    n_kv, d_v)`` (``k`` and ``v`` may have fewer heads: grouped-query attention); returns
    ``(b, s, n * d_v)``. Under TE the strided inputs are first made contiguous
    (``get_qkv_layout``, as ``te_fused_attention``).

    The torch ops, in order (Megatron's ``[s, b, n, d]``: the ``(b, s, ...)`` storages here are
    relabelled ``[s, b, ...]`` by a ``view``, the same bytes; values are never meaningful under
    megatron-te):

    - ("unfused") the causal mask: ``_te_causal_mask``, bool ``[1, 1, s, s]``, alive to the end;
    - ``repeat_interleave`` of k and v to n heads when n_kv < n (copies);
    - the score buffer ``[b * n, s, s]`` in q's dtype: TE's ``torch.empty``, Megatron's
      ``get_global_memory_buffer().get_tensor(..., "mpu")`` (a persistent buffer in Megatron,
      traced here as a temporary: docs/kernels.md); ``torch.baddbmm(buffer, q, k^T, beta=0,
      alpha=scale)`` makes the scores ``[b * n, s, s]``, a new tensor alive to the end of the
      forward (it saves views of q and k; TE drops its buffer there, Megatron's lives on);
    - the softmax (``_softmax``): fused when ``fused_softmax_available`` (the kernel saves its
      output ``[b, n, s, s]`` in q's dtype), else torch's fp32 softmax (an fp32 copy of the
      scores masked in place, the bool mask and the fp32 probabilities saved, then cast back);
    - attention dropout with probability ``dropout`` (``dropout_fn``, CUDA's ``native_dropout``
      under megatron-te: a bool mask ``[b, n, s, s]`` kept, and the dropped probabilities, which
      the next ``bmm`` saves); nothing when 0. Megatron forks the tensor-parallel RNG tracker
      around it (``tensor_parallel.get_cuda_rng_tracker().fork()``, TE's
      ``attention_dropout_ctx``): a CPU-side state swap, no device bytes;
    - ``torch.bmm(probs, v)`` ``[b * n, s, d_v]`` (it saves probs and a view of v), then
      ``permute(2, 0, 1, 3).contiguous()`` ``[s, b, n, d_v]``, viewed ``[s, b, n * d_v]``.

    Raises:
        ValueError: unknown ``impl`` (validated by the attention modules first).
    """
    if impl not in UNFUSED_IMPLS:
        raise ValueError(f"impl {impl!r} not in {UNFUSED_IMPLS}")
    if impl == "unfused" and not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        q, k, v = (t.contiguous() for t in (q, k, v))
    # held to the end, as by the caller (TE's DotProductAttention.forward, Megatron's Attention)
    inputs = (q, k, v)  # noqa: F841
    b, sq, n, _ = q.shape
    sk = k.shape[1]
    q, k, v = (t.view(t.shape[1], t.shape[0], *t.shape[2:]) for t in (q, k, v))  # [s, b, ...]
    te_mask = _te_causal_mask(sq, sk, q.device) if impl == "unfused" else None
    if k.shape[2] != n:  # grouped-query attention: each key / value head repeated (copies)
        k = k.repeat_interleave(n // k.shape[2], dim=2)
        v = v.repeat_interleave(n // v.shape[2], dim=2)
    buffer = torch.empty((b * n, sq, sk), dtype=q.dtype, device=q.device)
    query = q.reshape(sq, b * n, -1)  # [sq, b * np, hn]: a view
    key = k.reshape(sk, b * n, -1)
    scores = torch.baddbmm(buffer, query.transpose(0, 1), key.transpose(0, 1).transpose(1, 2),
                           beta=0.0, alpha=scale)  # [b * np, sq, sk]
    if impl == "unfused":  # TE rebinds matmul_result: its empty buffer goes; Megatron's stays
        del buffer
    # the scores stay alive to the end (matmul_result / attention_scores are locals of both)
    fused = fused_softmax_available(impl, b * n, sq, sk, q.dtype, softmax_fusion)
    probs = _softmax(impl, scores.view(b, n, sq, sk), te_mask, fused)
    probs = dropout_fn(probs, dropout)
    value = v.reshape(sk, b * n, -1)  # [sk, b * np, hn_v]
    context = torch.bmm(probs.view(b * n, sq, -1), value.transpose(0, 1))  # [b * np, sq, hn_v]
    context = context.view(b, n, sq, -1).permute(2, 0, 1, 3).contiguous()  # [sq, b, np, hn_v]
    return context.view(b, sq, -1)  # Megatron's [sq, b, np * hn_v], relabelled (b, s, ...)
