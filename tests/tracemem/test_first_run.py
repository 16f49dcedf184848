"""A new user's first run (issue 16 items 2-5): one name per thing, a table that explains itself,
a verdict, what would fit (each change re-estimated), and units that show small figures.

References: Megatron-Core's rank order (megatron/core/parallel_state.py, order "tp-cp-ep-dp-pp":
PP slowest, so stage p of world W at PP P is ranks p * W / P to (p + 1) * W / P - 1); the
megatron precision recipe (bf16 parameters 2 B, fp32 main grads 4 B: Megatron-LM
theoretical_memory_usage); hand arithmetic for units; a direct ``estimate`` run of each
change for the what-fits figures. Issue 26's first-run items (the tests at the end): SI
decimal units (1 GB = 10^9 B) beside IEC binary ones (1 GiB = 2^30 B), the presets' Hugging Face
repositories (each preset's "_comment" names its source), argparse's own flag names for the
did-you-mean, and a fake clock for the progress interval.
"""

import json
from pathlib import Path

import pytest

from modeling import load_config
from tracemem.advice import what_fits
from tracemem.cli import main
from tracemem.estimator import estimate
from tracemem.errors import TracememError
from tracemem.parallel import ParallelConfig
from tracemem.schedules import Step
from tracemem.report import (
    format_estimate,
    format_size,
    format_verdict,
    get_estimate,
    get_verdict,
    pick_units,
    stage_ranks,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(world_size=4, tp=2, sp=True, pp=2, micro_batch_size=2, seq_length=64,
            num_microbatches=4, experts="sequential", non_pytorch_memory="0B")
TOY = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
       "--seq-length", "16", "--vocab-size", "100", "--dtype", "float32", "--json"]


@pytest.fixture(scope="module")
def tiny():
    return estimate("deepseek-tiny", **TINY)


# item 2: `make demo` is the DeepSeek-V3 estimate; the toy transformer is `tracemem toy`

def test_make_demo_runs_estimate_and_the_toy_has_its_own_name(capsys):
    makefile = (ROOT / "Makefile").read_text()
    demo = makefile[makefile.index("\ndemo:"):].splitlines()[2]
    assert demo.strip() == "$(BIN)/tracemem estimate $(DEMO_ARGS)"
    assert main(["toy", *TOY]) == 0
    toy = capsys.readouterr()
    assert toy.err == ""
    assert main(["demo", *TOY]) == 0  # the deprecated alias: same output, and it says so
    alias = capsys.readouterr()
    assert alias.out == toy.out
    assert alias.err.strip() == (
        "tracemem: note: 'tracemem demo' is now 'tracemem toy' (this small built-in "
        "transformer); 'make demo' runs 'tracemem estimate' on DeepSeek-V3. The 'demo' alias "
        "will be removed.")


# item 3: ranks per stage, EP rank, step notation and gradients explained

def test_stage_ranks_follow_megatrons_order():
    par = ParallelConfig.create(load_config("deepseek-v3"), world_size=1024, tp=2, sp=True,
                                pp=16, ep=8, pp_first_stage_layers=4, pp_last_stage_layers=1)
    spans = stage_ranks(par)
    # 1024 / 16 = 64 ranks per stage, PP outermost: stage 1 = ranks 64-127
    assert spans[0] == [(0, 63)] and spans[1] == [(64, 127)] and spans[15] == [(960, 1023)]


def test_the_table_explains_itself(tiny):
    out = format_estimate(tiny, units="MiB", wide=True)
    lines = out.splitlines()
    header = next(line for line in lines if line.strip().startswith("stage"))
    assert header.split()[:4] == ["stage", "ranks", "EP", "rank"] and "at step" in header
    rows = [line.split() for line in lines if line.strip()[:1].isdigit()]
    # world 4, PP 2: stage 0 = ranks 0-1, stage 1 = ranks 2-3 (TP 2 fastest)
    assert [row[:3] for row in rows] == [["0", "0-1", "-"], ["1", "2-3", "-"]]
    assert "Memory columns in MiB (2^20 B): what is alive at each row's peak." in lines
    assert ("ranks: the stage's global ranks, 2 per stage (Megatron's rank order: TP fastest, "
            "then CP, DP, and PP slowest).") in lines
    assert 'EP rank "-": no expert parallelism (EP 1).' in lines
    assert ("grads: 4 B (fp32 main grads) per parameter against 2 B (bf16) for params under "
            "--precision megatron, hence twice params.") in lines
    step = Step.parse(tiny.worst.peak_step)  # e.g. 1B0: stage 1, backward, microbatch 0
    kind = {"F": "forward", "B": "backward"}[step.kind]
    assert (f"at step: the schedule step running at the peak, stage + kind + microbatch: "
            f"{step} = stage {step.stage}, {kind}, microbatch {step.microbatch} "
            f"(F = forward, B = backward).") in lines
    for r in tiny.ranks:  # ZeRO-1: gradients unsharded, 4 B against 2 B
        assert r.gradient_bytes >= 2 * r.parameter_bytes


