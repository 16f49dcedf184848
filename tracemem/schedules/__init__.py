"""Pipeline schedules: the ordered forward / backward steps of every pipeline rank.

A step is ``(stage, kind, microbatch)`` where ``stage`` is the model chunk (virtual stage) and
``kind`` is PyTorch's F (forward), B (full backward), I (input-gradient backward) or W
(weight-gradient backward), written in PyTorch's compact notation ``"0F3"`` (chunk 0, forward,
microbatch 3). Which rank runs a chunk is ``Placement`` (``placement.py``: loop, V,
bidirectional), the one table of it. ``SCHEDULES`` names the schedules: 1F1B, GPipe and
Megatron's interleaved 1F1B (``core.py``), ZB-H1 and ZB-V (``zero_bubble.py``), DualPipe and
DualPipeV (``dualpipe.py``); ``schedule`` gives the steps per rank, checked by
``check_schedule`` (the ``networkx`` DAG of dependencies).

Fidelity: a schedule here is an order of steps per rank, not a timeline; memory depends only on
that order (microbatches are independent apart from gradient accumulation). Communication
overlap and warm-up of send/receive buffers beyond one microbatch are not modelled.
"""

from tracemem.schedules.core import (
    SCHEDULES,
    Step,
    check_placement,
    check_schedule,
    format_grid,
    inflight_peak,
    placement,
    schedule,
)
from tracemem.schedules.placement import Placement

__all__ = ["SCHEDULES", "Placement", "Step", "check_placement", "check_schedule", "format_grid", "inflight_peak",
           "placement", "schedule"]
