"""Plain data and text tables from a trace. Nothing here prints: ``get_*`` returns data,
``format_*`` returns a string, and only the CLI prints (as ``torch.utils.flop_counter`` keeps
``get_flop_counts`` apart from ``get_table``)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from tabulate import tabulate

from tracemem.errors import TracememError
from tracemem.tracer import MemoryTracer

__all__ = ["UNITS", "UNIT_NOTES", "to_units", "pick_units", "format_size", "stage_ranks",
           "get_verdict", "format_verdict", "get_estimate", "format_estimate",
           "format_estimate_json",
           "format_fits", "get_summary", "format_breakdown", "format_comparisons",
           "estimate_columns", "plain_table", "TABLE_WIDTH", "DEFAULT_COLUMNS"]

# The field's memory figures are binary (GiB = 2^30 B, as torch.cuda.memory_summary prints);
# GB (10^9 B) is there to compare with logs and spec sheets that print GB.
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "GB": 10**9}
UNIT_NOTES = {"B": "bytes", "KiB": "2^10 B", "MiB": "2^20 B", "GiB": "2^30 B", "GB": "10^9 B"}
_AUTO = ("GiB", "MiB", "KiB", "B")  # what "auto" picks from, largest first


def to_units(nbytes: int, units: str) -> float:
    """``nbytes`` in ``units`` (one of ``UNITS``).

    Raises:
        TracememError: unknown unit; the message lists the valid ones.
    """
    if units not in UNITS:
        raise TracememError(f"units={units!r} is invalid; choose one of {', '.join(UNITS)}")
    return nbytes / UNITS[units]


def pick_units(nbytes: int) -> str:
    """The largest binary unit in which ``nbytes`` is at least 1: "GiB" for any real training
    job, "MiB" or "KiB" for a toy one, so its figures do not all read 0.00."""
    return next((u for u in _AUTO if nbytes >= UNITS[u]), "B")


def format_size(nbytes: int, units: str) -> str:
    """``nbytes`` in ``units`` for a table: 2 decimals ("144.89"), "0" for nothing at all,
    "<0.01" for a few bytes that would round to 0.00, and whole bytes with separators in
    "B"."""
    if units == "B":
        return f"{nbytes:,}"
    if nbytes == 0:
        return "0"
    text = f"{to_units(nbytes, units):,.2f}"
    return "<0.01" if text == "0.00" else text


def _size_label(nbytes: int, units: str, given: bool = False) -> str:
    """``144.89 GiB`` in prose; a size the user ``given`` (``--hbm``) without trailing zeros:
    ``80 GiB``, ``85.9 GB``."""
    if units == "B":
        return f"{nbytes:,} B"
    if given:
        return f"{to_units(nbytes, units):,.2f}".rstrip("0").rstrip(".") + f" {units}"
    return f"{format_size(nbytes, units)} {units}"


def _spans(ranks: list[int]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for r in ranks:
        if out and out[-1][1] == r - 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return [(a, b) for a, b in out]


def stage_ranks(par) -> dict[int, list[tuple[int, int]]]:
    """The global ranks of every pipeline stage, as inclusive ``(first, last)`` spans. In
    Megatron's rank order (TP fastest, PP slowest; ``ParallelConfig.stage_of``) each stage is
    one span of world / PP ranks: stage 1 of 1024 GPUs at PP 16 is ranks 64-127. Computed from
    the spans, not by visiting every rank (a world of 10^12 ranks answers at once)."""
    per = par.world_size // par.pp
    return {stage: [(stage * per, (stage + 1) * per - 1)] for stage in range(par.pp)}


def _format_spans(spans: list[tuple[int, int]]) -> str:
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _format_stages(stages: list[int]) -> str:
    """Stages in prose: ``[0, 15]`` -> "0 and 15", ``[1, 2, 3, 7]`` -> "1-3 and 7",
    ``[0, 2, 4]`` -> "0, 2 and 4"."""
    parts = _format_spans(_spans(stages)).split(",")
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def get_summary(tracer: MemoryTracer, top_modules: int = 10) -> dict[str, Any]:
    """A JSON-ready summary, every figure in bytes (int).

    Keys: ``peak_bytes``, ``baseline_bytes``, ``step_peak_bytes`` (peak - baseline),
    ``peak_event`` (index, phase, op and module of the event that set the peak, or null),
    ``by_category`` and ``by_module`` (bytes alive at the peak; modules limited to the
    ``top_modules`` largest), ``num_events``.
    """
    peak = tracer.peak_event_index
    event = tracer.events[peak] if peak is not None else None
    modules = tracer.by_module("peak")
    return {
        "peak_bytes": tracer.peak_bytes,
        "baseline_bytes": tracer.baseline_bytes,
        "step_peak_bytes": tracer.peak_bytes - tracer.baseline_bytes,
        "peak_event": None if event is None else {
            "index": event.index, "phase": event.phase.value, "op": event.op,
            "module": event.module},
        "by_category": tracer.by_category("peak"),
        "by_module": dict(list(modules.items())[:top_modules]),
        "num_events": len(tracer.events),
    }


def _rows(totals: dict[str, int], total: int, units: str) -> list[list[str]]:
    # Numbers are formatted here (tabulate would re-parse "0.000" as 0 and switch large floats
    # to scientific notation).
    return [[name or "(root)", f"{nbytes:,}", f"{to_units(nbytes, units):,.3f}",
             f"{100 * nbytes / total:.1f}" if total else "0.0"] for name, nbytes in totals.items()]


def _table(rows: list[list[Any]], headers: list[str]) -> str:
    return tabulate(rows, headers=headers, disable_numparse=True,
                    colalign=("left",) + ("right",) * (len(headers) - 1))


def format_breakdown(tracer: MemoryTracer, units: str = "GiB", top_modules: int = 10) -> str:
    """What is alive at the peak, by category and by module, as two tables."""
    summary = get_summary(tracer, top_modules)
    total = summary["peak_bytes"]
    head = ["bytes", units, "% of peak"]
    event = summary["peak_event"]
    where = ("" if event is None else
             f" (event {event['index']}: {event['phase']}, {event['op']}, "
             f"module {event['module'] or '(root)'})")
    lines = [
        f"peak: {total:,} B = {to_units(total, units):,.3f} {units}{where}",
        f"alive before the step: {summary['baseline_bytes']:,} B; added by the step at its "
        f"peak: {summary['step_peak_bytes']:,} B",
        "",
        _table(_rows(summary["by_category"], total, units), ["category"] + head),
        "",
        _table(_rows(summary["by_module"], total, units), [f"module (top {top_modules})"] + head),
    ]
    return "\n".join(lines)


def format_comparisons(comparisons: Sequence[Any]) -> str:
    """Real CPU peaks beside traced ones, one row per validation case (bytes)."""
    rows = [[c.case.name, f"{c.real_peak_bytes:,}", f"{c.traced_peak_bytes:,}",
             f"{c.gap_bytes:,}", f"{c.case.unseen_bytes:,}",
             "yes" if all(s.real.peak_bytes - s.traced_peak_bytes == c.case.unseen_bytes_at(s.index)
                          for s in c.steps) else "NO",
             "yes" if c.live_sets_equal else "NO"] for c in comparisons]
    steps = len(comparisons[0].steps) if comparisons else 0
    return _table(rows, ["case", "real peak B", "traced peak B", "real - traced B",
                         "named unseen B", f"explained, {steps} steps",
                         f"live = real, {steps} steps"])


_RANK_FIELDS = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "activation_bytes",
                "comm_buffer_bytes", "temporary_bytes", "buffer_bytes", "input_bytes",
                "zero3_gather_bytes", "workspace_bytes")
# the simulated CUDA caching allocator (tracemem.memory): max_memory_allocated / _reserved
_ALLOCATOR_FIELDS = ("allocated_peak_bytes", "reserved_peak_bytes", "fragmentation_bytes",
                     "largest_free_block_bytes", "reserved_peak_step")


def get_verdict(result) -> dict[str, Any]:
    """Whether the job fits, as plain data: ``pp_stages`` (count), ``stages_over_hbm`` (the
    pipeline stages with a rank over ``hbm_bytes``; None without ``--hbm``), ``fits`` (None
    without ``--hbm``), and the worst rank (``worst_pp_stage``, ``worst_ep_rank``,
    ``worst_peak_bytes``)."""
    hbm = result.hbm_bytes
    stages = sorted({r.pp_stage for r in result.ranks})
    # a rank fits when its simulated reserved peak plus the non-PyTorch memory fits in hbm
    # (RankEstimate.fits, set by the estimator)
    over = None if hbm is None else sorted({r.pp_stage for r in result.ranks
                                            if r.fits is False})
    worst = result.worst
    return {"pp_stages": len(stages), "hbm_bytes": hbm, "stages_over_hbm": over,
            "fits": None if over is None else not over, "worst_pp_stage": worst.pp_stage,
            "worst_ep_rank": worst.ep_rank, "worst_peak_bytes": worst.peak_bytes,
            # the most any rank needs of hbm: reserved peak + non-PyTorch memory
            "worst_needed_bytes": max(r.reserved_peak_bytes for r in result.ranks)
            + result.settings.get("non_pytorch_memory_bytes", 0),
            "host": get_host_memory(result)}


def get_host_memory(result) -> dict[str, Any]:
    """The host memory the job needs beyond its processes' own (``RankEstimate.host_bytes``:
    the optimizer offloaded by ``--optimizer-cpu-offload``, ``tracemem.offload``), as plain
    data: ``per_rank_bytes`` / ``pinned_per_rank_bytes`` (the most of any rank) and
    ``per_node_bytes`` / ``pinned_per_node_bytes`` (the most of any node of
    ``ranks_per_node`` consecutive global ranks, ``tracemem.offload.host_per_node``), and
    ``offload_flags``: the offload flags the job gives (a line says when they move nothing)."""
    from tracemem.offload import host_per_node

    par = result.parallel
    per_node = result.settings.get("ranks_per_node", 8)

    def most(name: str) -> tuple[int, int]:
        stage: dict[int, int] = {}
        for r in result.ranks:  # a stage's EP-rank classes: the most of them for every rank
            stage[r.pp_stage] = max(stage.get(r.pp_stage, 0), getattr(r, name))
        return max(stage.values(), default=0), host_per_node(par.world_size, par.pp, stage,
                                                             per_node)

    rank, node = most("host_bytes")
    pinned_rank, pinned_node = most("host_pinned_bytes")
    settings = result.settings or {}
    flags = [flag for flag, on in (
        ("--optimizer-cpu-offload", settings.get("optimizer_cpu_offload")),
        ("--fine-grained-activation-offloading",
         settings.get("fine_grained_activation_offloading")),
        ("--cpu-offloading-num-layers", settings.get("cpu_offloading_num_layers"))) if on]
    return {"ranks_per_node": per_node, "world_size": par.world_size, "per_rank_bytes": rank,
            "pinned_per_rank_bytes": pinned_rank, "per_node_bytes": node,
            "pinned_per_node_bytes": pinned_node, "offload_flags": flags}


def _hbm_label(hbm: int, units: str, given: str | None) -> str:
    """``--hbm`` in the verdict, saying which units it was read in: "80 GiB" (binary, as the
    tables), or for a decimal or plain-byte ``given`` "--hbm 80GB (decimal units, 1 GB = 10^9
    B; = 74.51 GiB)". Every figure of the verdict is in ``units`` (the table's): a size in
    another binary unit says its value in ``units`` too ("80 GiB (81,920 MiB)"), and a decimal
    one its value in ``units`` ("= 76,293.95 MiB"), so no two figures of one line need
    converting to compare."""
    from tracemem.job import size_unit

    if given is None or size_unit(given) == "binary":
        own = "B" if units == "B" else pick_units(hbm)
        label = _size_label(hbm, own, given=True)
        return label if own == units else f"{label} ({_size_label(hbm, units, given=True)})"
    kind = "decimal units, 1 GB = 10^9 B" if size_unit(given) == "decimal" else "bytes"
    return f"--hbm {given.strip()} ({kind}; = {_size_label(hbm, units)})"


def format_verdict(verdict: dict[str, Any], units: str = "GiB", hbm_given: str | None = None
                   ) -> str:
    """One line: "6 of 16 pipeline stages exceed 80 GiB (stages 1-6); the worst is stage 1 at
    98.62 GiB; the most a rank needs is 100.13 GiB (reserved + non-PyTorch memory)." A stage
    exceeds ``--hbm`` when a rank's reserved peak plus the non-PyTorch memory does
    (``RankEstimate.fits``). ``hbm_given``: ``--hbm`` as typed, so a decimal (80GB) or
    plain-byte size is said to be one (``_hbm_label``)."""
    units = pick_units(verdict["worst_peak_bytes"]) if units == "auto" else units
    where = f"stage {verdict['worst_pp_stage']}" + (
        "" if verdict["worst_ep_rank"] is None else f" (EP rank {verdict['worst_ep_rank']})")
    worst = f"the worst is {where} at {_size_label(verdict['worst_peak_bytes'], units)}"
    n, over, hbm = verdict["pp_stages"], verdict["stages_over_hbm"], verdict["hbm_bytes"]
    if over is None:  # what it needs is said, so --non-pytorch-memory shows without --hbm
        return (f"Verdict: {worst}; the most a rank needs is "
                f"{_size_label(verdict['worst_needed_bytes'], units)} (reserved + non-PyTorch "
                f"memory); give --hbm (e.g. 80GiB) to say whether it fits.")
    stage_word = "pipeline stage" if n == 1 else "pipeline stages"
    if not over:
        spare = hbm - verdict["worst_needed_bytes"]
        every = f"all {n} {stage_word} fit" if n > 1 else "the pipeline stage fits"
        return (f"Verdict: {every} in {_hbm_label(hbm, units, hbm_given)}; "
                f"{worst}; it needs {_size_label(verdict['worst_needed_bytes'], units)} "
                f"(reserved + non-PyTorch memory): {_size_label(spare, units)} to spare.")
    listed = "stage" if len(over) == 1 else "stages"
    exceed = "exceeds" if len(over) == 1 else "exceed"
    return (f"Verdict: {len(over)} of {n} {stage_word} {exceed} "
            f"{_hbm_label(hbm, units, hbm_given)} ({listed} {_format_stages(over)}); {worst}; "
            f"the most a rank needs is {_size_label(verdict['worst_needed_bytes'], units)} "
            f"(reserved + non-PyTorch memory).")


def format_host_memory(verdict: dict[str, Any], units: str = "GiB") -> str | None:
    """The verdict's host-memory line, or None when the job puts nothing on the host:
    "Host memory (optimizer and activation offload, EMA): 9.50 GiB per rank at most
    (4.00 GiB pinned), 76.00 GiB per node of 8 ranks (32.00 GiB pinned)." """
    host = verdict.get("host") or {}
    if not host.get("per_rank_bytes"):
        if host.get("offload_flags"):  # asked to offload, and nothing went: say so
            return (f"Host memory: none; {', '.join(host['offload_flags'])} moves nothing of "
                    f"this job to the host (no saved tensor reaches the offload's minimum "
                    f"size, or no module it names runs here; docs/offload.md).")
        return None
    units = pick_units(host["per_rank_bytes"]) if units == "auto" else units
    size = lambda n: _size_label(n, units)  # noqa: E731
    n = host["ranks_per_node"]
    world = host.get("world_size", n)
    node = f"per node of {n} rank{'s' * (n != 1)}" if world >= n else \
        f"on its one node ({world} rank{'s' * (world != 1)} of a node of {n})"
    return (f"Host memory (optimizer and activation offload, EMA): "
            f"{size(host['per_rank_bytes'])} per rank at most "
            f"({size(host['pinned_per_rank_bytes'])} pinned), "
            f"{size(host['per_node_bytes'])} {node} "
            f"({size(host['pinned_per_node_bytes'])} pinned).")


