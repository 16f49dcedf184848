"""Memory models beyond the tracer: the CUDA caching-allocator simulator (reserved memory,
fragmentation) and its ``PYTORCH_CUDA_ALLOC_CONF`` parser."""

from tracemem.memory.allocator import (
    AllocatorStats,
    CachingAllocatorSimulator,
    get_allocation_size,
    round_size,
    simulate,
)
from tracemem.memory.config import AllocatorConfig, parse_alloc_conf

__all__ = ["AllocatorConfig", "parse_alloc_conf", "CachingAllocatorSimulator", "AllocatorStats",
           "simulate", "round_size", "get_allocation_size"]