def test_the_grads_legend_says_where_a_backward_adds_its_bf16_gradient(capsys):
    # stage 0 of a tied GPT under PP 4 + VPP peaks in a backward whose embedding gradient,
    # [32,000, 512] bf16 = 31.25 MiB, is alive before it is added to the main grad: its grads
    # are more than twice its params, and the legend says why (the second fresh-user trial)
    assert main(["estimate", "--world-size", "8", "--vocab-size", "32000", "--units", "MiB",
                 "--quiet", "--megatron-args", "--num-layers", "8", "--hidden-size", "512",
                 "--num-attention-heads", "8", "--seq-length", "1024",
                 "--max-position-embeddings", "1024", "--micro-batch-size", "1",
                 "--global-batch-size", "16", "--bf16",
                 "--num-layers-per-virtual-pipeline-stage", "1", "--use-distributed-optimizer",
                 "--pipeline-model-parallel-size", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    stage0 = next(line.split() for line in lines if line.strip().startswith("0 "))
    params, grads = float(stage0[2]), float(stage0[3])
    assert 32_000 * 512 * 2 / 2**20 == 31.25
    assert abs(grads - 2 * params - 31.25) <= 0.02  # the table's two decimals, each rounded
    assert ("grads: 4 B (fp32 main grads) per parameter against 2 B (bf16) for params under "
            "--precision megatron, hence twice params (more where the peak is inside a "
            "backward: the bf16 gradient it is making, until added to the main grad).") in lines


def test_a_store_false_flag_over_a_megatron_job_is_named_as_typed(capsys):
    # the note names tracemem's flag (--no-overlap-p2p-communication), not the field it sets
    assert main(["estimate", "--world-size", "8", "--vocab-size", "32000", "--quiet",
                 "--no-overlap-p2p-communication", "--no-create-attention-mask-in-dataloader",
                 "--megatron-args", "--num-layers", "8", "--hidden-size", "512",
                 "--num-attention-heads", "8", "--seq-length", "1024",
                 "--max-position-embeddings", "1024", "--micro-batch-size", "1",
                 "--global-batch-size", "16", "--bf16",
                 "--num-layers-per-virtual-pipeline-stage", "1", "--use-distributed-optimizer",
                 "--pipeline-model-parallel-size", "4"]) == 0
    assert ("tracemem's flags set what the Megatron-LM job leaves to its default: "
            "--no-create-attention-mask-in-dataloader, --no-overlap-p2p-communication"
            ) in capsys.readouterr().out.splitlines()


def test_ep_rank_dash_is_explained_under_expert_parallelism():
    result = estimate("deepseek-tiny", world_size=4, ep=4, pp=1, micro_batch_size=2,
                      seq_length=32, num_microbatches=2, experts="sequential")
    # the wide table has the EP rank column, "-" in every row; the default none, one row a stage
    assert ('EP rank "-": the stage\'s 4 EP ranks hold the same under balanced routing, so '
            "one traced rank stands for all.") in format_estimate(result, wide=True).splitlines()
    assert ("EP ranks: the stage's 4 EP ranks hold the same under balanced routing, so one "
            "traced rank stands for all (one row per stage).") in format_estimate(
                result).splitlines()


def test_ep_rank_rows_and_dash_are_explained_under_skewed_routing():
    result = estimate("deepseek-tiny", world_size=8, ep=4, pp=2, micro_batch_size=2,
                      seq_length=32, num_microbatches=2, routing="zipf:1.0",
                      experts="sequential")
    # stage 0 holds the dense layers 0-1 only (first_k_dense_replace 2): every EP rank alike
    assert result.ranks[0].ep_rank is None and any(r.ep_rank is not None for r in result.ranks)
    legend = next(line for line in format_estimate(result).splitlines()
                  if line.startswith("EP rank:"))
    assert legend.endswith('"-": all of the stage\'s EP ranks alike (no MoE layer there, or the '
                           'same counts).')


def test_a_peak_in_the_optimizer_step_is_explained(tiny):
    from dataclasses import replace

    # the estimator writes "optimizer" for a peak in the optimizer step after the schedule
    ranks = [replace(r, peak_step="optimizer") if r.pp_stage == 0 else r for r in tiny.ranks]
    lines = format_estimate(replace(tiny, ranks=ranks), units="MiB").splitlines()
    line = next(line for line in lines if line.startswith("at step:"))
    assert line.endswith("(F = forward, B = backward); optimizer = the optimizer step after the "
                         "schedule's last step.")


def test_json_gives_the_ranks_of_each_stage(tiny):
    data = get_estimate(tiny)
    assert [r["stage_ranks"] for r in data["ranks"]] == [[[0, 1]], [[2, 3]]]


# item 4: a verdict, and what would fit (each change re-estimated)

def _between(tiny):
    """An HBM size between the two stages' reserved peaks (what --hbm is judged on, with no
    non-PyTorch memory), in bytes, so that stage 1 alone is over."""
    low, high = sorted(r.reserved_peak_bytes for r in tiny.ranks)
    assert tiny.worst.pp_stage == 1 and low < high
    return (low + high) // 2


def test_verdict_counts_the_stages_over_hbm(tiny):
    hbm, peak = _between(tiny), tiny.worst.peak_bytes
    needed = max(r.reserved_peak_bytes for r in tiny.ranks)  # + 0 B outside PyTorch
    over = estimate("deepseek-tiny", hbm=f"{hbm}B", **TINY)
    verdict = get_verdict(over)
    assert verdict["stages_over_hbm"] == [1] and verdict["fits"] is False
    assert format_verdict(verdict, "B") == (
        f"Verdict: 1 of 2 pipeline stages exceeds {hbm:,} B (stage 1); the worst is stage 1 at "
        f"{peak:,} B; the most a rank needs is {needed:,} B (reserved + non-PyTorch memory).")
    fits = estimate("deepseek-tiny", hbm="64MiB", **TINY)
    assert format_verdict(get_verdict(fits), "MiB") == (
        f"Verdict: all 2 pipeline stages fit in 64 MiB; the worst is stage 1 at "
        f"{peak / 2**20:.2f} MiB; it needs {needed / 2**20:.2f} MiB (reserved + "
        f"non-PyTorch memory): {(64 * 2**20 - needed) / 2**20:.2f} MiB to spare.")
    assert format_verdict(get_verdict(tiny), "MiB").endswith(
        f"the most a rank needs is {needed / 2**20:.2f} MiB (reserved + non-PyTorch memory); "
        f"give --hbm (e.g. 80GiB) to say whether it fits.")
    # the non-PyTorch memory shows without --hbm too: 512 MiB by default
    default = estimate("deepseek-tiny", **(TINY | {"non_pytorch_memory": "512MiB"}))
    assert f"needs is {(needed + 2**29) / 2**20:.2f} MiB" in format_verdict(
        get_verdict(default), "MiB")


@pytest.fixture(scope="module")
def fitted(tiny):
    """The tiny job over an HBM between its stages' needs, and its what-fits candidates."""
    base = estimate("deepseek-tiny", **dict(TINY, hbm=f"{_between(tiny)}B"))
    return base, what_fits(base)


def test_what_fits_re_estimates_each_change(tiny, fitted):
    hbm = _between(tiny)
    kwargs = dict(TINY, hbm=f"{hbm}B")
    base, candidates = fitted
    by_change = {c.change: c for c in candidates}
    assert set(by_change) == {
        "--recompute selective", "--recompute full",
        "--micro-batch-size 1 --num-microbatches 8", "--zero 2", "--zero 3",
        "--optimizer-cpu-offload --use-precision-aware-optimizer", "--ep 2",
        "--pp 4 --num-microbatches 8"}
    # each figure is that of a direct estimate with the change
    full = estimate("deepseek-tiny", **dict(kwargs, recompute="full"))
    assert by_change["--recompute full"].worst_peak_bytes == full.worst.peak_bytes
    needed = max(r.reserved_peak_bytes for r in full.ranks)
    assert by_change["--recompute full"].worst_needed_bytes == needed
    assert by_change["--recompute full"].fits == (needed <= hbm)
    half = estimate("deepseek-tiny", **dict(kwargs, micro_batch_size=1, num_microbatches=8))
    assert by_change["--micro-batch-size 1 --num-microbatches 8"].worst_peak_bytes \
        == half.worst.peak_bytes
    # world 4 at TP 2 has no room for PP 4: skipped with the validator's message
    assert by_change["--pp 4 --num-microbatches 8"].skipped == (
        "--world-size 4 is not a multiple of tp(2) * cp(1) * pp(4) = 8; DP would not be an "
        "integer; try --world-size 8, or --pp 2")
    tried = [c for c in candidates if c.skipped is None]
    assert tried == sorted(tried, key=lambda c: (not c.fits, c.worst_peak_bytes))
    data = get_estimate(base, candidates)
    assert data["what_fits"][0]["change"] == tried[0].change
    assert data["verdict"]["stages_over_hbm"] == [1]
    text = format_estimate(base, units="B", fits=candidates)
    assert (f"What would fit in {hbm:,} B: each line changes one setting and re-estimates "
            f"every stage") in text
    assert ("Not tried: --pp 4 --num-microbatches 8: --world-size 4 is not a multiple of "
            "tp(2)") in text


def test_what_fits_needs_hbm(capsys, tiny):
    with pytest.raises(ValueError, match=r"what_fits needs hbm \(e.g. --hbm 80GiB\)"):
        what_fits(tiny)
    assert main(["estimate", "--model", "deepseek-tiny", "--world-size", "4",
                 "--micro-batch-size", "1", "--seq-length", "16", "--num-microbatches", "1",
                 "--what-fits", "--quiet"]) == 2
    assert capsys.readouterr().err.strip() == (
        "tracemem: error: --what-fits needs --hbm (e.g. --hbm 80GiB): the memory to fit in")


# item 5: units

def test_units_by_hand():
    assert format_size(3 * 2**30 // 2, "GiB") == "1.50"
    assert format_size(10**9, "GB") == "1.00" and format_size(10**9, "GiB") == "0.93"
    assert format_size(2**20 * 5, "MiB") == "5.00"
    assert format_size(1234567, "B") == "1,234,567"
    assert format_size(0, "GiB") == "0" and format_size(512, "GiB") == "<0.01"
    assert pick_units(80 * 2**30) == "GiB" and pick_units(4 * 2**20) == "MiB"
    assert pick_units(2**30 - 1) == "MiB" and pick_units(1000) == "B"


def test_small_models_do_not_read_zero(capsys, tiny):
    # deepseek-tiny peaks at a few MiB: auto picks MiB; in GiB every figure would be < 0.01
    assert tiny.worst.peak_bytes < 2**30
    auto = format_estimate(tiny, units="auto")
    assert "Memory columns in MiB (2^20 B)" in auto
    assert "0.00" not in format_estimate(tiny, units="GiB")
    assert main(["static", "--model", "deepseek-tiny", "--world-size", "4", "--tp", "2",
                 "--pp", "2", "--units", "B"]) == 0
    out = capsys.readouterr().out
    assert "params B" in out and "(B = bytes; one row per pipeline stage)" in out
    assert main(["static", "--model", "deepseek-tiny", "--world-size", "4", "--tp", "2",
                 "--pp", "2", "--json"]) == 0
    stage1 = json.loads(capsys.readouterr().out)["stages"][1]
    assert main(["static", "--model", "deepseek-tiny", "--world-size", "4", "--tp", "2",
                 "--pp", "2", "--units", "MiB"]) == 0
    row = next(line.split() for line in capsys.readouterr().out.splitlines()
               if line.split()[:2] == ["1", "2-3"])
    assert row[-1] == f"{stage1['total_bytes'] / 2**20:.2f}"


def test_stage_ranks_agree_with_coordinates_and_answer_for_any_world_size():
    # every rank of a span has that pipeline rank (modeling.parallel.build.coordinates); a
    # world of 10^12 GPUs is answered from the spans, without visiting each rank
    from modeling.parallel.build import coordinates
    par = ParallelConfig.create(load_config("deepseek-tiny"), world_size=16, tp=2, pp=2, ep=2)
    spans = stage_ranks(par)
    assert spans == {0: [(0, 7)], 1: [(8, 15)]}
    assert all(coordinates(par, r).pp_rank == stage
               for stage, [(a, b)] in spans.items() for r in range(a, b + 1))
    huge = ParallelConfig.create(load_config("deepseek-tiny"), world_size=10**12, pp=2)
    assert stage_ranks(huge)[1] == [(5 * 10**11, 10**12 - 1)]


# issue 26: units, names, typos, progress when piped, files written, what-fits' ZeRO

def test_hbm_takes_decimal_binary_and_plain_bytes():
    from tracemem.job import parse_bytes, size_unit

    assert parse_bytes("80GB") == 80 * 10**9 and size_unit("80GB") == "decimal"
    assert parse_bytes("80 gb") == 80 * 10**9  # case and a space do not matter
    assert parse_bytes("80GiB") == 80 * 2**30 and size_unit("80GiB") == "binary"
    assert parse_bytes("141GB") == 141 * 10**9 and parse_bytes("1.5TB") == 15 * 10**11
    assert parse_bytes("85899345920") == 80 * 2**30 and size_unit("85899345920") == "bytes"
    with pytest.raises(TracememError, match=r"--hbm '80' is 80 bytes; give a unit, such as "
                                            r"80GB \(decimal\) or 80GiB \(binary\)"):
        parse_bytes("80")


def test_the_verdict_says_a_decimal_hbm_is_one():
    verdict = {"pp_stages": 2, "hbm_bytes": 80 * 10**9, "stages_over_hbm": [], "fits": True,
               "worst_pp_stage": 0, "worst_ep_rank": None, "worst_peak_bytes": 2**30,
               "worst_needed_bytes": 2**31}
    # 80e9 B / 2^30 = 74.5058 GiB; spare 80e9 - 2^31 = 77,852,516,352 B = 72.5058 GiB
    assert format_verdict(verdict, "GiB", "80GB") == (
        "Verdict: all 2 pipeline stages fit in --hbm 80GB (decimal units, 1 GB = 10^9 B; = "
        "74.51 GiB); the worst is stage 0 at 1.00 GiB; it needs 2.00 GiB (reserved + non-PyTorch "
        "memory): 72.51 GiB to spare.")
    binary = verdict | {"hbm_bytes": 80 * 2**30}
    assert "fit in 80 GiB;" in format_verdict(binary, "GiB", "80GiB")  # as before


@pytest.mark.parametrize("name, preset", [
    ("DeepSeek-V3", "deepseek-v3"), ("deepseek-ai/DeepSeek-V3", "deepseek-v3"),
    ("DEEPSEEK-TINY", "deepseek-tiny"), ("meta-llama/Meta-Llama-3-8B", "llama-3-8b"),
    ("Mixtral-8x7B-v0.1", "mixtral-8x7b"), ("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b"),
])
def test_presets_match_in_any_case_and_by_hugging_face_repository(name, preset):
    assert load_config(name).name == preset


def test_an_unknown_model_gets_a_close_preset_or_the_hub_note():
    with pytest.raises(TracememError, match=r"did you mean 'deepseek-v3'\?"):
        load_config("deepsek-v3")
    with pytest.raises(TracememError, match=r"tracemem reads no model hub: download the "
                                            r"repository's config.json and give its path"):
        load_config("some-org/Some-Model")


@pytest.mark.parametrize("typo, meant", [("--recompte", "--recompute"),
                                         ("--world-szie", "--world-size")])
def test_a_mistyped_flag_is_named_with_the_closest(capsys, typo, meant):
    argv = ["estimate", "--model", "deepseek-tiny", typo, "1"]
    if typo != "--world-szie":
        argv += ["--world-size", "1"]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err == (f"tracemem estimate: error: unrecognized argument "
                                       f"{typo}; did you mean {meant}? (see tracemem estimate "
                                       f"--help)\n")


def test_progress_when_piped_is_plain_lines_at_most_every_few_seconds():
    import io

    from tracemem.cli import _Progress

    now = [0.0]
    stream = io.StringIO()  # not a terminal
    progress = _Progress(stream, interval=5.0, clock=lambda: now[0])  # started at t = 0
    for t, stage in ((1, 1), (4.9, 2), (5.5, 3), (6, 4), (10, 5), (10.5, 6), (12, 7)):
        now[0] = t
        progress(f"tracing pipeline stage {stage}/8")
    progress.done()  # nothing to clear off a log
    # t 1 and 4.9: under 5 s since the start (a quick run prints nothing); 5.5: a line;
    # 6 and 10: under 5 s since it; 10.5: a line; 12: under 5 s since
    assert stream.getvalue() == ("tracemem: tracing pipeline stage 3/8\n"
                                 "tracemem: tracing pipeline stage 6/8\n")
    # done(held=True) (fit's counts): the message held back at t 12 ends the log, once
    progress.done(held=True)
    progress.done(held=True)
    assert stream.getvalue().splitlines()[2:] == ["tracemem: tracing pipeline stage 7/8"]
    quick = _Progress(io.StringIO(), interval=5.0, clock=lambda: 1.0)
    quick("fit: 1/2 layouts")
    quick.done(held=True)  # nothing printed before: a quick run stays silent
    assert quick.stream.getvalue() == ""


def test_estimate_piped_says_it_works_and_names_the_files_it_wrote(capsys, tmp_path,
                                                                    monkeypatch):
    import tracemem.cli as cli

    monkeypatch.setattr(cli, "PROGRESS_INTERVAL_S", 0)  # every message, for the test
    argv = ["estimate", "--model", "deepseek-tiny", "--world-size", "1",
            "--micro-batch-size", "1", "--seq-length", "16", "--num-microbatches", "1",
            "--kernels", "eager", "--snapshot", str(tmp_path / "snaps"), "--json"]
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "tracemem: tracing pipeline stage 1/1",
        "tracemem: replaying pipeline stage 1/1 through the schedule",
        "tracemem: simulating the caching allocator for pipeline stage 1/1",
        f"tracemem: wrote 1 snapshot (one per rank class) into {tmp_path / 'snaps'}/: "
        f"stage0.pickle; open them at https://pytorch.org/memory_viz or with python -m "
        f"torch.cuda._memory_viz"]
    assert (tmp_path / "snaps" / "stage0.pickle").is_file()
    # --plot's line (drawing it takes a second; the sentence is what is checked here)
    import argparse

    from tracemem.cli import _say_written

    _say_written(argparse.Namespace(snapshot=None, plot="step.svg"), 0)
    assert capsys.readouterr().err == "tracemem: wrote the plot to step.svg\n"


def test_what_fits_tries_no_zero_stage_above_3():
    from tracemem.advice import _candidates
    from tracemem.job import Job

    job = Job(model="deepseek-tiny", world_size=2, micro_batch_size=1, seq_length=16,
              num_microbatches=1, zero=3, kernels="eager")
    changes = [flags for flags, *_ in _candidates(job)]
    assert not any(flags.startswith("--zero") for flags in changes)  # was "--zero 4: invalid"
    job2 = Job(model="deepseek-tiny", world_size=2, micro_batch_size=1, seq_length=16,
               num_microbatches=1, zero=1, kernels="eager")
    assert [f for f, *_ in _candidates(job2) if f.startswith("--zero")] == ["--zero 2",
                                                                             "--zero 3"]


def test_under_skewed_routing_each_stage_lists_its_worst_class_first(tiny):
    from dataclasses import replace

    # two EP-rank classes per stage, as skewed routing makes them, traced in rising order of
    # peak (class {0} 1 MiB below class {1, 3}); the table lists each stage's worst first
    ranks = []
    for r in tiny.ranks:
        ranks += [replace(r, ep_rank=0, ep_ranks=(0,), peak_bytes=r.peak_bytes - 2**20),
                  replace(r, ep_rank=1, ep_ranks=(1, 3))]
    text = format_estimate(replace(tiny, ranks=ranks), units="B", wide=True)
    rows = [line.split() for line in text.splitlines()
            if line.strip()[:1].isdigit() and len(line.split()) > 10]
    # the wide table: stage, ranks, EP rank, ..., peak (4th from the end: peak, at step,
    # reserved, frag.)
    assert [(row[0], row[2], int(row[-4].replace(",", ""))) for row in rows] == [
        (str(r.pp_stage), "1,3" if r.ep_rank == 1 else "0", r.peak_bytes)
        for stage in (0, 1) for r in ranks[2 * stage:2 * stage + 2][::-1]]
    assert "each stage's worst class first" in text


def test_make_demo_installs_the_runtime_and_make_test_the_extras():
    # the Makefile's own recipes: demo needs no pytest, megatron-core or ray
    makefile = (ROOT / "Makefile").read_text()
    recipes = {block.split(":", 1)[0]: block for block in makefile.split("\n\n")
               if block[:1] == "$" or block.startswith(("demo:", "test:"))}
    assert "demo: $(RUNTIME)" in makefile and "test: $(EXTRAS)" in makefile
    runtime, = [b for b in recipes.values() if b.startswith("$(RUNTIME):")]
    extras, = [b for b in recipes.values() if b.startswith("$(EXTRAS): $(RUNTIME)")]
    assert runtime.rstrip().splitlines()[1].strip() == (
        "$(BIN)/python -m pip install --quiet -c constraints.txt -e .")
    assert "-e '.[test,megatron,ray]'" in extras
    readme = (ROOT / "README.md").read_text()
    assert "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu make demo" in readme


# issue 26, what was left: tables that fit 100 columns, the plot per rank class, and the
# numbers that surprised a first user, each explained where it is printed

def _table_lines(text):
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("stage "))
    end = lines.index("", start)
    return lines[start:end]


def test_the_default_table_fits_100_columns_and_wide_has_every_column(tiny):
    narrow = format_estimate(tiny, units="MiB")
    table = _table_lines(narrow)
    # the columns a user needs first; EP 1 here, one row per stage: no EP rank column
    assert table[0].split() == ["stage", "ranks", "params", "grads", "optimizer",
                                "activations", "in-flight", "peak", "at", "step", "reserved"]
    assert max(len(line) for line in table) <= 100
    assert "--wide adds EP rank, comm, temporaries, frag.; --json gives every figure in bytes." \
        in narrow.splitlines()
    # the legend explains the columns shown, and only those: frag. is --wide's
    assert "frag.:" not in narrow and "reserved: max_memory_reserved" in narrow
    wide = format_estimate(tiny, units="MiB", wide=True)
    assert _table_lines(wide)[0].split() == [
        "stage", "ranks", "EP", "rank", "params", "grads", "optimizer", "activations",
        "in-flight", "comm", "temporaries", "peak", "at", "step", "reserved", "frag."]
    assert "frag.: reserved - allocated" in wide and "--wide adds" not in wide


def test_a_table_still_too_wide_drops_the_step_column_first(tiny):
    from dataclasses import replace

    # EP-rank classes (as skewed routing makes them) add the EP rank column, and in bytes
    # with separators the figures are 7-10 characters: 106 columns with "at step", which goes
    # first (the worst rank's line below the table still names the step)
    ranks = [replace(r, ep_rank=1, ep_ranks=(1, 3)) for r in tiny.ranks]
    result = replace(tiny, ranks=ranks)
    text = format_estimate(result, units="B")
    header = _table_lines(text)[0]
    assert "at step" not in header and "ranks" in header and "in-flight" in header
    assert "EP rank" in header and max(len(line) for line in _table_lines(text)) <= 100
    assert "at step" in _table_lines(format_estimate(result, units="B", wide=True))[0]
    assert "at step" in _table_lines(format_estimate(tiny, units="B"))[0]  # no EP column
    assert "step: the schedule step running at the peak" in text
    assert f"at step {tiny.worst.peak_step}" in text


def test_host_memory_is_a_wide_column_only_when_a_rank_has_some(tiny):
    from dataclasses import replace

    # 3 MiB and 5 MiB of host memory (--optimizer-cpu-offload), put on the ranks by hand
    ranks = [replace(r, host_bytes=(3 + 2 * r.pp_stage) * 2**20) for r in tiny.ranks]
    wide = format_estimate(replace(tiny, ranks=ranks), units="MiB", wide=True)
    table = _table_lines(wide)
    assert table[0].split()[-1] == "host"
    assert [row.split()[-1] for row in table[2:]] == ["3.00", "5.00"]
    assert ("host: host (CPU) memory of the rank under --optimizer-cpu-offload, "
            "--fine-grained-activation-offloading, --cpu-offloading-num-layers and --ema "
            "host") in wide
    assert "host" not in _table_lines(format_estimate(tiny, units="MiB", wide=True))[0]
    assert "host" not in _table_lines(format_estimate(replace(tiny, ranks=ranks),
                                                      units="MiB"))[0]


def test_the_what_fits_table_fits_100_columns(fitted):
    base, candidates = fitted
    text = format_estimate(base, units="MiB", fits=candidates)
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("change "))
    end = next(i for i, line in enumerate(lines) if line.startswith("peak: the worst rank's"))
    assert lines[start].split() == ["change", "peak", "MiB", "stage", "needs", "MiB", "over",
                                    "fits"]
    assert max(len(line) for line in lines[start:end]) <= 100
    # every change tried is a row (a long one wraps at a space onto the next line)
    assert sum(line.startswith("--") for line in lines[start + 2:end]) == 7


