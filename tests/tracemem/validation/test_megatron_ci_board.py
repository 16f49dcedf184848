"""The megatron-ci scoreboard end to end on one case (its peak and its after-step check), and
its summary by hand (issue 21 items 1, 5).

References: the measured value is the golden file's, written here literally (Megatron-LM
tests/functional_tests/test_cases/gpt/gpt3_mcore_te_tp1_pp1_dist_optimizer_fim_dataset/
golden_values_dev_dgx_h100.json, iteration 2, as collected into tracemem/validation/
megatron_ci/); the board's shortcut (only the logged rank's class traced) is held against the
full estimate of the same Job; the summary against hand arithmetic.
"""

import pytest

from tracemem.cli import main
from tracemem.estimator import estimate
from tracemem.job import Job
from tracemem.validation.megatron_ci import case_job_kwargs, selection
from tracemem.validation.megatron_ci_board import (BoardRow, lazy_optimizer_bytes, score_case,
                                                  state_before_first_step, summary)

CASE = "gpt3_mcore_te_tp1_pp1_dist_optimizer_fim_dataset@dev_dgx_h100"


@pytest.fixture(scope="module")
def case():
    scored, _ = selection()
    return next(c for c in scored if c.name == CASE)


def test_one_case_end_to_end(case):
    row = score_case(case)
    assert (row.measured_iteration, row.measured_bytes) == (2, 4_702_430_720)
    assert (row.world_size, row.pp_stage, row.rank) == (8, 0, 7)  # PP 1: global rank 7
    # the logged rank alone, as the full estimate of the same job gives it
    full = estimate(Job(**case_job_kwargs(case)))
    assert row.tracemem_bytes == full.ranks[-1].allocated_peak_bytes
    assert row.error == row.tracemem_bytes / 4_702_430_720 - 1
    # the after-step check: mem-allocated-bytes at iteration 2 against the static memory and
    # the workspaces (what outlives the step)
    static = full.ranks[-1].static
    assert row.measured_after_bytes == 581_489_664
    assert row.tracemem_after_bytes == (static.param_bytes + static.grad_bytes
                                        + static.optimizer_bytes + static.buffer_bytes
                                        + full.ranks[-1].workspace_bytes)
    # iteration 1 (the golden file's value there): TE's FusedAdam makes the two fp32 moments
    # (8 of the recipe's 12 B per element: fp32 master, exp_avg, exp_avg_sq) at its first
    # step; the master weights exist from the optimizer's construction
    lazy = lazy_optimizer_bytes(full.job, static.optimizer_bytes)
    assert lazy == static.optimizer_bytes * 8 // 12
    assert row.measured_first_bytes == 4_605_814_272
    # this rank peaks in forward, before the moments exist: the peak falls by them, give or
    # take the caching allocator's rounding of the two blocks (2 MiB each at most)
    assert full.ranks[-1].peak_phase == "forward"
    assert abs(row.tracemem_bytes - row.tracemem_first_bytes - lazy) < 2 * 2**21


def _row(measured, traced):
    return BoardRow("x", "H100", 8, 2, measured, traced, traced, 0, 7, (), 0, measured, None, None)


def test_summary_by_hand():
    rows = [_row(100, 99), _row(100, 103), _row(100, 90), _row(200, 200)]
    s = summary(rows)
    # |errors| 0.01, 0.03, 0.10, 0: median (0.01 + 0.03) / 2; the 90th percentile by nearest
    # rank is the ceil(0.9 x 4) = 4th smallest, 0.10, which is also the worst
    assert s["cases"] == 4 and s["median_abs_error"] == pytest.approx(0.02)
    assert s["p90_abs_error"] == pytest.approx(0.10) and s["worst_abs_error"] == pytest.approx(0.10)
    assert (s["within_5pct"], s["within_2pct"]) == (3, 2)
    assert s["mean_error"] == pytest.approx((-0.01 + 0.03 - 0.10 + 0) / 4)


def test_an_inferred_row_is_marked():
    from dataclasses import replace

    from tracemem.validation.megatron_ci_board import format_board

    text = format_board([_row(100, 99), replace(_row(100, 97), name="y", inferred="why")],
                        [], [])
    assert "\ny *  " in text and "\nx  " in text
    assert "*: 1 case(s) scored with a launch or argument read from the case's history" in text


