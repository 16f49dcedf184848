"""Validation of the tracer against real execution: small cases, the profiler's ground truth,
and the comparison of the two."""

from tracemem.validation.cases import CASES, Case, Setup, get_case
from tracemem.validation.compare import (
           STEPS,
           Comparison,
           StepComparison,
           compare_case,
           trace_case,
)
from tracemem.validation.groundtruth import (
           ProfiledStep,
           model_step_real_and_traced,
           profile_cpu_loop,
           profile_cpu_step,
           unseen_allocations,
)

__all__ = ["CASES", "Case", "Setup", "get_case", "STEPS", "Comparison", "StepComparison",
           "compare_case", "trace_case", "ProfiledStep", "profile_cpu_loop", "profile_cpu_step",
           "unseen_allocations", "model_step_real_and_traced"]