def test_peak_and_allocated_peak_say_what_each_is(tiny):
    text = format_estimate(tiny, units="MiB")
    # the table's peak: storages rounded to 512 B; max_memory_allocated: whole blocks
    assert ("peak: the storages alive at the rank's peak, each rounded to --rounding (512 B); "
            "the simulated allocator's max_memory_allocated also counts the unsplit remainders "
            "of the blocks it hands out, so it can be a little higher (--json "
            "allocated_peak_bytes; --plot's \"allocated peak\").") in text.splitlines()
    for r in tiny.ranks:
        assert r.allocated_peak_bytes >= r.peak_bytes


def _timeline(label, scale):
    from tracemem.memory.timeline import AllocatorReplay

    # one 12 MiB parameter (own segment), then a 3 MiB activation in a 20 MiB segment, freed
    r = AllocatorReplay()
    r.step("0F0")
    r.alloc("w", 12 * scale * 2**20, "parameter", "layers.0", "static")
    r.alloc("x", 3 * 2**20, "activation", "layers.0.mlp", "aten.mm.default")
    r.step("0B0")
    r.free("x")
    return r.timeline(label)


def test_more_rank_classes_than_a_figure_holds_give_an_overview_and_one_file_each(tmp_path):
    from PIL import Image

    from tracemem.memory.plot import MAX_PANELS, detail_paths, plot_timelines

    few = [_timeline(f"stage {i}", 1) for i in range(MAX_PANELS)]
    assert detail_paths(few, tmp_path / "m.png") == []  # 4 panels: one figure, as before
    many = [_timeline(f"stage {i}", 1 + i) for i in range(4)] + [
        _timeline("stage 4, EP ranks 0-2", 1)]
    path = tmp_path / "m.png"
    fig = plot_timelines(many, path, hbm_bytes=80 * 2**30, units="GiB")
    details = detail_paths(many, path)
    assert [p.name for p in details] == [f"m-stage-{i}.png" for i in range(4)] + [
        "m-stage-4-ep-ranks-0-2.png"]
    assert all(p.stat().st_size > 1000 for p in [path, *details])
    # readable sizes at 110 dpi: the overview 12 x (0.32 x 5 + 1.8) in, a detail 12 x 3.6 in
    assert Image.open(path).size == (1320, 374)
    assert Image.open(details[0]).size == (1320, 396)
    # the overview: one bar per rank class, its allocated memory at its allocated peak
    ax = fig.axes[0]
    bars = [p for p in ax.patches if p.get_gid() == "category:parameter"] or [
        p for c in ax.containers if c.get_gid() == "category:parameter" for p in c]
    assert [round(b.get_width(), 6) for b in bars] == [
        round(12 * (1 + i) * 2**20 / 2**30, 6) for i in range(4)] + [round(12 / 1024, 6)]
    # each detail figure is the panel as before, its title saying what allocated peak is
    detail = fig.detail_figures[1].axes[0]
    assert "max_memory_allocated: whole blocks" in detail.get_title(loc="left")
    assert list({l.get_gid(): l for l in detail.get_lines()}["reserved"].get_ydata()) == \
        [v / 2**30 for v in many[1].reserved]


