"""Cost of tracing: microseconds per dispatched aten op and ops per second, for one
transformer block forward + backward on the meta device.

Compared side by side in one run: no mode at all, a do-nothing TorchDispatchMode (the floor any
dispatch-mode tracer pays), tracemem's MemoryTracer and PyTorch's MemTracker.

    .venv/bin/python benchmarks/tracer_overhead.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

from tracemem import MemoryTracer
from tracemem.validation.cases import EagerAttentionBlock


class CountingMode(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


class NopMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def build():
    block = EagerAttentionBlock(dim=1024, num_heads=16, seq_len=1024).to("meta")
    x = torch.empty(1, 1024, 1024, device="meta")
    return block, x


def run(make_context) -> float:
    block, x = build()
    context = make_context(block, x)
    start = time.perf_counter()
    with context:
        block(x).sum().backward()
    return time.perf_counter() - start


def _memory_tracer(block, x):
    tracer = MemoryTracer()
    tracer.track_external(block, x)
    return tracer


def _mem_tracker(block, x):
    tracker = MemTracker()
    tracker.track_external(block, x)
    return tracker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per variant")
    args = parser.parse_args()

    block, x = build()
    with CountingMode() as counter:
        block(x).sum().backward()
    ops = counter.ops

    variants = {
        "no mode": lambda b, x: contextlib.nullcontext(),
        "nop TorchDispatchMode": lambda b, x: NopMode(),
        "tracemem MemoryTracer": _memory_tracer,
        "torch MemTracker": _mem_tracker,
    }
    for make in variants.values():  # warm-up
        run(make)
    times = {name: statistics.median(run(make) for _ in range(args.repeats))
             for name, make in variants.items()}
    print(f"transformer block (h=1024, 16 heads, b=1, s=1024) forward+backward on meta: "
          f"{ops} dispatched aten ops; median of {args.repeats}; torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}")
    base = times["nop TorchDispatchMode"]
    print(f"{'variant':24s} {'ms/step':>9s} {'us/op':>8s} {'ops/s':>9s} {'vs nop mode':>12s}")
    for name, seconds in times.items():
        print(f"{name:24s} {seconds * 1e3:9.2f} {seconds / ops * 1e6:8.1f} {ops / seconds:9.0f} "
              f"{seconds / base:11.2f}x")


if __name__ == "__main__":
    main()
