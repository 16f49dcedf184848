"""The steady state of a pipeline schedule, replayed once and accounted for without walking it.

A rank's schedule (``tracemem.schedules``) repeats one pattern of steps once its warm-up is
over: under 1F1B, ``F k+w, B k`` for k = 1, 2, ...; under the interleaved schedule a longer
pattern over the model chunks. Every microbatch after the first replays the same traced
segments (``tracemem.estimator.Segments``: microbatch 1 stands for every later one), so the
replay's state after one repetition is the state before it with each in-flight microbatch
renumbered, or it is not; when it is, every later repetition is the same again, and the
replay jumps to the end of the repetitions with its state renumbered.

Nothing here assumes a schedule's shape. ``periodic_stretches`` finds, in any step list, the
stretches whose steps repeat with a period and a microbatch shift (every microbatch in them
past the first). ``tracemem.estimator.replay_events(periodic=True, sink=...)`` drives a
replay over them and, at period boundaries (up to ``MAX_PROBES``), looks for the replay's
state (the storages alive, with a consumer's own state such as the caching allocator
simulator's blocks, each replayed key renumbered relative to the boundary) among the earlier
boundaries': a quick summary first at every boundary (counts and bytes, so a growing state is
never hashed), then, at the boundaries ``probed`` picks (each of the first ``DENSE_PROBES``,
then fewer and fewer), a hash of the whole state; a hash seen ``c`` periods before is proven,
or dropped, by comparing the whole state with the one ``c`` periods later. Once proven, the
remaining whole cycles are skipped. The proof is the comparison itself (the state and the
steps ahead are equal up to the renumbering, and the replay is deterministic), so a replay
whose state never repeats (GPipe's growing forwards, an allocator whose blocks keep moving, a
storage left behind by each microbatch) is walked in full, and the result is the same either
way; the tests compare the two on every schedule.

Measured (docs/benchmarks.md): the storages held repeat after one period of every 1F1B-family
steady state, so the byte replay stops growing with M; the allocator's blocks repeat on some
stages only (a stage holding one microbatch at a time at once, others after tens to hundreds
of periods, some not within 512), so the allocator replay is shortened where they do.

Maxima (peaks) over the skipped cycles are the maxima already seen in the cycle; counters
(events, ``cudaMalloc`` calls) grow by the cycle's increment per cycle: the consumer adds them
(``ReplaySink.skip``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import NamedTuple, Protocol

__all__ = ["Stretch", "periodic_stretches", "ReplaySink", "MAX_PERIOD", "MIN_PERIODS",
           "MAX_PROBES", "DENSE_PROBES", "probed"]

MAX_PERIOD = 256    # longest pattern looked for, in steps (interleaved 1F1B: 2 x vpp x pp)
MIN_PERIODS = 4     # a stretch shorter than this is walked (nothing worth skipping)
MAX_PROBES = 2048   # period boundaries of a stretch at which a repeated state is looked for
DENSE_PROBES = 16   # boundaries probed one after another before the probes thin out (probed)


def probed(k: int) -> bool:
    """Whether period boundary ``k`` of a stretch hashes its whole state (when its quick
    summary has been seen): each of the first ``DENSE_PROBES`` (16), then every second up to
    32, every fourth up to 64, and so on: 8 per doubling of k, at multiples of a power of two
    (56 of the boundaries below 512). A state that repeats from boundary k0 on with a cycle of
    c <= 8 is still found, within about 3c x k0 / 8 boundaries more (two probes a multiple of
    c apart, then the proof a cycle later), so the replay may walk more cycles than probing
    every boundary would, while a state that never repeats (an allocator whose blocks keep
    moving) is hashed O(log k) times instead of k times. Which boundaries are probed decides
    only when a cycle is found: the results are the same either way."""
    # the stride doubles with k from 2 at DENSE_PROBES: DENSE_PROBES / 2 probes per doubling
    return k < DENSE_PROBES or k % (1 << (k.bit_length() - DENSE_PROBES.bit_length() + 1)) == 0


class Stretch(NamedTuple):
    """Steps ``start + k * period + j`` (k < ``count``, j < ``period``) equal steps
    ``start + j`` with ``shift * k`` added to their microbatch."""

    start: int
    period: int
    count: int
    shift: int


def _same(a, b, shift: int, split: set) -> bool:
    return (a.stage == b.stage and a.kind == b.kind and b.microbatch == a.microbatch + shift
            and a.microbatch >= 1 and a.kind != "O"
            and ((a.stage, a.microbatch) in split) == ((b.stage, b.microbatch) in split))


def periodic_stretches(steps: list, split: set | None = None,
                       max_period: int = MAX_PERIOD) -> list[Stretch]:
    """The repeated stretches of ``steps`` (``tracemem.schedules.Step`` list), in order and
    disjoint: each the longest run of whole periods found from its start, of at least
    ``MIN_PERIODS`` periods, with every microbatch >= 1 (their segments are microbatch 1's)
    and, for ``split`` (the ``(stage, microbatch)`` pairs whose backward is split), the same
    split status as the steps a period before. Greedy from the first step: a stretch starts
    at the first step where one is found, with the period covering the most steps."""
    split = split or set()
    n, out, i = len(steps), [], 0
    while i < n:
        best = None
        first = steps[i]
        if first.microbatch >= 1 and first.kind != "O":
            for period in range(1, min(max_period, (n - i) // MIN_PERIODS) + 1):
                if best is not None and period % best.period == 0:
                    continue  # a multiple of a period found covers no more steps
                shift = steps[i + period].microbatch - first.microbatch
                if shift <= 0:
                    continue
                length = period  # steps from i matching the step a period before
                while i + length < n and _same(steps[i + length - period],
                                               steps[i + length], shift, split):
                    length += 1
                if any(s.microbatch < 1 or s.kind == "O" for s in steps[i:i + period]):
                    continue
                count = length // period
                if count >= MIN_PERIODS and (best is None or count * period > best.count *
                                             best.period):
                    best = Stretch(i, period, count, shift)
        if best is None:
            i += 1
            continue
        out.append(best)
        i = best.start + best.count * best.period
    return out


class ReplaySink(Protocol):
    """A consumer of a replay with state of its own (the allocator simulator,
    ``tracemem.memory.timeline.AllocatorReplay``): what the replay needs from it at a period
    boundary."""

    def cheap_state(self) -> Hashable:
        """A quick summary of the state (sizes, counts): equal states give equal summaries."""

    def state(self, canon: Callable[[Hashable], Hashable]) -> Hashable:
        """The whole state, every replayed key written as ``canon(key)``."""

    def counters(self) -> tuple[int, ...]:
        """The cumulative counters (events, calls) that grow through a skipped cycle."""

    def skip(self, rename: Callable[[Hashable], Hashable], cycles: int,
             per_cycle: tuple[int, ...]) -> None:
        """Renumber every replayed key with ``rename`` and add ``cycles`` x ``per_cycle`` to
        the counters."""
