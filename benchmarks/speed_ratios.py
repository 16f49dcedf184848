"""Issue 27 item 4's three ratios, each against its peer in one run:

1. the demo estimate (``make demo``'s job without ``--what-fits``) against a do-nothing trace
   of the same layers: each distinct rank class's model built and run for its two traced
   microbatches, forward and backward, under a ``TorchDispatchMode`` that only calls the op
   (``_trace_fb`` with the tracer replaced by it): the floor any dispatch-mode tracer pays;
2. ``fit`` over N layouts (one worker) against the same N layouts estimated one by one, each
   with a fresh trace cache and the allocator simulated (as a user running ``tracemem
   estimate`` per layout would);
3. the demo under ``--routing zipf:1.0`` (every class of EP ranks traced) against balanced
   routing.

    .venv/bin/python benchmarks/speed_ratios.py
"""

from __future__ import annotations

import time
from dataclasses import replace

from torch.utils._python_dispatch import TorchDispatchMode

import tracemem.estimator as estimator
from tracemem.estimator import TraceCache, estimate
from tracemem.fit import SearchSpace, fit
from tracemem.job import Job

DEMO = dict(world_size=1024, tp=2, sp=True, pp=16, ep=8, etp=1, pp_first_stage_layers=4,
            pp_last_stage_layers=1, micro_batch_size=1, seq_length=4096, num_microbatches=16,
            schedule="1f1b", recompute="none", attention="flash", zero=1,
            precision="megatron", hbm="80GiB")
SPACE = SearchSpace(tp=(2,), ep=(8, 16), pp=(8, 16), recompute=("none", "selective", "full"),
                    zero=(1,))
FIT_JOB = dict(world_size=1024, hbm="80GiB", seq_length=4096, global_batch_size=1024)


class DoNothing(TorchDispatchMode):
    """Calls the op, records nothing; the tracer's other entry points are no-ops."""

    def __init__(self, **_):
        super().__init__()
        self.events: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

    def track_external(self, *_):
        pass

    def retain(self, *_):
        pass


def timed(call) -> tuple[float, object]:
    start = time.perf_counter()
    out = call()
    return time.perf_counter() - start, out


def demo_against_do_nothing() -> str:
    job = Job.create("deepseek-v3", **DEMO)
    estimate_s, _ = timed(lambda: estimate(job))
    classes = {unit.signature: unit for unit in estimator.rank_classes(job)}
    tracer = estimator.MemoryTracer
    estimator.MemoryTracer = DoNothing
    try:
        where = estimator._placement(job)
        nothing_s, _ = timed(lambda: [estimator._trace_fb(
            job.config, job.parallel, unit.rank, b=job.micro_batch_size, s=job.seq_length,
            routing=job.routing_model, attention=job.attention, experts=job.experts,
            recompute=job.recompute, recompute_modules=frozenset(job.recompute_modules),
            deallocate=job.deallocate_pipeline_outputs, rounding=job.rounding,
            kernels=job.profile, where=where, kinds=unit.kinds) for unit in classes.values()])
    finally:
        estimator.MemoryTracer = tracer
    return (f"| demo estimate / do-nothing trace of its {len(classes)} distinct rank classes | "
            f"{estimate_s:.2f} | {nothing_s:.2f} | {estimate_s / nothing_s:.1f}x |")


def fit_against_single_estimates() -> str:
    fit_s, result = timed(lambda: fit("deepseek-v3", space=SPACE, workers=1, closest=0,
                                      **FIT_JOB))
    base = result.job

    def singles():
        for row in result.rows:
            estimate(replace(base, **row.layout.job_fields()), trace_cache=TraceCache())
    singles_s, _ = timed(singles)
    n = len(result.rows)
    return (f"| fit over {n} layouts ({len(result.fitting)} fit) / {n} single estimates | "
            f"{fit_s:.1f} | {singles_s:.1f} | {fit_s / singles_s:.2f}x |")


def zipf_against_balanced() -> str:
    balanced_s, _ = timed(lambda: estimate("deepseek-v3", **DEMO))
    zipf_s, result = timed(lambda: estimate("deepseek-v3", routing="zipf:1.0", **DEMO))
    return (f"| demo under zipf:1.0 ({len(result.ranks)} rank classes) / balanced (16) | "
            f"{zipf_s:.1f} | {balanced_s:.1f} | {zipf_s / balanced_s:.1f}x |")


def main() -> None:
    estimate(Job.create("deepseek-tiny", world_size=1, micro_batch_size=1, seq_length=16,
                        num_microbatches=2))  # torch's lazy imports, once
    print("| ratio | s | peer s | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for part in (demo_against_do_nothing, zipf_against_balanced,
                 fit_against_single_estimates):
        print(part(), flush=True)


if __name__ == "__main__":
    main()
