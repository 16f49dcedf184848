"""How the schedule replay (``tracemem.estimator.replay_schedule``) grows with the number of
microbatches M, for every schedule: one deepseek-tiny stage (PP 4, one layer per virtual
stage, b 1, s 16) is traced once, then its segments are replayed under each schedule's steps
for stage 0 (the stage that holds the most microbatches) at M = 16 ... 4096.

Replayed events per second must stay flat when the replay is linear in events (issue 9 item
7: before, GPipe copied the live set at each new peak, so the rate fell as 1 / M).

    .venv/bin/python benchmarks/replay_scaling.py [--max-m 4096] [--quadratic]

``--quadratic`` also times the replay as it was before (commit 883570b; one run, up to
M = 1024), and the ratio of the two.

``--periodic`` (issue 27 item 2) instead times, in one run, the full replay against the
steady-state shortcut (``tracemem.periodic``), for the byte replay (``replay_schedule``) and
for the replay through the caching-allocator simulator, every stage of the rank, and checks
that both give the same figures (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "tracemem"))

from modeling import load_config  # noqa: E402
from modeling.common.routing import parse_routing  # noqa: E402
from tracemem.estimator import _trace_rank, replay_events, replay_schedule  # noqa: E402
from tracemem.parallel import ParallelConfig  # noqa: E402
from tracemem.schedules import schedule  # noqa: E402

PP = 4


def segments_for(vpp: int):
    cfg = load_config("deepseek-tiny")
    layout = (1,) * PP if vpp == 1 else (0,) * (PP * vpp - 4) + (1,) * 4
    par = ParallelConfig.create(cfg, world_size=PP, pp=PP, vpp=vpp, pp_layout=layout)
    _, segments = _trace_rank(cfg, par, 0, b=1, s=16, routing=parse_routing("balanced"),
                              attention="flash", experts="sequential", recompute="none",
                              recompute_modules=frozenset(), deallocate=True, rounding=512)
    return segments


def timed(fn, *args, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best


def allocator_figures(steps, segments, shortcut: bool) -> tuple:
    from tracemem.memory.timeline import replay_through_allocator

    events = ((lambda sink: replay_events(steps, PP, segments, periodic=sink is not None,
                                          sink=sink)) if shortcut
              else replay_events(steps, PP, segments))
    timeline, replay = replay_through_allocator(events, steps, [], "x", series=False)
    s = timeline.stats
    return (s.allocated_peak, s.reserved_peak, s.reserved_peak_event, s.num_device_alloc,
            replay.sim.events)


def periodic_table(max_m: int) -> None:
    print("| schedule | M | stage | events | byte replay full ms | shortcut ms | ratio | "
          "allocator full ms | shortcut ms | ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, vpp in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)):
        segments = segments_for(vpp)
        m = 16
        while m <= max_m:
            for stage, steps in enumerate(schedule(name, PP, vpp, m)):
                events = sum(1 for _ in replay_events(steps, PP, segments))
                full = replay_schedule(steps, PP, segments, 0, periodic=False)
                if replay_schedule(steps, PP, segments, 0) != full or \
                        allocator_figures(steps, segments, True) != \
                        allocator_figures(steps, segments, False):
                    sys.exit(f"{name} M={m} stage {stage}: the shortcut differs")
                b_full = timed(replay_schedule, steps, PP, segments, 0, None, False)
                b_short = timed(replay_schedule, steps, PP, segments, 0, None, True)
                a_full = timed(allocator_figures, steps, segments, False, repeat=1)
                a_short = timed(allocator_figures, steps, segments, True, repeat=1)
                print(f"| {name} | {m:,} | {stage} | {events:,} | {1000 * b_full:,.1f} | "
                      f"{1000 * b_short:,.1f} | {b_full / b_short:.1f}x | "
                      f"{1000 * a_full:,.1f} | {1000 * a_short:,.1f} | "
                      f"{a_full / a_short:.1f}x |", flush=True)
            m *= 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-m", type=int, default=4096)
    parser.add_argument("--quadratic", action="store_true")
    parser.add_argument("--periodic", action="store_true")
    args = parser.parse_args()
    if args.periodic:
        periodic_table(args.max_m)
        return
    if args.quadratic:
        from test_replay import quadratic_replay
    print("| schedule | M | replayed events | replay ms | events/s | before: ms | before / now |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, vpp in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)):
        segments = segments_for(vpp)
        m = 16
        while m <= args.max_m:
            steps = schedule(name, PP, vpp, m)[0]
            events = sum(1 for _ in replay_events(steps, PP, segments))
            seconds = timed(replay_schedule, steps, PP, segments, 0, None, False)
            old = ""
            if args.quadratic and m <= 1024:
                old_s = timed(quadratic_replay, steps, PP, segments, 0, repeat=1)
                old = f"{1000 * old_s:,.1f} | {old_s / seconds:.2f}x"
            print(f"| {name} | {m:,} | {events:,} | {1000 * seconds:,.1f} | "
                  f"{events / seconds:,.0f} | {old or ' | '} |", flush=True)
            m *= 4


if __name__ == "__main__":
    main()