def test_the_plot_files_are_named_on_stderr(capsys, tmp_path):
    import argparse
    import time

    from tracemem.cli import _say_written

    started = time.time()
    for name in ("p.png", "p-stage-0.png", "p-stage-1.png"):
        (tmp_path / name).write_bytes(b"x")
    _say_written(argparse.Namespace(snapshot=None, plot=str(tmp_path / "p.png")), started)
    assert capsys.readouterr().err == (
        f"tracemem: wrote the plot's overview to {tmp_path / 'p.png'} and one plot per rank "
        f"class beside it (2): p-stage-0.png, p-stage-1.png\n")


def test_selective_recompute_that_raises_the_peak_says_why():
    from tracemem.advice import selective_note

    kw = dict(world_size=1, micro_batch_size=1, seq_length=64, num_microbatches=1,
              rounding=0, non_pytorch_memory="0B", hbm="1GiB")
    none = estimate("llama-tiny", **kw)
    selective = estimate("llama-tiny", recompute="selective", **kw)
    # llama-tiny: 4 heads, 2 KV heads of 16, 4 layers; b 1, s 64. Per layer, selective keeps
    # linear_qkv's whole output, v being a slice of it: 64 x (4 + 2 x 2) x 16 x 2 = 16,384 B;
    # none keeps TE's contiguous copy of v (64 x 2 x 16 x 2 = 4,096 B), the logsumexp
    # (4 x 64 x 4 B = 1,024 B) and the RNG state (2 x 8 = 16 B): 16,384 - 5,136 = 11,248 B
    # more a layer, 44,992 B over the 4 layers held at the end of the forward
    assert selective.worst.activation_bytes - none.worst.activation_bytes == 4 * 11_248
    note = selective_note(none, selective)
    assert note.startswith("--recompute selective raises the peak: activations 0.04 MiB more "
                           "at stage 0; its checkpoint keeps core attention's inputs")
    assert "a slice of linear_qkv's fused output" in note
    assert selective_note(selective, none) == ""  # lower: nothing to explain
    assert "recompute selective: core attention's checkpoint keeps its inputs" in \
        format_estimate(selective)


