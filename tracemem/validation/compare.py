"""Run a validation case for real on CPU under the profiler and traced on the meta device, and
compare the peaks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tracemem.tracer import MemoryTracer
from tracemem.validation.cases import Case, Setup
from tracemem.validation.groundtruth import ProfiledStep, profile_cpu_step

__all__ = ["Comparison", "compare_case", "trace_case"]


@dataclass(frozen=True)
class Comparison:
    """Real and traced memory of one case's step, in bytes above what was alive before it.

    Attributes:
        case: the case.
        real: what the CPU allocator reported for the real step.
        tracer: the tracer of the same step on the traced device, for breakdowns.
        traced_end_bytes: bytes the traced step left allocated (measured at exit).
    """

    case: Case
    real: ProfiledStep
    tracer: MemoryTracer
    traced_end_bytes: int

    @property
    def real_peak_bytes(self) -> int:
        return self.real.peak_bytes

    @property
    def traced_peak_bytes(self) -> int:
        return self.tracer.peak_bytes - self.tracer.baseline_bytes

    @property
    def real_end_bytes(self) -> int:
        return self.real.end_bytes

    @property
    def gap_bytes(self) -> int:
        """Real peak minus traced peak."""
        return self.real_peak_bytes - self.traced_peak_bytes


def trace_case(case: Case, device: str = "meta", rounding: int | None = None
               ) -> tuple[MemoryTracer, Setup]:
    """Build ``case`` on ``device`` and trace one step. The setup is returned with the tracer:
    while it is alive, the tracer's ``current_bytes`` still counts the model and optimizer."""
    torch.manual_seed(0)
    setup = case.build(device)
    tracer = MemoryTracer(rounding=rounding)
    tracer.track_external(*setup.externals)
    with tracer:
        setup.step()
    return tracer, setup


def compare_case(case: Case, device: str = "meta") -> Comparison:
    """Profile one real CPU step of ``case`` (after a warm-up step on a separate copy, so that
    kernel caches are already built) and trace the same step on ``device``."""
    torch.manual_seed(0)
    case.build("cpu").step()  # warm-up on a throw-away copy
    torch.manual_seed(0)
    setup = case.build("cpu")
    real = profile_cpu_step(setup.step)
    tracer, traced_setup = trace_case(case, device)
    return Comparison(case, real, tracer, tracer.current_bytes - tracer.baseline_bytes)
