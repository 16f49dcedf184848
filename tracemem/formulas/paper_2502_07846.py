"""arXiv 2502.07846, "Memory Analysis on the Training Course of DeepSeek Models" (text in
shared/reference/). Symbols, as the paper defines them:

b micro-batch size; s sequence length; h hidden size (7168); d_cq query compression dim (1536);
d_c KV compression dim (512); d_h per-head dim (128); d_hr per-head RoPE dim (64); n_h heads (128);
N routed experts per layer (256); N_r experts activated per token (8); h_E expert hidden size
(2048). Parallelism: TP t (with SP over the same t ranks), EP e, PP stages of ``layers`` layers.

All activation terms are bytes with 2-byte (BF16) elements, as the paper counts them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PaperSymbols", "PAPER_V3", "rmsnorm_params", "mla_params", "moe_params",
           "zero_static_bytes", "mla_activation", "moe_activation", "mla_activation_full",
           "moe_activation_full"]


@dataclass(frozen=True)
class PaperSymbols:
    h: int = 7168
    d_cq: int = 1536
    d_c: int = 512
    d_h: int = 128
    d_hr: int = 64
    n_h: int = 128
    N: int = 256
    N_r: int = 8
    h_E: int = 2048


PAPER_V3 = PaperSymbols()


def rmsnorm_params(p: PaperSymbols, layers: int) -> int:
    """RMSNorm parameters: (2h + d_cq + d_c) per layer (the paper's Table 4 section:
    (7168 x 2 + 1536 + 512) x 4 = 65,536)."""
    return (2 * p.h + p.d_cq + p.d_c) * layers


def mla_params(p: PaperSymbols, layers: int, tp: int) -> tuple[int, int]:
    """(TP-split, replicated) MLA parameters per rank. Split over TP: W^UQ (d_h n_h x d_cq),
    W^UK and W^UV (d_h n_h x d_c each), W^O (h x d_h n_h); replicated: W^DQ (d_cq x h),
    W^DKV (d_c x h), W^QR (d_hr n_h x d_cq), W^KR (d_hr x h). PP16@TP2: 318,767,104 +
    110,886,912 = 429,654,016."""
    dn = p.d_h * p.n_h
    split = (dn * p.d_cq + dn * p.d_c * 2 + p.h * dn) * layers // tp
    replicated = (p.d_cq * p.h + p.d_c * p.h + p.d_hr * p.n_h * p.d_cq + p.d_hr * p.h) * layers
    return split, replicated


def moe_params(p: PaperSymbols, layers: int, ep: int, shared: int = 1) -> tuple[int, int]:
    """(router, experts) parameters per rank: the router N x h per layer, replicated; per layer
    N / e routed experts plus the shared expert(s), replicated, each 3 x h x h_E. EP8: 4 x
    1,835,008 and 132 x 3 x 7168 x 2048 = 5,813,305,344."""
    router = p.N * p.h * layers
    experts = layers * (p.N // ep + shared) * 3 * p.h * p.h_E
    return router, experts


def zero_static_bytes(dense_params: int, expert_params: int, dp: int, edp: int
                      ) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) bytes per rank with ZeRO over DP (dense) and EDP
    (experts): 2, 4 and 8 bytes per parameter (the paper's static-memory table; DP32 / EDP8:
    1.38, 2.76, 5.52 GiB)."""
    per_rank = dense_params // dp + expert_params // edp
    return 2 * per_rank, 4 * per_rank, 8 * per_rank


def mla_activation(p: PaperSymbols, b: int, s: int, tp: int) -> int:
    """M^A_1: one layer's MLA activations without recompute under TP t with SP (the paper's
    Figure 2 formula divided as in its TP2@SP2 expression): 4bsh/t + 2bs(d_cq + d_c)
    + 4bs(d_h + d_hr) n_h / t + 2bs d_h n_h / t + 5 b n_h s^2 / t + 2bs d_h n_h / t + bsh / t.
    The 2bs(d_cq + d_c) term stays whole: the down projections are replicated."""
    return (4 * b * s * p.h // tp + 2 * b * s * (p.d_cq + p.d_c)
            + 4 * b * s * (p.d_h + p.d_hr) * p.n_h // tp + 2 * b * s * p.d_h * p.n_h // tp
            + 5 * b * p.n_h * s * s // tp + 2 * b * s * p.d_h * p.n_h // tp
            + b * s * p.h // tp)


def moe_activation(p: PaperSymbols, b: int, s: int, tp: int, ep: int) -> int:
    """M^E_1: one layer's MoE activations without recompute under SP t, EP e: 4bsh / t
    + 4bsN + 2bsN_r + (N / e) (3 E h + 8 E h_E) + (3bsh + 8bsh_E) for the shared expert, with
    E = bs N_r / N tokens per expert (balanced routing)."""
    e_token = b * s * p.N_r // p.N
    return (4 * b * s * p.h // tp + 4 * b * s * p.N + 2 * b * s * p.N_r
            + (p.N // ep) * (3 * e_token * p.h + 8 * e_token * p.h_E)
            + 3 * b * s * p.h + 8 * b * s * p.h_E)


def mla_activation_full(p: PaperSymbols, b: int, s: int, tp: int) -> int:
    """M^A_2: with full recompute only the layer input is kept: 2bsh / t."""
    return 2 * b * s * p.h // tp


def moe_activation_full(p: PaperSymbols, b: int, s: int, tp: int) -> int:
    """M^E_2: with full recompute, the input and the router outputs: bsh + 2bsN_r (the paper
    writes it undivided by SP)."""
    return b * s * p.h + 2 * b * s * p.N_r