def test_the_approx_column_of_the_megatron_ci_board_is_explained():
    from tracemem.validation.megatron_ci_board import BoardRow, format_board

    fields = BoardRow.__dataclass_fields__
    values = {name: 0 for name in fields} | {
        "name": "case", "gpu": "H100", "approximations": ("--flag: what is not traced",),
        "after_error": None, "first_error": None, "formula_error": None,
        "measured_bytes": 2**30, "tracemem_bytes": 2**30}
    text = format_board([BoardRow(**{k: values[k] for k in fields})], [], [])
    assert "approx." in text.splitlines()[0]
    assert any(line.startswith("approx.: how many of the case's Megatron-LM arguments")
               for line in text.splitlines())


def test_verdict_figures_are_in_the_tables_units():
    verdict = {"pp_stages": 2, "hbm_bytes": 80 * 2**30, "stages_over_hbm": [], "fits": True,
               "worst_pp_stage": 1, "worst_ep_rank": None, "worst_peak_bytes": 5 * 2**20,
               "worst_needed_bytes": 6 * 2**20}
    # 80 GiB = 81,920 MiB; spare 81,920 - 6 = 81,914 MiB
    assert format_verdict(verdict, "MiB", "80GiB") == (
        "Verdict: all 2 pipeline stages fit in 80 GiB (81,920 MiB); the worst is stage 1 at "
        "5.00 MiB; it needs 6.00 MiB (reserved + non-PyTorch memory): 81,914.00 MiB to spare.")
    # 80 GB = 80e9 / 2^20 = 76,293.945 MiB; spare 76,293.95 - 6 = 76,287.95 MiB
    decimal = verdict | {"hbm_bytes": 80 * 10**9}
    assert format_verdict(decimal, "MiB", "80GB") == (
        "Verdict: all 2 pipeline stages fit in --hbm 80GB (decimal units, 1 GB = 10^9 B; = "
        "76,293.95 MiB); the worst is stage 1 at 5.00 MiB; it needs 6.00 MiB (reserved + "
        "non-PyTorch memory): 76,287.95 MiB to spare.")


