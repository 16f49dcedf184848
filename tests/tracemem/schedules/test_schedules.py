"""Pipeline schedules against invariants and hand-written expectations.

Reference: Megatron-LM's schedules (megatron/core/pipeline_parallel/schedules.py): 1F1B warm-up
min(pp - p - 1, M); interleaved warm-up (pp - p - 1) * 2 + (vpp - 1) * pp, capped at M * vpp;
in-flight counts derived by hand below.
"""

import pytest

from tracemem.errors import TracememError
from tracemem.schedules import Step, format_grid, inflight_peak, schedule


def test_step_notation_round_trips():
    assert str(Step(0, "F", 3)) == "0F3" and Step.parse("12B7") == Step(12, "B", 7)
    with pytest.raises(TracememError, match="step 'F3' is invalid"):
        Step.parse("F3")


@pytest.mark.parametrize("pp, m", [(4, 8), (4, 2), (16, 16), (3, 1)])
def test_1f1b_stage_p_holds_min_pp_minus_p_and_m(pp, m):
    ranks = schedule("1f1b", pp, 1, m)
    assert [inflight_peak(r) for r in ranks] == [min(pp - p, m) for p in range(pp)]


def test_gpipe_holds_every_microbatch():
    assert [inflight_peak(r) for r in schedule("gpipe", 4, 1, 6)] == [6] * 4


def test_1f1b_golden_order_for_two_stages():
    ranks = schedule("1f1b", 2, 1, 3)
    assert [str(s) for s in ranks[0]] == ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"]
    assert [str(s) for s in ranks[1]] == ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]


def test_interleaved_golden_order_and_inflight_counts():
    # pp 2, vpp 2, M 4: rank 0 warms up with (2 - 0 - 1) * 2 + (2 - 1) * 2 = 4 forwards:
    # chunk 0 of microbatches 0, 1 then chunk 1 (virtual stage 2) of microbatches 0, 1
    ranks = schedule("interleaved-1f1b", 2, 2, 4)
    assert [str(s) for s in ranks[0][:6]] == ["0F0", "0F1", "2F0", "2F1", "0F2", "2B0"]
    # rank 0 holds its 4 warm-up chunks plus one steady-state forward: 5; rank 1: 2 + 1 = 3
    assert [inflight_peak(r) for r in ranks] == [5, 3]
    # pp 4, vpp 2, M 8: rank p: (4 - p - 1) * 2 + 4 warm-up forwards, + 1
    assert [inflight_peak(r) for r in schedule("interleaved-1f1b", 4, 2, 8)] == [11, 9, 7, 5]
    assert "rank 1" in format_grid(ranks)


@pytest.mark.parametrize("name, pp, vpp, m, message", [
    ("zero-bubble", 4, 1, 8, "--schedule 'zero-bubble' is invalid; choose one of 1f1b, gpipe"),
    ("interleaved-1f1b", 4, 2, 6, "--num-microbatches 6 must be a multiple of --pp 4 for the "
                                  "interleaved schedule \\(Megatron-LM rejects it\\); try 8"),
    ("interleaved-1f1b", 4, 1, 8, "--schedule interleaved-1f1b needs --vpp 2 or more"),
    ("1f1b", 4, 2, 8, "--vpp 2 needs --schedule interleaved-1f1b \\(or zbv / dualpipev\\)"),
    ("1f1b", 4, 3, 8, "--vpp 3 needs --schedule interleaved-1f1b$"),
    # Megatron-LM validate_args: the interleaved schedule needs PP > 1
    ("interleaved-1f1b", 1, 2, 4, "--vpp 2 \\(the interleaved 1F1B schedule\\) needs --pp 2"),
    ("1f1b", 4, 1, 0, "--num-microbatches 0 must be a positive integer"),
])
def test_rejected_schedules(name, pp, vpp, m, message):
    with pytest.raises(TracememError, match=message):
        schedule(name, pp, vpp, m)


