"""The cost model of ``tracemem fit``: a stated, simple ranking of layouts that fit, not a
prediction of step time. Two figures per layout, each a closed form with its source:

- the pipeline bubble fraction of the schedule: idle time over compute time per step;
- the recompute overhead: extra compute over the step's compute;
- the communication bytes one rank sends per training step over TP / SP, EP and CP
  (per-layer volumes times the layers of the busiest pipeline stage times the microbatches).

Units: bytes are int; activations travel in bf16 (2 bytes). ``fit`` ranks by the step time
as a multiple of its ideal compute time, (1 + recompute overhead) x (1 + bubble fraction),
then by the bytes (``rank_key``): communication is assumed hidden behind compute, and
breaks ties.

Recompute overhead, with a layer's forward FLOPs 24 b s h^2 + 4 b s^2 h (Narayanan et al. 2021,
section 5.1, eq. (3)'s terms) and backward twice the forward, so a step is three forwards:
full recompute runs every forward again, 1 / 3; selective recompute (core attention, Korthikanti
et al. 2022 section 5) runs its 4 b s^2 h again, 4 b s^2 h / (3 (24 b s h^2 + 4 b s^2 h))
= s / (18 h + 3 s); none, 0.

Bubble time, in units where one stage's forward chunk takes F = 1, its input-gradient
backward B_in = 1 and its weight-gradient backward W = 1 (Qi et al. 2023, "Zero Bubble
Pipeline Parallelism", arXiv 2401.10241, section 2: T_F = T_B = T_W), so a full backward
B = B_in + W = 2 and two overlapped chunks F&B = F + B = 3 (no credit for the overlap):

- 1F1B and GPipe: (p - 1) / m (Narayanan et al. 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", arXiv 2104.04473, section 2.2.1);
- interleaved 1F1B with v model chunks per rank: (p - 1) / (v m) (ibid., section 2.2.2);
- ZB-H1 ("ZB1P"): (p - 1)(F + B - 2W) / (m (F + B)) = (p - 1) / (3 m) (DeepSeek-V3 technical
  report, arXiv 2412.19437, Table 2; Qi et al. 2023 section 3.1); ZB-V: the same bound (Qi et
  al. section 6 report ZB-V's bubble no larger than ZB-H1's at 1F1B's activation memory);
- DualPipe: (p / 2 - 1)(F&B + B - 3W) / (m (F + B)) = 2 (p / 2 - 1) / (3 m) (DeepSeek-V3
  report Table 2); DualPipeV: the same row with PP = 2 p stages on p devices (DualPipe README,
  deepseek-ai/DualPipe 3da1bbe): 2 (p - 1) / (3 m).

with p pipeline ranks and m microbatches per step; p = 1 has no bubble.

Communication per layer and microbatch, bytes one rank sends (ring collectives move (n - 1) / n
of the buffer per rank):

- TP / SP (Korthikanti et al. 2022, arXiv 2205.05198, section 4.2.2 and Figure 5): each
  layer runs two all-reduces in forward and two in backward (without SP), or two all-gathers
  and two reduce-scatters in each (with SP), the same bandwidth: 8 (t - 1) / t * b (s / c) h * 2.
- EP (DeepSeek-V3 report section 3.2.2; Megatron-Core ``MoEAlltoAllTokenDispatcher``): an
  MoE layer's dispatch and combine all-to-alls in forward, and their transposes in backward,
  each sending this rank's tokens b s / (c t_sp) times top-k copies of h values, of which
  (e - 1) / e leave the rank under balanced routing: 4 (e - 1) / e * (b s / (c t_sp)) k h * 2.
- CP (Megatron-Core's context parallelism with Transformer Engine's ``cp_comm_type="p2p"``,
  a ring: Liu et al. 2023, "Ring Attention", arXiv 2310.01889): forward passes c - 1 chunks
  of keys and values around the ring, backward the keys and values again and their gradients:
  3 (c - 1) * b (s / c) (a / t)(d_qk + d_v) * 2, with a heads, d_qk / d_v the per-head
  key / value widths.

Not modelled: pipeline send / receive, DP / EDP gradient reduce-scatter and parameter
all-gather (per step, not per microbatch), overlap of communication with compute, and the
links' bandwidths. TP's bytes are treated as hidden only where they stay inside a node: ``fit``
does not try a TP group larger than the ranks per node (``tracemem.fit.enumerate_layouts``,
``--ranks-per-node``; in Megatron's rank order a TP group is consecutive ranks), since its
four collectives per layer and microbatch over the inter-node network would not hide behind
compute, and this model has no term to price them.
"""

