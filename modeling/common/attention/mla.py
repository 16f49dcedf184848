"""Multi-head Latent Attention (DeepSeek-V2 / V3), the training form (no KV cache).

Queries: ``wq_b(q_norm(wq_a(x)))`` (or ``wq(x)`` when q_lora_rank is None, as in V2-Lite).
Keys and values: ``wkv_a`` makes the compressed latent (kv_lora_rank) and the decoupled RoPE
key (qk_rope_head_dim, one shared by all heads); ``wkv_b(kv_norm(latent))`` makes per-head
no-RoPE keys and values. Module names follow DeepSeek-V3's ``inference/model.py``.
Without ``cfg.mla_latent_norms`` (Megatron's MLA without ``--qk-layernorm``) neither latent is
normed; ``cfg.o_bias`` gives ``wo`` (Megatron's ``linear_proj``) a bias, its only one.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from modeling.common import offload
from modeling.common.checkpoint import CheckpointWithoutOutput, megatron_checkpoint
from modeling.common.config import ModelConfig
from modeling.kernels import KernelProfile, get_profile
from modeling.common.linear import Linear
from modeling.common.norm import make_norm
from modeling.common.rope import apply_rope
from modeling.parallel.collectives import all_gather, reduce_scatter
from modeling.parallel.groups import column, replicated, row
from tracemem.errors import TracememError

__all__ = ["MLA", "ATTENTION_KERNELS", "check_attention_kernel", "apply_rope"]

# flash, eager: modeling.kernels.attention; unfused, local: Megatron's --attention-backend
# unfused (TE's UnfusedDotProductAttention) and local (Megatron-Core's DotProductAttention)
ATTENTION_KERNELS = ("flash", "eager", "unfused", "local")


def check_attention_kernel(attention: str, kernels: KernelProfile, cp: int) -> None:
    """Refuse an attention kernel the profile does not run.

    "unfused" and "local" are Megatron's unfused attentions (``modeling.kernels.attention.
    megatron_unfused_attention``): megatron-te only, and neither supports context parallelism
    (Megatron-Core's ``DotProductAttention.__init__`` asserts ``context_parallel_size == 1``; TE's
    ``get_attention_backend`` disables ``UnfusedDotProductAttention`` under CP). They are not
    aliases of "eager" under the eager and torch profiles: those trace different ops (a bf16
    masked copy and an fp32 softmax kept) under the same name, so "eager" is named instead.

    Raises:
        TracememError: an unknown kernel; "eager" under megatron-te; "unfused" or "local"
            under another profile or with CP > 1.
    """
    if attention not in ATTENTION_KERNELS:
        raise TracememError(f"--attention {attention!r} is invalid; choose one of "
                            f"{', '.join(ATTENTION_KERNELS)}")
    megatron = kernels.orchestration == "megatron"
    if megatron and attention == "eager":
        raise TracememError(f"--kernels {kernels.name} runs Megatron's attentions: --attention "
                            f"eager needs --kernels eager or torch (Megatron's unfused "
                            f"attention: --attention unfused or local)")
    if attention in ("unfused", "local") and not megatron:
        raise TracememError(f"--attention {attention} is Megatron's --attention-backend "
                            f"{attention} and needs --kernels megatron-te; under --kernels "
                            f"{kernels.name} the s x s attention is --attention eager")
    if attention in ("unfused", "local") and cp > 1:
        raise TracememError(f"--attention {attention} does not support context parallelism "
                            f"(--cp {cp}); use --attention flash")


class MLA(nn.Module):
    """Multi-head Latent Attention.

    Args:
        cfg: the model config.
        attention: ``"eager"`` materialises the (b, n_h, s, s) scores and probabilities, as
            arXiv 2502.07846 counts them; ``"unfused"`` / ``"local"`` (megatron-te) are
            Megatron's unfused attentions (``check_attention_kernel``); ``"flash"`` calls a
            fused kernel that keeps only the
            output and the log-sum-exp for backward. MLA's value head (128) is narrower than
            its query/key head (192), which aten's FlashAttention-2 op rejects, so "flash" calls
            ``aten._scaled_dot_product_efficient_attention`` (output (b, n_h, s, d_v), logsumexp
            (b, n_h, ceil(s / 32) * 32) fp32), the same storages FlashAttention-3 keeps. That
            op has no CPU kernel: real CPU runs use "eager".
        num_heads: heads on this rank (TP shards heads); default all.
        replicate_q_rope: hold the query RoPE projection (W^QR, the RoPE columns of wq_b) as a
            separate, replicated ``wq_r`` for all heads, as arXiv 2502.07846 counts it; this
            rank's heads are then narrowed out of its output.

        sp, cp: sequence- and context-parallel degrees. The input and output are this rank's
            tokens ``(b, s / (cp * sp), h)``. With SP, the q and kv latents are all-gathered
            along the sequence and saved by the up projections at full length (Megatron-Core
            saves them sharded and all-gathers again in backward; arXiv 2502.07846 counts them
            at full length, "2bs(d_cq + d_c) undivided by SP"). With CP, K and V are
            all-gathered across the CP group before attention; under megatron-te with
            ``cp_comm_type`` "p2p", TE's ring attention (``modeling.kernels.
            context_parallel``) runs instead.

        kernels: the ``modeling.kernels`` profile. Under ``megatron-te`` the forward is
            Megatron-Core's ``MLASelfAttention`` (megatron/core/transformer/
            multi_latent_attention.py ``get_query_key_value_tensors``, Megatron-LM d98e8a6):
            TE down projections on the local tokens, q / kv norms fused into the up
            projections (``TELayerNormColumnParallelLinear``, which save the local input and
            re-gather in backward), the RoPE key gathered along the sequence, unfused RoPE,
            contiguous q / k / v into TE's fused attention, a row-parallel ``linear_proj``.

        Attention dropout (``cfg.attention_dropout``) applies in training, in every kernel.

    Raises:
        TracememError: unknown ``attention`` or one the profile does not run
            (``check_attention_kernel``); the replicated query RoPE projection under
            megatron-te.
    """

    def __init__(self, cfg: ModelConfig, attention: str = "flash", num_heads: int | None = None,
                 replicate_q_rope: bool = False, sp: int = 1, cp: int = 1,
                 kernels: KernelProfile | None = None):
        super().__init__()
        self.kernels = kernels or get_profile("eager")
        check_attention_kernel(attention, self.kernels, cp)
        if self.kernels.orchestration == "megatron" and replicate_q_rope:
            raise TracememError(
                f"--kernels {self.kernels.name} runs Megatron's MLA layout: --plan "
                f"paper-2502.07846 needs --kernels eager")
        self.attention = attention
        self.attention_dropout = cfg.attention_dropout
        self.sp, self.cp = sp, cp
        self.recompute: frozenset[str] = frozenset()  # set by Block: "core_attn", "mla_up_proj"
        self.num_heads = num_heads or cfg.num_attention_heads
        self.nope_dim, self.rope_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.qk_head_dim, self.v_head_dim = cfg.qk_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = self.qk_head_dim ** -0.5
        h, n = cfg.hidden_size, self.num_heads
        self.replicate_q_rope = replicate_q_rope
        q_head = self.nope_dim if replicate_q_rope else self.qk_head_dim
        kern = self.kernels
        # groups (modeling.parallel.plans' docstring): down projections duplicated, up
        # projections column-parallel, wo row-parallel
        dup, col, rw = replicated("attention"), column("attention"), row("attention")
        if cfg.q_lora_rank is None:
            self.wq = Linear(h, n * q_head, bias=False, kernels=kern, group=col)
        else:
            self.wq_a = Linear(h, cfg.q_lora_rank, bias=False, kernels=kern, group=dup)
            if cfg.mla_latent_norms:
                self.q_norm = make_norm(cfg, cfg.q_lora_rank, kern)
            self.wq_b = Linear(cfg.q_lora_rank, n * q_head, bias=False, kernels=kern,
                               group=col)
        if replicate_q_rope:
            self.wq_r = Linear(cfg.q_lora_rank or h, cfg.num_attention_heads * self.rope_dim,
                               bias=False, group=dup)
        self.wkv_a = Linear(h, self.kv_lora_rank + self.rope_dim, bias=False, kernels=kern,
                            group=dup)
        if cfg.mla_latent_norms:
            self.kv_norm = make_norm(cfg, self.kv_lora_rank, kern)
        self.wkv_b = Linear(self.kv_lora_rank, n * (self.nope_dim + self.v_head_dim),
                            bias=False, kernels=kern, group=col)
        # Megatron-Core's linear_proj has bias=add_bias_linear (multi_latent_attention.py
        # MLASelfAttention.__init__, skip_bias_add=True: added in bias_dropout_add; the same
        # bytes in the GEMM here, as GQA's); every other MLA projection has none
        self.wo = Linear(n * self.v_head_dim, h, bias=cfg.o_bias, kernels=kern, group=rw)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, self.rope_dim, 2, dtype=torch.float32)
                                      / self.rope_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (d_r / 2,)

    def forward(self, x: Tensor) -> Tensor:
        if self.kernels.orchestration == "megatron":
            return self._forward_megatron(x)
        # Down projections run on this rank's tokens; their outputs are all-gathered along the
        # sequence (SP) before the column-parallel up projections, as in Megatron-Core's MLA.
        q_in = x if hasattr(self, "wq") else self._q_norm(self.wq_a(x))
        q_in = all_gather(q_in, self.sp, dim=1)  # (b, s / cp, q_lora_rank or h)
        kv, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = all_gather(self._kv_norm(kv), self.sp, dim=1)  # (b, s / cp, kv_lora_rank)
        k_pe = all_gather(k_pe, self.sp, dim=1)  # (b, s / cp, d_r)
        if "mla_up_proj" in self.recompute:  # up projections, RoPE and core attention
            out = checkpoint(self._up_proj_and_attention, q_in, kv, k_pe, use_reentrant=False)
        else:
            out = self._up_proj_and_attention(q_in, kv, k_pe)
        out = self.wo(out)  # (b, s / cp, h), partial sums over TP
        return reduce_scatter(out, self.sp, dim=1)  # (b, s / (cp * sp), h)

    def _q_norm(self, x: Tensor) -> Tensor:
        """The q latent's norm, or ``x`` itself without latent norms (``mla_latent_norms``)."""
        return self.q_norm(x) if hasattr(self, "q_norm") else x

    def _kv_norm(self, x: Tensor) -> Tensor:
        return self.kv_norm(x) if hasattr(self, "kv_norm") else x

    def _up_proj_and_attention(self, q_in: Tensor, kv: Tensor, k_pe: Tensor) -> Tensor:
        b, s, _ = q_in.shape
        q = self.wq(q_in) if hasattr(self, "wq") else self.wq_b(q_in)
        if self.replicate_q_rope:
            q_nope = q.view(b, s, -1, self.nope_dim)  # (b, s, n_local, nope)
            q_pe = self.wq_r(q_in).view(b, s, -1, self.rope_dim).narrow(2, 0, self.num_heads)
        else:
            q = q.view(b, s, -1, self.qk_head_dim)  # (b, s, n_local, qk_head_dim)
            q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope(q_pe, self.inv_freq)], dim=-1)
        k_pe = apply_rope(k_pe.unsqueeze(2), self.inv_freq)  # (b, s, 1, d_r)
        kv = self.wkv_b(kv).view(b, s, -1, self.nope_dim + self.v_head_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_head_dim], dim=-1)  # (b, s, n_h, d)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, n_h, s / cp, d)
        # CP: every rank needs all keys and values (all-gather variant of context parallelism)
        k, v = all_gather(k, self.cp, dim=2), all_gather(v, self.cp, dim=2)
        if "core_attn" in self.recompute:
            out = checkpoint(self._core_attention, q, k, v, use_reentrant=False)
        else:
            out = self._core_attention(q, k, v)
        return out.transpose(1, 2).reshape(b, s, -1)  # (b, s / cp, n_local * v_head_dim)

    def _core_attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # (b, n_h, s / cp, d) in, (b, n_h, s / cp, v_head_dim) out
        return self.kernels.core_attention(q, k, v, self.scale, self.attention, self._dropout)

    @property
    def _dropout(self) -> float:
        """The attention dropout probability in force (0 outside training)."""
        return self.attention_dropout if self.training else 0.0

    # ------------------------------------------------------------------ Megatron-Core's MLA
    def _forward_megatron(self, x: Tensor) -> Tensor:
        # fine-grained activation offloading (modeling.common.offload): qkv_linear around
        # get_query_key_value_tensors (committed on the query, releasing the input),
        # core_attn around core attention (releasing query, key, value), attn_proj around
        # linear_proj (releasing its input): multi_latent_attention.py MLASelfAttention.forward
        with offload.group("qkv_linear", x) as x:
            if hasattr(self, "wq"):  # no q LoRA: linear_q_proj is column-parallel on x
                q_compressed = x
            else:  # linear_q_down_proj: duplicated TELinear, (b, s_local, q_lora_rank)
                q_compressed = self.wq_a(x)
            kv_combined = self.wkv_a(x)  # (b, s_local, kv_lora + d_r)
            kv_compressed, k_pos_emb = kv_combined.split([self.kv_lora_rank, self.rope_dim],
                                                         dim=-1)
            # gather_from_sequence_parallel_region (a contiguous input for the collective)
            k_pos_emb = all_gather(k_pos_emb.contiguous() if self.sp > 1 else k_pos_emb,
                                   self.sp, dim=1)  # (b, s / cp, d_r)
            del kv_combined
            # get_query_key_value_tensors returns before core attention runs, so the up
            # projections' outputs (not saved by anyone) are freed before it
            ckpt = None
            if "mla_up_proj" in self.recompute:
                # the up projections and RoPE under CheckpointWithoutOutput: query, key and
                # value are freed once core attention has saved them, and recomputed when the
                # gradient of core attention's output arrives (multi_latent_attention.py
                # get_query_key_value_tensors, forward: discard_output_and_register_recompute)
                ckpt = CheckpointWithoutOutput()
                qkv = ckpt.checkpoint(self._qkv_megatron, q_compressed, kv_compressed,
                                      k_pos_emb)
            else:
                qkv = self._qkv_megatron(q_compressed, kv_compressed, k_pos_emb)
            del k_pos_emb  # a local of get_query_key_value_tensors (the others it returns)
        query, key, value = offload.commit(tuple(qkv), "qkv_linear", [x])
        del qkv
        if "core_attn" in self.recompute:  # no group: _checkpointed_attention_forward
            out = self._attention_megatron(query, key, value)
        else:
            with offload.group("core_attn", query) as query:
                out = self._attention_megatron(query, key, value)
            out = offload.commit(out, "core_attn", [query, key, value])
        if ckpt is not None:
            ckpt.discard_output_and_register_recompute(out)
        with offload.group("attn_proj", out) as out:
            output = self.wo(out, "row", self.sp)  # (b, s_local, h)
        return offload.commit(output, "attn_proj", [out])

    def _attention_megatron(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """Core attention; with ``core_attn`` recompute under Megatron's reentrant
        ``tensor_parallel.checkpoint`` (transformer/attention.py
        ``_checkpointed_attention_forward``)."""
        k = self.kernels
        if self.cp > 1 and getattr(k, "cp_ring", False):
            # --cp-comm-type p2p: TE's ring attention passes K and V round the CP group
            if "core_attn" in self.recompute:
                return megatron_checkpoint(k.ring_attention, None, query, key, value, self.cp)
            return k.ring_attention(query, key, value, self.cp)
        # CP: every rank needs all keys and values (all-gather variant of context parallelism)
        key, value = all_gather(key, self.cp, dim=1), all_gather(value, self.cp, dim=1)
        if "core_attn" in self.recompute:
            return megatron_checkpoint(k.core_attention, None, query, key, value, self.scale,
                                       self.attention, self._dropout)
        return k.core_attention(query, key, value, self.scale, self.attention, self._dropout)

    def _qkv_megatron(self, q_compressed: Tensor, kv_compressed: Tensor,
                      k_pos_emb: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``qkv_up_proj_and_rope_apply`` of ``MLASelfAttention.get_query_key_value_tensors``:
        contiguous ``query``, ``key`` ``(b, s / cp, n_local, qk_head_dim)`` and ``value``."""
        k, sp = self.kernels, self.sp
        if hasattr(self, "wq"):
            q = self.wq(q_compressed, "column", sp)
        else:  # TELayerNormColumnParallelLinear: q_norm fused (TEColumnParallelLinear
            # without --qk-layernorm: gpt_layer_specs.py, q_layernorm IdentityOp)
            q = self.wq_b(q_compressed, "column", sp, getattr(self, "q_norm", None))
        b, s, _ = q.shape
        q = q.view(b, s, -1, self.qk_head_dim)  # (b, s / cp, n_local, qk_head_dim)
        kv = self.wkv_b(kv_compressed, "column", sp, getattr(self, "kv_norm", None))
        kv = kv.view(b, s, -1, self.nope_dim + self.v_head_dim)
        q_no_pe, q_pos_emb = q.split([self.nope_dim, self.rope_dim], dim=-1)
        k_no_pe, value = kv.split([self.nope_dim, self.v_head_dim], dim=-1)
        q_pos_emb = k.rope(q_pos_emb, self.inv_freq)
        k_pos_emb = k.rope(k_pos_emb.unsqueeze(-2), self.inv_freq)  # (b, s, 1, d_r)
        query = torch.cat([q_no_pe, q_pos_emb], dim=-1)
        key = torch.cat([k_no_pe, k_pos_emb.expand(-1, -1, q.shape[2], -1)], dim=-1)
        return query.contiguous(), key.contiguous(), value.contiguous()
