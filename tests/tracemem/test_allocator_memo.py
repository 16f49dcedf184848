"""Rank classes whose replayed stream is the same share one schedule replay and one
caching-allocator simulation (``tracemem.estimator.replay_class`` and ``allocator_row``'s
``memo``, ``replay_signature``): the rows must be those of a replay and a simulation per
class, and only streams that are the same may share."""

import pytest

import tracemem.estimator as E
from tracemem import Job, estimate


def _job(schedule: str) -> Job:
    return Job(model="deepseek-tiny", world_size=4, pp=4, pp_layout=(1, 1, 1, 1),
               schedule=schedule, micro_batch_size=1, seq_length=16, num_microbatches=8,
               hbm="1GiB")


_FIELDS = ("allocated_peak_bytes", "reserved_peak_bytes", "fragmentation_bytes",
           "largest_free_block_bytes", "reserved_peak_step", "fits", "peak_bytes", "peak_step",
           "inflight_microbatches", "activation_bytes", "by_module", "largest")


@pytest.mark.parametrize("schedule, simulations", [("dualpipe", 2), ("1f1b", 4)])
def test_shared_simulations_give_each_classes_own_row(monkeypatch, schedule, simulations):
    job = _job(schedule)
    runs = []
    real = E.replay_through_allocator

    def counted(*args, **kwargs):
        runs.append(args[3])
        return real(*args, **kwargs)

    monkeypatch.setattr(E, "replay_through_allocator", counted)
    shared = estimate(job)
    # DualPipe: rank s and rank 3 - s hold the same two model chunks and run the mirror
    # schedule (the same stream of allocs and frees): 2 simulations for 4 ranks; 1F1B's
    # stages run different steps (in flight PP - s): one each
    assert len(runs) == simulations
    runs.clear()
    traced = E.trace_classes(job, E.rank_classes(job), E.TraceCache())
    for t in traced:
        E.replay_class(job, t)  # no memo: a replay and a simulation per class
    alone = [E.allocator_row(job, t) for t in traced]
    assert len(runs) == 4
    for a, b in zip(shared.ranks, alone):
        assert [getattr(a, f) for f in _FIELDS] == [getattr(b, f) for f in _FIELDS]
        assert a.memory.label == b.memory.label
        assert a.memory.steps == b.memory.steps  # step labels renamed to the rank's own


def test_mirror_ranks_signatures_agree_and_others_differ():
    job = _job("dualpipe")
    traced = E.trace_classes(job, E.rank_classes(job), E.TraceCache())
    where, contents = E._placement(job), {}
    sigs = [E.replay_signature(t.steps, 4, t.segments,
                               lambda v, s=t.unit.stage: where.chunk_index(s, v), contents)
            for t in traced]
    assert sigs[0] == sigs[3] and sigs[1] == sigs[2] and sigs[0] != sigs[1]
