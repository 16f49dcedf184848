"""The schedule replay (tracemem.estimator.replay_schedule / replay_events).

Reference: the replay as it was before it became linear (issue 9 item 7), kept here verbatim
as ``quadratic_replay``: it copied the live set at every new peak. The linear replay must give
the same peak, step, in-flight count and live storages on real traced segments of
deepseek-tiny under every schedule. Hand arithmetic for the event stream's invariants.
"""

import pytest

from modeling import load_config
from tracemem.categories import Category
from tracemem.estimator import (
    ReplayPeak,
    _trace_rank,
    replay_events,
    replay_schedule,
)
from tracemem.parallel import ParallelConfig
from modeling.common.routing import parse_routing
from tracemem.schedules import schedule


def quadratic_replay(steps, pp, segments, base_bytes):
    """The replay before issue 9 item 7 (commit 883570b), verbatim but for the output."""
    current = base_bytes
    peak, peak_at, peak_live, inflight_at_peak = current, None, {}, 0
    live = {}
    started = finished = 0
    for index, step in enumerate(steps):
        if step.kind == "F":
            started += 1
        for event in segments.events[(step.stage // pp, step.kind, min(step.microbatch, 1))]:
            sid = (step.stage, step.microbatch, event.storage_id)
            if event.action == "free":
                if sid in live:
                    current -= live.pop(sid)[0]
                continue
            transient = event.category is Category.GRADIENT
            live[sid] = (event.nbytes, event)
            current += event.nbytes
            if current > peak:
                peak, peak_at, inflight_at_peak = current, index, started - finished
                peak_live = dict(live)
            if transient:
                current -= live.pop(sid)[0]
        if step.kind == "B":
            finished += 1
    return peak, peak_at, inflight_at_peak, {k: v[1] for k, v in peak_live.items()}


def traced(pp, vpp, recompute="none", routing="balanced"):
    cfg = load_config("deepseek-tiny")
    layout = None if vpp == 1 else (1,) * (pp * vpp)
    par = ParallelConfig.create(cfg, world_size=pp * 2, tp=2, sp=True, pp=pp, vpp=vpp,
                                pp_layout=layout)
    _, segments = _trace_rank(cfg, par, 0, b=1, s=16, routing=parse_routing(routing),
                              attention="flash", experts="sequential", recompute=recompute,
                              recompute_modules=frozenset(), deallocate=True, rounding=512)
    return segments


@pytest.mark.parametrize("name, pp, vpp, m, base", [
    ("gpipe", 2, 1, 5, 0), ("1f1b", 2, 1, 6, 1000), ("1f1b", 2, 1, 1, 0),
    ("interleaved-1f1b", 2, 2, 4, 7),
])
def test_linear_replay_equals_the_quadratic_one(name, pp, vpp, m, base):
    segments = traced(pp, vpp)
    for steps in schedule(name, pp, vpp, m):
        peak, at, inflight, live = quadratic_replay(steps, pp, segments, base)
        new = replay_schedule(steps, pp, segments, base)
        assert (new.peak_bytes, new.step_index, new.inflight) == (peak, at, inflight)
        by_category = {}
        for event in live.values():
            by_category[event.category.value] = \
                by_category.get(event.category.value, 0) + event.nbytes
        assert new.by_category == by_category
        assert sum(new.by_module.values()) == sum(e.nbytes for e in live.values())
        assert [d["bytes"] for d in new.largest] == \
            sorted((e.nbytes for e in live.values()), reverse=True)[:8]


def test_event_stream_balances_and_gradients_are_transient():
    segments = traced(2, 1)
    steps = schedule("1f1b", 2, 1, 3)[0]
    stream = list(replay_events(steps, 2, segments))
    held, total, peak = {}, 0, 0
    for replayed in stream:
        if replayed.action == "alloc":
            assert replayed.key not in held
            held[replayed.key] = replayed.nbytes
            total += replayed.nbytes
            peak = max(peak, total)
        else:
            total -= held.pop(replayed.key)  # every free is of a held storage, same bytes
    # a gradient's alloc is followed at once by its free (added into the main grad)
    for a, b in zip(stream, stream[1:]):
        if a.action == "alloc" and a.event.category is Category.GRADIENT:
            assert (b.action, b.key) == ("free", a.key)
    assert replay_schedule(steps, 2, segments, 0).peak_bytes == peak
    # steps are replayed in order
    assert [r.step_index for r in stream] == sorted(r.step_index for r in stream)


def test_static_memory_alone_is_a_peak_before_any_step():
    segments = traced(2, 1)
    result = replay_schedule([], 2, segments, 123)
    assert result == ReplayPeak(123, None, 0, {}, {}, [])


def test_module_state_outlives_its_traced_free_until_its_slot_is_made_again():
    # MemoryTracer.retain (the MoE dispatchers' probabilities and maps), by hand. 1F1B, PP 2,
    # M 4, rank 0: F0 F1 B0 F2 B1 F3 B2 B3. Each forward makes a 100-B state storage its
    # module keeps (slot "s") and a 10-B activation; the "probs" kind dies in the forward
    # (the trace's free), so only the slot holds it; the "map" kind is saved for backward too
    # (freed by the trace at B), so it dies at the later of its backward and the slot's next
    # storage.
    from types import SimpleNamespace

    from tracemem.estimator import Segments

    def ev(action, sid, nbytes, retain=None):
        return SimpleNamespace(action=action, storage_id=sid, nbytes=nbytes,
                               category=Category.ACTIVATION, module="", op=None, retain=retain)

    def run(state_dies_in_forward):
        f = {0: [ev("alloc", 1, 100, "s"), ev("alloc", 2, 10)],
             1: [ev("alloc", 3, 100, "s"), ev("alloc", 4, 10)]}
        b = {0: [ev("free", 2, 10)], 1: [ev("free", 4, 10)]}
        for mb, sid in ((0, 1), (1, 3)):
            (f if state_dies_in_forward else b)[mb].append(ev("free", sid, 100))
        segments = Segments({(0, "F", m): f[m] for m in (0, 1)} |
                            {(0, "B", m): b[m] for m in (0, 1)})
        steps = schedule("1f1b", 2, 1, 4)[0]
        assert [str(s) for s in steps] == ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2",
                                           "0B3"]
        alive, after = 0, [0] * len(steps)
        for e in replay_events(steps, 2, segments):
            alive += e.nbytes if e.action == "alloc" else -e.nbytes
            after[e.step_index] = alive
        return after

    # the state of the newest forward only (100), plus 10 per microbatch in flight
    assert run(True) == [110, 120, 110, 120, 110, 120, 110, 100]
    # saved for backward as well: microbatch 0's state lives to B0 although F1 replaced it
    assert run(False) == [110, 220, 110, 220, 110, 220, 110, 100]


@pytest.mark.parametrize("loop", [True, False])
def test_megatron_1f1b_keeps_the_last_backwards_pipeline_tensors(loop):
    # Segments.megatron_1f1b, by hand: PP 2, M 4, rank 1 (F0 B0 F1 B1 ... B3, then the
    # optimizer step O). A forward receives a 10-B input ("pp.input") and keeps a 100-B
    # activation; a backward receives a 20-B output gradient ("pp.output_grad"), frees the
    # activation and makes a 10-B input gradient ("pp.input_grad"), then drops all three.
    # Megatron's loop keeps the input and its gradient to the next backward (its start and
    # its end) and the output gradient to the next receive; the optimizer step comes after
    # the loop has returned. Without the loop's references (another schedule) all is freed.
    from dataclasses import replace as copy
    from types import SimpleNamespace

    from tracemem.estimator import Segments
    from tracemem.schedules import Step

    def ev(action, sid, nbytes, retain=None):
        return SimpleNamespace(action=action, storage_id=sid, nbytes=nbytes,
                               category=Category.ACTIVATION, module="", op=None, retain=retain)

    forward = [ev("alloc", 1, 10, "pp.input"), ev("alloc", 2, 100)]
    backward = [ev("alloc", 3, 20, "pp.output_grad"), ev("free", 2, 100),
                ev("alloc", 4, 10, "pp.input_grad"), ev("free", 4, 10), ev("free", 1, 10),
                ev("free", 3, 20)]
    segments = copy(Segments({(0, k, m): (forward if k == "F" else backward)
                              for k in "FB" for m in (0, 1)} | {(0, "O", 0): []}),
                    megatron_1f1b=loop)
    steps = schedule("1f1b", 2, 1, 4)[1] + [Step(1, "O", 0)]
    alive, after = 0, [0] * len(steps)
    for e in replay_events(steps, 2, segments):
        alive += e.nbytes if e.action == "alloc" else -e.nbytes
        after[e.step_index] = alive
    if loop:  # after a B: that microbatch's input, input gradient and output gradient
        assert after == [110, 40, 150, 40, 150, 40, 150, 40, 0]
    else:
        assert after == [110, 0, 110, 0, 110, 0, 110, 0, 0]
