"""The command line: values printed, and one-line errors with exit code 2.

Reference: hand arithmetic of the demo model's parameter count (numel * 4 B in float32).
"""

import json

import pytest

from tracemem.cli import build_parser, main
from tracemem.report import to_units

TINY = ["toy", "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "100", "--dtype", "float32"]

# embedding 100*64; block: 2 LayerNorms 2*(64+64), wqkv 64*192, wo 64*64,
# w1 64*256 + 256, w2 256*64 + 64; final LayerNorm 64+64; head 64*100.
TINY_PARAMS = 100 * 64 + 2 * 128 + 64 * 192 + 64 * 64 + 64 * 256 + 256 + 256 * 64 + 64 + 128 \
    + 64 * 100


def test_toy_json_reports_parameters_gradients_and_adam_states_at_the_peak(capsys):
    assert main(TINY + ["--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    categories = summary["by_category"]
    assert TINY_PARAMS == 62656
    assert categories["parameter"] == categories["gradient"] == TINY_PARAMS * 4
    assert categories["optimizer_state"] == 2 * TINY_PARAMS * 4  # exp_avg, exp_avg_sq
    assert summary["peak_event"]["phase"] == "optimizer"
    assert summary["peak_bytes"] == sum(categories.values())


def test_toy_table_prints_gib(capsys):
    assert main(TINY) == 0
    out = capsys.readouterr().out
    assert "GiB" in out and "optimizer_state" in out and "% of peak" in out


def test_validate_json_matches_the_real_peak(capsys):
    assert main(["validate", "--case", "mlp", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["real_peak_bytes"] == row["traced_peak_bytes"] > 0


@pytest.mark.parametrize("argv, message", [
    (TINY[:-2] + ["--num-attention-heads", "5"],
     "--num-attention-heads 5 must divide --hidden-size 64; try"),
    (["toy", "--seq-length", "0"], "argument --seq-length: 0 must be a positive integer"),
    (["toy", "--micro-batch-size", "two"], "argument --micro-batch-size: 'two' is not an integer"),
    (["toy", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["toy", "--units", "TB"], "argument --units: invalid choice: 'TB'"),
    (["estimate", "--units", "gb2"], "argument --units: invalid choice: 'gb2'"),
    (["demo", "--seq-length", "0"], "argument --seq-length: 0 must be a positive integer"),
    (["validate", "--case", "nope"], "--case 'nope' is not a CPU case; choose from mlp, "),
    (["validate", "--against", "torchtitan", "--case", "mlp"],
     "--case names a CPU case (--against cpu); --against torchtitan runs its own cases"),
    (["trace"], "argument COMMAND: invalid choice: 'trace'"),
    (["estimate"], "give --world-size (the number of GPUs), or a --recipe"),
    (["toy", "--tp", "2"], "error: unrecognized argument --tp (see tracemem toy --help)"),
    # the fourth trial's: --ci-case was ignored by megatron-core's oracle; --top was checked
    # only after fit's search had run
    (["validate", "--against", "megatron-core", "--ci-case", "x"],
     "--ci-case and --left-out apply to --against megatron-ci"),
    (["fit", "--model", "llama-tiny", "--world-size", "2", "--hbm", "80GiB", "--seq-length",
      "16", "--global-batch-size", "4", "--top", "0"], "--top 0 must be a positive integer"),
])
def test_usage_errors_are_one_line_and_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        code = main(argv)
        raise SystemExit(code)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flags, message", [
    # issue 26: two given values are invalid and --micro-batch-size is missing: the first
    # invalid one, in the Job's order of checks, is said first
    ("--world-size -4 --hbm 80XB --seq-length 64",
     "--world-size -4 must be a positive integer"),
    ("--world-size 4 --hbm 80XB --seq-length 64",
     "--hbm '80XB' is invalid; give a positive size of whole bytes such as 80GiB (binary: KiB, "
     "MiB, GiB, TiB), 80GB (decimal: kB, MB, GB, TB) or a byte count of 1 MiB or more"),
    ("--world-size 4 --hbm 80XB --micro-batch-size 1 --seq-length 64",  # no M either
     "--hbm '80XB' is invalid; give a positive size of whole bytes such as 80GiB (binary: KiB, "
     "MiB, GiB, TiB), 80GB (decimal: kB, MB, GB, TB) or a byte count of 1 MiB or more"),
    ("--world-size 4 --tp 2 --sp --seq-length 63",  # b missing; s given, and invalid
     "--seq-length 63 must be a multiple of cp * sp = 2 (the sequence is split across them)"),
    # every given value valid: the missing ones, b first, then s, then the batch
    ("--world-size 4 --hbm 80GB --seq-length 64", "give --micro-batch-size"),
    ("--world-size 4 --micro-batch-size 1", "give --seq-length"),
    ("--world-size 4 --micro-batch-size 1 --seq-length 64",
     "give --num-microbatches (M, per pipeline per step) or --global-batch-size (G sequences "
     "per step; M = G / (b x DP))"),
    # a check the missing value's stand-in would fail is not the user's: it names the flag
    ("--world-size 4 --global-batch-size 6 --seq-length 64", "give --micro-batch-size"),
])
def test_an_invalid_given_value_is_said_before_a_missing_one(capsys, flags, message):
    assert main(["estimate", "--model", "deepseek-tiny", "--quiet", *flags.split()]) == 2
    assert capsys.readouterr().err == f"tracemem: error: {message}\n"


def test_every_flag_has_help():
    parser = build_parser()
    subparsers = parser._subparsers._group_actions[0].choices
    for sub in subparsers.values():
        for action in sub._actions:
            assert action.help, f"{sub.prog} {action.option_strings} has no help"


def test_units_whitelist():
    assert to_units(3 * 2**30, "GiB") == 3.0
    assert to_units(3 * 10**9, "GB") == 3.0
    with pytest.raises(ValueError,
                       match="units='TB' is invalid; choose one of B, KiB, MiB, GiB, GB"):
        to_units(1, "TB")


def test_vpp_without_a_schedule_runs_the_interleaved_schedule_as_megatron_does(capsys):
    # Megatron-LM: a virtual pipeline size selects the interleaved schedule
    # (schedules.py get_forward_backward_func); a typed --schedule is kept and checked
    argv = ["estimate", "--model", "llama-tiny", "--world-size", "2", "--pp", "2", "--vpp", "2",
            "--micro-batch-size", "1", "--seq-length", "16", "--num-microbatches", "4",
            "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["schedule"] == "interleaved-1f1b"
    assert main([*argv, "--schedule", "1f1b"]) == 2
    assert "--vpp 2 needs --schedule interleaved-1f1b" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    ("--model llama-tiny --vocab-size 5",
     "--vocab-size applies to a Megatron-LM job that reads its vocabulary from a tokenizer "
     "file (--megatron-args / --megatron-config); a --model or --recipe gives its own"),
    ("--vocab-size -5 --megatron-args @docs/examples/megatron-pr6429-arm-c.args",
     "--vocab-size -5 must be a positive integer (the tokenizer's vocabulary before padding)"),
    ("--vocab-size 5000 --megatron-args @docs/examples/megatron-pr6429-arm-c.args",
     "--vocab-size 5000 is not used: the job gives --padded-vocab-size, which Megatron uses "
     "as given; drop --vocab-size"),
])
def test_a_vocab_size_that_would_go_unused_is_refused(flags, message, capsys, monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).parents[2])
    assert main(["estimate", "--world-size", "64", *flags.split()]) == 2
    assert message in capsys.readouterr().err


def test_ctrl_c_is_a_line_not_a_traceback(monkeypatch, capsys):
    import tracemem.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "_run_toy", interrupted)
    assert main(["toy"]) == 130  # 128 + SIGINT, as a shell reports it
    assert capsys.readouterr().err == "tracemem: toy interrupted\n"


def test_fit_progress_says_the_closest_apart_from_the_layouts(monkeypatch, capsys):
    # deepseek-tiny on 4 GPUs, 4 layouts, 1 closest estimated in full (test_fit.py's
    # test_fit_rows_agree_with_estimate): the last line counts it apart
    monkeypatch.setattr("tracemem.cli.PROGRESS_INTERVAL_S", 0)  # every line, piped
    assert main(["fit", "--model", "deepseek-tiny", "--world-size", "4", "--hbm", "1GiB",
                 "--seq-length", "64", "--global-batch-size", "4", "--tp", "1,2", "--ep", "2",
                 "--pp", "1,2", "--recompute", "none", "--zero", "1", "--kernels", "eager",
                 "--non-pytorch-memory", "1020MiB", "--closest", "1", "--workers", "1"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "fit:" in line]
    assert lines[-1].startswith("tracemem: fit: 4/4 layouts, the closest 1/1 in full, traces ")
