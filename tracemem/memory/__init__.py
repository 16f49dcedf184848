"""Memory models beyond the tracer: the CUDA caching-allocator simulator (reserved memory,
fragmentation), its ``PYTORCH_CUDA_ALLOC_CONF`` parser, and memory snapshots in the format of
``torch.cuda.memory._snapshot()``."""

from tracemem.memory.allocator import (
    AllocatorStats,
    CachingAllocatorSimulator,
    get_allocation_size,
    round_size,
    simulate,
)
from tracemem.memory.config import AllocatorConfig, parse_alloc_conf
from tracemem.memory.snapshot import to_snapshot, write_snapshot
from tracemem.memory.timeline import AllocatorReplay, MemoryTimeline

__all__ = ["AllocatorConfig", "parse_alloc_conf", "CachingAllocatorSimulator", "AllocatorStats",
           "simulate", "round_size", "get_allocation_size", "to_snapshot", "write_snapshot",
           "AllocatorReplay", "MemoryTimeline"]
