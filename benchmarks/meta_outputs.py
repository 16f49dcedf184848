"""The tracer's remembered meta outputs (``tracemem.tracer._MetaOutputs``) against torch's meta
kernels run for every op, in one process: the rank-class traces of the demo (DeepSeek-V3 on
1,024 GPUs, ``make demo``'s layout: 3 distinct classes) and of the same layout under
``--routing zipf:1.0`` (128 classes), each traced with every op running its meta kernel
(the peer), then with the outputs remembered (the first arm's run has filled nothing: the
remembered outputs are cleared before it, so its own repeats are what it reuses); the events
must be equal (exit 1 otherwise).

    .venv/bin/python benchmarks/meta_outputs.py
"""

from __future__ import annotations

import sys
import time

import tracemem.tracer as tracer_module
from tracemem.estimator import TraceCache, rank_classes, trace_classes
from tracemem.job import Job

DEMO = dict(world_size=1024, tp=2, sp=True, pp=16, ep=8, etp=1, pp_first_stage_layers=4,
            pp_last_stage_layers=1, micro_batch_size=1, seq_length=4096, num_microbatches=16,
            schedule="1f1b", recompute="none", attention="flash", zero=1, precision="megatron",
            hbm="80GiB")


def events(traced) -> list:
    return [[(key, [(e.action, e.nbytes, e.total_bytes, e.op, e.storage_id, e.category,
                     e.module, e.shape) for e in seg])
             for key, seg in sorted(t.segments.events.items())] for t in traced]


def timed(job: Job, remember: bool) -> tuple[float, list, int]:
    outputs = tracer_module.META_OUTPUTS
    outputs.outputs.clear()
    plain = outputs.cacheable
    if not remember:
        outputs.cacheable = lambda func: False
    try:
        classes = rank_classes(job)
        cache = TraceCache()
        start = time.perf_counter()
        traced = trace_classes(job, classes, cache)
        return time.perf_counter() - start, events(traced), cache.computed
    finally:
        outputs.cacheable = plain


def main() -> None:
    timed(Job.create("deepseek-tiny", world_size=1, micro_batch_size=1, seq_length=16,
                     num_microbatches=2), True)  # torch's lazy imports, once
    print("| job | rank classes (traced) | meta kernels s | remembered s | ratio | same events |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    bad = False
    for label, routing in (("demo", "balanced"), ("demo, --routing zipf:1.0", "zipf:1.0")):
        job = Job.create("deepseek-v3", routing=routing, **DEMO)
        plain_s, plain, computed = timed(job, False)
        kept_s, kept, _ = timed(job, True)
        bad |= plain != kept
        print(f"| {label} | {len(plain)} ({computed}) | {plain_s:.1f} | {kept_s:.1f} | "
              f"{plain_s / kept_s:.2f}x | {'yes' if plain == kept else 'NO'} |", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