def get_estimate(result, fits: Sequence[Any] | None = None) -> dict[str, Any]:
    """An ``Estimate`` as JSON-ready data, every figure in bytes (documented in
    docs/estimate.md); with ``fits`` (``tracemem.advice.what_fits``), its candidates under
    ``what_fits``."""
    par = result.parallel
    spans = stage_ranks(par)
    ranks = []
    for r in result.ranks:
        row = {"pp_stage": r.pp_stage, "ep_rank": r.ep_rank, "ep_ranks": list(r.ep_ranks),
               "rank": r.rank,
               "stage_ranks": [list(span) for span in spans[r.pp_stage]],
               "layers": r.layers, "inflight_microbatches": r.inflight_microbatches,
               "peak_step": r.peak_step, "peak_phase": r.peak_phase,
               "peak_bytes": r.peak_bytes}
        row.update({name: getattr(r, name) for name in _RANK_FIELDS})
        row.update({name: getattr(r, name) for name in _ALLOCATOR_FIELDS})
        row["host_bytes"] = r.host_bytes  # --optimizer-cpu-offload (tracemem.offload)
        row["host_pinned_bytes"] = r.host_pinned_bytes
        row["fits"] = r.fits  # reserved peak + non-PyTorch memory <= hbm (estimator)
        row["by_module_bytes"] = r.by_module
        row["largest_storages"] = r.largest
        ranks.append(row)
    worst = result.worst
    out = {
        "model": result.model,
        "parallel": {k: getattr(par, k) for k in ("world_size", "tp", "sp", "cp", "ep", "etp",
                                                   "pp", "vpp", "dp", "edp", "zero",
                                                   "precision", "plan",
                                                   "num_distributed_optimizer_instances")}
        | {"pp_layout": list(par.pp_layout)},
        "settings": result.settings,
        "hbm_bytes": result.hbm_bytes,
        "ranks": ranks,
        "worst": {"pp_stage": worst.pp_stage, "ep_rank": worst.ep_rank,
                  "ep_ranks": list(worst.ep_ranks),
                  "peak_bytes": worst.peak_bytes, "dominant": worst.dominant()[0]},
        "verdict": get_verdict(result),
    }
    out["host"] = out["verdict"]["host"]
    if fits is not None:
        out["what_fits"] = [candidate.as_dict() for candidate in fits]
    return out