@pytest.mark.parametrize("text", ["-1", "-1GiB", "0", "0.5"])
def test_a_size_below_one_byte_is_not_read_as_a_size_without_its_unit(text):
    from tracemem.job import parse_bytes

    with pytest.raises(TracememError, match=rf"--hbm '{text}' is invalid; give a positive "
                                            r"size of whole bytes such as 80GiB"):
        parse_bytes(text)


def test_gpu_without_hbm_judges_against_its_memory_and_says_so(capsys):
    args = ["estimate", "--model", "deepseek-tiny", "--world-size", "1", "--micro-batch-size",
            "1", "--seq-length", "16", "--num-microbatches", "1", "--quiet"]
    assert main(args + ["--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    # NVIDIA's H100 SXM data sheet: 80GB, read as 80 GiB (tracemem.job.GPU_MEMORY)
    assert "Verdict: the pipeline stage fits in 80 GiB (81,920 MiB)" in out
    assert ("HBM: --gpu H100 without --hbm: judged against 80GiB per GPU (NVIDIA H100 Tensor "
            "Core GPU data sheet, H100 SXM: 80GB, read as GiB; CUDA sees a little less); give "
            "--hbm to set it.") in out.splitlines()
    assert main(args + ["--gpu", "H100", "--hbm", "40GiB"]) == 0  # --hbm given: it is used
    out = capsys.readouterr().out
    assert "fits in 40 GiB" in out and "HBM: --gpu" not in out and "HBM:" not in out
    assert main(args + ["--gpu", "H100", "--hbm", "200GiB"]) == 0  # more than an H100 has
    assert ("HBM: --hbm 200 GiB is more than the H100's 80 GiB (NVIDIA H100 Tensor Core GPU "
            "data sheet, H100 SXM: 80GB); judged against the --hbm given.") in \
        capsys.readouterr().out.splitlines()
    assert main(args + ["--gpu", "A100", "--hbm", "200GiB"]) == 0  # no single size: no line
    assert "HBM:" not in capsys.readouterr().out
    # the data sheet's 80GB in 10^9-byte GB: 80 x 10^9 B = 74.51 GiB, said beside the reading
    # --gpu H100 alone takes (80 GiB)
    assert main(args + ["--gpu", "H100", "--hbm", "80GB"]) == 0
    assert ("HBM: --hbm 80GB is 80 x 10^9 B (74.51 GiB); the H100's data sheet figure read as "
            "GiB, as --gpu H100 alone reads it (NVIDIA H100 Tensor Core GPU data sheet, H100 "
            "SXM: 80GB), is 80 GiB: give --hbm 80GiB to judge against that.") in \
        capsys.readouterr().out.splitlines()
    assert main(args + ["--gpu", "A100"]) == 0  # 40 GB and 80 GB: no single size
    assert ("HBM: --gpu A100 is sold in more than one memory size; give --hbm (e.g. --hbm "
            "80GiB) to say whether it fits.") in capsys.readouterr().out.splitlines()
    # a Megatron-LM job takes it too (tracemem's typed flags override a Megatron job's)
    megatron = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
                "--max-position-embeddings 64 --micro-batch-size 1 --bf16 "
                "--disable-bias-linear").split()
    assert main(["estimate", "--world-size", "1", "--vocab-size", "500", "--quiet", "--gpu",
                 "H100", "--megatron-args", *megatron]) == 0
    assert "Verdict: the pipeline stage fits in 80 GiB" in capsys.readouterr().out


def test_an_ep_x_etp_error_says_etp_defaulted_to_tp():
    from tracemem.frontdoors import megatron_job

    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
            "--tensor-model-parallel-size", "2", "--sequence-parallel", "--num-experts", "4",
            "--expert-model-parallel-size", "4", "--moe-router-topk", "2", "--bf16",
            "--disable-bias-linear"]
    # ETP defaults to TP = 2 (arguments.py validate_args): etp 2 x ep 4 x pp 1 = 8 ranks per
    # expert-data-parallel replica, which 4 GPUs cannot hold
    with pytest.raises(TracememError, match=r"--world-size 4 is not a multiple of etp\(2\) \* "
                                            r"ep\(4\) \* pp\(1\) = 8: "
                                            r"--expert-tensor-parallel-size was not given, so "
                                            r"it is Megatron's default, the TP size \(2"):
        megatron_job(argv, world_size=4, vocab_size=1000)
    job = megatron_job(argv + ["--expert-tensor-parallel-size", "1"], world_size=4,
                       vocab_size=1000)
    assert (job.parallel.etp, job.parallel.edp) == (1, 1)


