"""Shared schedule replays and allocator simulations (``tracemem.estimator.replay_class``'s
and ``allocator_row``'s ``memo``) on the DeepSeek-V3 recipe (``--recipe deepseek-v3``:
DualPipe on PP 16), against one replay and one simulation per rank class as the peer, in one
run: the classes traced once, then replayed and simulated without the memo and with it; the
two must agree on every figure (exit 1 otherwise).

    .venv/bin/python benchmarks/allocator_memo.py
"""

from __future__ import annotations

import sys
import time

import tracemem.estimator as estimator
from tracemem.recipes import recipe_job

FIELDS = ("allocated_peak_bytes", "reserved_peak_bytes", "fragmentation_bytes",
          "largest_free_block_bytes", "reserved_peak_step", "fits", "peak_bytes", "peak_step",
          "inflight_microbatches", "by_module", "largest")


def main() -> int:
    job = recipe_job("deepseek-v3")
    t0 = time.perf_counter()
    traced = estimator.trace_classes(job, estimator.rank_classes(job), estimator.TraceCache())
    t1 = time.perf_counter()
    for t in traced:
        estimator.replay_class(job, t)
    alone = [estimator.allocator_row(job, t) for t in traced]
    t2 = time.perf_counter()
    replays: dict = {}
    for t in traced:
        estimator.replay_class(job, t, replays)
    memo: dict = {}
    shared = [estimator.allocator_row(job, t, memo=memo) for t in traced]
    t3 = time.perf_counter()
    same = all([getattr(a, f) for f in FIELDS] == [getattr(b, f) for f in FIELDS]
               for a, b in zip(alone, shared))
    runs = sum(1 for key in memo if key != "contents")
    print(f"trace: {t1 - t0:.1f} s; {len(traced)} rank classes")
    print(f"| replays and allocator rows | simulations | s |\n| --- | ---: | ---: |\n"
          f"| one per class (peer) | {len(traced)} | {t2 - t1:.1f} |\n"
          f"| shared (memo) | {runs} | {t3 - t2:.1f} |")
    print(f"ratio {(t2 - t1) / (t3 - t2):.2f}x; same figures: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