def format_estimate_json(result, fits: Sequence[Any] | None = None) -> str:
    """``get_estimate`` as indented JSON."""
    return json.dumps(get_estimate(result, fits), indent=2)


_STEP_KINDS = {"F": "forward", "B": "backward", "I": "input-gradient backward",
               "W": "weight-gradient backward"}
_STEP = re.compile(r"^([0-9]+)([A-Z])([0-9]+)$")  # tracemem.schedules.Step notation


def _placement_of(result, par):
    """The ``tracemem.schedules`` placement of ``result``'s schedule (None: unknown)."""
    from tracemem.schedules.core import SCHEDULES, placement

    name = result.settings.get("schedule")
    if name not in SCHEDULES:  # none named
        return None
    return placement(name, par.pp, par.vpp, result.settings.get("num_microbatches") or 1)


def _legend(result, units: str, keys: Sequence[str] | None = None,
            wide: bool = True) -> list[str]:
    """Short lines under the estimate table: what each non-obvious column of ``keys`` (the
    columns shown, ``estimate_columns``; None: all) means, derived from this run (precision
    recipe, rank order, routing, the worst rank's step); ``wide``: the table is --wide's
    (else a column of --wide's shown as a row's largest item says why)."""
    par = result.parallel
    shown = (lambda key: True) if keys is None else (lambda key: key in keys)  # noqa: E731
    lines = [f"Memory columns in {units} ({UNIT_NOTES[units]}): what is alive at each row's "
             f"peak."]
    if shown("peak"):
        rounding = getattr(result.job, "rounding", None)
        each = (f"each rounded to --rounding ({rounding} B)" if rounding else "exact bytes")
        lines.append(f"peak: the storages alive at the rank's peak, {each}; the simulated "
                     "allocator's max_memory_allocated also counts the unsplit remainders of "
                     "the blocks it hands out, so it can be a little higher (--json "
                     "allocated_peak_bytes; --plot's \"allocated peak\").")
    per_stage = par.world_size // par.pp
    if shown("ranks"):
        order = ("torchtitan's mesh order, ParallelDims: TP fastest, then CP, dp_shard, "
                 "dp_replicate, and PP slowest" if getattr(result.job, "origin", None)
                 == "torchtitan" else
                 "Megatron's rank order: TP fastest, then CP, DP, and PP slowest")
        lines.append(f"ranks: the stage's global ranks, {per_stage} per stage ({order}).")
    if all(r.ep_rank is None for r in result.ranks) and not shown("ep"):
        if par.ep > 1:
            lines.append(f"EP ranks: the stage's {par.ep} EP ranks hold the same under "
                         f"{result.settings.get('routing', 'balanced')} routing, so one traced "
                         f"rank stands for all (one row per stage).")
    elif all(r.ep_rank is None for r in result.ranks):
        if par.ep > 1:
            lines.append(f'EP rank "-": the stage\'s {par.ep} EP ranks hold the same under '
                         f"{result.settings.get('routing', 'balanced')} routing, so one traced "
                         f"rank stands for all.")
        else:
            lines.append('EP rank "-": no expert parallelism (EP 1).')
    else:
        lines.append(f"EP rank: under routing {result.settings.get('routing')}, each row is "
                     f"one class of the stage's EP ranks, those whose experts receive the same "
                     f"token counts in every MoE layer: traced once, they share its peak; "
                     f"each stage's worst class first"
                     + ('; "-": all of the stage\'s EP ranks alike (no MoE layer there, or '
                        'the same counts).' if any(r.ep_rank is None for r in result.ranks)
                        else "."))
    if any(r.workspace_bytes for r in result.ranks) and shown("workspaces"):
        lines.append(f"workspaces: what --gpu {result.settings.get('gpu')} keeps below the "
                     f"dispatcher (cuBLAS workspaces, TE's dummy weight gradients, Megatron's "
                     f"global memory buffer, RoPE's cache: tracemem/workspaces.py), held from "
                     f"the start of the step.")
    elif any(r.workspace_bytes for r in result.ranks):
        lines.append(f"peak and reserved include what --gpu {result.settings.get('gpu')} keeps "
                     f"below the dispatcher (cuBLAS workspaces and the like, "
                     f"tracemem/workspaces.py; --wide shows them).")
    if not wide and shown("temporaries"):  # some row's largest item (estimate_columns)
        lines.append("temporaries: storages neither kept for backward (activations) nor "
                     "gradients, optimizer states or communication buffers, alive at the "
                     "peak (a step's outputs and, under a split backward, what a deferred "
                     "weight-gradient step keeps); shown where they are a row's largest item.")
    if shown("host") and any(getattr(r, "host_bytes", 0) for r in result.ranks):
        lines.append("host: host (CPU) memory of the rank under --optimizer-cpu-offload, "
                     "--fine-grained-activation-offloading, --cpu-offloading-num-layers and "
                     "--ema host (pinned included), in neither peak nor reserved.")
    job = getattr(result, "job", None)
    if (result.settings.get("recompute") == "selective" and job is not None
            and not job.config.is_mla and job.profile.orchestration == "megatron"
            and "core_attn" in (job.recompute_modules or ())):
        # tracemem.advice.selective_note: the what-fits comparison, measured
        lines.append("recompute selective: core attention's checkpoint keeps its inputs, and "
                     "the value, a slice of linear_qkv's fused output (Megatron's "
                     "torch.split), keeps that whole output alive; the peak can be higher "
                     "than under --recompute none (--what-fits compares the two).")
    recipe = par.precision_spec  # the --precision recipe with any precision flags applied
    kinds = {1: "fp8", 2: "bf16", 4: "fp32"}
    g, p = recipe.grad_bytes, recipe.param_bytes
    line = (f"grads: {g} B ({kinds.get(g, '?')} main grads) per parameter against {p} B "
            f"({kinds.get(p, '?')}) for params under --precision {par.precision}")
    from tracemem.zero3 import fsdp2_group, pp_keeps_gathered

    if fsdp2_group(par) is not None and not pp_keeps_gathered(par):
        line = (f"grads: FSDP2's, made in backward: the bf16 unsharded gradients until each "
                f"unit's reduce-scatter, then its fp32 sharded ones ({g} B per parameter / "
                f"the FSDP group of {fsdp2_group(par)}), alive at the peak")
    elif g == 2 * p and par.zero != 2:
        line += ", hence twice params"
        if any(r.gradient_bytes > 2 * r.parameter_bytes for r in result.ranks):
            # a backward at the peak: its bf16 gradient, before it is added to the main grad
            line += (" (more where the peak is inside a backward: the bf16 gradient it is "
                     "making, until added to the main grad)")
    elif par.zero == 2:
        line += "; ZeRO-2 shards the grads, not the params"
    lines.append(line + ".")
    held = ("microbatch forwards" if par.vpp == 1 else
            "model-chunk forwards (up to M x VPP)")
    if shown("inflight"):
        lines.append(f"in-flight: {held} held at the peak, their activations kept for "
                     f"backward.")
    steps = [r.peak_step for r in result.ranks if r.peak_step]
    worst = next((step for step in [result.worst.peak_step, *steps]
                  if step and _STEP.match(step)), None)
    optimizer = ("; optimizer = the optimizer step after the schedule's last step"
                 if "optimizer" in steps else "")
    match = _STEP.match(worst or "")
    if match:
        where = _placement_of(result, par)
        chunked = where is not None and where.style != "loop"
        stage = "model chunk" if chunked else "virtual stage" if par.vpp > 1 else "stage"
        seen = {m[2] for step in steps if (m := _STEP.match(step))}
        kinds = ", ".join(f"{k} = {v}" for k, v in _STEP_KINDS.items() if k in seen | {"F", "B"})
        held_chunks = ""
        if chunked:  # DualPipe, DualPipeV, ZBV: two chunks per rank, not stage = rank
            last = where.num_chunks - 1  # stage s holds chunks s and last - s
            held_chunks = (f"; under {result.settings.get('schedule')} each rank holds "
                           f"2 model chunks, stage s chunks s and {last} - s")
        lines.append(f"{'at step' if shown('step') else 'step'}: the schedule step running "
                     f"at the peak, {stage} + kind + "
                     f"microbatch: {worst} = {stage} {match[1]}, "
                     f"{_STEP_KINDS.get(match[2], match[2])}, microbatch {match[3]} "
                     f"({kinds}){held_chunks}{optimizer}.")
    elif optimizer:
        lines.append("at step: optimizer = the optimizer step after the schedule's last step.")
    return lines


