"""tracemem: exact per-rank memory of large MoE training jobs, by tracing real torch ops on the
meta device."""

from tracemem.categories import Category, Phase
from tracemem.errors import MissingMetaKernelError, TracememError
from tracemem.tracer import MemoryEvent, MemoryTracer, StorageInfo

__all__ = ["Category", "Phase", "MemoryTracer", "MemoryEvent", "StorageInfo",
           "TracememError", "MissingMetaKernelError"]
__version__ = "0.1.0"
