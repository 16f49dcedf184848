"""tracemem: exact per-rank memory of large MoE training jobs, by tracing real torch ops on the
meta device."""

from tracemem.categories import Category, Phase
from tracemem.errors import (
    DataDependentOpError,
    FusedOptimizerError,
    MissingMetaKernelError,
    TracememError,
)
from tracemem.job import Job
from tracemem.parallel import ParallelConfig
from tracemem.tracer import MemoryEvent, MemoryTracer, StorageInfo

__all__ = ["Category", "Phase", "MemoryTracer", "MemoryEvent", "StorageInfo",
           "TracememError", "MissingMetaKernelError", "DataDependentOpError",
           "FusedOptimizerError", "ParallelConfig", "Job", "estimate"]


def estimate(job, /, *, progress=None, trace_cache=None, screen=False, snapshot=None,
             plot=None, **fields):
    """``tracemem.estimator.estimate``: peak memory of every distinct rank of ``job`` (a
    ``tracemem.Job``; or a model with the ``Job``'s fields as keywords, named as the CLI's
    flags). Imported on first use, so ``import tracemem`` stays light.

    Raises:
        TracememError: an invalid job, or a keyword that is not a ``Job`` field (an old name
            is refused with its new one: ``schedule_name`` is ``schedule``).
    """
    from tracemem.estimator import estimate as run

    return run(job, progress=progress, trace_cache=trace_cache, screen=screen,
               snapshot=snapshot, plot=plot, **fields)
__version__ = "0.1.0"
