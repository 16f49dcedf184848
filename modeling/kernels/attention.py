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
- megatron-te, "flash" with the profile option ``attention_backend`` "flash": TE
  ``DotProductAttention`` with its FlashAttention backend and flash-attn 2
  (``te_flash_attention``: Megatron's ``--attention-backend flash``); "auto" resolves per GPU
  architecture (``te_auto_attention_backend``).
- megatron-te, "unfused" and "local": the unfused attention of Megatron's ``--attention-backend
  unfused`` (TE's ``UnfusedDotProductAttention``) and ``--attention-backend local``
  (Megatron-Core's ``DotProductAttention``): ``megatron_unfused_attention``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from modeling.common import cpu_offload
from modeling.kernels.dropout import torch_dropout
from tracemem.errors import TracememError

__all__ = ["eager_attention", "sdpa_attention", "te_fused_attention", "te_flash_attention",
           "te_auto_attention_backend", "flash_mha_bwd_scratch", "TE_ATTENTION_BACKENDS",
           "megatron_unfused_attention", "UNFUSED_IMPLS"]


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
    cpu_offload.mark_base(q, k, v)  # FusedAttnFunc.forward under TE's CPU offloading
    out = _TEFusedAttention.apply(q, k, v)
    return out.view(*out.shape[:2], -1)


# ------------------------------------------------------------------------------------------------
# TE's FlashAttention backend (Megatron's --attention-backend flash) over flash-attn 2

# the megatron-te option attention_backend: which TE DotProductAttention backend runs
# Megatron's causal self-attention ("auto": te_auto_attention_backend)
TE_ATTENTION_BACKENDS = ("fused", "flash", "auto")


def te_auto_attention_backend(arch: tuple[int, int] | None, flash_attn: bool | None = None) -> str:
    """The backend TE d0067d0 picks under Megatron's ``--attention-backend auto`` (NVTE_FLASH_ATTN,
    NVTE_FUSED_ATTN, NVTE_UNFUSED_ATTN all 1) for Megatron's GPT attention (causal, sbhd, bf16,
    no bias, no FP8, head dims up to 128, MLA's 192 / 128), on a GPU of compute capability
    ``arch`` (None: not known), with flash-attn 2 installed (``flash_attn`` True), not
    installed (False) or not known (None). Returns "fused" or "flash".

    ``attention/dot_product_attention/utils.py`` ``get_attention_backend``: both backends
    support these inputs on sm80, sm90 and sm100 (the fused one given a cuDNN that does:
    ``common/fused_attn/fused_attn.cpp`` ``nvte_get_fused_attn_backend``, not checked here),
    so the choice is its last two steps:
    FlashAttention is available only if a flash-attn it accepts is installed ("All available
    backends": ``FlashAttentionUtils.is_installed``, 2.1.1 <= version < 2.8.4; FA3 only on
    sm90; FA4 not on sm80), and "Select FusedAttention for performance" drops FlashAttention
    whenever both are available and ``device_compute_capability >= (9, 0)``. So sm90 and
    sm100 run fused whatever is installed; sm80 runs flash-attn 2 if it is installed, else
    fused. Whether the Megatron-CI containers have flash-attn cannot be read from Megatron-LM's
    source (d98e8a6: not in ``uv.lock`` nor installed by ``docker/Dockerfile.ci.dev``; it would
    come from the NGC base image), so "not known" keeps fused (the profile's default) on sm80
    too, as on an unknown GPU.

    Not modelled: with TE's ``deterministic`` (``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``, which
    Megatron's deterministic CI cases set, or ``torch.are_deterministic_algorithms_enabled()``)
    ``get_attention_backend`` drops the fused F16_arbitrary_seqlen sub-backend in training
    below sm90 ("Filter: Determinism"), so sm80 then runs flash-attn if installed, else TE's
    unfused attention.
    """
    if arch is None or arch >= (9, 0) or not flash_attn:
        return "fused"
    return "flash"


def _round(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def flash_mha_bwd_scratch(q: Tensor, b: int, sq: int, skv: int, h: int, g: int, d: int,
                          d_v: int) -> None:
    """What flash-attn 2's ``mha_bwd`` (``csrc/flash_attn/flash_api.cpp``, v2.8.3) allocates
    beside the dq, dk, dv it is given, freed at its return: ``softmax_d`` ``[b, h,
    round(sq, 128)]`` fp32, ``dq_accum`` ``[b, round(sq, 128), h, round(d, 32 if d <= 128 else
    64)]`` fp32 (the non-deterministic path), and for GQA (g < h) ``dk_expanded``,
    ``dv_expanded`` ``[b, skv, h, d]`` in q's dtype (summed into dk, dv by ``at::sum_out``)."""
    sq_r = _round(sq, 128)
    scratch = [torch.empty((b, h, sq_r), dtype=torch.float32, device=q.device),
               torch.empty((b, sq_r, h, _round(d, 32 if d <= 128 else 64)),
                           dtype=torch.float32, device=q.device)]
    if g != h:
        scratch += [q.new_empty((b, skv, h, d)), q.new_empty((b, skv, h, d_v))]
    del scratch


class _FlashAttnFunc(torch.autograd.Function):
    """flash-attn 2.8.3 ``flash_attn_interface.py`` ``FlashAttnFunc`` (``flash_attn_func``,
    which TE calls for bshd / sbhd without padding) on bshd ``q`` ``(b, s, h, d)``, ``k``,
    ``v`` ``(b, s, g, d)``, head dims equal and multiples of 8 (no ``F.pad`` of its own).

    Forward: ``_flash_attn_forward`` -> ``flash_api.cpp`` ``mha_fwd``: ``out =
    torch::empty_like(q)``, ``softmax_lse`` ``[b, h, s]`` fp32, ``p`` ``torch::empty({0})``
    (no ``return_softmax``: no bytes), ``rng_state`` ``[2]`` int64; ``ctx.save_for_backward(q,
    k, v, out_padded, softmax_lse, rng_state)``; returns ``out_padded[..., :d]`` (the same
    storage). Backward: ``dq, dk, dv = torch.empty_like(q), ..._like(k), ..._like(v)``, then
    ``mha_bwd``'s scratch (``flash_mha_bwd_scratch``). Attention dropout keeps nothing more
    (the mask is regenerated from ``rng_state``)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        b, s, h, _ = q.shape
        out = torch.empty_like(q)
        softmax_lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
        rng_state = torch.empty((2,), dtype=torch.int64, device=q.device)
        ctx.save_for_backward(q, k, v, out, softmax_lse, rng_state)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, *_ = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        b, sq, h, d = q.shape
        flash_mha_bwd_scratch(q, b, sq, k.shape[1], h, k.shape[2], d, v.shape[-1])
        return dq, dk, dv


def te_flash_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """TE's FlashAttention backend with flash-attn 2 (Megatron's ``--attention-backend flash``
    sets NVTE_FLASH_ATTN=1, NVTE_FUSED_ATTN=0, NVTE_UNFUSED_ATTN=0: Megatron-LM d98e8a6
    ``megatron/core/models/common/language_module/language_module.py``
    ``LanguageModule._set_attention_backend``) on ``q``, ``k`` ``(b, s, n, d_qk)`` and ``v``
    ``(b, s, n_kv, d_v)`` (Megatron's ``[s, b, n, d]``, b-major here; k and v may have fewer
    heads); returns ``(b, s, n * d_v)``. TE d0067d0, in order:

    - ``dot_product_attention.py`` ``DotProductAttention.forward``: ``get_qkv_layout`` makes
      strided inputs contiguous (as ``te_fused_attention``); for MLA (d_qk != d_v) with
      flash-attn 2, ``_pad_qkv_head_dim`` pads the narrower of q / k and v to max(d_qk, d_v)
      with ``F.pad`` (new tensors; MLA's v). These are its locals, alive to its return;
    - ``backends.py`` ``FlashAttention.forward``: sbhd to bshd, ``x.transpose(0,
      1).contiguous()`` for each of q, k, v: a same-shape copy in the b-major relabelling, and
      no copy at b = 1 (``[s, 1, ...]`` transposed is already contiguous). Its
      ``_PrepareQKVForFA`` (one ``[3, b, s, n, d]`` buffer) needs the packed ``sbh3d`` layout,
      which the copies above never leave (docs/kernels.md, "Not emulated");
    - flash-attn's ``FlashAttnFunc`` (``_FlashAttnFunc``): saves the bshd q, k, v, its ``out``
      ``(b, s, n, d)``, ``softmax_lse`` and ``rng_state``;
    - ``output.view(b, s, -1).transpose(0, 1)`` then ``.contiguous()``: the sbhd output, a copy
      of the saved bshd ``out`` (none at b = 1), which ``linear_proj`` then saves;
    - MLA: ``_trim_output`` reshapes to ``[..., n, d_qk]``, slices ``d_v`` and reshapes back:
      a copy ``(b, s, n * d_v)``.

    Backward: the copies' backward passes gradients through (views in TE; the strided
    ``dout`` has a contiguous last dimension, so flash-attn's ``maybe_contiguous`` copies
    nothing), then flash-attn's (``_FlashAttnFunc``). Not modelled: flash-attn 3 (Hopper; TE
    prefers the fused backend there under ``auto``: ``te_auto_attention_backend``), the
    split-KV forward accumulators of ``mha_fwd`` (``set_params_splitkv``: ``[splits, b, n,
    s]`` and ``[splits, b, n, s, round(d, 32)]`` fp32, freed at its return, when attention
    dropout is 0 and b * n * ceil(s / 64) < 0.8 * 2 * the GPU's SM count), and the
    deterministic backward's ``dq_accum`` (``torch::zeros({ceil(SMs / (b * n)), b, ...})``
    under NVTE_ALLOW_NONDETERMINISTIC_ALGO=0): both depend on the GPU's SM count.

    Raises:
        TracememError: head dims flash-attn 2 does not take (TE's ``get_attention_backend``
            drops FlashAttention 2 when max(d_qk, d_v) > 256 or is not a multiple of 8).
    """
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        q, k, v = (t.contiguous() for t in (q, k, v))
    b, s, n, d_qk = q.shape
    d_v = v.shape[-1]
    d = max(d_qk, d_v)
    if d > 256 or d % 8:
        raise TracememError(f"TE's FlashAttention backend (--attention-backend flash) takes head "
                            f"dims up to 256 and a multiple of 8 (flash-attn 2); got d_qk {d_qk}, "
                            f"d_v {d_v}: use --attention-backend fused")
    if d_qk < d:  # _pad_qkv_head_dim
        q, k = F.pad(q, (0, d - d_qk)), F.pad(k, (0, d - d_qk))
    if d_v < d:
        v = F.pad(v, (0, d - d_v))
    caller = (q, k, v)  # DotProductAttention.forward's locals: alive to its return
    if b > 1:  # FlashAttention.forward: sbhd -> bshd, three copies
        q, k, v = (t.clone() for t in (q, k, v))
    cpu_offload.mark_base(q, k, v)  # FlashAttention.forward under TE's CPU offloading
    out = _FlashAttnFunc.apply(q, k, v).view(b, s, -1)  # (b, s, n * d), saved
    if b > 1:  # bshd -> sbhd, contiguous: a copy
        out = out.clone()
    if d_v < d:  # _trim_output: [..., :d_v] of (b, s, n, d), reshaped: a copy
        out = out.view(b, s, n, d)[..., :d_v].reshape(b, s, -1)
    del caller
    return out


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
    ``[b, np, sq, sk]`` in the input's dtype; backward reads the saved output and writes the
    input gradient into the incoming gradient in place ("Produce gradients in place":
    softmax.cpp ``scaled_masked_softmax_backward`` in every release, v2.14 to v2.18; TE main
    since 0c8cf2c03, 2026-07-24, allocates a fresh one instead, in no release yet). The mask
    ``[1, 1, sq, sk]`` bool is read, not saved."""

    @staticmethod
    def forward(ctx, scores: Tensor, mask: Tensor) -> Tensor:
        out = torch.empty_like(scores, memory_format=torch.contiguous_format)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (softmax_results,) = ctx.saved_tensors  # read by the backward kernel
        grad = grad.contiguous()  # the input gradient is written into it
        del softmax_results
        return grad, None


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
