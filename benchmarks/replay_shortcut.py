"""The steady-state shortcut (``tracemem.periodic``, issue 27 item 2) on DeepSeek-V3 estimates,
against the full replay as the peer, in one run: each layout estimated twice in this process
(traces shared through one ``TraceCache``, so the times compare the replays), first with no
boundary probed (``MAX_PROBES`` 0: every event walked), then with the whole state hashed at
every boundary whose quick summary was seen (the shortcut before ``periodic.probed`` thinned
the probes out), then as shipped; the three must agree on every figure of every rank (exit 1
otherwise).

    .venv/bin/python benchmarks/replay_shortcut.py
"""

from __future__ import annotations

import sys
import time

import tracemem.estimator as estimator
import tracemem.periodic as periodic
from tracemem.estimator import TraceCache, estimate

V3 = dict(world_size=1024, sp=True, pp=16, etp=1, pp_first_stage_layers=4,
          pp_last_stage_layers=1, micro_batch_size=1, seq_length=4096, schedule="1f1b",
          zero=1, hbm="80GiB")
LAYOUTS = [  # (label, fields): M = 4096 / (b x DP) at a global batch of 4096 sequences
    ("TP 8, EP 8, full recompute, M 512", dict(tp=8, ep=8, recompute="full",
                                               num_microbatches=512)),
    ("TP 2, EP 8, no recompute, M 128", dict(tp=2, ep=8, recompute="none",
                                             num_microbatches=128)),
]


def figures(result) -> list[tuple]:
    return [(r.pp_stage, r.peak_bytes, r.peak_step, r.inflight_microbatches,
             r.allocated_peak_bytes, r.reserved_peak_bytes, r.fragmentation_bytes,
             r.largest_free_block_bytes, r.reserved_peak_step, r.fits) for r in result.ranks]


def timed_estimate(fields: dict, cache: TraceCache, probes: int,
                   every: bool = False) -> tuple[float, list]:
    periodic.MAX_PROBES = estimator.MAX_PROBES = probes
    estimator.probed = (lambda k: True) if every else periodic.probed
    start = time.perf_counter()
    result = estimate("deepseek-v3", trace_cache=cache, **(V3 | fields))
    return time.perf_counter() - start, figures(result)


def main() -> None:
    shipped = periodic.MAX_PROBES
    print("| layout | full replay s | every boundary probed s | shortcut s | full / shortcut "
          "| every / shortcut | same figures |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    bad = False
    for label, fields in LAYOUTS:
        cache = TraceCache()
        estimate("deepseek-v3", trace_cache=cache, screen=True, **(V3 | fields))  # traces
        full_s, full = timed_estimate(fields, cache, 0)
        every_s, every = timed_estimate(fields, cache, shipped, every=True)
        short_s, short = timed_estimate(fields, cache, shipped)
        same = full == short == every
        bad |= not same
        print(f"| {label} | {full_s:.1f} | {every_s:.1f} | {short_s:.1f} | "
              f"{full_s / short_s:.1f}x | {every_s / short_s:.1f}x | "
              f"{'yes' if same else 'NO'} |", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
