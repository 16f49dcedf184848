"""The CLI's Megatron-LM front door: ``--megatron-args`` / ``@file`` / ``--megatron-config`` on
``estimate``, ``params``, ``static``, ``inventory`` and ``fit``; tracemem's typed flags override
the job and the output says so; answers printed back as Megatron-LM arguments (issue 20 items
2, 5).

References: the same job built in Python (``tracemem.frontdoors.megatron_job``) is the
independent side for the CLI's figures; Megatron-LM d98e8a6's flag names for the printed
arguments (``megatron/training/arguments.py``); hand arithmetic for M = G / (b x DP).
"""

import json
import shlex

import pytest

from tracemem.cli import main
from tracemem.estimator import estimate
from tracemem.frontdoors import megatron_job

# a small Megatron GPT with RoPE, SwiGLU and RMSNorm (no biases): 2 layers, h 64, 4 heads
ARGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
        "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 "
        "--tensor-model-parallel-size 2 --sequence-parallel --vocab-size 500 --bf16 "
        "--position-embedding-type rope --swiglu --normalization RMSNorm "
        "--disable-bias-linear --use-distributed-optimizer --lr 1e-4")


@pytest.fixture
def args_file(tmp_path):
    path = tmp_path / "job.args"
    path.write_text(ARGS.replace(" --micro", "\n--micro") + "\n")  # two lines
    return str(path)


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_estimate_from_an_args_file_is_the_python_job(capsys, args_file):
    code, out, _ = run(capsys, "estimate", "--world-size", "4", "--quiet", "--json",
                       "--megatron-args", f"@{args_file}")
    assert code == 0
    cli = json.loads(out)
    job = megatron_job(shlex.split(ARGS), world_size=4)
    # M = G / (b x DP) = 8 / (2 x 2) = 2; the vocabulary padded to 128 x TP 2 = 256: 512
    assert (job.microbatches, job.config.vocab_size) == (2, 512)
    api = estimate(job)
    assert [r["peak_bytes"] for r in cli["ranks"]] == [r.peak_bytes for r in api.ranks]
    assert cli["settings"]["num_microbatches"] == 2 and cli["settings"]["origin"] == "megatron"


def test_typed_flags_override_the_job_and_say_so(capsys, args_file):
    code, out, _ = run(capsys, "estimate", "--world-size", "4", "--quiet",
                       "--micro-batch-size", "1", "--megatron-args", f"@{args_file}")
    assert code == 0
    assert out.splitlines()[0] == ("tracemem's flags override the Megatron-LM job's: "
                                   "--micro-batch-size")
    assert "b=1, s=64, M=4" in out  # G 8 kept: 8 / (1 x 2)
    # tracemem's own settings (not Megatron arguments) are no override
    code, out, _ = run(capsys, "estimate", "--world-size", "4", "--quiet", "--hbm", "80GiB",
                       "--megatron-args", f"@{args_file}")
    assert code == 0 and "override" not in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt-tiny", "--megatron-args", "--num-layers", "2"],
     "--model and a Megatron-LM job (--megatron-config / --megatron-args) both describe the "
     "model; give one"),
    ([], "give --model (a preset or a config.json), or a Megatron-LM job"),
    (["--megatron-args", "--num-layer", "2"], "--num-layer"),
    (["--megatron-config", "/no/such/model_config.yaml"], "/no/such/model_config.yaml"),
])
def test_bad_megatron_input_is_one_line(capsys, argv, message):
    code, _, err = run(capsys, "estimate", "--world-size", "4", "--quiet", *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_print_megatron_args_round_trips(capsys, args_file):
    code, out, _ = run(capsys, "estimate", "--world-size", "4", "--print-megatron-args",
                       "--megatron-args", f"@{args_file}")
    assert code == 0
    printed = shlex.split(out.replace("\\\n", " "))
    assert "--tensor-model-parallel-size" in printed and "--sequence-parallel" in printed
    again, first = megatron_job(printed, world_size=4), megatron_job(shlex.split(ARGS),
                                                                     world_size=4)
    assert again.config == first.config
    assert (again.parallel, again.microbatches) == (first.parallel, first.microbatches)


def test_what_fits_answers_in_megatron_arguments(capsys, args_file):
    job = megatron_job(shlex.split(ARGS), world_size=4)
    worst = estimate(job.with_changes(hbm="80GiB")).worst
    hbm = worst.reserved_peak_bytes - 1  # just too small: the job does not fit
    code, out, _ = run(capsys, "estimate", "--world-size", "4", "--quiet", "--hbm", f"{hbm}B",
                       "--non-pytorch-memory", "0B", "--what-fits",
                       "--megatron-args", f"@{args_file}")
    assert code == 0 and "as Megatron-LM arguments" in out
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("--recompute full"))
    row = [lines[at]]  # the row and the lines its cells wrap onto (a blank first column)
    for line in lines[at + 1:]:
        if not line.startswith(" "):
            break
        row.append(line)
    assert "--recompute-granularity full" in " ".join(" ".join(row).split())
    assert "--ep 2" not in out  # a dense model: no expert parallelism to try


