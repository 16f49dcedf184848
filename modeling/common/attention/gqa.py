"""Grouped-query attention (GQA), with multi-head (MHA: as many key/value heads as query heads)
and multi-query (MQA: one) as its two ends; the training form (no KV cache).

``wq``, ``wk``, ``wv`` project to n_h query heads and n_kv key/value heads of ``head_dim``
each (optional biases: Qwen2's q, k, v; Llama's ``attention_bias`` on all four); Qwen3's
``q_norm`` / ``k_norm`` (over head_dim, ``cfg.normalization``'s norm) act on queries and keys
before RoPE; RoPE rotates the first ``rotary_dim`` channels of each head (partial RoPE), and
is skipped when ``cfg.position_embedding`` is not "rope" (Megatron's GPT with learned absolute
positions: no rotary embedding); ``wo`` projects back.
Module names follow torchtitan's ``models/llama3/model.py`` ``Attention`` (``wq``, ``wk``,
``wv``, ``wo``) and transformers' Qwen3 (``q_norm``, ``k_norm``). A profile with ``fused_qkv``
(the torch profile's default) holds one ``wqkv`` instead of ``wq``, ``wk``, ``wv``, as
torchtitan 0.3.0's ``FusedQKVLinear`` does (torchtitan/models/common/attention.py; its llama3
and qwen3 configs set ``fuse_qkv=True``): one GEMM to ``(b, s, n_kv * R * d)``, R = n_h / n_kv +
2, viewed ``(b, s, n_kv, R, d)``, split along R and each part copied contiguous; its backward
concatenates the three gradients (the split's ``cat``) before one input- and one
weight-gradient GEMM.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from modeling.common import offload
from modeling.common.checkpoint import megatron_checkpoint
from modeling.common.attention.mla import check_attention_kernel
from modeling.common.config import ModelConfig
from modeling.common.linear import Linear
from modeling.common.norm import make_norm
from modeling.common.rope import apply_rope, inv_freq
from modeling.kernels import KernelProfile, get_profile
from modeling.parallel.collectives import all_gather, reduce_scatter
from modeling.parallel.groups import column, row

__all__ = ["GQA", "repeat_kv"]


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """``(b, n_kv, s, d)`` -> ``(b, n_kv * n_rep, s, d)``, each key/value head repeated for its
    query group: ``expand`` then ``reshape`` (a copy), as transformers' ``repeat_kv``
    (models/llama/modeling_llama.py) does before eager or SDPA attention; ``n_rep`` 1 returns
    ``x`` itself."""
    if n_rep == 1:
        return x
    b, n_kv, s, d = x.shape
    return x[:, :, None].expand(b, n_kv, n_rep, s, d).reshape(b, n_kv * n_rep, s, d)


class GQA(nn.Module):
    """Grouped-query attention.

    Args:
        cfg: the model config (``attention == "gqa"``).
        attention: ``"eager"`` materialises the ``(b, n_h, s, s)`` scores and probabilities;
            ``"flash"`` runs a fused kernel that keeps the output and the log-sum-exp
            (``modeling.kernels.attention``). Under the eager and torch profiles the key and
            value heads are first repeated to n_h (``repeat_kv``), as transformers and
            torchtitan's SDPA path do.
        num_heads, num_kv_heads: query heads and query groups on this rank (TP splits both:
            n_h / TP and n_kv / TP, Megatron-Core ``Attention.__init__``
            ``num_query_groups_per_partition``); default all.
        sp, cp: sequence- and context-parallel degrees. Input and output are this rank's
            tokens ``(b, s / (cp * sp), h)``. With SP the input is all-gathered along the
            sequence before the column-parallel q, k, v projections and the output
            reduce-scattered after the row-parallel ``wo``; with CP keys and values are
            all-gathered across the CP group before attention (the all-gather variant of
            context parallelism, as ``MLA`` does), except under megatron-te with
            ``cp_comm_type`` "p2p": TE's ring attention (``modeling.kernels.
            context_parallel``) in place of the gather and the fused attention.
        kernels: the ``modeling.kernels`` profile. Under ``megatron-te`` the forward is
            Megatron-Core's ``SelfAttention`` with the TE layer spec (Megatron-LM d98e8a6,
            megatron/core/transformer/attention.py ``SelfAttention.__init__`` and
            ``get_query_key_value_tensors``; megatron/core/models/gpt/gpt_layer_specs.py
            ``get_gpt_layer_with_transformer_engine_spec``): one ``linear_qkv``
            (``TELayerNormColumnParallelLinear``: the input RMSNorm or LayerNorm fused in, q,
            k, v weights and biases in one GEMM, output ``(b, s, n_kv * (n_h / n_kv + 2) *
            head_dim)``), viewed per query group and split; the query ``reshape`` copies (the
            split is not viewable), ``q_layernorm`` / ``k_layernorm`` (``TENorm``, which copies
            the strided key), Megatron's unfused RoPE (``modeling.kernels.rope``; none without
            RoPE), TE's fused attention on n_kv key/value heads (no repeat; it copies the
            strided value), a row-parallel ``linear_proj`` (its bias, returned apart by
            ``skip_bias_add=True`` to the fused bias-dropout-add, stays in the GEMM here: the
            same bytes, see ``modeling.common.mlp.MLP``).

        Attention dropout (``cfg.attention_dropout``) applies in training, in every kernel;
        ``"unfused"`` / ``"local"`` (megatron-te) are Megatron's unfused attentions
        (``modeling.common.attention.mla.check_attention_kernel``).

    Raises:
        TracememError: unknown ``attention`` or one the profile does not run
            (``check_attention_kernel``).
    """

    def __init__(self, cfg: ModelConfig, attention: str = "flash", num_heads: int | None = None,
                 num_kv_heads: int | None = None, sp: int = 1, cp: int = 1,
                 kernels: KernelProfile | None = None):
        super().__init__()
        self.kernels = kern = kernels or get_profile("eager")
        check_attention_kernel(attention, kern, cp)
        self.attention = attention
        self.attention_dropout = cfg.attention_dropout
        self.sp, self.cp = sp, cp
        self.recompute: frozenset[str] = frozenset()  # set by Block: "core_attn"
        self.num_heads = num_heads or cfg.num_attention_heads
        self.num_kv_heads = num_kv_heads or cfg.num_key_value_heads
        self.head_dim = d = cfg.head_dim
        self.scale = d ** -0.5
        h, n, n_kv = cfg.hidden_size, self.num_heads, self.num_kv_heads
        # groups (modeling.parallel.plans' docstring): linear_qkv column-parallel (its biases
        # with it), linear_proj row-parallel (its bias replicated), q / k norms replicated
        col, rw = column("attention"), row("attention")
        self.fused_qkv = kern.fused_qkv and kern.orchestration != "megatron"
        if self.fused_qkv:  # torchtitan's FusedQKVLinear: one (n + 2 n_kv) d x h weight
            self.wqkv = Linear(h, (n + 2 * n_kv) * d, bias=cfg.qkv_bias, kernels=kern,
                               group=col)
        else:
            self.wq = Linear(h, n * d, bias=cfg.qkv_bias, kernels=kern, group=col)
            self.wk = Linear(h, n_kv * d, bias=cfg.qkv_bias, kernels=kern, group=col)
            self.wv = Linear(h, n_kv * d, bias=cfg.qkv_bias, kernels=kern, group=col)
        self.wo = Linear(n * d, h, bias=cfg.o_bias, kernels=kern, group=rw)
        if cfg.qk_norm:
            self.q_norm = make_norm(cfg, d, kern)
            self.k_norm = make_norm(cfg, d, kern)
        self.rope = cfg.has_rope
        if self.rope:
            self.register_buffer("inv_freq", inv_freq(cfg.rotary_dim, cfg.rope_theta),
                                 persistent=False)  # (rotary_dim / 2,)
            # the profile's RoPE cache, module state (torch: torchtitan's ComplexRoPE
            # freqs_cis, (max_position_embeddings, d / 2) complex64); not for partial RoPE
            cache = (kern.rope_cache(self.inv_freq, cfg.max_position_embeddings)
                     if cfg.rotary_dim == d else None)
            if cache is not None:
                self.register_buffer("rope_cache", cache, persistent=False)

    def forward(self, x: Tensor, norm: nn.Module | None = None) -> Tensor:
        """``x`` ``(b, s / (cp * sp), h)``; ``norm`` the layer's input norm when the
        profile fuses it into ``linear_qkv`` (megatron-te), else None."""
        if self.kernels.orchestration == "megatron":
            return self._forward_megatron(x, norm)
        x = all_gather(x, self.sp, dim=1)  # (b, s / cp, h)
        b, s, _ = x.shape
        if self.fused_qkv:
            q, k, v = self._fused_qkv_forward(x)
        else:
            q = self.wq(x).view(b, s, -1, self.head_dim)  # (b, s, n_local, d)
            k = self.wk(x).view(b, s, -1, self.head_dim)  # (b, s, n_kv_local, d)
            v = self.wv(x).view(b, s, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = self.kernels.rope_qk(q, k, self.inv_freq, getattr(self, "rope_cache", None))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, n, s / cp, d)
        # CP: every rank needs all keys and values (all-gather variant of context parallelism)
        k, v = all_gather(k, self.cp, dim=2), all_gather(v, self.cp, dim=2)
        if "core_attn" in self.recompute:
            out = checkpoint(self._core_attention, q, k, v, use_reentrant=False)
        else:
            out = self._core_attention(q, k, v)
        out = self.wo(out.transpose(1, 2).reshape(b, s, -1))  # (b, s / cp, h), partial sums
        return reduce_scatter(out, self.sp, dim=1)  # (b, s / (cp * sp), h)

    def _fused_qkv_forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """torchtitan 0.3.0 ``FusedQKVLinear.forward``: ``x`` ``(b, s, h)`` -> q ``(b, s,
        n_local, d)``, k, v ``(b, s, n_kv_local, d)``, each a contiguous copy of its slice of
        the one GEMM's output."""
        b, s, _ = x.shape
        per_group = self.num_heads // self.num_kv_heads
        qkv = self.wqkv(x).view(b, s, -1, per_group + 2, self.head_dim)
        parts = torch.split(qkv, [per_group, 1, 1], dim=-2)
        q, k, v = (t.reshape(b, s, -1, self.head_dim).contiguous() for t in parts)
        return q, k, v

    def _core_attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # (b, n, s / cp, d) queries, (b, n_kv, s, d) keys and values in; (b, n, s / cp, d) out
        n_rep = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        return self.kernels.core_attention(q, k, v, self.scale, self.attention, self._dropout)

    @property
    def _dropout(self) -> float:
        """The attention dropout probability in force (0 outside training)."""
        return self.attention_dropout if self.training else 0.0

    # ------------------------------------------------------- Megatron-Core's SelfAttention
    def _forward_megatron(self, x: Tensor, norm: nn.Module | None) -> Tensor:
        # fine-grained activation offloading (modeling.common.offload): qkv_linear around
        # get_query_key_value_tensors (committed on its outputs, nothing released), core_attn
        # around core attention (releasing query, key, value), attn_proj around linear_proj
        # (releasing its input): attention.py Attention.forward
        kern, d = self.kernels, self.head_dim
        with offload.group("qkv_linear", x) as x:
            mixed = self.wq(x, "column", self.sp, norm, fused=(self.wk, self.wv))
            b, s, _ = mixed.shape  # (b, s / cp, n_kv * (n / n_kv + 2) * d)
            per_group = self.num_heads // self.num_kv_heads
            mixed = mixed.view(b, s, self.num_kv_heads, (per_group + 2) * d)
            query, key, value = mixed.split([per_group * d, d, d], dim=3)
            del mixed
            query = query.reshape(b, s, -1, d)  # (b, s, n_local, d): a copy
            if hasattr(self, "q_norm"):  # TENorm (it copies a strided input: kernels.norm)
                query, key = self.q_norm(query), self.k_norm(key)
        query, key, value = offload.commit((query, key, value), "qkv_linear")
        if self.rope:
            query = kern.rope_bshd(query, self.inv_freq)
            key = kern.rope_bshd(key, self.inv_freq)  # (b, s, n_kv_local, d)
        # value stays a strided slice of linear_qkv's output: TE's fused attention copies it
        # (modeling.kernels.attention.te_fused_attention, get_qkv_layout)
        checkpointed = "core_attn" in self.recompute  # no group: _checkpointed_attention_forward
        with offload.group("core_attn", query, not checkpointed) as query:
            if self.cp > 1 and getattr(kern, "cp_ring", False):
                # --cp-comm-type p2p: TE's ring attention passes K and V round the CP group
                if checkpointed:
                    out = megatron_checkpoint(kern.ring_attention, None, query, key, value,
                                              self.cp)  # attention.py: reentrant
                else:
                    out = kern.ring_attention(query, key, value, self.cp)
            else:
                # CP: every rank needs all keys and values (all-gather variant of context
                # parallelism)
                key, value = all_gather(key, self.cp, dim=1), all_gather(value, self.cp, dim=1)
                if checkpointed:
                    # transformer/attention.py _checkpointed_attention_forward: reentrant
                    out = megatron_checkpoint(kern.core_attention, None, query, key, value,
                                              self.scale, self.attention, self._dropout)
                else:
                    out = kern.core_attention(query, key, value, self.scale, self.attention,
                                              self._dropout)
        out = offload.commit(out, "core_attn", [query, key, value], not checkpointed)
        with offload.group("attn_proj", out) as out:
            output = self.wo(out, "row", self.sp)  # (b, s / (cp * sp), h)
        return offload.commit(output, "attn_proj", [out])
