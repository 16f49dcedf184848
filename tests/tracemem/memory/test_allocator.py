"""The caching-allocator simulator against hand derivations from PyTorch's rules.

Reference: c10/cuda/CUDACachingAllocator.cpp and c10/core/AllocatorConfig.h / .cpp at torch
2.13 (``round_size``, ``get_allocation_size``, ``get_free_block``, ``should_split``,
``alloc_found_block``, ``free_block`` / ``try_merge_blocks``, ``release_cached_blocks``,
``release_available_cached_blocks``, ``garbage_collect_cached_blocks``, the expandable-segment
functions). Each expected segment count and byte figure is derived by hand in the comments;
the constants are kMinBlockSize 512 B, kSmallSize 1 MiB, kSmallBuffer 2 MiB, kMinLargeAlloc
10 MiB, kRoundLarge 2 MiB, large segment (kLargeBuffer) 20 MiB.
"""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracemem.errors import TracememError
from tracemem.memory import CachingAllocatorSimulator, parse_alloc_conf, round_size, simulate
from tracemem.memory.allocator import get_allocation_size

KiB, MiB = 2**10, 2**20


def run(events, conf=None, capacity=None):
    sim = CachingAllocatorSimulator(conf, capacity=capacity)
    for event in events:
        sim.step(*event)
        sim.check_invariants()
    return sim, sim.stats()


def test_round_size_and_segment_sizes():
    # round_size: < 512 -> 512, else up to a multiple of 512
    assert [round_size(n) for n in (1, 511, 512, 513, 1000)] == [512, 512, 512, 1024, 1024]
    # get_allocation_size: <= 1 MiB -> 2 MiB; < 10 MiB -> 20 MiB; else up to 2 MiB multiple
    assert get_allocation_size(1 * MiB) == 2 * MiB
    assert get_allocation_size(1 * MiB + 512) == 20 * MiB
    assert get_allocation_size(10 * MiB - 512) == 20 * MiB
    assert get_allocation_size(10 * MiB) == 10 * MiB
    assert get_allocation_size(10 * MiB + 512) == 12 * MiB


def test_small_requests_share_one_2mib_segment():
    # 3 x 1000 B: each rounds to 1024 B, small pool. The first finds no cached block, so a
    # 2 MiB segment is made and split (small pool: remainder 2 MiB - 1024 >= 512); the next
    # two are carved from the cached remainder. 1 segment, 2 MiB reserved, 3 * 1024 allocated.
    sim, stats = run([("alloc", i, 1000) for i in range(3)])
    assert (sim.num_segments(), stats.reserved_peak, stats.allocated_peak) == \
        (1, 2 * MiB, 3 * 1024)
    assert stats.requested_peak == 3000


def test_exact_fit_is_not_split_and_a_full_segment_gets_a_new_one():
    # 1 MiB (= kSmallSize, still small): 2 MiB segment split into 1 MiB + 1 MiB free. The
    # second 1 MiB takes the free 1 MiB exactly (remainder 0, no split). A 512 B request then
    # finds no free block: a second 2 MiB segment. 2 segments, 4 MiB reserved,
    # 2 MiB + 512 allocated.
    sim, stats = run([("alloc", "a", MiB), ("alloc", "b", MiB), ("alloc", "c", 1)])
    assert (sim.num_segments(), stats.reserved_peak, stats.allocated_peak) == \
        (2, 4 * MiB, 2 * MiB + 512)


def test_1mib_boundary_goes_to_the_large_pool_and_a_20mib_segment():
    # 1 MiB + 1 B rounds to 1 MiB + 512 > kSmallSize: large pool; get_allocation_size gives
    # 20 MiB; should_split (large): remainder 20 MiB - (1 MiB + 512) > 1 MiB, so split.
    sim, stats = run([("alloc", "a", MiB + 1)])
    assert (sim.num_segments(), stats.reserved_peak, stats.allocated_peak) == \
        (1, 20 * MiB, MiB + 512)
    assert stats.largest_free_block == 19 * MiB - 512


