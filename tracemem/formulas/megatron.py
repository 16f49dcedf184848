"""Megatron-LM's ``theoretical_memory_usage`` (megatron/training/theoretical_memory_usage.py,
``compute_weight_and_optimizer_memory``): bytes per parameter for weights and optimizer."""

from __future__ import annotations

__all__ = ["weight_and_optimizer_bytes_per_param"]


def weight_and_optimizer_bytes_per_param(dp: int, distributed_optimizer: bool) -> float:
    """18 B per parameter (bf16 weight 2 + fp32 main grad 4 + fp32 master weight and Adam m, v
    12); with the distributed optimizer the 12 optimizer bytes are sharded over DP: 6 + 12 / DP."""
    return 6 + 12 / dp if distributed_optimizer else 18.0
