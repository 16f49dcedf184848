"""The steady-state shortcut of the schedule replay (tracemem.periodic, issue 27 item 2).

Reference: the full replay. With the shortcut, every schedule's replay must give the same
peak, step, in-flight count and storages alive (``replay_schedule``), and the same caching
allocator figures (peaks, the event and step of the reserved peak, fragmentation, segments,
``cudaMalloc`` / ``cudaFree`` calls, the event count), on real traced segments of
deepseek-tiny, under default and expandable segments. The stretches are checked by hand.
"""

import pytest

from tracemem.estimator import (
    TraceCache,
    _placement,
    rank_classes,
    replay_events,
    replay_schedule,
    trace_classes,
)
from tracemem.job import Job
from tracemem.memory.timeline import replay_through_allocator, step_at
from tracemem.periodic import Stretch, periodic_stretches, probed
from tracemem.schedules import Step, schedule


def test_1f1b_stretch_by_hand():
    # 1F1B, pp 4, M 8, rank 0: warm-up F0 F1 F2, then F3 B0, F4 B1, ..., F7 B4, then B5 B6 B7.
    # The pair (F3, B0) holds microbatch 0 (its own segments), so the stretch is the pairs
    # from (F4, B1) at index 5: (F4 B1) (F5 B2) (F6 B3) (F7 B4), period 2, shift 1.
    steps = schedule("1f1b", 4, 1, 8)[0]
    assert [str(s) for s in steps[5:7]] == ["0F4", "0B1"]
    assert periodic_stretches(steps) == [Stretch(5, 2, 4, 1)]


def test_gpipe_stretches_by_hand():
    # GPipe, M 8: F0 | F1 .. F7 | B0 | B1 .. B7: two stretches of period 1 (7 steps each).
    steps = schedule("gpipe", 2, 1, 8)[0]
    assert periodic_stretches(steps) == [Stretch(1, 1, 7, 1), Stretch(9, 1, 7, 1)]


def test_no_stretch_on_microbatch_zero_or_split_changes():
    steps = [Step(0, "F", 0), Step(0, "B", 0)] * 6
    assert periodic_stretches(steps) == []
    # period 2, but the split status alternates: never a stretch
    steps = [Step(0, "F", m) for m in range(1, 9)]
    assert periodic_stretches(steps, split={(0, m) for m in range(1, 9, 2)}) == \
        [Stretch(0, 2, 4, 2)]


CASES = [  # (schedule, pp, vpp, M)
    ("1f1b", 4, 1, 24), ("1f1b", 2, 1, 40), ("gpipe", 2, 1, 12),
    ("interleaved-1f1b", 2, 2, 24), ("zb-h1", 2, 1, 24), ("zbv", 2, 2, 24),
    ("dualpipe", 2, 1, 24), ("dualpipev", 2, 2, 24),
]


def _job(name, pp, vpp, m):
    # deepseek-tiny: 4 layers (2 dense, 2 MoE) and one MTP module over pp x vpp chunks
    return Job.create("deepseek-tiny", world_size=pp, pp=pp, vpp=vpp, num_microbatches=m,
                      micro_batch_size=1, seq_length=16, schedule=name)


def _alloc(traced, job, periodic, config=None, capacity=None):
    """The allocator's figures for one traced rank class, replayed with the shortcut (the
    allocator as its sink) or in full."""
    place = _placement(job)
    stage, pp = traced.unit.stage, job.parallel.pp

    def chunk(v):
        return place.chunk_index(stage, v)

    events = ((lambda sink: replay_events(traced.steps, pp, traced.segments, chunk,
                                          periodic=sink is not None, sink=sink))
              if periodic else replay_events(traced.steps, pp, traced.segments, chunk))
    timeline, replay = replay_through_allocator(
        events, traced.steps, [("parameter", traced.static.param_bytes),
                               ("optimizer_state", traced.static.optimizer_bytes)],
        "x", config=config, capacity=capacity, series=False)
    s = timeline.stats
    return (s.allocated_peak, s.reserved_peak, s.reserved_peak_event,
            s.allocated_at_reserved_peak, s.largest_free_block, s.segments_at_reserved_peak,
            s.requested_peak, s.num_device_alloc, s.num_device_free, s.num_alloc_retries,
            s.num_ooms, s.oom_event, step_at(timeline, s.reserved_peak_event),
            replay.sim.events)