def test_10mib_boundary_and_an_unsplit_remainder_counts_as_allocated():
    # 10 MiB - 512: below kMinLargeAlloc -> 20 MiB segment, split (remainder 10 MiB + 512).
    _, below = run([("alloc", "a", 10 * MiB - 512)])
    assert (below.reserved_peak, below.allocated_peak) == (20 * MiB, 10 * MiB - 512)
    # exactly 10 MiB: its own segment rounded to 2 MiB = 10 MiB, nothing left over.
    _, exact = run([("alloc", "a", 10 * MiB)])
    assert (exact.reserved_peak, exact.allocated_peak) == (10 * MiB, 10 * MiB)
    # 11 MiB + 512: segment 12 MiB; remainder 12 MiB - (11 MiB + 512) = 1 MiB - 512, not
    # > 1 MiB, so the block is not split and the whole 12 MiB counts as allocated
    # (max_memory_allocated counts blocks, not requests).
    _, unsplit = run([("alloc", "a", 11 * MiB + 512)])
    assert (unsplit.reserved_peak, unsplit.allocated_peak, unsplit.requested_peak) == \
        (12 * MiB, 12 * MiB, 11 * MiB + 512)
    # 10 MiB + 512: segment 12 MiB, remainder 2 MiB - 512 > 1 MiB: split.
    _, split = run([("alloc", "a", 10 * MiB + 512)])
    assert (split.reserved_peak, split.allocated_peak) == (12 * MiB, 10 * MiB + 512)


def test_free_blocks_coalesce_and_are_reused_best_fit():
    # a = 3 MiB: 20 MiB segment -> [a 3][free 17]. b = 3 MiB: best fit is the 17 MiB block
    # -> [a 3][b 3][free 14]. Free a: [free 3][b 3][free 14] (a's neighbour b is allocated,
    # no merge). c = 2 MiB (large pool, > 1 MiB): best fit is the 3 MiB block (smallest that
    # fits); remainder 1 MiB is not > 1 MiB, so c takes all 3 MiB: allocated 3 + 3 = 6 MiB.
    sim, stats = run([("alloc", "a", 3 * MiB), ("alloc", "b", 3 * MiB), ("free", "a", 0),
                      ("alloc", "c", 2 * MiB)])
    assert (sim.num_segments(), sim.reserved_bytes, sim.allocated_bytes) == \
        (1, 20 * MiB, 6 * MiB)
    # free b and c: [c 3][b 3][free 14] merge into one free 20 MiB block, so an 18 MiB
    # request (own rounding: 18 MiB) fits in the cached segment, splitting 2 MiB off:
    # still 1 segment and 20 MiB reserved.
    for event in [("free", "b", 0), ("free", "c", 0)]:
        sim.step(*event)
    assert sim.largest_free_block() == 20 * MiB
    sim.step("alloc", "d", 18 * MiB)
    sim.check_invariants()
    assert (sim.num_segments(), sim.stats().reserved_peak, sim.allocated_bytes) == \
        (1, 20 * MiB, 18 * MiB)