def test_the_command(capsys):
    assert main(["validate", "--against", "megatron-ci", "--ci-case", CASE]) == 0
    out = capsys.readouterr().out
    assert CASE in out and "4,702,430,720" in out and "Summary: 1 cases" in out
    assert main(["validate", "--against", "megatron-ci", "--ci-case", "no-such-case"]) == 2
    assert "names no scored case" in capsys.readouterr().err


FSDP = ["--use-megatron-fsdp", "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor",
        "--load", "/tmp/checkpoints/"]


@pytest.mark.parametrize("argv, before", [
    # Megatron-LM d98e8a6 checkpointing.py load_checkpoint: the fsdp_dtensor branch builds the
    # loading state dict (distrib_optimizer.py _init_optimizer_states_with_dummy_values: a
    # dummy FusedAdam step) even when the --load directory is empty
    (FSDP, True),
    (FSDP[:-2], False),  # no --load: load_checkpoint is not called (training.py setup)
    (FSDP + ["--no-load-optim"], False),
    (FSDP + ["--finetune"], False),
    (FSDP[:1] + FSDP[2:], False),  # no distributed optimizer: not sharded_param_state_fsdp_...
    (FSDP[:3] + ["torch_dist"] + FSDP[4:], False),  # the format detected on disk: none
    (FSDP[1:], False),  # not Megatron-FSDP
])
def test_optimizer_state_before_iteration_1(argv, before):
    assert state_before_first_step(argv) is before


def test_megatron_fsdp_with_fsdp_dtensor_makes_its_state_before_iteration_1():
    # gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor (H100): its iteration 1 measured within
    # 2 % of its iteration 2 (1,469,652,992 B): the moments exist from the start, so
    # iteration 1's figure is iteration 2's
    scored, _ = selection()
    case = next(c for c in scored
                if c.name == "gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor@dev_dgx_h100")
    assert state_before_first_step(case.argv)
    row = score_case(case)
    assert row.tracemem_first_bytes == row.tracemem_bytes


def test_the_residue_beyond_1_percent_is_itemised_with_what_is_known():
    from tracemem.validation.megatron_ci_board import moe_router, residue_leads

    # Megatron-LM d98e8a6's defaults: --moe-router-load-balancing-type aux_loss, topk 2
    assert moe_router(["--num-layers", "2"]) is None
    assert moe_router(["--num-experts", "8"]) == "aux_loss top-2"
    assert moe_router(["--num-experts", "8", "--moe-router-load-balancing-type", "sinkhorn",
                       "--moe-router-topk", "1"]) == "sinkhorn top-1"
    assert moe_router(["--num-experts", "8", "--moe-router-enable-expert-bias"]) \
        == "aux_loss top-2 + expert bias"

    def row(name, gpu, tracemem, router=None, key="a", container="NGC 26.04"):
        return BoardRow(name, gpu, 8, 2, 1_000, tracemem, tracemem, 0, 7, (),
                        router=router, args_key=key, container=container)
    moe = row("x@h100", "H100", 940, "aux_loss top-2")
    twin = row("x@gb200", "GB200", 995, "aux_loss top-2", container="NGC 26.02")
    alone = row("y@a100", "A100", 970, key="b")
    assert residue_leads(moe, [moe, twin, alone]) == [
        "routing: a learned aux_loss top-2 router (tracemem routes balanced; the run's expert "
        "loads are not logged)",
        "the same arguments: GB200 NGC 26.02 -0.5% (within 1 % there: the residue comes with this "
        "run's GPU, container or run)"]
    assert residue_leads(alone, [moe, twin, alone]) == ["unexplained"]


def test_an_empty_case_name_is_refused(capsys):
    # an empty part of a name is in every name: it would score the whole board
    assert main(["validate", "--against", "megatron-ci", "--ci-case", ""]) == 2
    assert capsys.readouterr().err == (
        "tracemem: error: --ci-case '' names every case; give a case's name or a part of one, "
        "such as tp1_pp4_vp1 (the board's first column)\n")
