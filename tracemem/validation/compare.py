"""Run a validation case for real on CPU under the profiler and traced on the meta device, for
several steps in one loop, and compare after every step: the peak, the bytes left, and the set
of storages alive."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from tracemem.tracer import MemoryTracer, StorageInfo
from tracemem.validation.cases import Case, Setup
from tracemem.validation.groundtruth import ProfiledStep, no_cyclic_gc, profile_cpu_loop

__all__ = ["STEPS", "Comparison", "StepComparison", "compare_case", "trace_case"]

# Steps run in one loop per case. Two would show a leak of one step into the next; three also
# show that the live set settles (a leak grows by the same storages every step).
STEPS = 3


@dataclass(frozen=True)
class StepComparison:
    """One step of the loop, real and traced, in bytes.

    Attributes:
        index: 0 for the first step.
        real: what the CPU allocator reported for the step (``live``: sizes of all blocks
            alive after the step, the model's, optimizer's and inputs' included).
        traced_peak_bytes: the traced step's peak above what was alive when it began.
        traced_end_bytes: bytes the traced step left allocated.
        traced_live: the traced storages alive after the step, externals included.
    """

    index: int
    real: ProfiledStep
    traced_peak_bytes: int
    traced_end_bytes: int
    traced_live: tuple[StorageInfo, ...]

    @property
    def traced_live_sizes(self) -> tuple[int, ...]:
        return tuple(sorted(info.nbytes for info in self.traced_live))

    @property
    def live_sets_equal(self) -> bool:
        """Whether the same number of storages of each size is alive after the step."""
        return self.traced_live_sizes == self.real.live

    def live_difference(self) -> str:
        """The storages alive in one run and not the other, for an assertion message: traced
        extras with their op, shape and module; real extras by size (the allocator knows only
        the size)."""
        extra = Counter(self.traced_live_sizes) - Counter(self.real.live)
        missing = Counter(self.real.live) - Counter(self.traced_live_sizes)
        shown = []
        for info in self.traced_live:
            if extra[info.nbytes]:
                extra[info.nbytes] -= 1
                shown.append(f"{info.nbytes} B {info.op} {info.shape} in {info.module!r}")
        return (f"step {self.index}: only traced: [{'; '.join(shown)}]; only real (B): "
                f"{sorted(missing.elements())}")


@dataclass(frozen=True)
class Comparison:
    """Real and traced memory of one case's loop.

    Attributes:
        case: the case.
        steps: one ``StepComparison`` per step of the loop.
        tracer: the tracer of the whole traced loop, for breakdowns.
    """

    case: Case
    steps: tuple[StepComparison, ...]
    tracer: MemoryTracer

    @property
    def real(self) -> ProfiledStep:
        """The first step as the allocator saw it."""
        return self.steps[0].real

    @property
    def real_peak_bytes(self) -> int:
        """The first step's real peak above what was alive before it."""
        return self.steps[0].real.peak_bytes

    @property
    def traced_peak_bytes(self) -> int:
        return self.steps[0].traced_peak_bytes

    @property
    def real_end_bytes(self) -> int:
        return self.steps[0].real.end_bytes

    @property
    def traced_end_bytes(self) -> int:
        return self.steps[0].traced_end_bytes

    @property
    def gap_bytes(self) -> int:
        """The first step's real peak minus traced peak."""
        return self.real_peak_bytes - self.traced_peak_bytes

    @property
    def live_sets_equal(self) -> bool:
        """Whether the live sets agree after every step of the loop."""
        return all(s.live_sets_equal for s in self.steps)


def _traced_loop(case: Case, device: str, rounding: int | None, steps: int
                 ) -> tuple[MemoryTracer, Setup, list[tuple[int, int, tuple[StorageInfo, ...]]]]:
    torch.manual_seed(0)
    setup = case.build(device)
    tracer = MemoryTracer(rounding=rounding)
    tracer.track_external(*setup.externals)
    per_step = []
    for _ in range(steps):
        start_index, start_bytes = len(tracer.events), tracer.current_bytes
        with no_cyclic_gc(), tracer:  # as the real loop runs
            setup.step()
        totals = [e.total_bytes for e in tracer.events[start_index:]]
        peak = max([start_bytes, *totals]) - start_bytes
        live = tuple(tracer.live_at("now"))
        per_step.append((peak, tracer.current_bytes - start_bytes, live))
    return tracer, setup, per_step


def trace_case(case: Case, device: str = "meta", rounding: int | None = None, steps: int = 1
               ) -> tuple[MemoryTracer, Setup]:
    """Build ``case`` on ``device`` and trace ``steps`` steps in a loop. The setup is returned
    with the tracer: while it is alive, the tracer's ``current_bytes`` still counts the model
    and optimizer."""
    tracer, setup, _ = _traced_loop(case, device, rounding, steps)
    return tracer, setup


def compare_case(case: Case, device: str = "meta", steps: int = STEPS) -> Comparison:
    """Profile a loop of ``steps`` real CPU steps of ``case`` (after a warm-up loop on a
    separate copy, so that kernel caches are already built) and trace the same loop on
    ``device``."""
    def build():
        torch.manual_seed(0)
        return case.build("cpu").step

    warm = build()  # a throw-away copy
    for _ in range(steps):
        warm()
    del warm
    real = profile_cpu_loop(build, steps)
    tracer, _setup, traced = _traced_loop(case, device, None, steps)
    return Comparison(case, tuple(StepComparison(k, r, peak, end, live)
                                  for k, (r, (peak, end, live)) in enumerate(zip(real, traced))),
                      tracer)
