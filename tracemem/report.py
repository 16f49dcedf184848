"""Plain data and text tables from a trace. Nothing here prints: ``get_*`` returns data,
``format_*`` returns a string, and only the CLI prints (as ``torch.utils.flop_counter`` keeps
``get_flop_counts`` apart from ``get_table``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from tabulate import tabulate

from tracemem.errors import TracememError
from tracemem.tracer import MemoryTracer

__all__ = ["UNITS", "to_units", "get_summary", "format_breakdown", "format_comparisons",
           "get_estimate", "format_estimate", "format_estimate_json"]

# Binary units only: the field's memory figures are GiB (2^30 B), and "GB" is ambiguous.
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def to_units(nbytes: int, units: str) -> float:
    """``nbytes`` in ``units`` (one of ``UNITS``).

    Raises:
        TracememError: unknown unit; the message lists the valid ones.
    """
    if units not in UNITS:
        raise TracememError(f"units={units!r} is invalid; choose one of {', '.join(UNITS)}")
    return nbytes / UNITS[units]


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
             "yes" if c.gap_bytes == c.case.unseen_bytes else "NO",
             "yes" if c.live_sets_equal else "NO"] for c in comparisons]
    steps = len(comparisons[0].steps) if comparisons else 0
    return _table(rows, ["case", "real peak B", "traced peak B", "real - traced B",
                         "named unseen B", "explained", f"live = real, {steps} steps"])


_RANK_FIELDS = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "activation_bytes",
                "comm_buffer_bytes", "temporary_bytes", "buffer_bytes", "input_bytes",
                "zero3_gather_bytes")


def get_estimate(result) -> dict[str, Any]:
    """An ``Estimate`` as JSON-ready data, every figure in bytes (documented in
    docs/estimate.md)."""
    par = result.parallel
    ranks = []
    for r in result.ranks:
        row = {"pp_stage": r.pp_stage, "ep_rank": r.ep_rank, "rank": r.rank,
               "layers": r.layers, "inflight_microbatches": r.inflight_microbatches,
               "peak_step": r.peak_step, "peak_bytes": r.peak_bytes}
        row.update({name: getattr(r, name) for name in _RANK_FIELDS})
        row["fits"] = None if result.hbm_bytes is None else r.peak_bytes <= result.hbm_bytes
        row["by_module_bytes"] = r.by_module
        row["largest_storages"] = r.largest
        ranks.append(row)
    worst = result.worst
    return {
        "model": result.model,
        "parallel": {k: getattr(par, k) for k in ("world_size", "tp", "sp", "cp", "ep", "etp",
                                                   "pp", "vpp", "dp", "edp", "zero",
                                                   "precision", "plan")}
        | {"pp_layout": list(par.pp_layout)},
        "settings": result.settings,
        "hbm_bytes": result.hbm_bytes,
        "ranks": ranks,
        "worst": {"pp_stage": worst.pp_stage, "ep_rank": worst.ep_rank,
                  "peak_bytes": worst.peak_bytes, "dominant": worst.dominant()[0]},
    }


def format_estimate_json(result) -> str:
    """``get_estimate`` as indented JSON."""
    return json.dumps(get_estimate(result), indent=2)


def format_estimate(result) -> str:
    """One row per rank class, in GiB, and a line naming the worst rank."""
    gib = 2**30
    rows = []
    for r in result.ranks:
        fits = "" if result.hbm_bytes is None else ("yes" if r.peak_bytes <= result.hbm_bytes
                                                    else "NO")
        rows.append([r.pp_stage, "-" if r.ep_rank is None else r.ep_rank,
                     f"{r.parameter_bytes / gib:.2f}", f"{r.gradient_bytes / gib:.2f}",
                     f"{r.optimizer_state_bytes / gib:.2f}", f"{r.activation_bytes / gib:.2f}",
                     r.inflight_microbatches, f"{r.comm_buffer_bytes / gib:.2f}",
                     f"{r.temporary_bytes / gib:.2f}", f"{r.peak_bytes / gib:.2f}",
                     r.peak_step or "-"] + ([fits] if fits else []))
    headers = ["stage", "EP rank", "params", "grads", "optimizer", "activations", "in-flight",
               "comm", "temporaries", "peak", "at step"]
    if result.hbm_bytes is not None:
        headers.append(f"fits {result.hbm_bytes / gib:g} GiB")
    par, st = result.parallel, result.settings
    head = (f"{result.model}: world {par.world_size} (TP {par.tp}{' + SP' if par.sp else ''}, "
            f"CP {par.cp}, PP {par.pp}, VPP {par.vpp}, DP {par.dp}; EP {par.ep}, ETP {par.etp}, "
            f"EDP {par.edp}), ZeRO-{par.zero}, {par.precision}; b={st['micro_batch_size']}, "
            f"s={st['seq_length']}, M={st['num_microbatches']}, {st['schedule']}, recompute "
            f"{st['recompute']}, {st['attention']} attention, routing {st['routing']}")
    table = tabulate(rows, headers=headers, disable_numparse=True,
                     colalign=("right",) * len(headers))
    worst = result.worst
    item, size = worst.dominant()
    where = f"stage {worst.pp_stage}" + ("" if worst.ep_rank is None else
                                          f", EP rank {worst.ep_rank}")
    held = (f"{worst.inflight_microbatches} microbatches in flight" if par.vpp == 1 else
            f"{worst.inflight_microbatches} model-chunk forwards in flight")
    tail = (f"Worst rank: {where}, peak {worst.peak_bytes / gib:.2f} GiB at step "
            f"{worst.peak_step or '-'} with {held}; "
            f"largest item: {item} ({size / gib:.2f} GiB).")
    return "\n".join([head, "", table, "", "(memory columns in GiB = 2^30 bytes, alive at each "
                       "rank's peak; in-flight = forwards held, counted in model chunks: up to "
                       "M x VPP with VPP > 1)", tail])