def test_cublas_workspace_config_has_a_flag():
    from tracemem.cli import build_parser, job_from_args
    from tracemem.workspaces import torch_cublas_workspace_bytes

    args = build_parser().parse_args([
        "estimate", "--model", "deepseek-tiny", "--world-size", "1", "--micro-batch-size", "1",
        "--seq-length", "16", "--num-microbatches", "1", "--gpu", "H100",
        "--cublas-workspace-config", ":4096:8"])
    assert job_from_args(args).cublas_workspace_config == ":4096:8"
    # :SIZE:COUNT = 4096 KiB x 8 (torch 2.13 CublasHandlePool.cpp parseChosenWorkspaceSize)
    assert torch_cublas_workspace_bytes((9, 0), ":4096:8") == 4096 * 1024 * 8


def test_torch_cublas_default_and_the_p2p_overlap_have_flags():
    from tracemem.cli import build_parser, job_from_args

    def job(*extra):
        return job_from_args(build_parser().parse_args([
            "estimate", "--model", "deepseek-tiny", "--world-size", "1",
            "--micro-batch-size", "1", "--seq-length", "16", "--num-microbatches", "1",
            *extra]))

    assert job("--gpu", "GB200").torch_cublas_default == "2.13"
    # Megatron-LM's flag for the interleaved schedule's p2p overlap (on by default)
    assert job().overlap_p2p_comm is True
    assert job("--no-overlap-p2p-communication").overlap_p2p_comm is False
    assert job("--gpu", "GB200", "--torch-cublas-default", "sm90").torch_cublas_default \
        == "sm90"


def test_long_changes_wrap_between_flags_never_inside_one():
    from tracemem.report import _flag_lines

    # Megatron-FSDP's ZeRO-3 arguments (tracemem.frontdoors.megatron_flag_changes) in 33
    # columns: a flag keeps its value, "drop --flag" stays whole, and the one flag + value
    # longer than the column (33 + 1 + 18) breaks between the two
    text = ("--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
            "--ckpt-format fsdp_dtensor drop --use-distributed-optimizer")
    assert _flag_lines(text, 33) == ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                                     "optim_grads_params", "--ckpt-format fsdp_dtensor",
                                     "drop --use-distributed-optimizer"]
    assert _flag_lines("--pp 2 --num-microbatches 4", 21) == ["--pp 2",
                                                             "--num-microbatches 4"]


