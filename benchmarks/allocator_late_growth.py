"""Why the caching-allocator replay of a 1F1B stage is walked to its end (issue 27): the
demo's stage 1 (DeepSeek-V3, 1,024 GPUs, TP 2 + SP, PP 16 as 4 / 1 end stages, EP 8, no
recompute) replayed through ``allocator_row`` at M = 64, 128 and 256: the ``cudaMalloc``
count, the reserved peak and the step of the last growth of reserved memory. With
``--pools M``: the same stage at M, each pool's blocks (small, large; owners renumbered
relative to the boundary) hashed at every boundary of the schedule's steady state, and the
first boundary whose pool state repeats an earlier one's (none: it never repeats).

    .venv/bin/python benchmarks/allocator_late_growth.py [--pools 512]
"""

from __future__ import annotations

import argparse

import tracemem.estimator as E
from tracemem.job import Job
from tracemem.memory.timeline import AllocatorReplay, step_at
from tracemem.periodic import periodic_stretches

DEMO = dict(world_size=1024, tp=2, sp=True, pp=16, ep=8, etp=1, pp_first_stage_layers=4,
            pp_last_stage_layers=1, micro_batch_size=1, seq_length=4096, schedule="1f1b",
            recompute="none", zero=1, hbm="80GiB")
STAGE = 1


def stage(m: int):
    job = Job.create("deepseek-v3", num_microbatches=m, **DEMO)
    traced = E.trace_classes(job, E.rank_classes(job)[STAGE:STAGE + 1], E.TraceCache())[0]
    E.replay_class(job, traced)
    return job, traced


def growth(m: int) -> str:
    job, traced = stage(m)
    row = E.allocator_row(job, traced, series=True)
    reserved = row.memory.reserved
    last = max(i for i in range(1, len(reserved)) if reserved[i] > reserved[i - 1])
    stats = row.memory.stats
    return (f"| {m} | {stats.num_device_alloc} | {stats.reserved_peak / 2**30:.4f} | "
            f"{row.allocated_peak_bytes / 2**30:.4f} | {step_at(row.memory, last)} |")


def pools(m: int) -> str:
    job, traced = stage(m)
    where = E._placement(job)
    steps = traced.steps
    stretch = max(periodic_stretches(steps), key=lambda s: s.count * s.period)
    boundaries = {stretch.start + k * stretch.period: k for k in range(stretch.count)}
    replay = AllocatorReplay(job.alloc_config, series=False)
    sim = replay.sim
    static = traced.static  # first, as allocator_row allocates it
    for i, (category, nbytes) in enumerate(
            [("parameter", static.param_bytes), ("gradient", static.held_grad_bytes),
             ("optimizer_state", static.optimizer_bytes), ("buffer", static.buffer_bytes)]
            + [("workspace", w.nbytes) for w in static.workspaces]):
        if nbytes:
            replay.alloc(("static", i), nbytes, category)
    seen: dict[str, dict[int, int]] = {"small": {}, "large": {}}
    repeats: dict[str, tuple[int, int]] = {}
    current = None
    for index, key, action, nbytes, _ in E.replay_events(
            steps, job.parallel.pp, traced.segments, lambda v: where.chunk_index(STAGE, v)):
        if index != current:
            current = index
            k = boundaries.get(index)
            if k is not None:
                offset = k * stretch.shift

                def canon(owner, offset=offset):
                    if type(owner) is tuple and len(owner) == 3 and owner[1] >= 1:
                        return (owner[0], owner[1] - offset, owner[2])
                    return ("held", owner)

                for pool in ("small", "large"):
                    blocks = []
                    for base in sorted(sim.segments):
                        seg = sim.segments[base]
                        if seg.small != (pool == "small"):
                            continue
                        blocks.append((seg.base, seg.size))
                        b = seg.head
                        while b is not None:
                            blocks.append((b.addr, b.size, canon(b.key)) if b.allocated
                                          else (b.addr, b.size))
                            b = b.next
                    digest = hash(tuple(blocks))
                    if digest in seen[pool] and pool not in repeats:
                        repeats[pool] = (seen[pool][digest], k)
                    seen[pool].setdefault(digest, k)
        if action == "alloc":
            replay.alloc(key, nbytes, "activation")
        else:
            replay.free(key)
    small = sum(s.small for s in sim.segments.values())
    return (f"M {m}: {stretch.count} steady-state boundaries (period {stretch.period} steps); "
            f"segments small {small}, large {len(sim.segments) - small}; first repeated "
            f"pool state (earlier boundary, boundary): {repeats or 'none'}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pools", type=int, default=None)
    args = parser.parse_args()
    print("| M | cudaMalloc calls | reserved peak GiB | allocated peak GiB | last growth at |")
    print("| ---: | ---: | ---: | ---: | --- |")
    for m in (64, 128, 256):
        print(growth(m), flush=True)
    if args.pools:
        print(pools(args.pools))


if __name__ == "__main__":
    main()