def _allocator_legend(result, units: str, keys: Sequence[str] | None = None) -> str:
    """What the reserved / frag. / fits columns mean (tracemem.memory, docs/allocator.md);
    ``keys``: the columns shown (None: all)."""
    conf = result.settings.get("alloc_conf") or "default settings"
    outside = result.settings.get("non_pytorch_memory_bytes", 0)
    line = (f"reserved: max_memory_reserved of PyTorch's CUDA caching allocator (simulated, "
            f"{conf})")
    if keys is None or "frag" in keys:
        line += ("; frag.: reserved - allocated when reserved first reached its peak "
                 "(cached free blocks that did not fit the request that grew it)")
    if result.hbm_bytes is not None:
        hbm = result.hbm_bytes
        line += (f"; fits: reserved + {_size_label(outside, units)} non-PyTorch memory (CUDA "
                 f"context, --non-pytorch-memory) <= {_size_label(hbm, units)}")
        if keys is not None and "frag" not in keys:
            # the narrow table's column is "fits": the legend names the --hbm it judges
            line += (f" (yes: the rank fits in "
                     f"{_size_label(hbm, 'B' if units == 'B' else pick_units(hbm), True)})")
    return line + "."


def _ep_ranks_text(r) -> str:
    """The EP ranks of a rank class: "-" when all are alike, else e.g. "0-2,5"."""
    from tracemem.estimator import _ranks_text

    return "-" if r.ep_rank is None else _ranks_text(list(r.ep_ranks) or [r.ep_rank])


