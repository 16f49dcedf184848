"""Replay speed of the caching-allocator simulator (tracemem.memory) against the event count,
beside a peer in the same run: a plain byte counter over the same events (what the replay
cost before the simulator: a dict of live sizes and a running sum).

The stream is synthetic but shaped like a training step: mostly last-in-first-out frees, a
fixed seed, sizes drawn from four bands (<= 4 KiB, <= 2 MiB, 1-12 MiB, 10-60 MiB), about as
many frees as allocations. Median of 3 runs per size.

    .venv/bin/python benchmarks/allocator_replay.py
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from tracemem.memory import CachingAllocatorSimulator

MiB = 2**20


def stream(n: int, seed: int = 0) -> list[tuple[str, int, int]]:
    rnd = random.Random(seed)
    events, live, key = [], [], 0
    while len(events) < n:
        if live and rnd.random() < 0.48:
            index = len(live) - 1 - min(int(rnd.expovariate(0.5)), len(live) - 1)
            events.append(("free", live.pop(index), 0))
        else:
            band = rnd.random()
            nbytes = (rnd.randint(1, 4096) if band < 0.3 else
                      rnd.randint(4096, 2 * MiB) if band < 0.6 else
                      rnd.randint(MiB, 12 * MiB) if band < 0.9 else
                      rnd.randint(10 * MiB, 60 * MiB))
            events.append(("alloc", key, nbytes))
            live.append(key)
            key += 1
    return events


def count_only(events) -> int:
    live, current, peak = {}, 0, 0
    for action, key, nbytes in events:
        if action == "alloc":
            live[key] = nbytes
            current += nbytes
            peak = max(peak, current)
        else:
            current -= live.pop(key)
    return peak


def timed(fn, repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    print(f"torch {torch.__version__}")
    print("| events | conf | simulator s | events/s | byte counter s | ratio | reserved peak MiB "
          "| segments at peak |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in (1_000, 10_000, 100_000, 300_000):
        events = stream(n)
        base = timed(lambda: count_only(events))
        for conf in ("", "expandable_segments:True"):
            sim_holder = {}

            def run():
                sim = CachingAllocatorSimulator(conf)
                sim_holder["stats"] = sim.replay(events)
            seconds = timed(run)
            stats = sim_holder["stats"]
            print(f"| {n:,} | {conf or 'default'} | {seconds:.3f} | {n / seconds:,.0f} | "
                  f"{base:.4f} | {seconds / base:.0f}x | {stats.reserved_peak / MiB:,.0f} | "
                  f"{stats.segments_at_reserved_peak} |")


if __name__ == "__main__":
    main()
