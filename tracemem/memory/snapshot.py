"""A simulated allocator as a ``torch.cuda.memory._snapshot()`` dictionary, for PyTorch's own
viewers (``torch.cuda._memory_viz`` ``segment_plot``, ``trace_plot``, ``memory``,
``segments``, ``segsum``, ``trace``; https://pytorch.org/memory_viz).

Format (torch 2.13, ``torch/cuda/memory.py`` ``_snapshot`` and the ``SegmentInfo`` /
``TraceEntry`` it converts, c10/cuda/CUDACachingAllocator.h):

- ``segments``: the allocator's state at the end of the replay, one per ``cudaMalloc`` and one
  per contiguous mapped range of an expandable segment, sorted by address: ``device``,
  ``address``, ``total_size``, ``allocated_size``, ``active_size``, ``requested_size``,
  ``stream``, ``segment_type`` (``"small"`` / ``"large"``), ``segment_pool_id``,
  ``is_expandable``, ``frames``, ``blocks`` (``address``, ``size``, ``requested_size``,
  ``state`` ``"active_allocated"`` or ``"inactive"``, ``frames``).
- ``device_traces``: one list (device 0) of ``alloc``, ``free_requested``,
  ``free_completed``, ``segment_alloc``, ``segment_free``, ``segment_map``,
  ``segment_unmap`` entries with ``addr``, ``size`` (the request for alloc / free, the
  segment for segment events), ``stream``, ``time_us`` (the event's index: there is no clock
  on the meta device) and ``frames``.

A frame names the module (as ``filename``) and the aten op (as ``name``) that made the
storage; ``line`` is 0. Allocation entries carry a ``category`` (tracemem's: parameter,
activation, ...). PyTorch's viewer fails when categories are present but none is named
``unknown`` (noted in the project's design notes), so segment events, whose memory belongs to
no tensor, are given the category ``unknown``.
"""

from __future__ import annotations

import pickle
from pathlib import Path

from tracemem.errors import TracememError
from tracemem.memory.allocator import CachingAllocatorSimulator

__all__ = ["to_snapshot", "write_snapshot"]


def _frames(info: dict | None) -> list[dict]:
    if not info:
        return []
    return [{"filename": info.get("module") or "<top>", "line": 0,
             "name": info.get("op") or info.get("category") or "<no op>"}]


def _block(b) -> dict:
    return {"address": b.addr, "size": b.size,
            "requested_size": b.requested if b.allocated else 0,
            "state": "active_allocated" if b.allocated else "inactive",
            "frames": _frames(b.info) if b.allocated else []}


def _segment(head, blocks: list, expandable: bool) -> dict:
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    requested = sum(b["requested_size"] for b in blocks)
    return {"device": 0, "address": head.addr, "total_size": sum(b["size"] for b in blocks),
            "allocated_size": allocated, "active_size": allocated,
            "requested_size": requested, "stream": 0,
            "segment_type": "small" if head.pool.small else "large",
            "segment_pool_id": (0, 0), "is_expandable": expandable, "frames": [],
            "blocks": blocks}


def to_snapshot(sim: CachingAllocatorSimulator) -> dict:
    """The snapshot dictionary of ``sim`` (made with ``record_history=True``).

    Raises:
        TracememError: the simulator kept no history.
    """
    if sim.history is None:
        raise TracememError("the allocator simulator was made without record_history=True; "
                            "a snapshot needs its trace")
    segments = []
    for base in sorted(sim.segments):
        seg = sim.segments[base]
        block, run_head, run = seg.head, None, []
        while block is not None:
            if block.mapped:
                if run_head is None:
                    run_head = block
                run.append(_block(block))
            elif run:
                segments.append(_segment(run_head, run, seg.expandable))
                run_head, run = None, []
            block = block.next
        if run:
            segments.append(_segment(run_head, run, seg.expandable))
    trace = []
    for entry in sim.history:
        action, info = entry["action"], entry["info"]
        record = {"action": action, "addr": entry["addr"], "size": entry["size"], "stream": 0,
                  "time_us": entry["event"]}
        if action.startswith("segment"):
            record["frames"] = []
            record["category"] = "unknown"
        else:
            record["frames"] = _frames(info)
            record["category"] = (info or {}).get("category") or "unknown"
        trace.append(record)
    conf = sim.config
    return {"segments": segments, "device_traces": [trace],
            "allocator_settings": {
                "PYTORCH_CUDA_ALLOC_CONF": conf.text,
                "max_split_size": conf.max_split_size if conf.max_split_size is not None
                else -1,
                "garbage_collection_threshold": conf.garbage_collection_threshold,
                "expandable_segments": conf.expandable_segments,
                "roundup_power2_divisions": list(conf.roundup_power2_divisions)}}


def write_snapshot(sim: CachingAllocatorSimulator, path: str | Path) -> Path:
    """Pickle ``to_snapshot(sim)`` to ``path`` (open it at https://pytorch.org/memory_viz or
    with ``python -m torch.cuda._memory_viz trace_plot FILE``).

    Raises:
        TracememError: no history, or the file cannot be written.
    """
    path = Path(path)
    data = to_snapshot(sim)
    try:
        with open(path, "wb") as f:
            pickle.dump(data, f)
    except OSError as e:
        raise TracememError(f"--snapshot: cannot write {str(path)!r}: {e.strerror}") from None
    return path