def test_crosscheck_and_inventory_fit_100_columns_by_default(capsys, monkeypatch):
    import tracemem.crosscheck as crosscheck
    from tracemem.inventory import format_inventory, get_inventory

    # every line but the first (the job, prose) within 100 columns; --wide: the old tables
    rows = crosscheck.korthikanti_rows(s=256, b=1)
    monkeypatch.setattr(crosscheck, "korthikanti_rows", lambda **kw: rows)
    assert main(["crosscheck", "--korthikanti", "--s", "256"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in out[1:]) <= 100
    assert out[2].split() == ["#", "quantity", "formula", "traced", "%"]
    assert any(line.startswith("[1] ") for line in out)  # row 1's reason, under the table
    assert main(["crosscheck", "--korthikanti", "--s", "256", "--wide"]) == 0
    assert capsys.readouterr().out.splitlines()[2].split()[-2:] == ["%", "reason"]
    inventory = [get_inventory("deepseek-tiny", world_size=1, micro_batch_size=1,
                               seq_length=16)]
    out = format_inventory(inventory).splitlines()
    assert out[2].split() == ["module", "saved", "by", "shape", "dtype", "bytes"]
    assert max(len(line) for line in out[1:]) <= 100
    assert format_inventory(inventory, wide=True).splitlines()[2].split()[-1] == "source"


def test_crosscheck_schedules_puts_the_reasons_under_its_table(monkeypatch):
    import argparse

    import tracemem.crosscheck as crosscheck
    from tracemem.cli import _format_schedule_rows
    from tracemem.crosscheck import ScheduleRow

    # two made-up rows (the real ones take a minute): the layout of the default table
    fields = ScheduleRow.__dataclass_fields__
    row = {k: 0 for k in fields} | dict(
        schedule="dualpipev", rank=3, layers=[4, 5, 6, 7], param_bytes=11 * 2**30,
        param_multiple=2.0, param_formula=2, inflight=17, inflight_formula=17,
        inflight_at_peak=17, activation_bytes=55 * 2**30, peak_bytes=99 * 2**30,
        reason="a reason " * 20, recompute="none")
    monkeypatch.setattr(crosscheck, "schedule_rows", lambda b, s, **kw: [
        ScheduleRow(**{k: row[k] for k in fields}),
        ScheduleRow(**{k: (row | {"reason": ""})[k] for k in fields})])
    args = argparse.Namespace(b=1, s=4096, json=False, wide=False, recompute="none",
                              recompute_modules=None)
    lines = _format_schedule_rows(args).splitlines()
    assert max(len(line) for line in lines[1:]) <= 100
    assert lines[2].split() == ["#", "schedule", "rank", "layers", "params", "x", "traced/T2",
                                "held/T2", "at", "peak", "act.", "peak"]
    assert lines[4].split() == ["1", "dualpipev", "3", "4-7", "11.00", "2.00", "/", "2",
                                "17", "/", "17", "17", "55.00", "99.00"]
    assert [line[:4] for line in lines if line.startswith("[")] == ["[1] "]  # row 2: none


# issue 26, the last trial's findings: each reproducer now a one-line error or a legend line

TINY_FLAGS = ["estimate", "--model", "deepseek-tiny", "--world-size", "2", "--pp", "2",
              "--micro-batch-size", "1", "--seq-length", "64", "--num-microbatches", "4"]


@pytest.mark.parametrize("extra, message", [
    # a value with a minus sign reaches the Job (argparse said "expected one argument")
    (["--hbm", "-80GiB"], "--hbm '-80GiB' is invalid; give a positive size of whole bytes "
                          "such as 80GiB (binary: KiB, MiB, GiB, TiB), 80GB (decimal: kB, MB, "
                          "GB, TB) or a byte count of 1 MiB or more"),
    (["--non-pytorch-memory", "-1MiB"], "--non-pytorch-memory '-1MiB' is invalid; give a size "
                                        "of whole bytes such as 512MiB (binary: KiB, MiB, GiB, "
                                        "TiB), 512MB (decimal: kB, MB, GB, TB) or a byte count "
                                        "of 1 MiB or more (or 0)"),
    # a small number without a unit is refused here as for --hbm (512 B of overhead is a slip)
    (["--non-pytorch-memory", "512"], "--non-pytorch-memory '512' is 512 bytes; give a unit, "
                                      "such as 512MB (decimal) or 512MiB (binary)"),
    (["--hbm", "80"], "--hbm '80' is 80 bytes; give a unit, such as 80GB (decimal) or 80GiB "
                      "(binary)"),
    # CUDA's caching allocator rounds to 512 B (kMinBlockSize); no allocator to 500
    (["--rounding", "500"], "--rounding 500 is not a power of two; allocators round to one "
                            "(the CUDA caching allocator: 512), or give 0 for exact bytes"),
    # the second trial's
    (["--hbm", "80Gb"], "--hbm '80Gb': Gb reads as G-bits; give 80GB (decimal bytes) or 80GiB "
                        "(binary)"),
    (["--gpu", "H100", "--cublas-workspace-config", "16:8"],
     "--cublas-workspace-config '16:8' is invalid; give :SIZE:COUNT (SIZE in KiB), one or "
     "more, such as :4096:8 (Megatron-LM's deterministic runs) or :4096:2:16:8"),
    # 999,999,999 KiB x 8 = 8,191,999,991,808 B
    (["--gpu", "H100", "--cublas-workspace-config", ":999999999:8"],
     "--cublas-workspace-config :999999999:8 is 8,191,999,991,808 B a cuBLAS handle, more "
     "than 1 TiB; no GPU holds that"),
    (["--cublas-workspace-config", ":4096:8"],  # no --gpu: it would change nothing
     "--cublas-workspace-config sizes PyTorch's cuBLAS workspaces, which are counted with "
     "--gpu only: give --gpu (e.g. H100)"),
    (["--torch-cublas-default", "sm90"],  # no --gpu: it would change nothing
     "--torch-cublas-default sizes PyTorch's cuBLAS workspaces, which are counted with --gpu "
     "only: give --gpu (e.g. GB200)"),
    (["--print-megatron-args"],  # megatron-te's default cross entropy, by its flag
     "--cross-entropy-fusion te (megatron-te's default) has no Megatron-LM argument "
     "(Megatron-LM refuses --cross-entropy-fusion-impl te: validate_args); give "
     "--cross-entropy-fusion native or none to print the job"),
])
def test_the_last_trials_inputs_get_one_line_errors(capsys, extra, message):
    assert main(TINY_FLAGS + extra) == 2
    assert capsys.readouterr().err == f"tracemem: error: {message}\n"


def test_plain_byte_counts_and_zero_overhead_are_still_sizes(capsys):
    # 2^20 B and up reads as a byte count (parse_bytes); 0 with its unit or without it
    assert main(TINY_FLAGS + ["--quiet", "--json", "--hbm", "85899345920",
                              "--non-pytorch-memory", "0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["hbm_bytes"], out["settings"]["non_pytorch_memory_bytes"]) == (80 * 2**30, 0)


def test_choices_take_any_letter_case(capsys):
    assert main(TINY_FLAGS + ["--quiet", "--json", "--schedule", "GPipe",
                              "--recompute", "Full", "--units", "gib"]) == 0
    settings = json.loads(capsys.readouterr().out)["settings"]
    assert (settings["schedule"], settings["recompute"]) == ("gpipe", "full")
    assert main(TINY_FLAGS + ["--quiet", "--units", "MIB"]) == 0
    assert "Memory columns in MiB (2^20 B)" in capsys.readouterr().out


def test_dualpipe_names_the_model_chunk_of_its_step_and_the_chunks_a_rank_holds(capsys):
    # DualPipe (arXiv 2412.19437 3.2.1): rank r holds chunks r and pp - 1 - r of its two copies
    assert main(["estimate", "--model", "deepseek-tiny", "--world-size", "4", "--pp", "4",
                 "--schedule", "dualpipe", "--num-microbatches", "8", "--micro-batch-size",
                 "1", "--seq-length", "256", "--quiet"]) == 0
    out = capsys.readouterr().out
    legend = next(line for line in out.splitlines() if line.startswith("at step:"))
    assert legend == (
        "at step: the schedule step running at the peak, model chunk + kind + microbatch: "
        "0B0 = model chunk 0, backward, microbatch 0 (F = forward, B = backward); under "
        "dualpipe each rank holds 2 model chunks, stage s chunks s and 3 - s.")


def test_the_flags_door_names_the_approximations_the_megatron_door_does(capsys, tmp_path):
    # the same job through both doors: the same "Approximated" notes (megatron_approximations
    # of the job's Megatron-LM arguments)
    flags = TINY_FLAGS + ["--quiet", "--cross-entropy-fusion", "native"]
    assert main(flags + ["--print-megatron-args"]) == 0
    path = tmp_path / "job.args"
    path.write_text(capsys.readouterr().out)
    assert main(flags) == 0
    mine = capsys.readouterr().out
    assert main(["estimate", "--world-size", "2", "--quiet", "--megatron-args",
                 f"@{path}"]) == 0
    theirs = capsys.readouterr().out

    def notes(text):  # the items below the first line, continuation lines included
        lines = text.splitlines()[1:]
        return lines[:next(i for i, line in enumerate(lines) if not line.startswith(("- ", "  ")))]

    assert notes(mine) == notes(theirs) and notes(mine)
    assert mine.splitlines()[0] == ("Approximated (what Megatron-LM does in this job, by its "
                                    "defaults, that tracemem does not trace):")
    # wrapped within 100 columns; the "--no-" flags not given say Megatron's default holds
    assert max(len(line) for line in notes(mine)) <= 100
    assert ("- without --no-rope-fusion (Megatron's default): TE's fused RoPE saves less than "
            "the unfused RoPE traced, so the estimate is a little high") \
        in " ".join(line.strip() for line in notes(mine))


def test_params_checks_a_world_size_and_megatron_typos_get_close_suggestions_only(capsys):
    assert main(["params", "--model", "deepseek-tiny", "--world-size", "-3"]) == 2
    assert capsys.readouterr().err == ("tracemem: error: --world-size -3 must be a positive "
                                       "integer\n")
    assert main(["estimate", "--world-size", "4", "--megatron-args", "--num-layers", "2",
                 "--bogus-arg", "3"]) == 2
    assert "did you mean" not in capsys.readouterr().err


def test_letter_case_in_fit_lists_and_the_optimizer(capsys):
    from tracemem.fit import search_space
    space = search_space(recompute="FULL,None", schedule="1F1B", sp="ON")
    assert (space.recompute, space.schedule, space.sp) == (("full", "none"), ("1f1b",), (True,))
    assert main(TINY_FLAGS + ["--quiet", "--json", "--optimizer", "FUSED"]) == 0
    assert json.loads(capsys.readouterr().out)["settings"]["optimizer"] == "fused"


def test_a_job_megatron_cannot_state_says_why_no_approximations_are_listed(capsys):
    assert main(TINY_FLAGS + ["--quiet", "--schedule", "gpipe"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("Approximated: none listed; Megatron-LM cannot run this job as "
                            "given (")
    assert main(TINY_FLAGS + ["--quiet", "--schedule", "gpipe", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["approximations"] == [] and out["approximations_not_listed"].startswith(
        "Megatron-LM cannot run this job as given (schedule 'gpipe'")


def test_a_tp_no_world_size_makes_valid_is_said_first(capsys):
    # deepseek-tiny has 4 heads: TP 3 is invalid at any world size, so the heads are named,
    # not the world sizes that TP 3 would divide
    assert main(["estimate", "--model", "deepseek-tiny", "--world-size", "4", "--tp", "3"]) == 2
    assert capsys.readouterr().err == ("tracemem: error: --tp 3 must divide "
                                       "num_attention_heads (4); try 1, 2, 4\n")
