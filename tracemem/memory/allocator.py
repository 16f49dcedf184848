"""A simulator of PyTorch's CUDA caching allocator (``CUDACachingAllocator``, torch 2.13).

Feed it an ordered stream of ``("alloc" | "free", id, nbytes)`` events; it keeps blocks,
segments and the small / large free pools as ``DeviceCachingAllocator`` does and reports what
``torch.cuda.max_memory_allocated`` (blocks handed out, whole blocks including an unsplit
remainder) and ``torch.cuda.max_memory_reserved`` (segments) would say, the fragmentation at
the reserved peak (reserved - allocated, and the largest free block then) and the per-event
series.

Each rule cites the function it mirrors in c10/cuda/CUDACachingAllocator.cpp
(``DeviceCachingAllocator``) and c10/core/AllocatorConfig.h / .cpp at torch 2.13 (constants
``kMinBlockSize``, ``kSmallSize``, ``kSmallBuffer``, ``kMinLargeAlloc``, ``kRoundLarge`` and
``large_segment_size`` are read from the installed 2.13 headers); docs/allocator.md lists
every rule with its source and what is left out.

Example:
    >>> sim = CachingAllocatorSimulator(parse_alloc_conf("expandable_segments:True"))
    >>> stats = sim.replay([("alloc", "a", 3 * 2**20), ("free", "a", 0)])
    >>> stats.reserved_peak   # one 20 MiB page of the large pool's expandable segment
    20971520

Known limitations (left out): one stream (no cross-stream reuse, ``record_stream`` or CUDA
events, so ``free`` completes at once), no CUDA-graph / MemPool private pools, no
``cudaMallocAsync`` backend, no free-memory callbacks, no IPC; a failed ``cudaMalloc`` is
decided against ``capacity`` (bytes of device memory the allocator may get), not by a driver.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, insort
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from tracemem.errors import TracememError
from tracemem.memory.config import MiB, AllocatorConfig, parse_alloc_conf

__all__ = ["CachingAllocatorSimulator", "AllocatorStats", "round_size", "get_allocation_size",
           "simulate", "K_MIN_BLOCK_SIZE", "K_SMALL_SIZE", "K_SMALL_BUFFER",
           "K_MIN_LARGE_ALLOC", "K_ROUND_LARGE"]

# c10/core/AllocatorConfig.h (torch 2.13)
K_MIN_BLOCK_SIZE = 512          # all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 * MiB          # largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 * MiB        # "small" allocations are packed in 2 MiB blocks
K_MIN_LARGE_ALLOC = 10 * MiB    # allocations between 1 and 10 MiB may use kLargeBuffer
K_ROUND_LARGE = 2 * MiB         # round up large allocations to 2 MiB
_BASE_ADDRESS = 0x7F0000000000  # where simulated device addresses start (any value works)


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    # DeviceCachingAllocator::roundup_power2_next_division
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    division = power2_floor >> (divisions.bit_length() - 1)
    if division == 0:
        return power2_floor << 1
    floor = size & ~(division - 1)
    return size if floor == size else floor + division


def round_size(size: int, config: AllocatorConfig | None = None) -> int:
    """Bytes of the block a request of ``size`` bytes gets: at least 512, a multiple of 512,
    or, with ``roundup_power2_divisions``, the next of N equal steps between two powers of
    two. Source: ``DeviceCachingAllocator::round_size`` and
    ``AcceleratorAllocatorConfig::roundup_power2_divisions(size)`` (interval index
    floor(log2 size) - 20, clamped to 0..15)."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = 0
    if config is not None:
        index = min(max(size.bit_length() - 1 - 20, 0), 15)
        divisions = config.roundup_power2_divisions[index]
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return _roundup_power2_next_division(size, divisions)
    return K_MIN_BLOCK_SIZE * ((size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def get_allocation_size(size: int, large_segment_size: int = 20 * MiB) -> int:
    """Bytes of the segment ``cudaMalloc``-ed for a rounded request ``size`` that no cached
    block fits: 2 MiB for <= 1 MiB, the large segment size (20 MiB) below 10 MiB, else
    ``size`` rounded up to 2 MiB. Source: ``DeviceCachingAllocator::get_allocation_size``."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return large_segment_size
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


class _Segment:
    """One ``cudaMalloc`` (``expandable`` False) or one expandable segment (a reserved
    address range mapped ``page`` bytes at a time)."""

    __slots__ = ("base", "size", "small", "expandable", "page", "mapped_pages", "head")

    def __init__(self, base, size, small, expandable, page=0):
        self.base, self.size, self.small = base, size, small
        self.expandable, self.page = expandable, page
        self.mapped_pages = 0
        self.head = None  # the block at `base`


class _Block:
    """``Block``: a piece of a segment, allocated, free (cached) or, in an expandable
    segment, unmapped."""

    __slots__ = ("addr", "size", "requested", "allocated", "prev", "next", "seg", "mapped",
                 "pool", "gc_base", "key", "info")

    def __init__(self, addr, size, seg, pool, mapped=True):
        self.addr, self.size, self.seg, self.pool, self.mapped = addr, size, seg, pool, mapped
        self.requested = 0
        self.allocated = False
        self.prev = self.next = None
        self.gc_base = 0
        self.key = None
        self.info = None

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


_ADDR_BITS = 64  # a pool key is size << 64 | address: one int orders as (size, address)
_ADDR_MASK = (1 << _ADDR_BITS) - 1
_NO_MAX_SPLIT = 2**64  # max_split_size unset: no block is oversize


class _Pool:
    """``BlockPool``: free mapped blocks ordered by (size, address) for the best-fit
    ``lower_bound`` (``BlockComparatorSize``; one stream), and unmapped expandable ranges by
    address (``BlockComparatorAddress``). ``keys`` holds each free block as the one int
    ``size << 64 | address`` (the same order as the pair, compared faster)."""

    __slots__ = ("small", "keys", "blocks", "unmapped_addrs", "unmapped", "gc_calls")

    def __init__(self, small: bool):
        self.small = small
        self.keys: list[int] = []
        self.blocks: dict[int, _Block] = {}
        self.unmapped_addrs: list[int] = []
        self.unmapped: dict[int, _Block] = {}
        self.gc_calls = 0  # get_free_blocks_call_count

    def insert(self, b: _Block) -> None:  # insert_into_blocks
        b.gc_base = self.gc_calls
        insort(self.keys, b.size << _ADDR_BITS | b.addr)
        self.blocks[b.addr] = b

    def remove(self, b: _Block) -> None:
        keys, key = self.keys, b.size << _ADDR_BITS | b.addr
        i = bisect_left(keys, key)
        assert keys[i] == key
        del keys[i]
        del self.blocks[b.addr]

    def block_at(self, i: int) -> _Block:
        """The free block of ``keys[i]``."""
        return self.blocks[self.keys[i] & _ADDR_MASK]

    def insert_unmapped(self, b: _Block) -> None:
        insort(self.unmapped_addrs, b.addr)
        self.unmapped[b.addr] = b

    def remove_unmapped(self, b: _Block) -> None:
        i = bisect_left(self.unmapped_addrs, b.addr)
        assert self.unmapped_addrs[i] == b.addr
        del self.unmapped_addrs[i]
        del self.unmapped[b.addr]

    def largest(self) -> int:
        return self.keys[-1] >> _ADDR_BITS if self.keys else 0


@dataclass(frozen=True)
class AllocatorStats:
    """The result of a replay. Bytes are int; event indices count every replayed event.

    Attributes:
        allocated_peak: ``max_memory_allocated``: the most bytes in blocks handed out (whole
            blocks: a request of 1.5 MiB that took an unsplit 2 MiB block counts 2 MiB).
        reserved_peak: ``max_memory_reserved``: the most bytes in segments (mapped pages
            under expandable segments).
        reserved_peak_event: index of the first event after which ``reserved_peak`` held.
        allocated_at_reserved_peak, fragmentation_bytes (reserved_peak minus it),
        largest_free_block, segments_at_reserved_peak: the state then.
        requested_peak: the most bytes requested (before any rounding).
        num_device_alloc / num_device_free: ``cudaMalloc`` (or page-map) and ``cudaFree``
            (or unmap) calls; num_alloc_retries: mallocs that freed cached blocks and
            retried; num_ooms: 1 if a malloc failed even then, else 0 (a real run stops
            there; the replay goes on as if the device had no limit from then on);
            oom_event: index of that event, or None.
        allocated, reserved: per-event series (bytes after each event).
    """

    allocated_peak: int
    reserved_peak: int
    reserved_peak_event: int | None
    allocated_at_reserved_peak: int
    fragmentation_bytes: int
    largest_free_block: int
    segments_at_reserved_peak: int
    requested_peak: int
    num_device_alloc: int
    num_device_free: int
    num_alloc_retries: int
    num_ooms: int
    oom_event: int | None
    allocated: array
    reserved: array


class CachingAllocatorSimulator:
    """``DeviceCachingAllocator`` for one device and one stream, in Python.

    Args:
        config: an ``AllocatorConfig`` (``parse_alloc_conf``) or a setting string; None for
            PyTorch's defaults.
        capacity: bytes of device memory the allocator can get (device memory less the CUDA
            context, NCCL and other non-PyTorch memory); None = unlimited, so no ``cudaMalloc``
            fails and nothing is ever freed to the driver.
        device_total: total device memory in bytes, for ``per_process_memory_fraction`` and
            the address space of an expandable segment (1 1/8 of it); default ``capacity``.
        record_history: keep the ``TraceEntry`` list (``alloc``, ``free_requested``,
            ``free_completed``, ``segment_alloc``, ``segment_free``, ``segment_map``,
            ``segment_unmap``) for ``tracemem.memory.snapshot``.
        record_series: keep the allocated / reserved bytes after every event
            (``AllocatorStats.allocated`` / ``reserved``; off: both empty).

    Raises:
        TracememError: a bad config string, or a negative / non-int capacity.
    """

    def __init__(self, config: AllocatorConfig | str | None = None, *,
                 capacity: int | None = None, device_total: int | None = None,
                 record_history: bool = False, record_series: bool = True):
        if not isinstance(config, AllocatorConfig):
            config = parse_alloc_conf(config)
        for name, value in (("capacity", capacity), ("device_total", device_total)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value <= 0):
                raise TracememError(f"{name}={value!r} must be a positive int (bytes) or None")
        self.config = config
        self.capacity = capacity
        self.device_total = device_total if device_total is not None else capacity
        # setMemoryFraction: allowed_memory_maximum = fraction * device total; set_fraction
        self.allowed_max = None
        if config.per_process_memory_fraction is not None and self.device_total is not None:
            self.allowed_max = int(config.per_process_memory_fraction * self.device_total)
        self._gc = self.allowed_max is not None and config.garbage_collection_threshold > 0
        self.max_split = config.max_split_size if config.max_split_size is not None \
            else _NO_MAX_SPLIT
        self._plain_rounding = max(config.roundup_power2_divisions) <= 1
        self._expandable = bool(config.expandable_segments)
        self.small = _Pool(True)
        self.large = _Pool(False)
        self.live: dict[Hashable, _Block] = {}
        self.segments: dict[int, _Segment] = {}
        self._n_segments = 0  # cudaMalloc segments + mapped ranges of expandable ones
        self._next_addr = _BASE_ADDRESS
        self.allocated_bytes = 0              # stats.allocated_bytes
        self.reserved_bytes = 0               # total_allocated_memory / reserved_bytes
        self.requested_bytes = 0
        self.num_device_alloc = self.num_device_free = 0
        self.num_alloc_retries = self.num_ooms = 0
        self.oom_event: int | None = None
        self.history: list[dict] | None = [] if record_history else None
        self._info = None
        # malloc's inline path for a request a cached block serves (_malloc_cached): plain
        # rounding, no expandable segments, no max_split_size, no garbage collection, no
        # history; anything else, and every request no cached block serves, takes _malloc
        self._cached_path = (self._plain_rounding and not self._expandable and not self._gc
                             and self.max_split == _NO_MAX_SPLIT and self.history is None)
        # series and peaks
        self.events = 0
        self.allocated_series = array("q")
        self.reserved_series = array("q")
        self._record_series = record_series
        self.allocated_peak = self.reserved_peak = self.requested_peak = 0
        self._at_peak = (None, 0, 0, 0)  # event, allocated, largest free, segments

    # ----------------------------------------------------------------- public driving API
    def malloc(self, key: Hashable, nbytes: int, info: dict | None = None) -> None:
        """Allocate ``nbytes`` for ``key`` (as ``NativeCachingAllocator::malloc``); a size of
        0 allocates nothing (``allocate``: ``if (size != 0)``). ``info`` is kept with the
        block for snapshots (e.g. ``{"module": ..., "op": ..., "category": ...}``).

        Raises:
            TracememError: ``key`` is already allocated or ``nbytes`` is not an int >= 0.
        """
        if type(nbytes) is not int and (isinstance(nbytes, bool)
                                        or not isinstance(nbytes, int)) or nbytes < 0:
            raise TracememError(f"allocation {key!r}: nbytes={nbytes!r} must be an int >= 0")
        live = self.live
        if key in live:
            raise TracememError(f"allocation {key!r} is already live; free it first")
        if nbytes and self._cached_path and self._malloc_cached(key, nbytes, info):
            return
        if nbytes:
            self._info = info
            block = self._malloc(nbytes)
            block.key, block.info = key, info
            live[key] = block
            self.requested_bytes += nbytes
        else:
            live[key] = None
        self._sample()

    def free(self, key: Hashable) -> None:
        """Free ``key``'s block (``DeviceCachingAllocator::free``; one stream, so the free
        completes at once).

        Raises:
            TracememError: ``key`` is not allocated.
        """
        try:
            block = self.live.pop(key)
        except KeyError:
            raise TracememError(f"free of {key!r}, which is not allocated") from None
        if block is not None:
            self.requested_bytes -= block.requested
            self._free(block)
        # _sample, of which only the series and the count can change: a free raises no
        # peak (allocated and requested bytes fall, reserved bytes stay: a free caches)
        if self._record_series:
            self.allocated_series.append(self.allocated_bytes)
            self.reserved_series.append(self.reserved_bytes)
        self.events += 1

    def step(self, action: str, key: Hashable, nbytes: int = 0,
             info: dict | None = None) -> None:
        """One event: ``action`` is ``"alloc"`` or ``"free"`` (``nbytes`` ignored for free)."""
        if action == "alloc":
            self.malloc(key, nbytes, info)
        elif action == "free":
            self.free(key)
        else:
            raise TracememError(f"event action {action!r} must be 'alloc' or 'free'")

    def replay(self, events: Iterable) -> AllocatorStats:
        """Run ``(action, key, nbytes)`` events in order and return the stats."""
        for action, key, nbytes in events:
            self.step(action, key, nbytes)
        return self.stats()

    def stats(self) -> AllocatorStats:
        event, alloc_then, largest, segs = self._at_peak
        return AllocatorStats(
            allocated_peak=self.allocated_peak, reserved_peak=self.reserved_peak,
            reserved_peak_event=event, allocated_at_reserved_peak=alloc_then,
            fragmentation_bytes=self.reserved_peak - alloc_then, largest_free_block=largest,
            segments_at_reserved_peak=segs, requested_peak=self.requested_peak,
            num_device_alloc=self.num_device_alloc, num_device_free=self.num_device_free,
            num_alloc_retries=self.num_alloc_retries, num_ooms=self.num_ooms,
            oom_event=self.oom_event, allocated=self.allocated_series,
            reserved=self.reserved_series)

    def num_segments(self) -> int:
        """Segments as ``torch.cuda.memory_snapshot`` reports them: each ``cudaMalloc``, and
        each contiguous mapped range of an expandable segment (``snapshot``)."""
        return self._n_segments

    def _count_segments(self) -> int:
        count = 0
        for seg in self.segments.values():
            if not seg.expandable:
                count += 1
                continue
            b, prev_mapped = seg.head, False
            while b is not None:
                if b.mapped and not prev_mapped:
                    count += 1
                prev_mapped = b.mapped
                b = b.next
        return count

    def largest_free_block(self) -> int:
        """The largest cached (free, mapped) block: ``cacheInfo``."""
        return max(self.small.largest(), self.large.largest())

    def check_invariants(self) -> None:
        """Assert the allocator's internal consistency (for tests): blocks tile each segment
        with linked neighbours, free mapped blocks are in their pool and never adjacent (they
        were coalesced), and the allocated / reserved counters equal the blocks' sizes."""
        allocated = reserved = 0
        for seg in self.segments.values():
            b, addr, prev = seg.head, seg.base, None
            while b is not None:
                assert b.addr == addr and b.prev is prev and b.seg is seg, (seg.base, b.addr)
                if b.allocated:
                    allocated += b.size
                elif b.mapped:
                    assert b.pool.blocks.get(b.addr) is b
                    assert prev is None or prev.allocated or not prev.mapped, "uncoalesced"
                else:
                    assert seg.expandable and b.pool.unmapped.get(b.addr) is b
                    assert prev is None or prev.allocated or prev.mapped, "uncoalesced"
                if b.mapped:
                    reserved += b.size
                addr, prev, b = addr + b.size, b, b.next
            assert addr == seg.base + seg.size
        assert allocated == self.allocated_bytes, (allocated, self.allocated_bytes)
        assert self._count_segments() == self._n_segments
        assert reserved == self.reserved_bytes, (reserved, self.reserved_bytes)
        assert sum(len(p.keys) for p in (self.small, self.large)) == \
            sum(len(p.blocks) for p in (self.small, self.large))

    # ----------------------------------------------------------------- internals
    def _sample(self) -> None:
        allocated, reserved = self.allocated_bytes, self.reserved_bytes
        if self._record_series:
            self.allocated_series.append(allocated)
            self.reserved_series.append(reserved)
        if allocated > self.allocated_peak:
            self.allocated_peak = allocated
        if self.requested_bytes > self.requested_peak:
            self.requested_peak = self.requested_bytes
        if reserved > self.reserved_peak or self._at_peak[0] is None:
            self.reserved_peak = reserved
            self._at_peak = (self.events, self.allocated_bytes, self.largest_free_block(),
                             self._n_segments)
        self.events += 1

    def _trace(self, action: str, addr: int, size: int, block: _Block | None = None) -> None:
        if self.history is not None:
            info = block.info if block is not None and block.info is not None else self._info
            self.history.append({"action": action, "addr": addr, "size": size,
                                 "event": self.events, "info": info})

    def _new_address(self, size: int) -> int:
        addr = self._next_addr
        self._next_addr += -(-size // K_ROUND_LARGE) * K_ROUND_LARGE
        return addr

    def _malloc(self, orig_size: int) -> _Block:
        # DeviceCachingAllocator::malloc
        if self._plain_rounding:  # round_size without roundup_power2_divisions
            size = 512 if orig_size < 512 else (orig_size + 511) & ~511
        else:
            size = round_size(orig_size, self.config)
        pool = self.small if size <= K_SMALL_SIZE else self.large  # get_pool
        block = self._get_free_block(pool, size)
        if block is None:
            alloc_size = get_allocation_size(size, self.config.large_segment_size)
            if self._gc:
                self._garbage_collect_cached_blocks()
            block = self._alloc_block(pool, size, alloc_size)
            if block is None and self._release_available_cached_blocks(pool, size):
                block = self._alloc_block(pool, size, alloc_size)
            if block is None:
                self._release_cached_blocks()
                self.num_alloc_retries += 1
                block = self._alloc_block(pool, size, alloc_size)
            if block is None:
                # a real run raises OutOfMemoryError here; record it and go on as if the
                # device had no limit from here on, so the peaks of the whole step are known
                self.num_ooms += 1
                self.oom_event = self.events
                self.capacity = self.allowed_max = None
                self._gc = False
                block = self._alloc_block(pool, size, alloc_size)
        # DeviceCachingAllocator::should_split (inline: the hot path)
        remaining = block.size - size
        if block.pool.small or self._expandable:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            split = size < self.max_split and remaining > K_SMALL_SIZE
        return self._alloc_found_block(block, pool, size, orig_size, split)

    def _malloc_cached(self, key: Hashable, orig_size: int, info: dict | None) -> bool:
        """``malloc`` of ``orig_size`` bytes for ``key`` when a cached block serves it, in one
        frame (the hot path of a replay; ``self._cached_path`` settings only): the same steps
        as ``_malloc`` -> ``_get_free_block`` (best fit, its common case) ->
        ``should_split`` -> ``_alloc_found_block``, then ``_sample``. False, with nothing
        changed, when no cached block is large enough (``_malloc`` then calls
        ``cudaMalloc``). ``tests/tracemem/memory/test_allocator.py`` holds the two paths
        equal on random streams."""
        size = 512 if orig_size < 512 else (orig_size + 511) & ~511  # round_size
        small = size <= K_SMALL_SIZE
        pool = self.small if small else self.large  # get_pool
        keys = pool.keys
        i = bisect_left(keys, size << _ADDR_BITS)  # lower_bound(search_key): best fit
        if i == len(keys):
            return False
        block = pool.blocks.pop(keys[i] & _ADDR_MASK)
        del keys[i]  # pool.remove(block), its index known
        remaining = block.size - size
        # should_split: the small pool keeps a remainder of kMinBlockSize, the large one of
        # more than kSmallSize (no max_split_size)
        if (remaining >= K_MIN_BLOCK_SIZE) if small else (remaining > K_SMALL_SIZE):
            rest = block
            block = _Block(rest.addr, size, rest.seg, pool)
            block.prev = rest.prev
            if block.prev is not None:
                block.prev.next = block
            else:
                block.seg.head = block
            block.next = rest
            rest.prev = block
            rest.addr += size
            rest.size -= size
            pool.insert(rest)
        block.allocated = True
        block.requested = orig_size
        block.key, block.info = key, info
        self.live[key] = block
        self.allocated_bytes += block.size
        self.requested_bytes += orig_size
        # _sample: no cudaMalloc, so the reserved bytes and their peak are unchanged
        if self._record_series:
            self.allocated_series.append(self.allocated_bytes)
            self.reserved_series.append(self.reserved_bytes)
        if self.allocated_bytes > self.allocated_peak:
            self.allocated_peak = self.allocated_bytes
        if self.requested_bytes > self.requested_peak:
            self.requested_peak = self.requested_bytes
        if self._at_peak[0] is None:
            self.reserved_peak = self.reserved_bytes
            self._at_peak = (self.events, self.allocated_bytes, self.largest_free_block(),
                             self._n_segments)
        self.events += 1
        return True

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        # DeviceCachingAllocator::get_free_block
        if self._gc:
            pool.gc_calls += 1
        keys = pool.keys
        i = bisect_left(keys, size << _ADDR_BITS)  # lower_bound(search_key): best fit
        if i == len(keys):
            return None
        block = pool.blocks[keys[i] & _ADDR_MASK]
        if not block.seg.expandable and self.max_split == _NO_MAX_SPLIT:  # the common case
            del keys[i]  # pool.remove(block), its index known
            del pool.blocks[block.addr]
            return block
        if block.seg.expandable:
            if self.config.expandable_segments:
                # best fit by the size a block can grow to (its unmapped successor counts)
                def grow(b):
                    return b.size + (b.next.size if b.next is not None and not b.next.mapped
                                     else 0)
                j = i + 1
                while (block.seg.expandable and j < len(keys)
                       and grow(pool.block_at(j)) < grow(block)):
                    block = pool.block_at(j)
                    j += 1
            else:
                j = i + 1
                while j < len(keys) and pool.block_at(j).seg.expandable:
                    j += 1
                if j == len(keys):
                    return None
                block = pool.block_at(j)
        # do not return an oversized block for a request below max_split_size
        if size < self.max_split and block.size >= self.max_split:
            return None
        # an oversized block serves a large request only within max_non_split_rounding_size
        if size >= self.max_split and \
                block.size >= size + self.config.max_non_split_rounding_size:
            return None
        pool.remove(block)
        return block

    def _alloc_found_block(self, block: _Block, pool: _Pool, size: int, orig_size: int,
                           split: bool) -> _Block:
        # DeviceCachingAllocator::alloc_found_block: the front `size` bytes are handed out,
        # the remainder stays cached in the pool
        if split:
            remaining = block
            block = _Block(remaining.addr, size, remaining.seg, pool)
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = remaining
            remaining.prev = block
            remaining.addr += size
            remaining.size -= size
            if block.prev is None:
                block.seg.head = block
            pool.insert(remaining)
        block.allocated = True
        block.requested = orig_size
        self.allocated_bytes += block.size
        if self.history is not None:
            self._trace("alloc", block.addr, orig_size, block)
        return block

    def _free(self, block: _Block) -> None:
        # DeviceCachingAllocator::free -> free_block
        block.allocated = False
        self.allocated_bytes -= block.size
        if self.history is not None:
            self._trace("free_requested", block.addr, block.requested, block)
            self._trace("free_completed", block.addr, block.requested, block)
        block.info = block.key = None
        pool = block.pool
        for candidate in (block.prev, block.next):
            if candidate is not None and not candidate.allocated:  # else nothing to merge
                self._try_merge(block, candidate)
        pool.insert(block)

    def _try_merge(self, dst: _Block, src: _Block | None) -> int:
        # DeviceCachingAllocator::try_merge_blocks: absorb a free neighbour in the same
        # mapped state (a free block is in pool.blocks, an unmapped one in pool.unmapped)
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        pool = src.pool
        if src.mapped:
            pool.remove(src)
        else:
            pool.remove_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
            else:
                dst.seg.head = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    def _fits(self, nbytes: int) -> bool:
        return self.capacity is None or \
            self.reserved_bytes + nbytes <= self.capacity

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int) -> _Block | None:
        # DeviceCachingAllocator::alloc_block
        if self.allowed_max is not None and \
                self.reserved_bytes + alloc_size > self.allowed_max:
            return None
        if self.config.expandable_segments:
            return self._try_allocate_expandable_block(pool, size)
        if not self._fits(alloc_size):  # cudaMalloc fails
            return None
        seg = _Segment(self._new_address(alloc_size), alloc_size, pool.small, False)
        self.segments[seg.base] = seg
        block = seg.head = _Block(seg.base, alloc_size, seg, pool)
        self.reserved_bytes += alloc_size
        self._n_segments += 1
        self.num_device_alloc += 1
        self._trace("segment_alloc", seg.base, alloc_size)
        return block

    def _release_block(self, block: _Block) -> None:
        # DeviceCachingAllocator::release_block: cudaFree a whole, free, non-expandable segment
        assert not block.is_split() and not block.seg.expandable
        block.pool.remove(block)
        del self.segments[block.seg.base]
        self.reserved_bytes -= block.size
        self._n_segments -= 1
        self.num_device_free += 1
        self._trace("segment_free", block.addr, block.size)

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        # DeviceCachingAllocator::release_available_cached_blocks: free oversize cached
        # blocks (>= max_split_size), the smallest that is big enough, else largest first
        if self.config.max_split_size is None:
            return False
        key = max(size, self.max_split)
        i = bisect_left(pool.keys, key << _ADDR_BITS)
        if i == len(pool.keys) or pool.block_at(i).seg.expandable:
            if i == 0:
                return False
            released, i = 0, i - 1
            while released < key and i >= 0:
                block = pool.block_at(i)
                if block.size < self.max_split:
                    break
                if not block.seg.expandable:
                    released += block.size
                    self._release_block(block)
                i -= 1
            return released >= key
        self._release_block(pool.block_at(i))
        return True

    def _release_cached_blocks(self) -> None:
        # DeviceCachingAllocator::release_cached_blocks -> release_blocks(large, small):
        # cudaFree every free unsplit segment; unmap the free pages of expandable segments
        for pool in (self.large, self.small):
            to_unmap = []
            for key in list(pool.keys):
                block = pool.blocks[key & _ADDR_MASK]
                if block.seg.expandable:
                    to_unmap.append(block)
                elif not block.is_split():
                    self._release_block(block)
            for block in to_unmap:
                self._unmap_block(block)
                if not block.is_split():
                    self._release_expandable_segment(block)

    def _garbage_collect_cached_blocks(self) -> None:
        # DeviceCachingAllocator::garbage_collect_cached_blocks: above threshold *
        # allowed_memory_maximum, free unsplit large cached blocks at least as old (in
        # get_free_block calls) as the average, until the excess is reclaimed
        threshold = int(self.config.garbage_collection_threshold * self.allowed_max)
        if self.reserved_bytes <= threshold:
            return
        target = self.reserved_bytes - threshold
        pool = self.large
        freeable = [b for b in map(pool.blocks.__getitem__, (k & _ADDR_MASK for k in pool.keys))
                    if not b.is_split()]
        total_age = sum(pool.gc_calls - b.gc_base for b in freeable)
        count = len(freeable)
        if count == 0:
            return
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for key in list(pool.keys):
                block = pool.blocks.get(key & _ADDR_MASK)
                if block is None or block.is_split() or block.seg.expandable:
                    continue
                age = pool.gc_calls - block.gc_base
                if age >= age_threshold:
                    freed = True
                    reclaimed += block.size
                    total_age -= age
                    count -= 1
                    self._release_block(block)

    # ------------------------------------------------------------ expandable segments
    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        # DeviceCachingAllocator::find_expandable_block: the lowest address with room for
        # `size` in free + unmapped blocks, else a new segment reserving 1 1/8 of the device
        def allocatable(b):
            return b is not None and not b.allocated

        def has_room(b):
            total = 0
            while total < size and allocatable(b):
                total += b.size
                b = b.next
            return total >= size

        for addr in pool.unmapped_addrs:
            c = pool.unmapped[addr]
            if allocatable(c.prev):
                c = c.prev
            if has_room(c):
                return c
        page = K_SMALL_BUFFER if pool.small else self.config.large_segment_size
        device = self.device_total if self.device_total is not None else 2**40
        pages = -(-(device + device // 8) // page)
        seg = _Segment(self._new_address(pages * page), pages * page, pool.small, True, page)
        self.segments[seg.base] = seg
        block = seg.head = _Block(seg.base, seg.size, seg, pool, mapped=False)
        pool.insert_unmapped(block)
        return block

    def _map_block(self, to_map: _Block, size: int) -> bool:
        # DeviceCachingAllocator::map_block / ExpandableSegment::map: map whole pages
        # covering [addr, addr + size); the rest stays an unmapped block
        seg = to_map.seg
        begin = (to_map.addr - seg.base) // seg.page
        end = -(-(to_map.addr + size - seg.base) // seg.page)
        mapped = (end - begin) * seg.page
        if not self._fits(mapped):
            return False
        pool = to_map.pool
        left = to_map.prev is not None and to_map.prev.mapped
        right = mapped == to_map.size and to_map.next is not None and to_map.next.mapped
        self._n_segments += 1 - left - right  # a new mapped range, joined to its neighbours
        pool.remove_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = _Block(to_map.addr + mapped, to_map.size - mapped, seg, pool, mapped=False)
            rest.prev, rest.next = to_map, to_map.next
            if to_map.next is not None:
                to_map.next.prev = rest
            to_map.next = rest
            pool.insert_unmapped(rest)
            to_map.size = mapped
        self._try_merge(to_map, to_map.prev)
        self._try_merge(to_map, to_map.next)
        pool.insert(to_map)
        self.reserved_bytes += mapped
        seg.mapped_pages += end - begin
        self.num_device_alloc += 1
        self._trace("segment_map", begin * seg.page + seg.base, mapped)
        return True

    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        # DeviceCachingAllocator::try_allocate_expandable_block
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            nxt = candidate.next
            if not self._map_block(nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt  # map_block merged the free block before it into nxt
        pool.remove(candidate)
        return candidate

    def _unmap_block(self, block: _Block) -> None:
        # DeviceCachingAllocator::unmap_block / ExpandableSegment::unmap: unmap the whole
        # pages inside a free block; partial pages at either end stay mapped, free blocks
        seg = block.seg
        begin = -(-(block.addr - seg.base) // seg.page)
        end = (block.addr + block.size - seg.base) // seg.page
        if begin >= end:
            return
        pool = block.pool
        pool.remove(block)
        start, stop = seg.base + begin * seg.page, seg.base + end * seg.page
        if start > block.addr:
            before = _Block(block.addr, start - block.addr, seg, pool)
            before.prev, before.next = block.prev, block
            if block.prev is not None:
                block.prev.next = before
            else:
                seg.head = before
            block.prev = before
            pool.insert(before)
        if stop < block.addr + block.size:
            after = _Block(stop, block.addr + block.size - stop, seg, pool)
            after.prev, after.next = block, block.next
            if block.next is not None:
                block.next.prev = after
            block.next = after
            pool.insert(after)
        block.addr = start
        block.size = stop - start
        block.mapped = False
        left = block.prev is not None and block.prev.mapped
        right = block.next is not None and block.next.mapped
        self._n_segments += left + right - 1  # a mapped range loses a middle / end / all
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        pool.insert_unmapped(block)
        self.reserved_bytes -= stop - start
        seg.mapped_pages -= end - begin
        self.num_device_free += 1
        self._trace("segment_unmap", start, stop - start)

    def _release_expandable_segment(self, block: _Block) -> None:
        # DeviceCachingAllocator::release_expandable_segment: the whole range is unmapped
        assert block.size == block.seg.size and not block.mapped
        block.pool.remove_unmapped(block)
        del self.segments[block.seg.base]


def simulate(events: Iterable, config: AllocatorConfig | str | None = None, *,
             capacity: int | None = None) -> AllocatorStats:
    """Replay ``(action, key, nbytes)`` events through a fresh simulator; see
    ``CachingAllocatorSimulator``."""
    return CachingAllocatorSimulator(config, capacity=capacity).replay(events)
