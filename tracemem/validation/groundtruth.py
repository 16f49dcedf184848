"""Ground truth for the tracer: the CPU allocator's own record of real steps.

``torch.profiler.profile(activities=[CPU], profile_memory=True)`` records one allocation event
per CPU allocation and free (c10's ``ProfiledCPUMemoryReporter`` in c10/core/CPUAllocator.cpp:
the block's address and its requested byte count, positive for an allocation, negative for a
free). Summing the byte counts in time order gives the bytes allocated at every moment; pairing
each free with the allocation at the same address gives the set of blocks alive at any moment.
Both come from below the dispatcher, so they do not depend on the tracer or on any dispatch mode
(which would give every tensor a Python object and so could change lifetimes itself).

The events are read from ``kineto_results.experimental_event_tree()`` (``_EventType.Allocation``
with ``extra_fields.ptr`` / ``alloc_size``), as ``torch/profiler/_memory_profiler.py`` does
(torch 2.13). Frees of blocks allocated before profiling started are not reported (the reporter
does not know their size), so a validation loop builds its model under the profiler.
"""

from __future__ import annotations

import gc
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

from tracemem.tracer import MemoryTracer

__all__ = ["ProfiledStep", "profile_cpu_step", "profile_cpu_loop", "unseen_allocations",
           "quiet_stderr", "no_cyclic_gc", "model_step_real_and_traced"]

_STEP_MARKER = "tracemem.validation.step"

# What the profiler writes on fd 2 from C++: Kineto's "USDT:2026-11-29 17:59:51 8865:8865
# SyncActivityProfilerHandler.cpp:52] profiler_start" lines and c10's glog-style warnings
# ("[W1129 17:59:51.123456 ...] Memory block of unknown size ...").
_NATIVE_LOG_LINE = re.compile(r"^([A-Z]+:\d{4}-\d\d-\d\d |\[[WIE]\d{4} )")


@dataclass(frozen=True)
class ProfiledStep:
    """One real CPU step as the allocator saw it, in bytes.

    Attributes:
        deltas: signed bytes of each CPU allocation (+) and free (-) during the step, in time
            order.
        peak_bytes: the maximum running sum of ``deltas`` (0 if nothing was allocated): the
            peak above what was alive when the step began.
        end_bytes: the sum of ``deltas``: bytes the step left allocated.
        live: sizes of the blocks alive right after the step that were allocated since
            profiling began (while building, or in this or an earlier step), sorted.
    """

    deltas: tuple[int, ...]
    peak_bytes: int
    end_bytes: int
    live: tuple[int, ...] = ()


@contextmanager
def quiet_stderr() -> Iterator[None]:
    """Send what native code writes on file descriptor 2 (the profiler's ``profiler_start`` /
    ``profiler_stop`` lines, c10 warnings) to a temporary file instead of the terminal; the
    descriptor is restored on exit, also on error. On error, the captured lines that are not
    native log lines are written back to stderr, so nothing that explains a failure is lost."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            if failed:
                sink.seek(0)
                text = sink.read().decode(errors="replace")
                kept = [line for line in text.splitlines() if not _NATIVE_LOG_LINE.match(line)]
                if kept:
                    print("\n".join(kept), file=sys.stderr)


@contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """Collect cyclic garbage now and keep Python's cycle collector off inside (restored on
    exit). Otherwise garbage from earlier code (a module whose hook is its own bound method
    forms a cycle) can be collected in the middle of a measured loop, and the allocator reports
    the free of a block the loop never made: the allocator remembers every block allocated
    while any profiler was recording."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def profile_cpu_loop(build: Callable[[], Callable[[], Any]], steps: int) -> list[ProfiledStep]:
    """Call ``build()`` (which makes a model, optimizer and inputs and returns the step
    function), then run the step ``steps`` times, all in one profiled loop with one intra-op
    thread (the allocation order is then deterministic); return what the CPU allocator reported
    for each step. Building under the profiler makes every block of the run known to it, so a
    step's ``live`` holds all blocks alive after it. The thread count and stderr are restored
    afterwards.

    Raises:
        ValueError: ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError(f"steps={steps!r} must be >= 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with quiet_stderr(), no_cyclic_gc(), profile(activities=[ProfilerActivity.CPU],
                                                     profile_memory=True) as prof:
            step = build()
            for k in range(steps):
                with record_function(f"{_STEP_MARKER}.{k}"):
                    step()
            del step
    finally:
        torch.set_num_threads(threads)
    allocations, starts, ends = [], {}, {}
    stack = list(reversed(prof.profiler.kineto_results.experimental_event_tree()))
    order = 0
    while stack:  # depth first, so events of one thread keep their recording order
        event = stack.pop()
        if event.tag == _EventType.Allocation:
            fields = event.extra_fields
            if fields.device.type == "cpu":
                allocations.append((event.start_time_ns, order, fields.ptr, fields.alloc_size))
                order += 1
        elif event.name.startswith(_STEP_MARKER + "."):
            k = int(event.name.rsplit(".", 1)[1])
            starts[k], ends[k] = event.start_time_ns, event.end_time_ns
        stack.extend(reversed(event.children))
    allocations.sort()
    out, live, i = [], {}, 0
    for k in range(steps):
        deltas = []
        while i < len(allocations) and allocations[i][0] <= ends[k]:
            t, _, ptr, nbytes = allocations[i]
            if nbytes > 0:
                live[ptr] = nbytes
            else:
                live.pop(ptr, None)
            if t >= starts[k]:
                deltas.append(int(nbytes))
            i += 1
        running = peak = 0
        for delta in deltas:
            running += delta
            peak = max(peak, running)
        out.append(ProfiledStep(tuple(deltas), peak, running, tuple(sorted(live.values()))))
    return out


def profile_cpu_step(step: Callable[[], Any]) -> ProfiledStep:
    """Run ``step()`` once under the profiler (see ``profile_cpu_loop``); ``live`` then holds
    the blocks allocated by the step and alive after it."""
    return profile_cpu_loop(lambda: step, 1)[0]


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


def model_step_real_and_traced(cfg, *, b: int = 2, s: int = 16, attention: str = "eager"
                               ) -> tuple[ProfiledStep, int, int]:
    """One training step of model ``cfg`` (a ``modeling.ModelConfig``; eager kernels, fp32,
    AdamW, balanced routing, b sequences of s tokens) for real on CPU under the profiler
    (after a warm-up step on a throw-away copy) and traced on meta: the real step, and the
    traced step's peak and bytes left above its externals (the family tests' reference)."""
    from modeling import build_model
    from modeling.common.routing import Balanced

    def build(device):
        torch.manual_seed(0)
        # built on the device itself: Module.to("meta") unties a tied head from the embedding
        model = build_model(cfg, device, attention=attention, dtype=torch.float32,
                            kernels="eager")
        for param in model.parameters():
            torch.nn.init.normal_(param, std=0.02)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, cfg.vocab_size, (b, s)).to(device)
        labels = torch.randint(0, cfg.vocab_size, (b, s)).to(device)
        return model, optimizer, tokens, labels

    def step(model, optimizer, tokens, labels):
        model(tokens, labels, Balanced()).backward()
        optimizer.step()

    step(*build("cpu"))  # warm-up: first-use allocations stay out of the measured step
    cpu = build("cpu")
    real = profile_cpu_step(lambda: step(*cpu))
    meta = build("meta")
    tracer = MemoryTracer()
    tracer.track_external(*meta)
    with tracer:
        step(*meta)
    return (real, tracer.peak_bytes - tracer.baseline_bytes,
            tracer.current_bytes - tracer.baseline_bytes)
