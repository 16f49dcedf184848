"""Ground truth for the tracer: the CPU allocator's own record of a real step.

``torch.profiler.profile(activities=[CPU], profile_memory=True)`` records one ``[memory]``
event per CPU allocation and free (c10's ``ProfiledCPUMemoryReporter``: the requested byte
count, positive for an allocation, negative for a free). Summing them in time order gives the
bytes allocated during the step at every moment; its maximum is the real peak above what was
allocated before profiling started. Frees of blocks allocated before profiling started are not
reported (the reporter does not know their size), so a step must not free its externals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from tracemem.tracer import MemoryTracer

__all__ = ["ProfiledStep", "profile_cpu_step", "unseen_allocations"]


@dataclass(frozen=True)
class ProfiledStep:
    """A real CPU step as the allocator saw it.

    Attributes:
        deltas: signed bytes of each CPU allocation (+) and free (-), in time order.
        peak_bytes: the maximum running sum of ``deltas`` (0 if nothing was allocated).
        end_bytes: the sum of ``deltas``: bytes the step left allocated.
    """

    deltas: tuple[int, ...]
    peak_bytes: int
    end_bytes: int


def profile_cpu_step(step: Callable[[], Any]) -> ProfiledStep:
    """Run ``step()`` once under the profiler with one intra-op thread and return what the CPU
    allocator reported. The thread count is restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the allocation order is deterministic
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    finally:
        torch.set_num_threads(threads)
    cpu = torch._C._autograd.DeviceType.CPU
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == cpu]
    events.sort(key=lambda e: e.start_ns())  # stable: ties keep recording order
    deltas = tuple(int(e.nbytes()) for e in events)
    running = peak = 0
    for delta in deltas:
        running += delta
        peak = max(peak, running)
    return ProfiledStep(deltas, peak, running)


def unseen_allocations(real: ProfiledStep, tracer: MemoryTracer) -> list[int]:
    """The allocator events of ``real`` that ``tracer`` (run on the same step, on CPU) did not
    see: a greedy in-order match of signed sizes. What is left are allocations below the
    dispatcher (kernel workspaces, wrapped Python scalars). A diagnostic, not an exact
    alignment: equal-sized events can pair with a neighbour."""
    traced = [e.nbytes if e.action == "alloc" else -e.nbytes for e in tracer.events
              if e.phase.value != "external"]
    unseen, i = [], 0
    for delta in real.deltas:
        if i < len(traced) and traced[i] == delta:
            i += 1
        else:
            unseen.append(delta)
    return unseen