# The default table fits this many columns (a terminal of 100; issue 26); --wide shows every
# column, --json every figure.
TABLE_WIDTH = 100
# the estimate table's columns: (key, header); the default shows DEFAULT_COLUMNS (those a
# user needs first: the static parts, activations, the peak, where it happens, the reserved
# peak and the verdict), and drops NARROWING's keys in that order while it is wider than
# TABLE_WIDTH; ``wide`` shows them all
_COLUMNS = (("stage", "stage"), ("ranks", "ranks"), ("ep", "EP rank"), ("params", "params"),
            ("grads", "grads"), ("optimizer", "optimizer"), ("activations", "activations"),
            ("inflight", "in-flight"), ("comm", "comm"), ("temporaries", "temporaries"),
            ("workspaces", "workspaces"), ("peak", "peak"), ("step", "at step"),
            ("reserved", "reserved"), ("frag", "frag."), ("fits", "fits"), ("host", "host"))
DEFAULT_COLUMNS = ("stage", "ranks", "ep", "params", "grads", "optimizer", "activations",
                   "inflight", "peak", "step", "reserved", "fits")
_NARROWING = ("step", "ranks", "inflight")
# RankEstimate.dominant()'s items that only --wide shows, by column
_DOMINANT_COLUMNS = {"communication buffers": "comm", "temporaries": "temporaries",
                     "workspaces below the dispatcher": "workspaces"}


