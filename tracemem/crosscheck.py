"""``tracemem crosscheck``: published closed forms beside the traced figures for the same
configuration, term by term, with the tensors behind every difference taken from the trace.

``paper_rows`` follows arXiv 2502.07846: DeepSeek-V3, PP16 (4 layers per middle stage), TP2 with
SP, EP8, ETP1, the paper's sharding plan and precision, eager attention (as the paper counts
the s x s scores), a middle stage (layers 4-7), exact bytes (no allocator rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modeling.common.block import Block
from modeling import load_config
from modeling.parallel.build import build_rank
from modeling.parallel.pp import recv_forward
from modeling.common.routing import Balanced
from tracemem.estimator import estimate
from tracemem.formulas import megatron
from tracemem.formulas import paper_2502_07846 as paper
from tracemem.parallel import ParallelConfig
from tracemem.static import static_memory
from tracemem.tracer import MemoryTracer

__all__ = ["Row", "paper_rows", "korthikanti_rows", "ScheduleRow", "schedule_rows", "DEMO_LAYOUT"]

PAPER_LAYOUT = dict(world_size=1024, tp=2, sp=True, pp=16, ep=8, etp=1,
                    pp_layout=(4,) * 15 + (1,), plan="paper-2502.07846",
                    precision="paper-2502.07846")
STAGE, FIRST_LAYER = 1, 4  # the paper's middle stage: layers 4-7


@dataclass(frozen=True)
class Row:
    """One quantity: the formula's bytes (or elements), the traced ones, and why they differ.
    ``formula`` is None for what the formulas leave out."""

    quantity: str
    formula: int | None
    traced: int
    reason: str
    unit: str = "B"

    @property
    def difference(self) -> int | None:
        return None if self.formula is None else self.traced - self.formula


def _describe(infos: list, limit: int = 3) -> str:
    """The largest traced storages, grouped by module, shape and dtype."""
    groups: dict[tuple, list[int]] = {}
    for info in infos:
        key = (info.module, tuple(info.shape), str(info.dtype).removeprefix("torch."))
        groups.setdefault(key, []).append(info.nbytes)
    top = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:limit]
    return "; ".join(f"{len(sizes)} x {module or '(root)'} {list(shape)} {dtype} "
                     f"({sum(sizes) / 2**20:,.1f} MiB)" for (module, shape, dtype), sizes in top)


def _trace_stage_forward(cfg, par, b: int, s: int, recompute: str) -> list:
    """Activations alive after one microbatch's forward on the paper's middle stage."""
    model = build_rank(cfg, par, STAGE * (par.world_size // par.pp), attention="eager",
                       dtype=torch.bfloat16)
    for module in model.modules():
        if isinstance(module, Block):
            module.set_recompute(recompute)
    tracer = MemoryTracer(devices={"meta"})
    tracer.track_external(model)
    labels = torch.zeros(b, s, dtype=torch.long, device="meta")
    with tracer:
        x = recv_forward((b, s // par.tp, cfg.hidden_size), torch.bfloat16)
        out = model(x, labels, Balanced())
    infos = [i for i in tracer.live_at("now") if i.category.value == "activation"]
    del x, out
    return infos


def _layer_part(infos: list, layer: int, part: str) -> list:
    prefixes = ((f"layers.{layer}.attn",) if part == "mla" else
                (f"layers.{layer}.ffn",))  # attn / attn_norm, ffn / ffn_norm
    return [i for i in infos if i.module.startswith(prefixes)]


def _check_batch(b, s, heads: int) -> None:
    """``b`` and ``s`` bounded where they enter, as a ``Job`` bounds its own
    (``tracemem.job``): positive integers, at most 2^32 tokens, and the eager attention's
    b x heads x s x s fp32 scores in at most 1 PiB.

    Raises:
        TracememError: the first bound that fails, naming --b or --s.
    """
    from tracemem.errors import TracememError
    from tracemem.job import MAX_TOKENS, check_tensor_bytes

    for flag, value in (("--b", b), ("--s", s)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise TracememError(f"{flag} {value!r:.60} must be a positive integer")
    if b * s > MAX_TOKENS:
        raise TracememError(f"--b {b} x --s {s} = {b * s:,} tokens per microbatch is more "
                            f"than 2^32; no machine holds one layer's activations for that")
    check_tensor_bytes(f"the eager attention scores, b {b} x {heads} heads x s {s} x s {s} x "
                       f"4 B", b * heads * s * s * 4)


def paper_rows(b: int = 1, s: int = 4096, num_microbatches: int = 16) -> list[Row]:
    """The cross-check table for arXiv 2502.07846 at micro-batch size ``b`` and sequence
    length ``s`` (see the module docstring).

    Raises:
        TracememError: ``b`` or ``s`` not a positive integer or out of bounds
            (``_check_batch``).
    """
    cfg = load_config("deepseek-v3")
    _check_batch(b, s, cfg.num_attention_heads)
    p = paper.PAPER_V3
    par = ParallelConfig.create(cfg, zero=3, **PAPER_LAYOUT)
    model = build_rank(cfg, par, STAGE * (par.world_size // par.pp), dtype=torch.bfloat16)
    static = static_memory(model, par)
    c = static.by_component
    split, replicated = paper.mla_params(p, 4, par.tp)
    router, experts = paper.moe_params(p, 4, par.ep)
    zero = paper.zero_static_bytes(paper.rmsnorm_params(p, 4) + split + replicated + router,
                                   experts, par.dp, par.edp)
    same = "same accounting"
    rows = [
        Row("RMSNorm parameters, 4 layers", paper.rmsnorm_params(p, 4), c["norms"], same, ""),
        Row("MLA parameters, 4 layers", split + replicated, c["attention"], same, ""),
        Row("MoE parameters (router + 132 experts), 4 layers", router + experts,
            c["router"] + c["routed_experts"] + c["shared_experts"],
            same + "; V3's router correction bias (4 x 256) is a buffer, not a parameter", ""),
        Row("ZeRO-3 parameter bytes (DP 32, EDP 8)", zero[0], static.param_bytes, same),
        Row("ZeRO-3 gradient bytes", zero[1], static.grad_bytes, same),
        Row("ZeRO-3 optimizer-state bytes", zero[2], static.optimizer_bytes, same),
    ]

    params = static.dense_params + static.expert_params
    for zero_stage in (0, 1):
        mpar = ParallelConfig.create(cfg, zero=zero_stage, **(PAPER_LAYOUT | {
            "precision": "megatron"}))
        mem = static_memory(model, mpar)
        per_param = megatron.weight_and_optimizer_bytes_per_param(mpar.dp, zero_stage == 1)
        rows.append(Row(
            f"Megatron theoretical_memory_usage, ZeRO-{zero_stage}: "
            f"{'6 + 12 / DP' if zero_stage else '18'} B per parameter",
            round(per_param * params), mem.param_bytes + mem.grad_bytes + mem.optimizer_bytes,
            same if zero_stage == 0 else
            f"Megatron's formula shards every optimizer state over DP ({mpar.dp}); the "
            f"{static.expert_params:,} expert parameters shard over EDP ({mpar.edp})"))

    none = _trace_stage_forward(cfg, par, b, s, "none")
    full = _trace_stage_forward(cfg, par, b, s, "full")
    m_a1, m_e1 = paper.mla_activation(p, b, s, par.tp), paper.moe_activation(p, b, s, par.tp,
                                                                             par.ep)
    mla, moe = _layer_part(none, FIRST_LAYER, "mla"), _layer_part(none, FIRST_LAYER, "moe")
    stage_none = sum(i.nbytes for i in none)
    stage_full = sum(i.nbytes for i in full)
    layer_input = b * s // par.tp * cfg.hidden_size * 2  # bf16 (b, s / t, h)
    checkpointed = [i for i in full if i.nbytes == layer_input]
    # What the trace shows behind the two activation differences:
    probs = [i for i in mla if i.dtype == torch.float32 and len(i.shape) == 4
             and i.shape[-1] == i.shape[-2] == s]
    received = max((i.shape[0] for i in moe if len(i.shape) == 2
                    and i.shape[-1] == cfg.hidden_size), default=0)
    local_experts = cfg.num_routed_experts // par.ep
    rows += [
        Row("MLA activations per layer, no recompute (M^A_1)", m_a1,
            sum(i.nbytes for i in mla),
            f"the eager softmax keeps its probabilities in float32 "
            f"({sum(i.nbytes for i in probs):,} B: {_describe(probs, 1)}) beside the bf16 "
            f"scores, where 5bn_hs^2 / t counts 2.5 two-byte arrays; traced: "
            + _describe(mla)),
        Row("MoE activations per layer, no recompute (M^E_1)", m_e1,
            sum(i.nbytes for i in moe),
            f"each of the {local_experts} local experts receives {received // local_experts} "
            f"tokens ({received:,} rows, from all {par.ep} EP peers' s / t tokens), the "
            f"formula's E = bsN_r / N = {b * s * p.N_r // p.N}; traced: " + _describe(moe)),
        Row("stage activations per microbatch, no recompute (4 M^A_1 + 4 M^E_1)",
            4 * (m_a1 + m_e1), stage_none,
            "the two rows above over 4 layers (float32 probabilities, EP fan-in); traced: "
            + _describe(none)),
        Row("stage activations per microbatch, full recompute (4 M^A_2 + 4 M^E_2)",
            4 * (paper.mla_activation_full(p, b, s, par.tp)
                 + paper.moe_activation_full(p, b, s, par.tp)),
            stage_full, "traced: " + _describe(full)),
        Row("MLA per layer, full recompute (M^A_2 = 2bsh / t: the layer input)",
            paper.mla_activation_full(p, b, s, par.tp), stage_full // 4,
            "same accounting: each layer keeps its checkpointed input, traced: "
            + _describe(checkpointed, 1)),
        Row("MoE per layer, full recompute (M^E_2 = bsh + 2bsN_r)",
            paper.moe_activation_full(p, b, s, par.tp), 0,
            "Megatron's full recompute checkpoints the whole layer (attention and MoE) from the "
            "layer input, so the MoE input and router outputs are not kept; traced: nothing "
            "else alive after the forward"),
    ]

    settings = dict(micro_batch_size=b, seq_length=s, num_microbatches=num_microbatches,
                    rounding=None, zero=3, kernels="eager", **PAPER_LAYOUT)
    eager = estimate("deepseek-v3", attention="eager", **settings)
    flash = estimate("deepseek-v3", attention="flash", **settings)
    mid, first, last = eager.ranks[STAGE], eager.ranks[0], eager.ranks[-1]
    rows += [
        Row(f"stage-1 activations at its peak, 1F1B, M = {num_microbatches}",
            4 * (m_a1 + m_e1), mid.activation_bytes,
            f"the formula counts one microbatch; 1F1B keeps {mid.inflight_microbatches} in "
            f"flight on stage 1 (stage 0: {first.inflight_microbatches}), ratio "
            f"{mid.activation_bytes / (4 * (m_a1 + m_e1)):.1f}"),
        Row("stage 0 peak (embedding, 3 dense layers + 1 MoE layer)", None, first.peak_bytes,
            f"not analysed by the paper; {first.inflight_microbatches} microbatches in flight; "
            f"largest item {first.dominant()[0]}"),
        Row("last stage peak (1 layer, head, loss over a 129,280-entry vocabulary, MTP)", None,
            last.peak_bytes, f"not analysed by the paper; largest item {last.dominant()[0]}"),
        Row("communication buffers alive at stage 1's peak", None, mid.comm_buffer_bytes,
            "all-gathers, reduce-scatters and all-to-alls not kept for backward"),
        Row("temporaries alive at stage 1's peak", None, mid.temporary_bytes,
            f"transients of the step running at the peak ({mid.peak_step})"
            + (": " + "; ".join(f"{x['module']} {x['shape']} {x['dtype']}" for x in mid.largest
                                if x["category"] == "temporary")
               if any(x["category"] == "temporary" for x in mid.largest)
               else "; none is among the 8 largest storages alive")),
        Row("stage-1 activations at its peak, flash instead of eager attention", None,
            flash.ranks[STAGE].activation_bytes,
            f"{(mid.activation_bytes - flash.ranks[STAGE].activation_bytes) / 2**30:,.1f} GiB "
            f"less: the fused kernel keeps output and logsumexp, not the s x s scores"),
    ]
    return rows


def korthikanti_rows(s: int = 2048, b: int = 1, h: int = 1024, a: int = 16,
                     pp: int = 4, vpp: int = 2) -> list[Row]:
    """Korthikanti et al. 2022 (arXiv 2205.05198) against a traced GPT-style layer
    (``tracemem.validation.cases.EagerAttentionBlock``: LayerNorm, fused QKV, eager causal
    attention, output projection, LayerNorm, 4h GELU MLP; no dropout, no TP) in bf16, and their
    pipeline first-stage factors against tracemem's schedules.

    Raises:
        TracememError: ``b`` or ``s`` not a positive integer or out of bounds
            (``_check_batch``).
    """
    from torch.utils.checkpoint import checkpoint

    _check_batch(b, s, a)

    from tracemem.formulas import korthikanti
    from tracemem.schedules import inflight_peak, schedule
    from tracemem.validation.cases import EagerAttentionBlock

    def trace(recompute: bool) -> list:
        with torch.device("meta"):
            block = EagerAttentionBlock(h, a, s).to(torch.bfloat16)
        tracer = MemoryTracer()
        tracer.track_external(block)
        with tracer:
            x = torch.empty(b, s, h, dtype=torch.bfloat16, device="meta", requires_grad=True)
            out = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        infos = [i for i in tracer.live_at("now") if i.category.value == "activation"]
        held = [i for i in tracer.live_at("now") if i.category.value == "input"]  # x itself
        del x, out
        return infos, held

    none, _ = trace(False)
    full, inputs = trace(True)
    formula_none = int(korthikanti.per_layer(s, b, h, a, 1, "none"))
    sbh, as2b = s * b * h, a * s * s * b
    stats = [i for i in none if "norm" in i.module and i.dtype == torch.float32]
    rows = [
        Row("activations per layer, no parallelism: sbh(34 + 5as/h)", formula_none,
            sum(i.nbytes for i in none),
            f"the formula has dropout masks and outputs (as^2 b + 2as^2 b + 2sbh = "
            f"{3 * as2b + 2 * sbh:,} B) the traced layer has none; the trace has LayerNorm "
            f"statistics the formula omits ({sum(i.nbytes for i in stats):,} B: "
            + _describe(stats, 1) + "); largest traced: " + _describe(none)),
        Row("activations per layer, full recompute: 2sbh",
            int(korthikanti.per_layer(s, b, h, a, 1, "full")),
            sum(i.nbytes for i in full) + sum(i.nbytes for i in inputs),
            "same accounting: only the layer input is kept; traced: "
            + _describe(full + inputs, 1)),
    ]
    chunks = inflight_peak(schedule("1f1b", pp, 1, 4 * pp)[0])
    rows.append(Row(f"1F1B first stage, microbatches held (PP {pp})", pp, chunks,
                    "same accounting: stage 0 holds pp microbatches", ""))
    chunks = inflight_peak(schedule("interleaved-1f1b", pp, vpp, 4 * pp)[0])
    factor = korthikanti.first_stage_total(1.0, pp, pp, m=4 * pp, vpp=vpp)  # in stages' worth
    rows.append(Row(f"interleaved first stage, stages' worth of activations (PP {pp}, VPP "
                    f"{vpp}): pp (1 + (pp - 1) / (pp v))", round(factor * 1000),
                    round(chunks / vpp * 1000),
                    f"same accounting: rank 0 holds {chunks} chunks of 1/{vpp} stage "
                    f"(Megatron's warm-up + 1); values x 1000", ""))
    return rows


# The demo configuration (Makefile DEMO_ARGS) with M = 32, the fewest microbatches DualPipe
# takes on PP 16 (2 * pp).
DEMO_LAYOUT = dict(world_size=1024, tp=2, sp=True, pp=16, ep=8, etp=1,
                   pp_first_stage_layers=4, pp_last_stage_layers=1, zero=1,
                   precision="megatron")


@dataclass(frozen=True)
class ScheduleRow:
    """One rank under one schedule: traced against the closed forms of
    ``tracemem.formulas.pipeline_schedules``.

    ``param_multiple``: the rank's parameter bytes over a mean stage's (all ranks' parameter
    bytes over the number of chunks they hold); ``inflight``: the most model chunks of
    microbatches the rank's schedule holds at once (``inflight_peak``); ``inflight_at_peak``:
    those held at the rank's byte peak; ``recompute``: the recompute the rank was traced
    under ("none", "full", or "selective" with its modules). Table 2's counts and multiples
    do not depend on it: recompute changes the bytes of each held microbatch, not how many
    the schedule holds (DeepSeek-V3 report 3.2.1, 3.3.2; DualPipe README)."""

    schedule: str
    rank: int
    layers: list[int]
    param_bytes: int
    param_multiple: float
    param_formula: int
    inflight: int
    inflight_formula: int
    inflight_at_peak: int
    activation_bytes: int
    peak_bytes: int
    reason: str
    recompute: str = "none"


def schedule_rows(model: str = "deepseek-v3", *, b: int = 1, s: int = 4096,
                  num_microbatches: int = 32, schedules: tuple[str, ...] | None = None,
                  layout: dict | None = None, **options) -> list[ScheduleRow]:
    """Every rank of every schedule that takes ``layout`` (vpp 1: 1f1b, zb-h1, dualpipe;
    vpp 2: zbv, dualpipev), traced by ``estimate``, beside the DeepSeek-V3 report's Table 2
    and the zero-bubble paper, with the reason for each difference derived from the ranks'
    chunks and the schedule's counts. ``options`` go to ``estimate`` (kernels, attention,
    recompute and recompute_modules: Table 2's rows under recompute, the W steps' too).

    Raises:
        TracememError: an invalid layout or a schedule it does not take.
    """
    from tracemem.formulas import pipeline_schedules as closed
    from tracemem.schedules import inflight_peak, placement, schedule

    layout = dict(DEMO_LAYOUT if layout is None else layout)
    vpp = layout.get("vpp", 1)
    recompute = options.get("recompute", "none")
    if recompute == "selective":
        recompute += f" ({' '.join(options.get('recompute_modules', ('core_attn',)))})"
    if schedules is None:
        schedules = ("1f1b", "zb-h1", "dualpipe") if vpp == 1 else ("zbv", "dualpipev")
    rows = []
    for name in schedules:
        result = estimate(model, micro_batch_size=b, seq_length=s,
                          num_microbatches=num_microbatches, schedule=name,
                          **layout, **options)
        par = result.parallel
        where = placement(name, par.pp, par.vpp, num_microbatches)
        steps = schedule(name, par.pp, par.vpp, num_microbatches)
        held = [where.chunks_of(r.pp_stage) for r in result.ranks]
        mean_stage = sum(r.parameter_bytes for r in result.ranks) / sum(map(len, held))
        for r, chunks in zip(result.ranks, held):
            p = r.pp_stage
            multiple = r.parameter_bytes / mean_stage
            count = inflight_peak(steps[p])
            formula = closed.activation_multiple(name, par.pp)
            reasons = []
            if abs(multiple - closed.parameter_multiple(name)) > 0.005:
                spans = ", ".join(
                    f"{c} (layers {ls[0]}-{ls[-1]})" if ls else f"{c} (no layers)"
                    for c, ls in zip(chunks, par.layers_of_stage(p, where)))
                ends = [e for e, held_it in (("the embedding", 0 in chunks),
                                             ("the head, loss and MTP",
                                              where.num_chunks - 1 in chunks)) if held_it]
                reasons.append(f"holds chunk(s) {spans}" + (f" with {' and '.join(ends)}"
                               if ends else "") + "; Table 2 assumes equal stages")
            if count != formula:
                if name in ("1f1b", "zb-h1") and count == min(par.pp - p, num_microbatches):
                    reasons.append(f"rank {p} holds min(PP - {p}, M) = {count} (Megatron's "
                                   f"warm-up); Table 2's PP is rank 0's")
                else:
                    reasons.append(f"the schedule holds {count} chunks at most on this rank")
            if r.inflight_microbatches != count:
                reasons.append(f"the byte peak ({r.peak_step}) holds {r.inflight_microbatches}:"
                               f" W's inputs or a backward's transients outweigh one more "
                               f"forward")
            rows.append(ScheduleRow(name, p, r.layers, r.parameter_bytes, round(multiple, 3),
                                    closed.parameter_multiple(name), count, formula,
                                    r.inflight_microbatches, r.activation_bytes, r.peak_bytes,
                                    "; ".join(reasons), recompute))
    return rows
