"""One forward and backward of a kernel call traced on meta, the kernel tests' harness: what
each pass allocated, what the forward left alive besides its output, and each pass's peak.
The tests derive their expected values by hand from the sources they cite; this only
records."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tracemem import MemoryTracer

__all__ = ["leaf", "peak_of", "TracedCall", "trace_call"]

BF16 = torch.bfloat16


def leaf(*shape, dtype=BF16):
    """A meta tensor that needs a gradient."""
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)


def peak_of(events) -> int:
    """The highest running sum of ``events``' allocations minus frees, from 0."""
    now = peak = 0
    for e in events:
        now += e.nbytes if e.action == "alloc" else -e.nbytes
        peak = max(peak, now)
    return peak


@dataclass
class TracedCall:
    """``forward`` / ``backward``: the events of each pass (``MemoryEvent``); ``kept``: the
    storages made in forward and alive after it, besides the output (``live_at`` items);
    ``out``: the output; ``tracer``: the ``MemoryTracer``."""

    forward: list
    backward: list
    kept: list
    out: torch.Tensor
    tracer: MemoryTracer

    def allocs(self, events) -> list:
        return [e for e in events if e.action == "alloc"]

    @property
    def kept_bytes(self) -> int:
        return sum(i.nbytes for i in self.kept)


def trace_call(fn, inputs, externals=()) -> TracedCall:
    """``fn(*inputs)`` traced forward, then its output's backward with a meta gradient of the
    output's shape; ``inputs`` and ``externals`` are tracked as external (not counted)."""
    tracer = MemoryTracer(rounding=None)
    tracer.track_external(*inputs, *externals)
    with tracer:
        out = fn(*inputs)
    forward = [e for e in tracer.events if e.phase.value == "forward"]
    out_id = tracer._live[out.untyped_storage()._cdata].sid
    kept = [i for i in tracer.live_at("now")
            if i.phase.value == "forward" and i.storage_id != out_id]
    grad = torch.empty(out.shape, dtype=out.dtype, device="meta")
    tracer.track_external(grad)
    start = len(tracer.events)
    with tracer:
        out.backward(grad)
    return TracedCall(forward, tracer.events[start:], kept, out, tracer)