# --- zero-bubble and DualPipe schedules -------------------------------------------------
# Golden orders derived by hand from the sources each schedule cites:
# ZB-H1: torch/distributed/pipelining/schedules.py (torch 2.13), _get_1f1b_rank_ops with
#   enable_zero_bubble: warm-up min(pp - p - 1, M) forwards; the first p I's keep their W.
# ZB-V: ScheduleZBVZeroBubble._calculate_single_rank_operations.
# DualPipe / DualPipeV: deepseek-ai/DualPipe (3da1bbe) DualPipe.step / DualPipeV.step, phases
#   1-8; in-flight peak PP + 1 (its README's memory table, PP = pipeline stages).


def _orders(name, pp, vpp, m):
    return [" ".join(str(s) for s in steps) for steps in schedule(name, pp, vpp, m)]


def test_zb_h1_golden_order_for_two_stages():
    # rank 0: 1 warm-up F; each I is followed by its W (p = 0 defers none)
    # rank 1: no warm-up; the first I keeps its W, so every later I is followed by the
    # previous microbatch's W, and W2 runs last
    assert _orders("zb-h1", 2, 1, 3) == [
        "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2",
        "1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2"]
    # full activations held as 1F1B: min(pp - p, M)
    assert [inflight_peak(r) for r in schedule("zb-h1", 4, 1, 8)] == [4, 3, 2, 1]


def test_zbv_golden_order_for_two_ranks():
    # rank 0 holds chunks 0 and 3: 2 * (2 - 0) - 1 = 3 forwards of chunk 0, then pp - p = 2
    # rounds of chunk-3 F, I, W; steady F0 I0 W0 F1 I1 W1; cool-down pp - p = 2 rounds of
    # chunk-0 I, W
    # rank 1 holds chunks 1 and 2: 1 forward, p = 1 pair (2F, 1F), 1 round of 2F 2I 2W,
    # steady rounds while chunk 0 has forwards left, then (1I, 2I), then 1I 1W, then the
    # pending W's of chunk 2, then of chunk 1
    assert _orders("zbv", 2, 2, 4) == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0F3 0I0 0W0 3F2 3I2 3W2 0I1 0W1 3F3 3I3 3W3 "
        "0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1F3 1I1 1W1 2F3 2I2 2W2 1I2 2I3 "
        "1I3 1W2 2W3 1W3"]
    # chunks held at the peak: 4 = 2 * pp chunks of half a stage, 1F1B's pp stages
    assert [inflight_peak(r) for r in schedule("zbv", 2, 2, 4)] == [4, 4]


def test_dualpipev_golden_order_for_two_ranks():
    # rank 0 (chunks 0, 3): 1: 2 x F0; 2: 1 x (F0, F1); 3: 1 x (I1 W1 F1); 4: 1 x (F0 B1 F1
    # B0); 5: 1 x (B1 F1 B0); 6: B1 full, then B0 split (i == 0 == 1 // 2, rank even);
    # 7: W, I0; 8: W
    # rank 1 (chunks 1, 2): 2: 2 pairs; 4: 2 rounds; 6: round 0 full, round 1 split
    assert _orders("dualpipev", 2, 2, 4) == [
        "0F0 0F1 0F2 3F0 3I0 3W0 3F1 0F3 3B1 3F2 0B0 3B2 3F3 0B1 3B3 0I2 0W2 0I3 0W3",
        "1F0 2F0 1F1 2F1 1F2 2B0 2F2 1B0 1F3 2B1 2F3 1B1 2B2 1B2 2I3 1I3 2W3 1W3"]
    # PP + 1 chunks at the peak (PP = 2 * pp = 4 stages): 0F0 0F1 0F2 3F0 3I0 3F1 0F3 -> 5
    assert [inflight_peak(r) for r in schedule("dualpipev", 2, 2, 4)] == [5, 5]
    assert [inflight_peak(r) for r in schedule("dualpipev", 4, 2, 10)] == [9] * 4


def test_dualpipe_golden_order_for_two_ranks():
    # microbatches 0, 1 enter at rank 0 (chunk 0 then 1), 2, 3 at rank 1 (chunk 0 on rank 1,
    # chunk 1 on rank 0); each rank runs 1 x (F0 F1), 1 x (F0 B1 F1 B0), then B1 full and B0
    # split (half_rank 0 is even), then the W
    assert _orders("dualpipe", 2, 1, 4) == [
        "0F0 1F2 0F1 1B2 1F3 0B0 1B3 0I1 0W1",
        "0F2 1F0 0F3 1B0 1F1 0B2 1B1 0I3 0W3"]
    # PP + 1 microbatch-stages at each rank's peak (DualPipe README, pp = 2 and 8)
    assert [inflight_peak(r) for r in schedule("dualpipe", 2, 1, 4)] == [3, 3]
    assert [inflight_peak(r) for r in schedule("dualpipe", 8, 1, 20)] == [9] * 8


