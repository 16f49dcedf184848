"""``tracemem fit`` with the periodic shortcut's probes thinned out (``tracemem.periodic.probed``,
as shipped) against the whole state hashed at every period boundary whose quick summary was
seen (before), in one process, one worker, on a space of DeepSeek-V3 layouts with many
microbatches (1,024 GPUs, global batch 4,096 sequences: M = 4096 / DP up to 256); the
traces are made first and shared by both arms, whose rows must be equal (exit 1 otherwise).

    .venv/bin/python benchmarks/fit_probes.py
"""

from __future__ import annotations

import sys
import time

import tracemem.estimator as estimator
import tracemem.fit as fit_module
import tracemem.periodic as periodic
from tracemem.fit import SearchSpace, fit

SPACE = SearchSpace(tp=(2, 4), ep=(8,), pp=(8, 16), recompute=("none", "full"), zero=(1,))
JOB = dict(world_size=1024, hbm="80GiB", seq_length=4096, global_batch_size=4096,
           space=SPACE, workers=1)


def rows(result) -> list[dict]:
    return [{k: v for k, v in r.as_dict().items() if not k.startswith("traces_")}
            for r in result.rows + result.closest]


def timed(every: bool) -> tuple[float, list[dict], int]:
    estimator.probed = (lambda k: True) if every else periodic.probed
    start = time.perf_counter()
    result = fit("deepseek-v3", **JOB)
    return time.perf_counter() - start, rows(result), len(result.rows)


def main() -> None:
    # one TraceCache for the three runs: the first makes the traces, the two arms share them
    cache = estimator.TraceCache()
    fit_module._worker_cache = lambda cache_dir, run_id: cache
    warm_s, _, n = timed(every=False)
    every_s, every, _ = timed(every=True)
    thinned_s, thinned, _ = timed(every=False)
    same = every == thinned
    print(f"{n} layouts; first run (tracing too) {warm_s:.1f} s; every boundary probed "
          f"{every_s:.1f} s; thinned (shipped) {thinned_s:.1f} s; ratio "
          f"{every_s / thinned_s:.2f}x; same rows: {'yes' if same else 'NO'}")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