def test_what_fits_says_so_when_every_rank_fits(capsys, args_file):
    # found by the fresh-user trial: the README's --what-fits example fits, and the flag
    # printed nothing
    code, out, _ = run(capsys, "estimate", "--world-size", "4", "--quiet", "--hbm", "80GiB",
                       "--what-fits", "--megatron-args", f"@{args_file}")
    assert code == 0 and "What would fit" not in out
    assert out.rstrip().endswith("--what-fits: every rank fits already, so no change was "
                                 "re-estimated (it tries changes only for a job that does not "
                                 "fit).")


def test_params_static_inventory_take_the_job(capsys, args_file):
    code, out, _ = run(capsys, "params", "--world-size", "4", "--json",
                       "--megatron-args", f"@{args_file}")
    assert code == 0
    # by hand, h 64, 4 heads of 16 (MHA), padded vocab 512; with --swiglu Megatron's ffn is
    # int((4h x 2 / 3) / 64) x 64 = int(2.67) x 64 = 128 (arguments.py validate_args), fc1 2 x 128
    # per layer: 2 RMSNorms 128 + qkv 64 x 192 + proj 64 x 64 + fc1 64 x 256 + fc2 128 x 64
    layer = 128 + 64 * 192 + 64 * 64 + 64 * 256 + 128 * 64
    # embeddings tied (Megatron's default): one 512 x 64 table, and the final norm
    assert json.loads(out)["total"] == 2 * layer + 512 * 64 + 64
    code, out, _ = run(capsys, "static", "--world-size", "4", "--json",
                       "--megatron-args", f"@{args_file}")
    assert code == 0 and json.loads(out)["parallel"]["tp"] == 2
    code, out, _ = run(capsys, "inventory", "--world-size", "4", "--json",
                       "--megatron-args", f"@{args_file}")
    assert code == 0 and json.loads(out)[0]["settings"]


def test_fit_takes_the_job_and_answers_in_its_arguments(capsys, args_file):
    code, out, _ = run(capsys, "fit", "--world-size", "4", "--hbm", "1GiB", "--quiet",
                       "--workers", "1", "--tp", "2", "--pp", "1", "--recompute", "none",
                       "--micro-batch-size", "1,2", "--megatron-args", f"@{args_file}")
    assert code == 0, out
    best = next(line for line in out.splitlines() if line.startswith("best"))
    # the first row ranked (b 1 or 2, both fit in 1 GiB: the same cost); b 2 is the job's
    assert best.startswith("best, as changes to the Megatron-LM arguments: ")