def test_placements_are_one_table():
    from tracemem.schedules import placement
    loop = placement("interleaved-1f1b", 2, 2, 4)
    v = placement("zbv", 2, 2, 4)
    both = placement("dualpipe", 4, 1, 8)
    assert [loop.chunks_of(r) for r in range(2)] == [[0, 2], [1, 3]]
    assert [v.chunks_of(r) for r in range(2)] == [[0, 3], [1, 2]]
    assert [both.chunks_of(r) for r in range(4)] == [[0, 3], [1, 2], [1, 2], [0, 3]]
    # chunk 1 of microbatch 0 (first half) runs on rank 1, of microbatch 4 on rank 2
    assert both.rank_of(1, 0) == 1 and both.rank_of(1, 4) == 2
    assert both.copies(0) == 2 and v.copies(0) == 1


@pytest.mark.parametrize("name, pp, vpp, m", [
    ("zb-h1", 4, 1, 2), ("zb-h1", 3, 1, 7), ("zbv", 4, 2, 3), ("zbv", 3, 2, 9),
    ("dualpipe", 4, 1, 8), ("dualpipe", 6, 1, 14), ("dualpipev", 3, 2, 6),
    ("dualpipev", 4, 2, 11)])
def test_new_schedules_pass_the_dependency_check(name, pp, vpp, m):
    ranks = schedule(name, pp, vpp, m)  # check_schedule runs inside
    assert sum(len(r) for r in ranks) > 0


@pytest.mark.parametrize("name, pp, vpp, m, message", [
    ("dualpipe", 3, 1, 6, "--schedule dualpipe needs an even --pp"),
    ("dualpipe", 4, 1, 6, "--num-microbatches 6 must be even and at least 2 \\* pp = 8"),
    ("dualpipev", 4, 2, 7, "--num-microbatches 7 must be at least 2 \\* pp = 8"),
    ("zbv", 4, 1, 8, "--schedule zbv places two model chunks on every rank in a V; give "
                     "--vpp 2"),
    ("dualpipe", 4, 2, 8, "--vpp 2 needs --schedule dualpipev"),
])
def test_rejected_new_schedules(name, pp, vpp, m, message):
    with pytest.raises(TracememError, match=message):
        schedule(name, pp, vpp, m)


def test_orders_match_pytorchs_own_generators():
    """PyTorch's pipelining builds the same orders (overlapped F&B pairs written F, B)."""
    from torch.distributed.pipelining import schedules as torch_schedules

    def torch_orders(cls, pp, m):
        gen = object.__new__(cls)  # only the order generator, no process group
        gen.pp_group_size, gen._n_microbatches, gen.num_stages = pp, m, 2 * pp
        gen.n_local_stages = 2
        if cls is torch_schedules.ScheduleInterleavedZeroBubble:
            gen.n_local_stages, gen.number_of_rounds = 1, max(1, m // pp)
            gen.microbatches_per_round = m // gen.number_of_rounds
        orders = []
        for rank in range(pp):
            actions = []
            for a in filter(None, gen._calculate_single_rank_operations(rank)):
                actions += a.sub_actions if a.sub_actions else [a]
            orders.append(" ".join(f"{a.stage_index}{a.computation_type.value}"
                                   f"{a.microbatch_index}" for a in actions))
        return orders

    for pp, m in [(2, 4), (4, 8), (4, 11), (3, 9)]:
        assert _orders("zbv", pp, 2, m) == torch_orders(torch_schedules.ScheduleZBVZeroBubble,
                                                        pp, m)
        assert _orders("dualpipev", pp, 2, m) == torch_orders(
            torch_schedules.ScheduleDualPipeV, pp, m)
    for pp, m in [(2, 4), (4, 8), (3, 9)]:
        assert _orders("zb-h1", pp, 1, m) == torch_orders(
            torch_schedules.ScheduleInterleavedZeroBubble, pp, m)