@pytest.mark.parametrize("name,pp,vpp,m", CASES)
def test_shortcut_equals_full_replay(name, pp, vpp, m):
    job = _job(name, pp, vpp, m)
    traced = trace_classes(job, rank_classes(job), TraceCache())
    place_pp = job.parallel.pp
    place = _placement(job)
    for one in traced:
        stage = one.unit.stage

        def chunk(v, stage=stage):
            return place.chunk_index(stage, v)

        full = replay_schedule(one.steps, place_pp, one.segments, 1000, chunk, periodic=False)
        short = replay_schedule(one.steps, place_pp, one.segments, 1000, chunk)
        assert short == full
        for config in (None, "expandable_segments:True"):
            assert _alloc(one, job, True, config) == _alloc(one, job, False, config)
        # a device that runs out: cached blocks released, retried, then the OOM recorded
        tight = one.static.param_bytes + one.static.optimizer_bytes + 2**20
        assert _alloc(one, job, True, capacity=tight) == _alloc(one, job, False,
                                                                 capacity=tight)


def test_reserved_peak_reached_after_the_skipped_cycles():
    # 1F1B on the last of 2 stages holds one microbatch at a time, so its steady state
    # repeats after one pair and the shortcut skips the rest (asserted: it replays under a
    # fifth of the events). A 64 MiB block made in the optimizer step, larger than anything
    # cached, is a cudaMalloc there: the reserved peak is reached after the skip, at step
    # 1O0, and every figure still equals the full replay's.
    from types import SimpleNamespace

    from tracemem.categories import Category

    # a dense model: deepseek-tiny's MoE stages hold their dispatchers' state from one
    # microbatch to the next (MemoryTracer.retain), whose small blocks move the small pool's
    # layout for many cycles, so the shortcut finds no cycle on them within its probes; 64
    # microbatches: Megatron's loop keeps the last backward's pipeline tensors too
    # (Segments.megatron_1f1b), and the blocks settle a few pairs later than without
    job = Job.create("llama-tiny", world_size=2, pp=2, num_microbatches=64,
                     micro_batch_size=1, seq_length=16, schedule="1f1b")
    last = trace_classes(job, rank_classes(job), TraceCache())[-1]
    big = SimpleNamespace(action="alloc", nbytes=64 * 2**20, storage_id=-1,
                          category=Category.TEMPORARY, module="optimizer", op="synthetic",
                          shape=(64 * 2**20,), dtype="uint8", retain=None)
    freed = SimpleNamespace(**(vars(big) | {"action": "free"}))
    last.segments.events[(0, "O", 0)] = list(last.segments.events[(0, "O", 0)]) + [big, freed]
    yielded = []

    def counting(sink):
        place = _placement(job)
        for event in replay_events(last.steps, 2, last.segments,
                                   lambda v: place.chunk_index(1, v), periodic=True,
                                   sink=sink):
            yielded.append(event)
            yield event

    timeline, replay = replay_through_allocator(counting, last.steps, [], "x", series=False)
    short = timeline.stats
    full = _alloc(last, job, False)
    assert _alloc(last, job, True) == full
    assert len(yielded) * 5 < replay.sim.events
    assert step_at(timeline, short.reserved_peak_event) == "1O0" == full[12]
    assert short.reserved_peak_event > len(yielded)  # numbered as in the full replay


@pytest.mark.parametrize("name", ["zb-h1"])
def test_allocator_cycle_with_two_microbatches_in_flight(name):
    # stage 0 of 2 holds two microbatches in flight: the allocator's blocks settle into a
    # cycle after a few dozen pairs (its fragmentation pattern repeats), and the shortcut
    # proves it by comparing the whole state; it then replays about a third of the events
    # (measured: 15,960 of 45,600) and every figure equals the full replay's. Megatron's 1F1B
    # did too (15,708 of 44,880) until the replay held what its loop and the MoE dispatchers
    # keep between microbatches (Segments.megatron_1f1b, MemoryTracer.retain): its blocks
    # no longer repeat within these 120 microbatches (docs/benchmarks.md)
    job = _job(name, 2, 1, 120)
    first = trace_classes(job, rank_classes(job), TraceCache())[0]
    from tracemem.memory.timeline import AllocatorReplay

    place = _placement(job)
    for config in (None, "expandable_segments:True"):
        sink = AllocatorReplay(config, series=False)
        walked = 0
        for _, key, action, nbytes, event in replay_events(
                first.steps, 2, first.segments, lambda v: place.chunk_index(0, v),
                periodic=True, sink=sink):
            walked += 1
            sink.alloc(key, nbytes, event.category.value) if action == "alloc" \
                else sink.free(key)
        assert walked * 2 < sink.sim.events
        assert _alloc(first, job, True, config) == _alloc(first, job, False, config)