def test_printed_arguments_read_back_as_an_args_file(capsys, args_file, tmp_path):
    # --print-megatron-args writes a launch script's lines, continued with " \"
    code, out, _ = run(capsys, "estimate", "--world-size", "4", "--print-megatron-args",
                       "--megatron-args", f"@{args_file}")
    printed = tmp_path / "printed.args"
    printed.write_text(out)
    assert out.count(" \\\n") >= 10
    code2, out2, _ = run(capsys, "estimate", "--world-size", "4", "--print-megatron-args",
                         "--megatron-args", f"@{printed}")
    assert (code, code2) == (0, 0) and out2 == out


def test_a_tracemem_flag_after_megatron_args_is_named(capsys, args_file):
    code, _, err = run(capsys, "estimate", "--world-size", "4", "--quiet",
                       "--megatron-args", f"@{args_file}", "--hbm", "80GiB")
    assert code == 2 and err.strip() == (
        "tracemem: error: --hbm is tracemem's flag, not Megatron-LM's: give it before "
        "--megatron-args (everything after that is Megatron's)")
    code, _, err = run(capsys, "estimate", "--world-size", "4", "--quiet", "--vocab-size", "0",
                       "--megatron-args", f"@{args_file}")
    assert code == 2 and "--vocab-size 0 must be a positive integer" in err


def test_a_new_pp_restates_megatron_s_virtual_stages(capsys, tmp_path):
    # 8 layers, PP 2, 2 layers per virtual stage: VPP = 8 / (2 x 2) = 2; with --pp 4 the job
    # keeps VPP 2, which --num-layers-per-virtual-pipeline-stage 2 would now make 1, so the
    # printed arguments state VPP itself
    path = tmp_path / "vpp.args"
    path.write_text(ARGS.replace("--tensor-model-parallel-size 2 --sequence-parallel ", "")
                    .replace("--num-layers 2", "--num-layers 8")
                    + " --pipeline-model-parallel-size 2"
                      " --num-layers-per-virtual-pipeline-stage 2")
    code, out, _ = run(capsys, "estimate", "--world-size", "4", "--pp", "4",
                       "--print-megatron-args", "--megatron-args", f"@{path}")
    words = out.replace("\\\n", " ").split()
    assert code == 0 and "--num-layers-per-virtual-pipeline-stage" not in words
    assert words[words.index("--num-virtual-stages-per-pipeline-rank") + 1] == "2"
    assert words[words.index("--pipeline-model-parallel-size") + 1] == "4"


def test_another_kernel_profile_drops_the_job_s_megatron_kernel_options(capsys, args_file):
    code, out, err = run(capsys, "estimate", "--world-size", "4", "--quiet", "--kernels",
                         "eager", "--megatron-args", f"@{args_file}")
    assert code == 0, err
    assert out.splitlines()[0] == "tracemem's flags override the Megatron-LM job's: --kernels"
    assert "kernels eager" in out


def test_an_empty_megatron_args_and_a_printed_override(capsys, args_file):
    code, _, err = run(capsys, "estimate", "--world-size", "4", "--megatron-args")
    assert code == 2 and err.strip() == (
        "tracemem: error: --megatron-args needs Megatron-LM arguments after it (or @FILE); it "
        "takes everything that follows it, so give it last")
    # printed arguments stay alone on stdout (an @FILE); the override is said on stderr
    code, out, err = run(capsys, "estimate", "--world-size", "4", "--tp", "4",
                         "--print-megatron-args", "--megatron-args", f"@{args_file}")
    assert code == 0 and out.startswith("--")
    assert "tracemem's flags override the Megatron-LM job's: --tp" in err


def test_a_required_tracemem_flag_after_megatron_args_is_named_not_missing(capsys, args_file):
    # argparse would say "the following arguments are required: --world-size"
    code, _, err = run(capsys, "estimate", "--quiet", "--megatron-args", f"@{args_file}",
                       "--world-size", "4")
    assert code == 2 and err.strip() == (
        "tracemem: error: --world-size is tracemem's flag, not Megatron-LM's: give it before "
        "--megatron-args (everything after that is Megatron's)")
