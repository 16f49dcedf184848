"""tracemem: exact per-rank memory of large MoE training jobs, by tracing real torch ops on the
meta device."""

from tracemem.categories import Category, Phase
from tracemem.errors import (
    DataDependentOpError,
    FusedOptimizerError,
    MissingMetaKernelError,
    TracememError,
)
from tracemem.parallel import ParallelConfig
from tracemem.tracer import MemoryEvent, MemoryTracer, StorageInfo

__all__ = ["Category", "Phase", "MemoryTracer", "MemoryEvent", "StorageInfo",
           "TracememError", "MissingMetaKernelError", "DataDependentOpError",
           "FusedOptimizerError", "ParallelConfig", "estimate"]


def estimate(model, **kwargs):
    """``tracemem.estimator.estimate``: peak memory of every distinct rank (imported on first
    use, so ``import tracemem`` stays light)."""
    from tracemem.estimator import estimate as run

    return run(model, **kwargs)
__version__ = "0.1.0"
