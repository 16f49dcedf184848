"""Sharding of the model over a parallel layout: plans (which module is split how) and
``build_rank`` (the modules one rank holds, with local shapes; imported on first use)."""

from __future__ import annotations

__all__ = ["build_rank"]


def __getattr__(name: str):
    if name == "build_rank":
        from modeling.parallel.build import build_rank

        return build_rank
    raise AttributeError(f"module 'modeling.parallel' has no attribute {name!r}")