from __future__ import annotations

__all__ = ["BF16", "bubble_fraction", "recompute_overhead", "tp_bytes", "ep_bytes",
           "cp_bytes", "step_cost", "rank_key"]

BF16 = 2  # bytes per activation element


def bubble_fraction(schedule: str, pp: int, vpp: int, m: int) -> float:
    """Idle over compute time per step of ``schedule`` on ``pp`` ranks with ``vpp`` chunks per
    rank and ``m`` microbatches (the module docstring's rows).

    Raises:
        ValueError: an unknown schedule (the CLI's choices come from ``tracemem.schedules``).
    """
    if pp == 1:
        return 0.0
    if schedule in ("1f1b", "gpipe"):
        return (pp - 1) / m
    if schedule == "interleaved-1f1b":
        return (pp - 1) / (vpp * m)
    if schedule in ("zb-h1", "zbv"):
        return (pp - 1) / (3 * m)
    if schedule == "dualpipe":
        return 2 * (pp / 2 - 1) / (3 * m)
    if schedule == "dualpipev":
        return 2 * (pp - 1) / (3 * m)
    raise ValueError(f"no bubble formula for schedule {schedule!r}")


def recompute_overhead(recompute: str, s: int, h: int) -> float:
    """Extra compute of ``recompute`` ("none", "selective", "full") over a step's compute, for
    sequence length ``s`` and hidden size ``h`` (the module docstring's rows).

    Raises:
        ValueError: an unknown recompute mode.
    """
    if recompute == "none":
        return 0.0
    if recompute == "full":
        return 1 / 3
    if recompute == "selective":
        return s / (18 * h + 3 * s)
    raise ValueError(f"no overhead formula for recompute {recompute!r}")


def tp_bytes(b: int, s: int, h: int, tp: int, cp: int = 1) -> int:
    """TP / SP bytes one rank sends per layer and microbatch (forward and backward):
    8 (t - 1) / t * b (s / c) h * 2 (Korthikanti et al. 2022, section 4.2.2)."""
    return 8 * (tp - 1) * b * (s // cp) * h * BF16 // tp


def ep_bytes(b: int, s: int, h: int, top_k: int, ep: int, cp: int = 1, sp_tp: int = 1) -> int:
    """EP all-to-all bytes one rank sends per MoE layer and microbatch (dispatch and combine,
    forward and backward): 4 (e - 1) / e * (b s / (c t_sp)) k h * 2; ``sp_tp``: TP when SP
    splits the sequence, else 1."""
    return 4 * (ep - 1) * (b * s // (cp * sp_tp)) * top_k * h * BF16 // ep


def cp_bytes(b: int, s: int, heads: int, d_qk: int, d_v: int, tp: int, cp: int) -> int:
    """CP ring bytes one rank sends per attention layer and microbatch (``heads``: the key /
    value heads, all of them under MLA, the query groups under GQA): 3 (c - 1) *
    b (s / c) (a / t)(d_qk + d_v) * 2 (keys and values forward; again and their gradients
    backward)."""
    return 3 * (cp - 1) * b * (s // cp) * (heads // tp) * (d_qk + d_v) * BF16


def step_cost(bubble: float, recompute: float) -> float:
    """Step time over ideal compute time: (1 + recompute overhead) x (1 + bubble)."""
    return (1 + recompute) * (1 + bubble)


def rank_key(cost: float, comm_bytes: int) -> tuple[float, int]:
    """The order of ``fit``'s table: the smaller ``step_cost`` first (rounded to 1e-6 so
    float noise does not decide), then the fewer bytes sent per step."""
    return (round(cost, 6), comm_bytes)
