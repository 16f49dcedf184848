"""Context parallelism with ``--cp-comm-type p2p``: Transformer Engine's ring attention, as
Megatron-Core runs it (megatron-te profile, option ``cp_comm_type="p2p"``).

Megatron-LM d98e8a6 passes ``cp_comm_type`` (``--cp-comm-type``, default ``p2p``) to TE through
``megatron/core/extensions/transformer_engine.py`` ``TEDotProductAttention.__init__`` (with the
CP group, its global ranks and a shared ``cp_stream``); TE d0067d0 then runs, from
``attention/dot_product_attention/backends.py`` ``FusedAttention.forward`` (each of q, k, v
made contiguous first), ``attention/dot_product_attention/context_parallel.py``
``attn_forward_func_with_cp``, which for ``p2p`` applies ``AttnFuncWithCPAndKVP2P``. What it
allocates, for Megatron's GPTModel: ``qkv_format`` ``sbhd`` (``TEDotProductAttention``'s
``self.qkv_format``), a causal mask, bf16, no attention bias, no FP8, the fused (cuDNN
``F16_arbitrary_seqlen``) backend. ``attn_forward_func_with_cp`` asserts ``qkv_format !=
"sbhd" or use_fused_attention``, and TE's ``get_attention_backend`` (``utils.py``) prefers the
fused backend on sm90+; TE's FlashAttention backend (the megatron-te option
``attention_backend`` "flash": Megatron's ``--attention-backend flash``) is
``te_ring_attention(..., backend="flash")``. Notation: this rank holds ``s`` = S / CP
tokens (two chunks of S / (2 CP), Megatron's ``get_batch_on_this_cp_rank`` load balancing),
``h`` query heads, ``g`` key/value heads (GQA; MHA: g = h; MLA: g = h with d_v < d_qk), ``kv``
= the numel of k plus v.

Forward (``AttnFuncWithCPAndKVP2P.forward``), CP steps i = 0 .. CP-1, ring rank r:

- q, k, v are viewed ``[2, s/2, b, ., d]`` (the two chunks, a view);
- ``p2p_comm_buffers[0] = torch.cat((k.view(-1), v.view(-1)))``: a ``[kv]`` send buffer;
  at each step i < CP-1 ``p2p_comm_buffers[i+1] = torch.empty_like(p2p_comm_buffers[i])``
  receives the next rank's KV. The list keeps every buffer to the end of forward: CP buffers
  of ``kv`` elements at its end (not two: the "double buffering" is of ``kv_inputs``, views);
- each step's ``cp_p2p_fwd_fused_attn`` calls ``cpp_extensions/fused_attn.py``
  ``fused_attn_fwd`` (``csrc/extensions/attention.cpp`` ``fused_attn_fwd``: O, then the
  ``rng_state`` ``[2]`` int64, then the softmax statistics S ``[b, h, sq, 1]`` fp32). The
  section decides the shapes (``cp_p2p_fwd_prepare_qkv``): step 0 "diagonal" (all s queries,
  all s keys, causal), 1 <= i <= r "lower-triangle" (all queries, the first chunk of keys:
  ``k[0]``, a contiguous slice in sbhd, so ``.contiguous()`` copies nothing), i > r
  "upper-triangle" (the second chunk of queries ``q[1]``, all keys): ``out_per_step[i]``
  ``[sq, b, h, d_v]`` and ``softmax_lse_per_step[i]`` with sq = s, or s/2 above the
  diagonal. All of them live to the end of forward (lists);
- at step 1 ``softmax_lse = torch.clone(softmax_lse_per_step[0])`` (after ``squeeze_``):
  ``[b, h, s]`` fp32, the merged statistics (later steps correct it in place);
- the output correction (``flash_attn_fwd_out_correction_init``, a ``jit_fuser`` function:
  ``torch.compile``, ``jit.py`` ``lazy_compile``, so one fused kernel) makes ``out``
  ``[s, b, h, d_v]`` in q's dtype; the other steps add into it in place
  (``flash_attn_fwd_out_correction``, ``..._second_half_out_correction``);
  ``out.to(fwd_nominal_dtype)`` is ``out`` itself, returned;
- saved (``prepare_for_saving`` then ``ctx.save_for_backward``): q (the input), ``kv =
  p2p_comm_buffers[-1]`` (the last received buffer), ``out``, ``softmax_lse`` and the CP
  ``rng_states``; the ``cu_seqlens`` tensors it also saves come from
  ``_get_cu_seqlens_info_with_cp``'s module-level cache (``[b + 1]`` int32, made once per
  (b, S, CP)) and are not counted per call. Freed at its return: the first CP-1 KV buffers,
  every ``out_per_step`` and ``softmax_lse_per_step``.

Backward (``AttnFuncWithCPAndKVP2P.backward``), steps i = 0 .. CP-1 in reverse ring order:

- ``dout.contiguous()`` (a copy only if the gradient arrives strided);
- on ranks r < CP-1 ``softmax_lse_`` = the second half of ``softmax_lse``, ``.contiguous()``:
  ``[b, h, s/2]`` fp32, to the end;
- ``dq_buffer = torch.empty_like(q)`` (the dq accumulator, returned as dq), and two ring
  buffers ``torch.empty((2, *kv.shape))`` of ``2 kv`` elements each: ``[KV, dKV]`` (KV
  travels forward, the dKV accumulator travels back); the saved ``kv`` is copied into the
  first;
- each step's ``cp_p2p_bwd_fused_attn`` calls ``fused_attn_bwd`` (``attention.cpp``: layout
  group ``NVTE_HD_HD_HD``, so dQ, dK, dV are three ``torch::empty`` of q_part's, k_part's,
  v_part's shapes): step CP-1 "diagonal" (s, s), i >= CP-r-1 "lower-triangle" (dq s, dk dv
  s/2), else "upper-triangle" (dq s/2, dk dv s). The loop's ``dq_, dk_, dv_ = None, None,
  None`` frees a step's before the next allocates; dq, dk, dv are accumulated in place into
  ``dq_buffer`` and the received dKV half;
- returned: dq (``dq_buffer``) and dk, dv as views of the last dKV half: they hold that whole
  ring buffer (``2 kv`` elements) for as long as they live; the other ring buffer is freed.

cuDNN's workspaces (``allocateSpace`` in ``attention.cpp``) are below what this models, as for
the non-CP fused attention (``modeling.kernels.attention``). KV ring buffers are
``comm_buffer`` s (the last forward one, saved, becomes an ``activation``).

Which CP rank: the kernel takes ``rank`` (its ring position); the profile passes the last
(CP-1), the rank Megatron logs (global rank ``world_size - 1``: TP fastest, then CP): every
forward step of it is on or below the diagonal.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from modeling.kernels.attention import flash_mha_bwd_scratch
from tracemem.categories import Category
from tracemem.errors import TracememError
from tracemem.tracer import MemoryTracer

__all__ = ["CP_COMM_TYPES", "te_ring_attention", "ring_sections"]

# Megatron's --cp-comm-type values tracemem models (megatron-te option cp_comm_type); a2a and
# a2a+p2p (TE's AttnFuncWithCPAndQKVOA2A, and the hierarchical a2a+p2p) are not
CP_COMM_TYPES = ("allgather", "p2p")


def _comm(t: Tensor) -> Tensor:
    mode = _get_current_dispatch_mode()
    if isinstance(mode, MemoryTracer):
        mode.tag(t, Category.COMM_BUFFER)
    return t


def ring_sections(cp: int, rank: int, backward: bool = False) -> list[str]:
    """The section of each step of ring rank ``rank`` of ``cp``: TE's causal tiles
    (``AttnFuncWithCPAndKVP2P.forward``: 0 "diagonal", i <= rank "lower-triangle", else
    "upper-triangle"; backward: CP-1 "diagonal", i >= CP-rank-1 "lower-triangle", else
    "upper-triangle")."""
    if backward:
        return ["diagonal" if i == cp - 1 else "lower-triangle" if i >= cp - rank - 1
                else "upper-triangle" for i in range(cp)]
    return ["diagonal" if i == 0 else "lower-triangle" if i <= rank else "upper-triangle"
            for i in range(cp)]


class _TERingAttention(torch.autograd.Function):
    """``AttnFuncWithCPAndKVP2P`` (module docstring) on ``(b, s, ., d)`` tensors: Megatron's
    ``[s, b, ., d]`` relabelled b-major, the same bytes per tensor."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cp: int, rank: int,
                flash: bool) -> Tensor:
        b, s, h, _ = q.shape
        d_v, dev = v.shape[-1], q.device
        buffers = [_comm(torch.cat((k.view(-1), v.view(-1)), dim=-1))]  # (kv,)
        rng_states, out_per_step, lse_per_step = [], [], []
        softmax_lse = None
        for i, section in enumerate(ring_sections(cp, rank)):
            if i < cp - 1:  # the next rank's KV
                buffers.append(_comm(torch.empty_like(buffers[i])))
            sq = s // 2 if section == "upper-triangle" else s
            out_per_step.append(q.new_empty((b, sq, h, d_v)))  # O
            if flash:  # mha_fwd: out, softmax_lse [b, h, sq], p (empty {0}), rng_state
                lse_per_step.append(torch.empty((b, h, sq), dtype=torch.float32, device=dev))
                rng_states.append(torch.empty((2,), dtype=torch.int64, device=dev))
            else:  # fused_attn_fwd: O, rng_state, S [b, h, sq, 1]
                rng_states.append(torch.empty((2,), dtype=torch.int64, device=dev))
                lse_per_step.append(torch.empty((b, h, sq, 1), dtype=torch.float32,
                                                device=dev))
            if i == 1:  # the correction of step 0 runs after step 1's attention
                softmax_lse = lse_per_step[0].view(b, h, s).clone()  # (b, h, s) fp32
        # flash_attn_fwd_out_correction_init: out (b, s, h, d_v) in q's dtype; the other
        # corrections (softmax_lse's and out's) are in place
        out = q.new_empty((b, s, h, d_v))
        ctx.cp, ctx.rank, ctx.flash = cp, rank, flash
        ctx.k_shape, ctx.v_shape = k.shape, v.shape
        ctx.save_for_backward(q, buffers[-1], out, softmax_lse, *rng_states)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, kv, _out, softmax_lse, *_rng_states = ctx.saved_tensors
        cp, rank = ctx.cp, ctx.rank
        b, s, h, d = q.shape
        (_, _, g, _), d_v = ctx.k_shape, ctx.v_shape[-1]
        if not ctx.flash:  # use_fused_attention: a copy only if strided
            dout = dout.contiguous()
        held = []  # locals TE holds to its return
        if rank < cp - 1:  # softmax_lse_: the second chunk's statistics, contiguous
            held.append(softmax_lse.view(b, h, 2, s // 2)[:, :, 1].contiguous())  # (b, h, s/2)
        dq_buffer = torch.empty_like(q)
        rings = [_comm(kv.new_empty((2, kv.numel()))) for _ in range(2)]  # [KV, dKV] each
        rings[0][0].copy_(kv)
        step_grads = None
        for section in ring_sections(cp, rank, backward=True):
            step_grads = None  # the previous step's dq_, dk_, dv_: freed
            sq = s // 2 if section == "upper-triangle" else s
            skv = s // 2 if section == "lower-triangle" else s
            # fused_attn_bwd: dQ, dK, dV (NVTE_HD_HD_HD: three torch::empty); flash:
            # cp_p2p_bwd_flash_attn's torch.empty_like of q_part, k_part, v_part; both are
            # accumulated in place into dq_buffer and the received dKV
            step_grads = (q.new_empty((b, sq, h, d)), q.new_empty((b, skv, g, d)),
                          q.new_empty((b, skv, g, d_v)))
            if ctx.flash:
                flash_mha_bwd_scratch(q, b, sq, skv, h, g, d, d_v)
        del step_grads, held
        dkv = rings[cp % 2][1]  # the last step's received dKV
        k_numel = b * s * g * d
        dk = dkv[:k_numel].view(ctx.k_shape)
        dv = dkv[k_numel:].view(ctx.v_shape)
        return dq_buffer, dk, dv, None, None, None


def te_ring_attention(q: Tensor, k: Tensor, v: Tensor, cp: int, rank: int,
                      backend: str = "fused") -> Tensor:
    """TE's ring attention (``AttnFuncWithCPAndKVP2P``, module docstring) at ring rank
    ``rank`` of ``cp`` on this rank's ``q`` ``(b, s, h, d_qk)``, ``k`` ``(b, s, g, d_qk)`` and
    ``v`` ``(b, s, g, d_v)`` (s = S / CP; Megatron's ``[s, b, ., d]``, b-major here); returns
    ``(b, s, h * d_v)``. Strided inputs are first made contiguous, as for the non-CP fused
    attention (``modeling.kernels.attention.te_fused_attention``: TE's ``get_qkv_layout``,
    then ``FusedAttention.forward``'s ``x.contiguous()`` under CP).

    ``backend`` "fused" (the module docstring) or "flash": TE's FlashAttention backend
    (Megatron's ``--attention-backend flash`` sets NVTE_FLASH_ATTN=1, NVTE_FUSED_ATTN=0:
    ``models/common/language_module/language_module.py``
    ``LanguageModule._set_attention_backend``), flash-attn 2 (v2.8.3
    ``flash_attn_interface.py`` ``_flash_attn_forward`` / ``_backward``, which TE imports).
    ``backends.py`` ``FlashAttention.forward`` first copies q, k, v from sbhd to bshd
    (``x.transpose(0, 1).contiguous()``: three copies, the caller's tensors alive beside
    them), runs the ring in ``bshd`` (``cp_p2p_fwd_flash_attn``: per step
    ``out`` ``empty_like(q_part)``, ``softmax_lse`` ``[b, h, sq]`` fp32, an empty ``p``, the
    ``rng_state``; the half-chunk views of bshd keep a contiguous last dimension, so
    ``maybe_contiguous`` copies nothing), and returns ``output.view(b, s, -1).transpose(0,
    1)...contiguous()``: a copy, so the ring's saved bshd ``out`` and the returned sbhd
    output (which ``linear_proj`` saves) are two storages. Backward: no ``dout.contiguous()``,
    and each step's ``mha_bwd`` scratch (``attention.flash_mha_bwd_scratch``). Not modelled:
    flash-attn 3 (Hopper, if installed: no rng_state, its own scratch), flash-attn's split-KV
    forward accumulators (chosen by an SM-count heuristic), the deterministic ``dq_accum``
    (per-SM splits), and the copies the transposed gradients may cause upstream.
    Approximation: at b = 1 TE copies nothing (``[s, 1, ...]`` transposed is already
    contiguous, for the inputs and the output alike; ``attention.te_flash_attention`` models
    that), while this ring path copies at any b.

    Raises:
        TracememError: ``cp`` below 2, ``rank`` outside [0, cp), or an odd local sequence
            length (TE: "Sequence length per GPU needs to be divisible by 2!").
    """
    if cp < 2 or not 0 <= rank < cp:
        raise TracememError(f"ring attention needs --cp >= 2 and a CP rank in [0, cp); got "
                            f"cp {cp}, rank {rank}")
    if q.shape[1] % 2 or k.shape[1] % 2:
        raise TracememError(f"ring attention (--cp-comm-type p2p) needs an even sequence "
                            f"length per CP rank, got {q.shape[1]}: --seq-length must be a "
                            f"multiple of 2 x CP ({2 * cp})")
    if backend not in ("fused", "flash"):
        raise TracememError(f"ring attention backend {backend!r} is not one of fused, flash")
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        q, k, v = (t.contiguous() for t in (q, k, v))
    flash = backend == "flash"
    caller = (q, k, v)  # DotProductAttention.forward's own q, k, v: alive to its return
    if flash:  # sbhd -> bshd: Megatron's [s, b] relabelled (b, s), so a same-shape copy
        q, k, v = (t.clone() for t in (q, k, v))
    out = _TERingAttention.apply(q, k, v, cp, rank, flash)
    out = out.view(*out.shape[:2], -1)
    out = out.clone() if flash else out  # flash: bshd -> sbhd, contiguous: a copy
    del caller
    return out
