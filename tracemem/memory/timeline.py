"""A rank's replayed allocations and frees, driven through the caching-allocator simulator,
kept as a per-event timeline (allocated by category, reserved, schedule steps) for reports,
plots and snapshots.

``AllocatorReplay`` takes events one at a time (``alloc`` / ``free`` / ``step``) so it can
sit behind any replay loop; ``timeline()`` returns the ``MemoryTimeline``.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

from tracemem.categories import Category
from tracemem.memory.allocator import AllocatorStats, CachingAllocatorSimulator
from tracemem.memory.config import AllocatorConfig

__all__ = ["AllocatorReplay", "MemoryTimeline", "replay_through_allocator", "step_at"]


@dataclass(frozen=True)
class MemoryTimeline:
    """Memory of one rank class after every replayed event, in bytes.

    Attributes:
        label: e.g. ``"stage 0"``.
        allocated, reserved: ``torch.cuda.memory_allocated`` / ``memory_reserved`` after each
            event (the simulator's series).
        by_category: allocated bytes (whole blocks) per tracemem category after each event;
            they sum to ``allocated``.
        steps: ``(event index, label)`` where each schedule step's first event is; static
            memory comes before the first step.
        stats: the simulator's ``AllocatorStats``.
    """

    label: str
    allocated: array
    reserved: array
    by_category: dict[str, array]
    steps: list[tuple[int, str]]
    stats: AllocatorStats = field(repr=False)


class AllocatorReplay:
    """Feeds ``alloc`` / ``free`` events to a ``CachingAllocatorSimulator`` and records the
    per-category series.

    An ``alloc`` of a key that is still live (a storage that grew with ``resize_``, which the
    tracer reports as the new size allocated, then the old one freed) keeps the old block
    under a shadow key until the next ``free`` of that key, which frees the old block first:
    the new block is made before the old one is released, as the allocator sees it.

    Without ``series`` (no per-event series at all, the simulator's included) and without
    ``record_history``, it is a ``tracemem.periodic.ReplaySink``: a replay may skip the
    schedule's repeated cycles once the allocator's state repeats (``periodic``).
    """

    def __init__(self, config: AllocatorConfig | str | None = None, *,
                 capacity: int | None = None, device_total: int | None = None,
                 record_history: bool = False, series: bool = True):
        self.sim = CachingAllocatorSimulator(config, capacity=capacity,
                                             device_total=device_total,
                                             record_history=record_history,
                                             record_series=series)
        # a state that a skipped cycle repeats exactly: no series, no history, and no
        # garbage collection (whose block ages count calls)
        self.periodic = not series and not record_history and not self.sim._gc
        self._keep_series = series  # per-category series (for plots); off saves time
        self._category: dict[Hashable, str] = {}
        self._shadow: dict[Hashable, list] = {}
        self._current: dict[str, int] = {}
        self._series: dict[str, array] = {}
        self.steps: list[tuple[int, str]] = []

    def step(self, label: str) -> None:
        """Mark the start of a schedule step at the next event."""
        self.steps.append((self.sim.events, label))

    def alloc(self, key: Hashable, nbytes: int, category: str, module: str = "",
              op: str | None = None) -> None:
        sim = self.sim
        if key in sim.live:
            shadow = ("resized", key, len(self._shadow.setdefault(key, [])))
            sim.live[shadow] = sim.live.pop(key)
            if self._keep_series:
                self._category[shadow] = self._category.pop(key)
            self._shadow[key].append(shadow)
        # what a block holds, for snapshots (kept only where the history is)
        sim.malloc(key, nbytes, None if sim.history is None else
                   {"module": module, "op": op, "category": category})
        if self._keep_series:  # a block's category: only the per-category series needs it
            self._category[key] = category
            block = sim.live[key]
            self._add(category, block.size if block is not None else 0)

    def free(self, key: Hashable) -> None:
        shadows = self._shadow.get(key)
        if shadows:
            key = shadows.pop(0)
            if not shadows:
                del self._shadow[key[1]]
        if not self._keep_series:
            self.sim.free(key)
            return
        block = self.sim.live.get(key)
        size = block.size if block is not None else 0
        self.sim.free(key)
        self._add(self._category.pop(key), -size)

    def _add(self, category: str, delta: int) -> None:
        if not self._keep_series:
            return
        if category not in self._series:
            self._series[category] = array("q", bytes(8 * (self.sim.events - 1)))
            self._current[category] = 0
        self._current[category] += delta
        for name, series in self._series.items():
            series.append(self._current[name])

    # ------------------------------------------------ tracemem.periodic.ReplaySink
    def cheap_state(self) -> Hashable:
        sim = self.sim
        return (sim.allocated_bytes, sim.reserved_bytes, len(sim.live))

    def state(self, canon) -> Hashable:
        """Every segment's blocks in address order (address, size, mapped; for an allocated
        one the bytes requested and its owner as ``canon(key)``), the zero-byte allocations,
        the resized storages' shadows, and the allocator's limits. (A block's category is
        its owner's traced storage's, so the renumbered owner says it; and a sink keeps no
        series, so no categories.)"""
        sim = self.sim

        def name(key):
            if type(key) is tuple and key and key[0] == "resized":
                return ("resized", canon(key[1]), key[2])
            return canon(key)

        blocks = []
        for base in sorted(sim.segments):
            seg = sim.segments[base]
            blocks.append((seg.base, seg.size, seg.small, seg.expandable, seg.mapped_pages))
            b = seg.head
            while b is not None:
                # a free block's requested bytes are its last owner's (stale): not state
                blocks.append((b.addr, b.size, b.mapped, b.requested, name(b.key))
                              if b.allocated else (b.addr, b.size, b.mapped))
                b = b.next
        return (tuple(blocks), frozenset(name(k) for k, b in sim.live.items() if b is None),
                frozenset((canon(k), tuple(name(s) for s in v))
                          for k, v in self._shadow.items()),
                sim._next_addr, sim.capacity, sim.allowed_max, sim.num_ooms)

    def counters(self) -> tuple[int, ...]:
        sim = self.sim
        return (sim.events, sim.num_device_alloc, sim.num_device_free, sim.num_alloc_retries)

    def skip(self, rename, cycles: int, per_cycle: tuple[int, ...]) -> None:
        sim = self.sim

        def name(key):
            if type(key) is tuple and key and key[0] == "resized":
                return ("resized", rename(key[1]), key[2])
            return rename(key)

        sim.live = {name(k): b for k, b in sim.live.items()}
        for block in sim.live.values():
            if block is not None:
                block.key = name(block.key)
        self._shadow = {rename(k): [name(s) for s in v] for k, v in self._shadow.items()}
        sim.events += cycles * per_cycle[0]
        sim.num_device_alloc += cycles * per_cycle[1]
        sim.num_device_free += cycles * per_cycle[2]
        sim.num_alloc_retries += cycles * per_cycle[3]

    def timeline(self, label: str) -> MemoryTimeline:
        stats = self.sim.stats()
        return MemoryTimeline(label, stats.allocated, stats.reserved, dict(self._series),
                              list(self.steps), stats)


def step_at(timeline: MemoryTimeline, event: int | None) -> str | None:
    """The label of the schedule step running at ``event`` (None: static memory, before any
    step)."""
    if event is None:
        return None
    i = bisect_right([e for e, _ in timeline.steps], event) - 1
    return timeline.steps[i][1] if i >= 0 else None


_VALUES = {c: c.value for c in Category}  # Category.value without the enum's descriptor


def replay_through_allocator(replayed: Iterable, steps: list, static: Iterable[tuple[str, int]],
                             label: str, **kwargs) -> tuple[MemoryTimeline, AllocatorReplay]:
    """Drive ``AllocatorReplay(**kwargs)`` with a rank's static memory, one allocation per
    ``(category, bytes)`` line item (as contiguous buffers: Megatron-Core's
    ``ParamAndGradBuffer`` holds a rank's gradients, and its distributed optimizer's
    parameters and states, in a few large buffers), then with ``replayed``: the
    ``(step_index, key, action, nbytes, event)`` tuples of
    ``tracemem.estimator.replay_events``, in order (or a function of the replay's
    ``ReplaySink``, None where it cannot be one, that returns them).
    ``steps[step_index]`` labels the x axis.
    """
    r = AllocatorReplay(**kwargs)
    if callable(replayed):  # replay_events(sink=...) for a replay that may skip cycles
        replayed = replayed(r if r.periodic else None)
    for index, (category, nbytes) in enumerate(static):
        if nbytes:
            r.alloc(("static", index), nbytes, category, "", "static")
    current = None
    sim = r.sim
    if r._keep_series or sim.history is not None:
        for index, key, action, nbytes, event in replayed:
            if index != current:
                r.step(str(steps[index]))
                current = index
            if action == "alloc":
                r.alloc(key, nbytes, _VALUES.get(event.category) or event.category.value,
                        event.module, event.op)
            else:
                r.free(key)
        return r.timeline(label), r
    # no series and no history (estimate's and fit's rows): no category, module or op is
    # read; the simulator driven directly, AllocatorReplay only for a resized storage
    live, shadow, malloc, free, marks = sim.live, r._shadow, sim.malloc, sim.free, r.steps
    for index, key, action, nbytes, event in replayed:
        if index != current:
            marks.append((sim.events, str(steps[index])))  # r.step
            current = index
        if action == "alloc":
            if key in live:
                r.alloc(key, nbytes, "")
            else:
                malloc(key, nbytes, None)
        elif key in shadow:
            r.free(key)
        else:
            free(key)
    return r.timeline(label), r
