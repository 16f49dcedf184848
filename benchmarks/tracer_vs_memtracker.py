"""tracemem's MemoryTracer and PyTorch's MemTracker
(``torch.distributed._tools.mem_tracker``) on the validation cases, beside the real CPU peak.

For each case: the real peak of the step above its baseline (torch.profiler, CPU ``[memory]``
events), each tool's traced peak above its baseline on the meta device, and each tool's tracing
time. Run:

    .venv/bin/python benchmarks/tracer_vs_memtracker.py
"""

from __future__ import annotations

import time

import torch
from tabulate import tabulate
from torch.distributed._tools.mem_tracker import MemTracker

from tracemem.validation import CASES, compare_case, trace_case


def mem_tracker_peak(case) -> tuple[int | str, float]:
    """MemTracker's peak above its baseline, summed over devices (meta, plus CPU scalars)."""
    torch.manual_seed(0)
    setup = case.build("meta")
    tracker = MemTracker()
    tracker.track_external(*setup.externals)
    before = sum(snap["Total"] for snap in tracker.get_tracker_snapshot("current").values())
    start = time.perf_counter()
    try:
        with tracker:
            setup.step()
    except Exception as error:  # MemTracker refuses some patterns; report, do not hide
        return f"error: {type(error).__name__}", time.perf_counter() - start
    seconds = time.perf_counter() - start
    peak = sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
    return peak - before, seconds


def main() -> None:
    rows = []
    for case in CASES:
        comparison = compare_case(case)  # includes the real CPU run; time the trace alone below
        start = time.perf_counter()
        trace_case(case)
        ours_seconds = time.perf_counter() - start
        theirs, theirs_seconds = mem_tracker_peak(case)
        rows.append([
            case.name, comparison.real_peak_bytes, comparison.traced_peak_bytes,
            comparison.real_peak_bytes - comparison.traced_peak_bytes, theirs,
            comparison.real_peak_bytes - theirs if isinstance(theirs, int) else "",
            f"{ours_seconds * 1e3:.1f}", f"{theirs_seconds * 1e3:.1f}",
            f"{theirs_seconds / ours_seconds:.2f}"])
    print(f"torch {torch.__version__}; bytes are above each step's baseline")
    print(tabulate(rows, headers=["case", "real peak B", "tracemem B", "real - tracemem",
                                  "MemTracker B", "real - MemTracker", "tracemem ms",
                                  "MemTracker ms", "MemTracker/tracemem time"], intfmt=","))


if __name__ == "__main__":
    main()
