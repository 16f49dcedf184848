"""Pipeline schedules: the ordered forward / backward steps of every pipeline rank.

A step is ``(stage, microbatch, kind)`` where ``stage`` is the virtual stage (with VPP v, rank p
runs virtual stages p, p + pp, ...), written in PyTorch's compact notation ``"0F3"`` (stage 0,
forward, microbatch 3). ``SCHEDULES`` maps a name to a function ``(pp, vpp, M) -> list of
steps per rank``; ``check_schedule`` builds the ``networkx`` DAG of dependencies and checks it.

Fidelity: a schedule here is an order of steps per rank, not a timeline; memory depends only on
that order (microbatches are independent apart from gradient accumulation). Communication
overlap and warm-up of send/receive buffers beyond one microbatch are not modelled.
"""

from tracemem.schedules.core import (
    SCHEDULES,
    Step,
    check_schedule,
    format_grid,
    inflight_peak,
    schedule,
)

__all__ = ["SCHEDULES", "Step", "check_schedule", "format_grid", "inflight_peak", "schedule"]
