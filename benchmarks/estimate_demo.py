"""Wall time of the main job, `make demo`'s `tracemem estimate` on DeepSeek-V3, against the
plain tracing work it is made of (one V3 stage's two microbatches), on this machine.

    .venv/bin/python benchmarks/estimate_demo.py
"""

from __future__ import annotations

import time

import torch

from tracemem.estimator import estimate

DEMO = dict(world_size=1024, tp=2, sp=True, pp=16, ep=8, etp=1, pp_first_stage_layers=4,
            pp_last_stage_layers=1, micro_batch_size=1, seq_length=4096, num_microbatches=16,
            schedule="1f1b", recompute="none", attention="flash", zero=1,
            precision="megatron", hbm="80GiB")


def what_fits_time() -> None:
    """--what-fits: the demo's estimate against the single-change search that follows it."""
    from tracemem.advice import what_fits

    start = time.perf_counter()
    base = estimate("deepseek-v3", **DEMO)
    base_s = time.perf_counter() - start
    start = time.perf_counter()
    fits = what_fits(base)
    fits_s = time.perf_counter() - start
    tried = [c for c in fits if c.skipped is None]
    print(f"{'demo estimate, then --what-fits':45s} {base_s:6.1f} s + {fits_s:.1f} s "
          f"({len(tried)} re-estimates, {fits_s / base_s:.1f}x the estimate); "
          f"{sum(c.fits for c in tried)} fit")


def main() -> None:
    print(f"torch {torch.__version__}")
    what_fits_time()
    for label, extra in [("demo (flash, no recompute)", {}),
                         ("full recompute", {"recompute": "full"}),
                         ("eager kernels, eager attention",
                          {"kernels": "eager", "attention": "eager"}),
                         ("zipf:1.0 routing (every EP-rank class)", {"routing": "zipf:1.0"})]:
        start = time.perf_counter()
        result = estimate("deepseek-v3", **(DEMO | extra))
        seconds = time.perf_counter() - start
        worst = result.worst
        print(f"{label:45s} {seconds:6.1f} s   worst stage {worst.pp_stage} "
              f"peak {worst.peak_bytes / 2**30:7.2f} GiB, stage 0 in flight "
              f"{result.ranks[0].inflight_microbatches}")


if __name__ == "__main__":
    main()