def _estimate_cells(r, spans, units: str) -> dict[str, str]:
    size = lambda n: format_size(n, units)  # noqa: E731
    return {"stage": str(r.pp_stage), "ranks": _format_spans(spans[r.pp_stage]),
            "ep": _ep_ranks_text(r), "params": size(r.parameter_bytes),
            "grads": size(r.gradient_bytes), "optimizer": size(r.optimizer_state_bytes),
            "activations": size(r.activation_bytes), "inflight": str(r.inflight_microbatches),
            "comm": size(r.comm_buffer_bytes), "temporaries": size(r.temporary_bytes),
            "workspaces": size(r.workspace_bytes), "peak": size(r.peak_bytes),
            "step": r.peak_step or "-", "reserved": size(r.reserved_peak_bytes),
            "frag": size(r.fragmentation_bytes),
            "fits": "" if r.fits is None else ("yes" if r.fits else "NO"),  # reserved-based
            # host (CPU) memory of --optimizer-cpu-offload, fine-grained activation offloading
            # and --ema host, not in the peak (tracemem.offload, modeling.common.offload)
            "host": size(getattr(r, "host_bytes", 0))}


def estimate_columns(result, units: str, wide: bool = False,
                     width: int = TABLE_WIDTH) -> tuple[list[str], list[list[str]]]:
    """The estimate table's column keys (``_COLUMNS``) and rows (one per rank class, each
    stage's worst first), as strings in ``units``. ``wide``: every column that has something
    to show; else ``DEFAULT_COLUMNS`` (the EP rank only where the rows are EP-rank classes),
    with any other category column that holds a row's largest item (``RankEstimate.dominant``),
    narrowed (``_NARROWING``) until the table is at most ``width`` characters."""
    spans = stage_ranks(result.parallel)
    # a stage's rows (EP-rank classes under skewed routing) its worst first: the stage's
    # maximum is its first row, however many classes follow
    ordered = sorted(result.ranks, key=lambda r: (r.pp_stage, -r.peak_bytes))
    cells = [_estimate_cells(r, spans, units) for r in ordered]
    keys = [k for k, _ in _COLUMNS]
    if not any(r.workspace_bytes for r in result.ranks):  # no GPU named: none counted
        keys.remove("workspaces")
    if result.hbm_bytes is None:
        keys.remove("fits")
    if not any(getattr(r, "host_bytes", 0) for r in result.ranks):  # nothing on the host
        keys.remove("host")
    if not wide:
        # a column of --wide's is shown where it holds some row's largest item (the recipe's
        # stage 7: TE's deferred weight-gradient inputs, temporaries)
        largest = {_DOMINANT_COLUMNS.get(r.dominant()[0]) for r in result.ranks}
        keys = [k for k in keys if k in DEFAULT_COLUMNS or k in largest]
        if all(r.ep_rank is None for r in result.ranks):  # one row per stage: said in the legend
            keys.remove("ep")
        for drop in _NARROWING:
            if _table_width(keys, cells, result, units, wide) <= width:
                break
            keys.remove(drop)
    return keys, [[row[k] for k in keys] for row in cells]


def _estimate_headers(keys: list[str], result, units: str, wide: bool) -> list[str]:
    names = dict(_COLUMNS)
    if wide and result.hbm_bytes is not None:  # the narrow table says it in the legend
        hbm = result.hbm_bytes
        names["fits"] = f"fits {_size_label(hbm, 'B' if units == 'B' else pick_units(hbm), True)}"
    return [names[k] for k in keys]


def _table_width(keys, cells, result, units, wide) -> int:
    heads = _estimate_headers(keys, result, units, wide)
    return sum(max([len(h)] + [len(row[k]) for row in cells]) for h, k in zip(heads, keys)) \
        + 2 * (len(keys) - 1)  # plain_table: two spaces between columns


