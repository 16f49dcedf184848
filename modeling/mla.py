"""Multi-head Latent Attention (DeepSeek-V2 / V3), the training form (no KV cache).

Queries: ``wq_b(q_norm(wq_a(x)))`` (or ``wq(x)`` when q_lora_rank is None, as in V2-Lite).
Keys and values: ``wkv_a`` makes the compressed latent (kv_lora_rank) and the decoupled RoPE
key (qk_rope_head_dim, one shared by all heads); ``wkv_b(kv_norm(latent))`` makes per-head
no-RoPE keys and values. Module names follow DeepSeek-V3's ``inference/model.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from modeling.config import ModelConfig
from modeling.linear import Linear
from modeling.parallel.collectives import all_gather, reduce_scatter
from tracemem.errors import TracememError

__all__ = ["MLA", "ATTENTION_KERNELS", "apply_rope"]

ATTENTION_KERNELS = ("flash", "eager")


def apply_rope(x: Tensor, inv_freq: Tensor) -> Tensor:
    """Rotate ``x`` ``(b, s, n, d_r)`` by position (rotate-half form). Positions are
    0..s-1; ``inv_freq`` is ``(d_r / 2,)``."""
    s = x.shape[1]
    positions = torch.arange(s, device=x.device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)  # (s, d_r / 2)
    cos = angles.cos().repeat(1, 2)[None, :, None, :].to(x.dtype)  # (1, s, 1, d_r)
    sin = angles.sin().repeat(1, 2)[None, :, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class MLA(nn.Module):
    """Multi-head Latent Attention.

    Args:
        cfg: the model config.
        attention: ``"eager"`` materialises the (b, n_h, s, s) scores and probabilities, as
            arXiv 2502.07846 counts them; ``"flash"`` calls a fused kernel that keeps only the
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
            all-gathered across the CP group before attention.

    Raises:
        TracememError: unknown ``attention``.
    """

    def __init__(self, cfg: ModelConfig, attention: str = "flash", num_heads: int | None = None,
                 replicate_q_rope: bool = False, sp: int = 1, cp: int = 1):
        super().__init__()
        if attention not in ATTENTION_KERNELS:
            raise TracememError(f"--attention {attention!r} is invalid; choose one of "
                                f"{', '.join(ATTENTION_KERNELS)}")
        self.attention = attention
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
        if cfg.q_lora_rank is None:
            self.wq = Linear(h, n * q_head, bias=False)
        else:
            self.wq_a = Linear(h, cfg.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(cfg.q_lora_rank, eps=cfg.rms_norm_eps)
            self.wq_b = Linear(cfg.q_lora_rank, n * q_head, bias=False)
        if replicate_q_rope:
            self.wq_r = Linear(cfg.q_lora_rank or h, cfg.num_attention_heads * self.rope_dim,
                               bias=False)
        self.wkv_a = Linear(h, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = nn.RMSNorm(self.kv_lora_rank, eps=cfg.rms_norm_eps)
        self.wkv_b = Linear(self.kv_lora_rank, n * (self.nope_dim + self.v_head_dim),
                               bias=False)
        self.wo = Linear(n * self.v_head_dim, h, bias=False)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, self.rope_dim, 2, dtype=torch.float32)
                                      / self.rope_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (d_r / 2,)

    def forward(self, x: Tensor) -> Tensor:
        # Down projections run on this rank's tokens; their outputs are all-gathered along the
        # sequence (SP) before the column-parallel up projections, as in Megatron-Core's MLA.
        q_in = x if hasattr(self, "wq") else self.q_norm(self.wq_a(x))
        q_in = all_gather(q_in, self.sp, dim=1)  # (b, s / cp, q_lora_rank or h)
        kv, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = all_gather(self.kv_norm(kv), self.sp, dim=1)  # (b, s / cp, kv_lora_rank)
        k_pe = all_gather(k_pe, self.sp, dim=1)  # (b, s / cp, d_r)
        if "mla_up_proj" in self.recompute:  # up projections, RoPE and core attention
            out = checkpoint(self._up_proj_and_attention, q_in, kv, k_pe, use_reentrant=False)
        else:
            out = self._up_proj_and_attention(q_in, kv, k_pe)
        out = self.wo(out)  # (b, s / cp, h), partial sums over TP
        return reduce_scatter(out, self.sp, dim=1)  # (b, s / (cp * sp), h)

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
        if self.attention == "eager":
            scores = (q @ k.transpose(-2, -1)) * self.scale  # (b, n_h, s / cp, s)
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool,
                              device=q.device).triu(1)
            probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1, dtype=torch.float32)
            return probs.to(v.dtype) @ v  # (b, n_h, s / cp, v_head_dim)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, True, scale=self.scale)[0]