def test_fragmentation_at_the_reserved_peak():
    # a = 12 MiB (own 12 MiB segment), b = 1.5 MiB (20 MiB segment, split: 18.5 MiB free),
    # free a (cached: reserved stays 32 MiB). c = 14 MiB: the 18.5 MiB free block fits
    # (best fit; 12 MiB is too small), remainder 4.5 MiB split off. The reserved peak, 32 MiB,
    # is first reached at event 1 (b), when 12 + 1.5 = 13.5 MiB were allocated: fragmentation
    # 18.5 MiB, and the largest free block then is b's segment's remainder, 18.5 MiB.
    _, stats = run([("alloc", "a", 12 * MiB), ("alloc", "b", 3 * MiB // 2),
                    ("free", "a", 0), ("alloc", "c", 14 * MiB)])
    assert (stats.reserved_peak, stats.reserved_peak_event) == (32 * MiB, 1)
    assert stats.allocated_at_reserved_peak == 27 * MiB // 2
    assert stats.fragmentation_bytes == 37 * MiB // 2
    assert stats.largest_free_block == 37 * MiB // 2
    assert stats.segments_at_reserved_peak == 2
    assert list(stats.reserved) == [12 * MiB, 32 * MiB, 32 * MiB, 32 * MiB]
    assert list(stats.allocated) == [12 * MiB, 27 * MiB // 2, 3 * MiB // 2, 31 * MiB // 2]


def test_max_split_size_keeps_oversize_blocks_whole():
    # max_split_size_mb:20. a = 30 MiB: own 30 MiB segment (>= max_split: oversize). Free.
    # b = 5 MiB: the cached 30 MiB block is oversize and b < max_split, so get_free_block
    # refuses it; a new 20 MiB segment is made. Reserved 50 MiB, 2 segments.
    # Default settings would split the 30 MiB block instead: reserved 30 MiB, 1 segment.
    events = [("alloc", "a", 30 * MiB), ("free", "a", 0), ("alloc", "b", 5 * MiB)]
    sim, stats = run(events, "max_split_size_mb:20")
    assert (sim.num_segments(), stats.reserved_peak) == (2, 50 * MiB)
    sim_default, default = run(events)
    assert (sim_default.num_segments(), default.reserved_peak) == (1, 30 * MiB)
    # c = 25 MiB >= max_split: the 30 MiB block is < 25 + 20 (max_non_split_rounding, 20 MiB
    # default), so c takes it whole, unsplit (should_split: size >= max_split): 30 MiB
    # allocated for c, plus b's 5 MiB block.
    sim.step("alloc", "c", 25 * MiB)
    assert (sim.allocated_bytes, sim.reserved_bytes) == (35 * MiB, 50 * MiB)
    # with max_non_split_rounding_mb:20 but a 60 MiB cached block, a 21 MiB request refuses it
    # (60 >= 21 + 20) and gets its own 22 MiB segment: 60 + 22 = 82 MiB reserved.
    _, rounding = run([("alloc", "a", 60 * MiB), ("free", "a", 0), ("alloc", "b", 21 * MiB)],
                      "max_split_size_mb:20,max_non_split_rounding_mb:20")
    assert rounding.reserved_peak == 82 * MiB


def test_cudamalloc_failure_frees_cached_segments_and_retries():
    # capacity 40 MiB. a = 30 MiB segment, freed (cached). b = 32 MiB: no cached block fits;
    # cudaMalloc(32 MiB) fails (30 + 32 > 40); max_split_size is unset, so
    # release_available_cached_blocks does nothing; release_cached_blocks frees the unsplit
    # 30 MiB segment; the retry succeeds. Reserved: 30, 30, then 32 MiB: peak 32 MiB.
    events = [("alloc", "a", 30 * MiB), ("free", "a", 0), ("alloc", "b", 32 * MiB)]
    sim, stats = run(events, capacity=40 * MiB)
    assert (stats.reserved_peak, stats.num_alloc_retries, stats.num_device_free) == \
        (32 * MiB, 1, 1)
    assert (stats.num_ooms, stats.oom_event) == (0, None)
    # without a capacity nothing is ever returned to the driver: 62 MiB
    assert simulate(events).reserved_peak == 62 * MiB
    # with capacity 31 MiB even the retry fails: an OOM at event 2, replayed past it
    _, oom = run(events, capacity=31 * MiB)
    assert (oom.num_ooms, oom.oom_event, oom.reserved_peak) == (1, 2, 32 * MiB)


def test_release_available_cached_blocks_frees_one_oversize_block_first():
    # max_split_size_mb:20, capacity 100 MiB. a = 40 MiB and b = 30 MiB segments, both
    # freed (oversize, cached). c = 50 MiB: no cached block (< 50 + 20 but too small);
    # cudaMalloc(50) fails (70 + 50 > 100); release_available_cached_blocks looks for the
    # smallest oversize block >= 50 MiB: none, so it frees from the largest down until 50 MiB
    # are released: 40 then 30 MiB (70 >= 50). Retry: 50 MiB. No release_cached_blocks
    # call, so no retry is counted.
    events = [("alloc", "a", 40 * MiB), ("alloc", "b", 30 * MiB), ("free", "a", 0),
              ("free", "b", 0), ("alloc", "c", 50 * MiB)]
    _, stats = run(events, "max_split_size_mb:20", capacity=100 * MiB)
    assert (stats.reserved_peak, stats.num_device_free, stats.num_alloc_retries) == \
        (70 * MiB, 2, 0)
    assert list(stats.reserved)[-1] == 50 * MiB


def test_garbage_collection_frees_old_cached_blocks_above_the_threshold():
    # per_process_memory_fraction 1.0 of a 100 MiB device: allowed maximum 100 MiB; GC at
    # 0.5 -> threshold 50 MiB. get_free_block counts calls on the large pool: a (1), b (2),
    # c (3). a = 40 MiB segment, freed after call 1 (age base 1); b = 42 MiB (reserved 40 <=
    # 50: no GC), freed after call 2 (base 2). c = 44 MiB, no fit: reserved 82 > 50, target 32;
    # ages 3-1 = 2 and 3-2 = 1, mean 1.5: only a's 40 MiB block is old enough and is freed
    # (40 >= 32). Then 42 + 44 = 86 MiB <= 100: peak 86 MiB.
    events = [("alloc", "a", 40 * MiB), ("free", "a", 0), ("alloc", "b", 42 * MiB),
              ("free", "b", 0), ("alloc", "c", 44 * MiB)]
    conf = "garbage_collection_threshold:0.5,per_process_memory_fraction:1.0"
    _, stats = run(events, conf, capacity=100 * MiB)
    assert (stats.reserved_peak, stats.num_device_free) == (86 * MiB, 1)
    # without GC the 44 MiB cudaMalloc fails at 82 + 44 > 100: release_cached_blocks frees
    # both cached segments and the retry leaves 44 MiB: peak 82 MiB
    _, plain = run(events, capacity=100 * MiB)
    assert (plain.reserved_peak, plain.num_device_free, list(plain.reserved)[-1]) == \
        (82 * MiB, 2, 44 * MiB)


def test_expandable_segments_grow_one_segment_by_pages():
    # expandable_segments:True. a = 3 MiB (large pool): a new expandable segment; map_block
    # maps whole pages (large pool: 20 MiB) covering 3 MiB: 20 MiB; should_split
    # (expandable: remainder >= 512): [a 3][free 17][unmapped ...].
    # b = 30 MiB: no free block fits; find_expandable_block starts at the free 17 MiB block
    # before the unmapped range; 13 MiB more are mapped as one 20 MiB page, merged:
    # [a 3][free 37] -> split: [a 3][b 30][free 7]. Reserved 40 MiB, one segment.
    events = [("alloc", "a", 3 * MiB), ("alloc", "b", 30 * MiB)]
    sim, stats = run(events, "expandable_segments:True")
    assert (sim.num_segments(), stats.reserved_peak, stats.allocated_peak) == \
        (1, 40 * MiB, 33 * MiB)
    assert stats.num_device_alloc == 2  # two page maps
    # default: a gets a 20 MiB segment, b its own 30 MiB one: 50 MiB in 2 segments
    sim_default, default = run(events)
    assert (sim_default.num_segments(), default.reserved_peak) == (2, 50 * MiB)
    # small pool pages are 2 MiB: 1000 B maps one 2 MiB page
    _, small = run([("alloc", "s", 1000)], "expandable_segments:True")
    assert small.reserved_peak == 2 * MiB


def test_expandable_segments_unmap_free_pages_on_oom():
    # capacity 60 MiB, expandable. a = 30 MiB maps 2 pages (40 MiB): [a 30][free 10];
    # b = 9 MiB fits the free 10 MiB: [a 30][b 9][free 1]. Free a: [free 30][b 9][free 1].
    # c = 25 MiB: best fit is the free 30 MiB block (expandable: split, remainder 5 MiB):
    # no new page. d = 30 MiB: free blocks 5 and 1 MiB; find_expandable_block: the free 1 MiB
    # before the unmapped range; 29 MiB more need 2 pages (40 MiB): 40 + 40 > 60 fails;
    # release_cached_blocks unmaps whole free pages only (the free 5 MiB at [25, 30) and
    # 1 MiB at [39, 40) hold no whole page): nothing; the retry fails too: OOM at event 4.
    events = [("alloc", "a", 30 * MiB), ("alloc", "b", 9 * MiB), ("free", "a", 0),
              ("alloc", "c", 25 * MiB), ("alloc", "d", 30 * MiB)]
    _, stats = run(events, "expandable_segments:True", capacity=60 * MiB)
    assert (stats.oom_event, stats.num_device_free) == (4, 0)
    # free c and b first instead: the whole first 40 MiB is free; d = 30 MiB fits there
    # (best fit by grow size), no map at all: reserved peak 40 MiB.
    events = events[:4] + [("free", "c", 0), ("free", "b", 0), ("alloc", "d", 30 * MiB)]
    _, stats = run(events, "expandable_segments:True", capacity=60 * MiB)
    assert (stats.reserved_peak, stats.num_ooms) == (40 * MiB, 0)


def test_roundup_power2_divisions():
    # 4 divisions: 1.2 MiB (1,258,291 B) lies in [1, 2) MiB, steps of 256 KiB -> 1.25 MiB.
    # 1200 B is not > 512 * 4, so it keeps the 512 B rounding: 1536.
    conf = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(1_258_291, conf) == 1_310_720
    assert round_size(1200, conf) == 1536
    assert round_size(1_258_291) == 1_258_496
    # [256:1,>:8]: intervals below index 8 (256 MiB) get 1 (no rounding); above, 8:
    # 600 MiB in [512, 1024) MiB, steps of 64 MiB -> 640 MiB; 300 MiB (index 8) -> 1.
    conf = parse_alloc_conf("roundup_power2_divisions:[256:1,>:8]")
    assert conf.roundup_power2_divisions == (1,) * 9 + (8,) * 7
    assert round_size(600 * MiB, conf) == 640 * MiB
    assert round_size(300 * MiB + 1, conf) == 300 * MiB + 512


def test_parse_alloc_conf_keys_and_defaults():
    conf = parse_alloc_conf("expandable_segments:True, max_split_size_mb:128,"
                            "garbage_collection_threshold:0.8,release_lock_on_cudamalloc:True")
    assert conf.expandable_segments and conf.max_split_size == 128 * MiB
    assert conf.garbage_collection_threshold == 0.8
    assert conf.ignored == ("release_lock_on_cudamalloc",)
    default = parse_alloc_conf(None)
    assert (default.max_split_size, default.max_non_split_rounding_size,
            default.large_segment_size) == (None, 20 * MiB, 20 * MiB)
    assert parse_alloc_conf("large_segment_size_mb:64").large_segment_size == 64 * MiB


@pytest.mark.parametrize("text, match", [
    ("expandable_segment:True", "unrecognized key 'expandable_segment'"),
    ("expandable_segments:true", "needs True or False"),
    ("max_split_size_mb:10", "too small, must be >= 20"),
    ("max_split_size_mb:12abc", "needs a non-negative integer"),
    ("garbage_collection_threshold:1.5", r"must be in \(0.0, 1.0\)"),
    ("roundup_power2_divisions:3", "power of 2"),
    ("max_split_size_mb:128,", "trailing ','"),
    ("max_split_size_mb", "expected ':'"),
    ("backend:cudaMallocAsync", "not modelled"),
    ("large_segment_size_mb:10", "must be > 10"),
])
def test_parse_alloc_conf_errors_are_one_line(text, match):
    with pytest.raises(TracememError, match=match) as info:
        parse_alloc_conf(text)
    assert "\n" not in str(info.value)


def test_bad_events_raise():
    sim = CachingAllocatorSimulator()
    with pytest.raises(TracememError, match="not allocated"):
        sim.free("x")
    sim.malloc("x", 10)
    with pytest.raises(TracememError, match="already live"):
        sim.malloc("x", 10)
    with pytest.raises(TracememError, match="must be 'alloc' or 'free'"):
        sim.step("realloc", "y", 1)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["", "expandable_segments:True", "max_split_size_mb:20",
                        "roundup_power2_divisions:4,max_split_size_mb:40"]),
       st.sampled_from([None, 120 * MiB]), st.integers(0, 2**32))
