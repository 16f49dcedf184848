"""The caching-allocator simulator's inline path for requests a cached block serves
(``CachingAllocatorSimulator._malloc_cached``) against every request through the general
``_malloc``, in one run: the 16 rank classes of one DeepSeek-V3 layout (1,024 GPUs, TP 4 + SP,
PP 16 as 4 / 1 end stages, EP 8, full recompute, M 256), traced once, then each class's
``allocator_row`` with the inline path off (the peer), then on; the figures must be equal
(exit 1 otherwise).

    .venv/bin/python benchmarks/allocator_paths.py
"""

from __future__ import annotations

import sys
import time

import tracemem.estimator as estimator
from tracemem.job import Job
from tracemem.memory.allocator import CachingAllocatorSimulator

LAYOUT = dict(world_size=1024, tp=4, sp=True, pp=16, ep=8, etp=1, pp_first_stage_layers=4,
              pp_last_stage_layers=1, micro_batch_size=1, seq_length=4096,
              num_microbatches=256, schedule="1f1b", recompute="full", zero=1, hbm="80GiB")


def rows(job: Job, traced: list, inline: bool) -> tuple[float, list]:
    init = CachingAllocatorSimulator.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._cached_path = self._cached_path and inline

    CachingAllocatorSimulator.__init__ = patched
    try:
        start = time.perf_counter()
        out = [estimator.allocator_row(job, t) for t in traced]
        return time.perf_counter() - start, [
            (r.reserved_peak_bytes, r.allocated_peak_bytes, r.fragmentation_bytes,
             r.largest_free_block_bytes, r.reserved_peak_step, r.fits) for r in out]
    finally:
        CachingAllocatorSimulator.__init__ = init


def main() -> None:
    job = Job.create("deepseek-v3", **LAYOUT)
    traced = estimator.trace_classes(job, estimator.rank_classes(job), estimator.TraceCache())
    for t in traced:
        estimator.replay_class(job, t)
    general_s, general = rows(job, traced, False)
    inline_s, inline = rows(job, traced, True)
    same = general == inline
    print(f"16 allocator rows (M 256): general path {general_s:.2f} s, inline cached-block "
          f"path {inline_s:.2f} s, {general_s / inline_s:.2f}x; same figures: "
          f"{'yes' if same else 'NO'}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
