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
    ("1f1b", 4, 2, 8, "--vpp 2 needs --schedule interleaved-1f1b"),
    ("1f1b", 4, 1, 0, "--num-microbatches 0 must be a positive integer"),
])
def test_rejected_schedules(name, pp, vpp, m, message):
    with pytest.raises(TracememError, match=message):
        schedule(name, pp, vpp, m)