def test_fit_gives_the_same_rows_without_the_shortcut(monkeypatch):
    # issue 27: fit's rows (needs, fits, screened, every figure) with the shortcut equal the
    # rows of the full replay (MAX_PROBES 0: no boundary probed, every event walked), on a
    # small space of deepseek-tiny at M = 64
    import tracemem.periodic as periodic
    from tracemem.fit import SearchSpace, fit

    space = SearchSpace(tp=(1,), pp=(2,), ep=(1, 2), recompute=("none", "full"), zero=(1,))

    def rows():
        result = fit("deepseek-tiny", space=space, workers=1, world_size=4, hbm="40MiB",
                     seq_length=32, global_batch_size=128, non_pytorch_memory="0")
        return [r.as_dict() for r in result.rows + result.closest]

    short = rows()
    monkeypatch.setattr(periodic, "MAX_PROBES", 0)
    monkeypatch.setattr("tracemem.estimator.MAX_PROBES", 0)
    assert rows() == short
    assert len(short) == 4 and all(r["num_microbatches"] == 64 for r in short)


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_shortcut_equals_full_replay_with_dispatcher_state_under_recompute(recompute):
    # The MoE dispatchers' state (MemoryTracer.retain) is held past its microbatch; under
    # recompute the backward's re-run replaces it, so finished microbatches' storages stay
    # held across the skipped cycles and are renumbered with them (the allocator too).
    job = Job.create("deepseek-tiny", world_size=2, pp=2, num_microbatches=24,
                     micro_batch_size=1, seq_length=16, schedule="1f1b", recompute=recompute,
                     recompute_modules=("moe",) if recompute == "selective" else ("core_attn",))
    place = _placement(job)
    for one in trace_classes(job, rank_classes(job), TraceCache()):
        stage = one.unit.stage

        def chunk(v, stage=stage):
            return place.chunk_index(stage, v)

        assert replay_schedule(one.steps, 2, one.segments, 1000, chunk) == \
            replay_schedule(one.steps, 2, one.segments, 1000, chunk, periodic=False)
        assert _alloc(one, job, True) == _alloc(one, job, False)


def test_a_sink_renames_held_module_state_with_the_replay():
    # A stand-in sink that keeps the keys the replay holds (its state repeats when the
    # replay's does). After a skip, every key the replay frees must be one the sink holds:
    # the dispatchers' state of finished microbatches (held past their backward, MemoryTracer.
    # retain) is renamed on both sides, or a later free misses.
    job = _job("1f1b", 2, 1, 40)
    last = trace_classes(job, rank_classes(job), TraceCache())[-1]

    class Keys:
        def __init__(self):
            self.live, self.skipped = set(), 0

        def cheap_state(self):
            return len(self.live)

        def state(self, canon):
            return frozenset(canon(k) for k in self.live)

        def counters(self):
            return ()

        def skip(self, rename, cycles, per_cycle):
            self.live = {rename(k) for k in self.live}
            self.skipped += cycles

    def replay(sink):
        keys = sink if sink is not None else Keys()  # skip() replaces sink.live
        for event in replay_events(last.steps, 2, last.segments, periodic=sink is not None,
                                   sink=sink):
            if event.action == "alloc":
                keys.live.add(event.key)
            else:
                assert event.key in keys.live, event
                keys.live.remove(event.key)
        return keys.live

    sink = Keys()
    held = replay(sink)
    assert sink.skipped > 0
    # what is held at the end (the last microbatches' dispatcher state among it) is named
    # as in the full replay
    assert held == replay(None)
    assert any(e.retain for events in last.segments.events.values() for e in events)


def test_what_is_alive_at_a_peak_after_a_skip_is_renamed_with_it():
    # DualPipe under full recompute, 40 microbatches: the middle ranks peak at step 79, after
    # skipped cycles, with storages held across the skip. replay_schedule's second pass
    # rebuilds what is alive at the peak; it must rename what it holds at the skip as the
    # replay does (_RenameAlive), or the frees after it miss and the categories, the largest
    # storages and their microbatches count storages already freed.
    job = Job.create("deepseek-tiny", world_size=8, ep=2, pp=4, num_microbatches=40,
                     micro_batch_size=1, seq_length=16, schedule="dualpipe", recompute="full")
    place = _placement(job)
    middle = [one for one in trace_classes(job, rank_classes(job), TraceCache())
              if one.unit.stage in (1, 2)]
    for one in middle:
        def chunk(v, stage=one.unit.stage):
            return place.chunk_index(stage, v)

        short = replay_schedule(one.steps, 4, one.segments, 1000, chunk)
        assert short.step_index == 79
        assert short == replay_schedule(one.steps, 4, one.segments, 1000, chunk,
                                        periodic=False)
        assert sum(short.by_category.values()) == short.peak_bytes - 1000


def test_probed_boundaries_thin_out_by_powers_of_two():
    # by hand: every boundary below 16, then strides 2, 4, 8, 16, 32 over [16, 32), [32, 64),
    # [64, 128), [128, 256), [256, 512): 8 each, 16 + 5 x 8 = 56
    assert all(probed(k) for k in range(16))
    assert [k for k in range(16, 80) if probed(k)] == [
        16, 18, 20, 22, 24, 26, 28, 30, 32, 36, 40, 44, 48, 52, 56, 60, 64, 72]
    assert sum(probed(k) for k in range(512)) == 56