def plain_table(rows: Sequence[Sequence[Any]], headers: Sequence[str],
                align: Sequence[str] | None = None) -> str:
    """``rows`` under ``headers`` as text: each column as wide as its widest cell or header
    (no padding beyond that, unlike tabulate's headers), two spaces between columns, a dashed
    rule; ``align`` per column "left" or "right" (default: all right). Cells are str()."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]
    align = align or ["right"] * len(headers)

    def line(values):
        return "  ".join(v.ljust(w) if a == "left" else v.rjust(w)
                         for v, w, a in zip(values, widths, align)).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths])]
                     + [line(row) for row in cells])


def _fp8_text(settings: dict) -> str:
    """" (FP8 hybrid, tensorwise)" for a job whose megatron-te kernels run FP8, else ""."""
    options = settings.get("kernel_options") or {}
    recipe = options.get("fp8_recipe", "none")
    if recipe in (None, "none"):
        return ""
    return f" (FP8 {options.get('fp8_format') or 'e4m3'}, {recipe})"


def _replicas_text(par) -> str:
    """`` (N replicas x M shards)`` after DP when the layout has N > 1 optimizer instances:
    Megatron's distributed-optimizer instances under ZeRO 1, torchtitan's HSDP replicas under
    ZeRO 3 (``tracemem.parallel.ParallelConfig``); else nothing."""
    n = par.num_distributed_optimizer_instances
    if n == 1:
        return ""
    what = "HSDP replicas" if par.zero == 3 else "optimizer instances"
    return f" ({n} {what} x {par.dp_cp // n} shards)"


def format_estimate(result, units: str = "GiB", fits: Sequence[Any] | None = None,
                    wide: bool = False, hbm_from_gpu: str | None = None) -> str:
    """One row per rank class, in ``units`` (one of ``UNITS``, or "auto": ``pick_units`` of
    the worst peak), a legend of the columns shown, the worst rank, the verdict, and with
    ``fits`` (``tracemem.advice.what_fits``) what would fit. The table fits ``TABLE_WIDTH``
    columns (``estimate_columns``); ``wide`` shows every column (comm, temporaries,
    workspaces, frag.). ``hbm_from_gpu``: the --gpu whose memory (``GPU_MEMORY``) stood in
    for a --hbm not given, said under the verdict, as is a --hbm above the --gpu's memory or
    its data-sheet figure in GB (``_hbm_gpu_note``)."""
    if units == "auto":
        units = pick_units(result.worst.peak_bytes)
    elif units not in UNITS:
        to_units(0, units)  # raises, naming the valid units
    keys, rows = estimate_columns(result, units, wide)
    headers = _estimate_headers(keys, result, units, wide)
    par, st = result.parallel, result.settings
    head = (f"{result.model}: world {par.world_size} (TP {par.tp}{' + SP' if par.sp else ''}, "
            f"CP {par.cp}, PP {par.pp}, VPP {par.vpp}, DP {par.dp}{_replicas_text(par)}; "
            f"EP {par.ep}, ETP {par.etp}, "
            f"EDP {par.edp}), ZeRO-{par.zero}, {par.precision}; b={st['micro_batch_size']}, "
            f"s={st['seq_length']}, M={st['num_microbatches']}, {st['schedule']}, kernels "
            f"{st.get('kernels', 'eager')}{_fp8_text(st)}, recompute "
            f"{st['recompute']}, {st['attention']} attention, routing {st['routing']}"
            + "".join(f", {kind} replaced by {name}"
                      for kind, name in st.get("replace", {}).items()))
    table = plain_table(rows, headers)
    worst = result.worst
    item, size = worst.dominant()
    where = f"stage {worst.pp_stage}" + ("" if worst.ep_rank is None else
                                          f", EP rank {_ep_ranks_text(worst)}")
    n = worst.inflight_microbatches
    held = (f"{n} microbatch{'' if n == 1 else 'es'} in flight" if par.vpp == 1 else
            f"{n} model-chunk forward{'' if n == 1 else 's'} in flight")
    tail = (f"Worst rank: {where}, peak {_size_label(worst.peak_bytes, units)} at step "
            f"{worst.peak_step or '-'} with {held}; "
            f"largest item: {item} ({_size_label(size, units)}).")
    lines = [head, "", table, "", *_legend(result, units, keys, wide),
             _allocator_legend(result, units, keys)]
    if not wide:
        lines.append(_wide_note(result, keys))
    verdict = get_verdict(result)
    lines += ["", tail, format_verdict(verdict, units, getattr(result.job, "hbm", None))]
    if hbm_from_gpu is not None:
        from tracemem.job import GPU_MEMORY

        if GPU_MEMORY[hbm_from_gpu] is None:
            lines.append(f"HBM: --gpu {hbm_from_gpu} is sold in more than one memory size; "
                         f"give --hbm (e.g. --hbm 80GiB) to say whether it fits.")
        else:
            size, source = GPU_MEMORY[hbm_from_gpu]
            lines.append(f"HBM: --gpu {hbm_from_gpu} without --hbm: judged against {size} "
                         f"per GPU ({source}, read as GiB; CUDA sees a little less); give "
                         f"--hbm to set it.")
    else:
        note = _hbm_gpu_note(result.job)
        if note:
            lines.append(note)
    host = format_host_memory(verdict, units)
    if host:  # --optimizer-cpu-offload
        lines.append(host)
    if fits is not None:
        lines += ["", format_fits(fits, result, units)]
    return "\n".join(lines)


def _hbm_gpu_note(job) -> str | None:
    """A line when ``job``'s --hbm is more than its --gpu has (``GPU_MEMORY``; kinds sold in
    one size only), or is the GPU's data-sheet figure in 10^9-byte GB where ``GPU_MEMORY``
    reads it as GiB ("80GB" with an H800: 74.51 GiB, not 80); else None. The verdict is
    against the --hbm given either way."""
    from tracemem.job import GPU_MEMORY, parse_bytes

    gpu, hbm = getattr(job, "gpu", None), getattr(job, "hbm_bytes", None)
    known = GPU_MEMORY.get(gpu) if gpu is not None else None
    if known is None or hbm is None:
        return None
    size = parse_bytes(known[0])
    if hbm * 2**30 == size * 10**9:  # the same number, in GB
        return (f"HBM: --hbm {job.hbm} is {hbm // 10**9} x 10^9 B "
                f"({_size_label(hbm, 'GiB')}); the {gpu}'s data sheet figure read as GiB, as "
                f"--gpu {gpu} alone reads it ({known[1]}), is {_size_label(size, 'GiB', True)}:"
                f" give --hbm {known[0]} to judge against that.")
    if hbm <= size:
        return None
    size = parse_bytes(known[0])
    return (f"HBM: --hbm {_size_label(hbm, 'GiB', given=True)} is more than the {gpu}'s "
            f"{_size_label(size, 'GiB', given=True)} ({known[1]}); judged against the --hbm "
            f"given.")


def _wide_note(result, keys: list[str]) -> str:
    """The line that names the columns the default table leaves out."""
    every, _ = estimate_columns(result, "B", wide=True)
    names = dict(_COLUMNS)
    left = [names[k] for k in every if k not in keys and k != "fits"]  # host: the wide table
    return (f"--wide adds {', '.join(left)}; --json gives every figure in bytes." if left else
            "--json gives every figure in bytes.")


def _flag_units(text: str) -> list[str]:
    """``text``'s flags, each with its values: "--a 1 --b drop --c" -> ["--a 1", "--b",
    "drop --c"] ("drop --flag": ``tracemem.frontdoors.megatron_flag_changes``' removal)."""
    units: list[list[str]] = []
    for token in text.split():
        if units and (not token.startswith("--") and token != "drop" or units[-1] == ["drop"]):
            units[-1].append(token)
        else:
            units.append([token])
    return [" ".join(u) for u in units]


def _flag_lines(text: str, width: int) -> list[str]:
    """Command-line ``text`` in lines of at most ``width`` characters, broken only between
    flags: a flag keeps its values on its line ("--pipeline-model-parallel-size 2"), and
    "drop --flag" (``tracemem.frontdoors.megatron_flag_changes``' removal) stays whole; a
    flag with its values longer than ``width`` breaks between them."""
    pieces = []
    for unit in _flag_units(text):  # a flag too long for a line: its values on the next
        pieces += unit.split() if len(unit) > width else [unit]
    lines: list[str] = []
    for unit in pieces:
        if lines and len(lines[-1]) + 1 + len(unit) <= width:
            lines[-1] += " " + unit
        else:
            lines.append(unit)
    return lines or [""]


def _wrapped(rows: list[list[str]], widths: dict[int, int]) -> list[list[str]]:
    """``rows`` with the cells of the columns ``widths`` names wrapped between flags to their
    widths (``_flag_lines``): a row's further lines follow it, blank in the other columns."""
    out = []
    for row in rows:
        parts = {i: _flag_lines(row[i], width) for i, width in widths.items()}
        for n in range(max(len(p) for p in parts.values())):
            out.append([(parts[i][n] if n < len(parts[i]) else "") if i in parts else
                        (cell if n == 0 else "") for i, cell in enumerate(row)])
    return out


def format_fits(fits: Sequence[Any], result, units: str = "GiB") -> str:
    """The ``what_fits`` candidates as a table: each single change, its worst peak (re-estimated),
    the most a rank needs (reserved + non-PyTorch memory, what ``--hbm`` is judged on) and the
    stages still over ``--hbm``; the ones that fit first."""
    units = pick_units(result.worst.peak_bytes) if units == "auto" else units
    hbm = (_size_label(result.hbm_bytes, units, given=True) if result.hbm_bytes is not None
           else "--hbm")
    tried = [c for c in fits if c.skipped is None]
    skipped = [c for c in fits if c.skipped is not None]
    if not tried and not skipped:
        return f"What would fit in {hbm}: nothing to try."
    fitting = sum(c.fits for c in tried)
    lead = (f"What would fit in {hbm}: each line changes one setting and re-estimates every "
            f"stage ({fitting} of {len(tried)} fit"
            + ("" if fitting else "; no single change is enough") + "):")
    megatron = any(c.megatron_change for c in tried)  # the job came as Megatron arguments
    rows = [[c.change, format_size(c.worst_peak_bytes, units), str(c.worst_pp_stage),
             format_size(c.worst_needed_bytes, units), str(len(c.stages_over_hbm)),
             "yes" if c.fits else "NO"] + ([c.megatron_change] if megatron else [])
            for c in tried]
    lines = [lead]
    if rows:
        headers = ["change", f"peak {units}", "stage", f"needs {units}", "over", "fits"] \
            + (["as Megatron-LM arguments"] if megatron else [])
        align = ["left"] + ["right"] * 5 + (["left"] if megatron else [])
        # the change columns wrap (at spaces, between flags) so the table fits TABLE_WIDTH
        rest = sum(max(len(h), *(len(r[i]) for r in rows)) + 2
                   for i, h in enumerate(headers) if align[i] == "right")
        room = max(24, TABLE_WIDTH - rest - 2 * megatron)  # for the one or two left columns
        widths = {0: room}
        if megatron:  # the change gets its longest flag, or what the Megatron column leaves
            unit = max(len(u) for r in rows for u in _flag_units(r[0]))
            other = max(len(u) for r in rows for u in _flag_units(r[-1]))
            widths[0] = min(max(len(r[0]) for r in rows), max(unit, room - other, 16))
            widths[len(headers) - 1] = max(16, room - widths[0])
        lines.append(plain_table(_wrapped(rows, widths), headers, align))
        lines.append(f"peak: the worst rank's peak after the change, at that stage; needs: the "
                     f"most a rank needs (reserved + non-PyTorch memory); over: stages over "
                     f"{hbm}.")
    notes = sorted({c.note for c in tried if c.note})
    lines += [f"({note})" for note in notes]
    lines += [f"Not tried: {c.change}: {c.skipped}" for c in skipped]
    return "\n".join(lines)