def test_random_streams_keep_the_allocator_consistent(conf, capacity, seed):
    # invariants, not values: blocks tile segments, free neighbours are coalesced, the
    # counters equal the blocks; allocated <= reserved after every event
    rnd = random.Random(seed)
    sim = CachingAllocatorSimulator(conf, capacity=capacity)
    live = []
    for i in range(60):
        if live and rnd.random() < 0.45:
            sim.free(live.pop(rnd.randrange(len(live))))
        else:
            sim.malloc(i, rnd.choice([rnd.randint(1, 4 * KiB), rnd.randint(1, 2 * MiB),
                                      rnd.randint(MiB, 12 * MiB), rnd.randint(10 * MiB,
                                                                              40 * MiB)]))
            live.append(i)
        sim.check_invariants()
    stats = sim.stats()
    assert all(a <= r for a, r in zip(stats.allocated, stats.reserved))


def _layout(sim):
    out = []
    for base in sorted(sim.segments):
        b = sim.segments[base].head
        while b is not None:
            out.append((b.addr, b.size, b.allocated, b.requested if b.allocated else None,
                        b.key))
            b = b.next
    return out


# sizes at the rules' edges too: whole MiB (a 20 MiB segment less 19 MiB leaves exactly
# kSmallSize, which the large pool does not split off), 512-byte steps near 1 MiB
_SIZES = st.one_of(st.integers(0, 30 * MiB), st.integers(1, 24).map(lambda k: k * MiB),
                   st.integers(-4, 4).map(lambda k: MiB + 512 * k))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), _SIZES), min_size=1, max_size=120),
       st.sampled_from([None, 3 * 2**30]), st.randoms(use_true_random=False))
def test_the_cached_block_path_equals_the_general_one(ops, capacity, rng):
    # malloc's inline path for a request a cached block serves (_malloc_cached) against the
    # same stream with it off (every request through _malloc): after every event the same
    # blocks (address, size, owner, bytes asked), counters, peaks and series
    fast = CachingAllocatorSimulator(capacity=capacity)
    slow = CachingAllocatorSimulator(capacity=capacity)
    assert fast._cached_path
    slow._cached_path = False
    live, n = [], 0
    for alloc, size in ops:
        if alloc or not live:
            n += 1
            events = [("alloc", n, size)]
            live.append(n)
        else:
            events = [("free", live.pop(rng.randrange(len(live))))]
        for event in events:
            fast.step(*event)
            slow.step(*event)
        fast.check_invariants()
        assert _layout(fast) == _layout(slow)
        assert fast.stats() == slow.stats()
