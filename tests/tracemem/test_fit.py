"""``tracemem fit``: layout enumeration counted by hand (Megatron-LM's rules as
``ParallelConfig.create`` and ``check_job`` hold them: megatron/training/arguments.py
``validate_args``, megatron/core/transformer/transformer_config.py "Uneven PP",
megatron/core/num_microbatches_calculator.py), the fit of a tiny model against direct
``estimate`` calls, the trace cache giving identical estimates, and the CLI's errors."""

from __future__ import annotations

import json
import shlex

import pytest

from modeling import load_config
from tracemem.cli import main
from tracemem.errors import TracememError
from tracemem.estimator import TraceCache, estimate
from tracemem.fit import SearchSpace, enumerate_layouts, fit, pp_layouts, search_space
from tracemem.report import format_estimate_json

TINY = load_config("deepseek-tiny")  # 4 layers (2 dense, 2 MoE), 4 heads, 8 routed experts


def test_pp_layouts_counted_by_hand():
    # 4 layers on 2 stages: the even split 2/2, and first + last = 4 with both >= 1
    # (Megatron: "num_layers_in_first_pipeline_stage must be larger than 0"): 1/3, 2/2
    # (the even split again, said once), 3/1
    assert pp_layouts(4, 2, 1, "all") == [(None, None), (3, 1), (1, 3)]
    # 4 layers on 3 stages: no even split; the one middle stage needs >= 1 layer:
    # (1, 1) leaves 2, (1, 2) and (2, 1) leave 1: three layouts; balanced (ends no larger
    # than the middle): only (1, 1); suggested: that one
    assert pp_layouts(4, 3, 1, "all") == [(2, 1), (1, 1), (1, 2)]
    assert pp_layouts(4, 3, 1, "balanced") == [(1, 1)]
    assert pp_layouts(4, 3, 1) == [(1, 1)]
    # DeepSeek-V3's 61 layers on 16 stages: middle k layers, first + last = 61 - 14 k >= 2:
    # k = 1..4 gives 47, 33, 19, 5, so 46 + 32 + 18 + 4 = 100 layouts; balanced (ends <= k)
    # only k = 4: (4, 1), (3, 2), (2, 3), (1, 4); suggested: the fewest layers last, (4, 1)
    assert len(pp_layouts(61, 16, 1, "all")) == 100
    assert pp_layouts(61, 16, 1, "balanced") == [(4, 1), (3, 2), (2, 3), (1, 4)]
    assert pp_layouts(61, 16, 1) == [(4, 1)]
    # VPP 2: the ends and each middle rank's layers divide by vpp; 8 layers on 2 ranks:
    # even 4/4, or first + last = 8 with both even: (2, 6), (4, 4) (the even split), (6, 2)
    assert pp_layouts(8, 2, 2, "all") == [(None, None), (6, 2), (2, 6)]
    # 61 (odd) layers cannot split into even ends and even middles
    assert pp_layouts(61, 16, 2, "all") == []


def test_enumeration_counted_by_hand():
    space = SearchSpace(tp=(1, 2, 4, 8), ep=(1, 2, 4, 8), pp=(1, 2), micro_batch_size=(1, 2),
                        recompute=("none",), zero=(1,), schedule=("1f1b",))
    layouts, rejected = enumerate_layouts(TINY, 8, 64, 8, space)
    # 64 candidates (tp 4 x ep 4 x pp 2 x b 2; SP on where TP > 1). Per TP in 1, 2, 4 (each
    # divides 4 heads, 128, 32, 64): ep x pp must divide 8: all 8 pairs but ep 8 x pp 2 = 16,
    # so 7 layouts per b; b = 1 always gives an integer M = 8 / DP; b = 2 needs 2 DP | 8, false
    # only for DP = 8 (TP 1, PP 1: the 4 EP values). 3 x 7 x 2 - 4 = 38.
    assert len(layouts) == 38
    # TP 8: 8 candidates x 2 b (world or heads); ep 8 x pp 2: 3 TPs x 2 b; b = 2 with DP 8: 4
    assert sum(rejected.values()) == 64 - 38 == 16 + 6 + 4
    assert {(l.tp, l.sp) for l in layouts} == {(1, False), (2, True), (4, True)}
    m = {(l.tp, l.pp, l.micro_batch_size): l.num_microbatches for l in layouts}
    assert m[(4, 2, 2)] == 8 // (2 * 1) == 4 and m[(1, 1, 1)] == 8 // (1 * 8) == 1


def test_enumeration_schedule_rules():
    space = SearchSpace(tp=(1,), ep=(1,), pp=(2,), recompute=("none",), zero=(1,),
                        schedule=("1f1b", "dualpipe", "zb-h1"))
    # world 2 at PP 2: DP 1, so M = G. G = 8: every schedule takes M 8 (DualPipe: even pp, and
    # M even and >= 2 pp = 4; DualPipe README / tracemem.schedules.dualpipe)
    layouts, rejected = enumerate_layouts(TINY, 2, 64, 8, space)
    assert sorted(l.schedule for l in layouts) == ["1f1b", "dualpipe", "zb-h1"] and not rejected
    # G = 2: M 2 < 2 pp, DualPipe alone refuses it
    layouts, rejected = enumerate_layouts(TINY, 2, 64, 2, space)
    assert sorted(l.schedule for l in layouts) == ["1f1b", "zb-h1"]
    assert rejected == {"--num-microbatches 2 must be even and at least 2 * pp = 4 for "
                        "dualpipe": 1}


def test_search_space_errors():
    assert search_space(tp="1,2,2", sp="on,off").tp == (1, 2)
    for kwargs, match in [({"tp": "1,x"}, "--tp value 'x' is not"),
                          ({"sp": "yes"}, "--sp value 'yes' is invalid"),
                          ({"recompute": "some"}, "--recompute value 'some' is invalid"),
                          ({"zero": "4"}, "--zero value 4 is invalid"),
                          ({"pp": "0"}, "--pp value 0 is invalid"),
                          ({"pp_ends": "most"}, "--pp-ends 'most' is invalid"),
                          ({"ep": ","}, "--ep ',' has an empty value"),
                          ({"ep": ""}, "--ep '' has an empty value")]:
        with pytest.raises(TracememError, match=match):
            search_space(**kwargs)


JOB = dict(micro_batch_size=1, seq_length=64, kernels="eager", hbm="1GiB",
           non_pytorch_memory="1000MiB")


def test_shared_trace_cache_gives_identical_estimates(tmp_path):
    """A trace reused (from memory, or from disk in a new cache) gives the same estimate,
    byte for byte in every figure, as a fresh ``estimate`` call."""
    layouts = [dict(world_size=4, pp=2, ep=2, num_microbatches=4, zero=1),
               dict(world_size=4, pp=2, ep=2, num_microbatches=2, zero=2,
                    schedule="gpipe"),
               dict(world_size=8, pp=2, ep=2, num_microbatches=4, zero=1)]
    fresh = [format_estimate_json(estimate("deepseek-tiny", **JOB, **k), None)
             for k in layouts]
    shared = TraceCache(tmp_path)
    first = [format_estimate_json(estimate("deepseek-tiny", **JOB, **k, trace_cache=shared),
                                  None) for k in layouts]
    assert first == fresh
    # 2 stages, distinct signatures: 2 traces, reused by the other two layouts (4 reuses)
    assert shared.counts() == {"computed": 2, "reused": 4, "loaded": 0}
    again = TraceCache(tmp_path)  # a later run: every (trace, ZeRO / DP) result on disk
    assert [format_estimate_json(estimate("deepseek-tiny", **JOB, **k, trace_cache=again),
                                 None) for k in layouts] == fresh
    assert again.counts() == {"computed": 0, "reused": 0, "loaded": 6}


def test_screen_only_skips_layouts_that_cannot_fit():
    kwargs = dict(world_size=2, pp=1, ep=2, num_microbatches=2, **JOB)
    full = estimate("deepseek-tiny", **kwargs)
    screened = estimate("deepseek-tiny", **kwargs, screen=True)
    over = full.ranks[0].peak_bytes + 1000 * 2**20 > 2**30
    assert screened.screened == over
    assert screened.ranks[0].peak_bytes == full.ranks[0].peak_bytes
    assert full.ranks[0].reserved_peak_bytes >= full.ranks[0].peak_bytes


def test_fit_rows_agree_with_estimate():
    space = SearchSpace(tp=(1, 2), ep=(2,), pp=(1, 2), recompute=("none",), zero=(1,),
                        schedule=("1f1b",))
    # 4 MiB for PyTorch: TP 1 / PP 1's replayed peak alone (4.3 MiB) is over (screened);
    # the others pass the screen and are simulated (one 20 MiB segment: none fits)
    seen = []
    result = fit("deepseek-tiny", world_size=4, hbm="1GiB", seq_length=64,
                 global_batch_size=4, space=space, workers=1, kernels="eager",
                 non_pytorch_memory="1020MiB", closest=1, progress=seen.append)
    assert len(result.rows) == 4
    # the progress bar's figures: layouts done of total (4 families of one, then the one
    # re-estimated), traces computed and reused so far, an ETA
    assert [p["done"] for p in seen] == [1, 2, 3, 4, 5] and seen[-1]["total"] == 5
    assert seen[-1]["computed"] == result.traces["computed"] and seen[-1]["eta_s"] == 0
    for row in result.rows:
        direct = estimate("deepseek-tiny", world_size=4, hbm="1GiB", seq_length=64,
                          kernels="eager", non_pytorch_memory="1020MiB",
                          **row.layout.job_fields())
        needs = max(r.reserved_peak_bytes for r in direct.ranks) + 1020 * 2**20
        fits = all(r.fits for r in direct.ranks)
        assert row.fits == fits
        if not row.screened:
            assert row.needed_bytes == needs
        else:
            assert not fits and row.needed_bytes <= needs
    for row in result.closest:
        assert not row.screened and not row.fits and row.headroom_bytes < 0
    assert sum(r.screened for r in result.rows) == 1 and len(result.closest) == 1
    # one rank class per stage (balanced routing), and the screened layout (TP 1, PP 1: one
    # stage) again in full, its trace reused: its lower bound (4.3 MiB) was the closest
    asked = sum(result.traces.values())
    assert asked == sum(r.layout.pp for r in result.rows) + 1
    assert result.traces["reused"] >= 1


def test_fit_cli(capsys):
    args = ["fit", "--model", "deepseek-tiny", "--world-size", "4", "--hbm", "1GiB",
            "--seq-length", "64", "--global-batch-size", "4", "--kernels", "eager",
            "--tp", "1", "--ep", "2", "--pp", "1,2", "--recompute", "none", "--zero", "1",
            "--non-pytorch-memory", "1000MiB", "--workers", "1", "--quiet"]
    assert main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len([r for r in data["rows"] if not r["exact"] or not r["screened"]]) >= 2
    assert main(args + ["--csv", "--closest", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("layout") is False and "needed_bytes" in lines[0]
    assert len(lines) == 1 + 2


@pytest.mark.parametrize("extra, message", [
    (["--tp", "1,two"], "--tp value 'two' is not an integer"),
    (["--tp=-1"], "--tp value '-1' must be a positive integer"),
    (["--hbm", "lots"], "--hbm 'lots' is invalid"),
    (["--tp", "3"], "no valid layout of deepseek-tiny on 4 GPUs"),
    (["--address", "auto"], "--address applies to --engine ray"),
    (["--workers", "0"], "--workers 0 must be a positive integer"),
    (["--global-batch-size", "0"], "--global-batch-size 0 must be a positive integer"),
    # deepseek-tiny has 4 layers: Megatron's TransformerConfig refuses N >= num_layers
    (["--cpu-offloading-num-layers", "4", "--kernels", "megatron-te"],
     "--cpu-offloading-num-layers 4: CPU offloading can be done only for layers less than 4"),
    (["--cpu-offloading-num-layers", "-1"], "--cpu-offloading-num-layers -1 is invalid"),
])
def test_fit_cli_errors(capsys, extra, message):
    args = ["fit", "--model", "deepseek-tiny", "--world-size", "4", "--hbm", "1GiB",
            "--seq-length", "64", "--global-batch-size", "4", "--quiet"]
    assert main(args + extra) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_layouts_the_job_refuses_are_rejected_not_fatal():
    # TE CPU offloading has no pipeline parallelism (Megatron's TransformerConfig): with N = 1
    # fixed, the PP 2 layout is rejected under the Job's reason and PP 1 is still estimated;
    # a fixed field wrong for every layout (N = 4 of 4 layers) is the Job's one-line error
    space = SearchSpace(tp=(1,), ep=(1,), pp=(2, 1), recompute=("none",), zero=(1,),
                        micro_batch_size=(1,), schedule=("1f1b",))
    fields = dict(world_size=2, hbm="80GiB", seq_length=64, global_batch_size=4,
                  space=space, workers=1, kernels="megatron-te", closest=0)
    result = fit("deepseek-tiny", cpu_offloading_num_layers=1, **fields)
    assert [r.layout.pp for r in result.rows] == [1]
    assert result.job.cpu_offloading_num_layers == 1
    assert result.rejected == {"--cpu-offloading-num-layers with --pp 2: currently there is "
                               "no support for pipeline parallelism with CPU offloading": 1}
    with pytest.raises(TracememError, match="only for layers less than 4"):
        fit("deepseek-tiny", cpu_offloading_num_layers=4, **fields)
    # the table says the 3 most common refusals, --wide every one
    from dataclasses import replace

    from tracemem.fit import format_fit

    many = replace(result, rejected={"a": 5, "b": 4, "c": 3, "d": 1})
    assert ("Not valid, skipped: 13 candidates; the most common reasons (3 of 4; --wide gives "
            "every one): a (5); b (4); c (3).") in format_fit(many).splitlines()
    assert ("Not valid, skipped: 13 candidates; the reasons: a (5); b (4); c (3); d (1).") in \
        format_fit(many, wide=True).splitlines()


def test_fit_cli_cpu_offloading_num_layers(capsys):
    # tracemem fit's own flag, as the Python fit()'s field: the PP 2 layout skipped under the
    # Job's refusal, PP 1 estimated with N = 1
    args = ["fit", "--model", "deepseek-tiny", "--world-size", "2", "--hbm", "80GiB",
            "--seq-length", "64", "--global-batch-size", "4", "--kernels", "megatron-te",
            "--tp", "1", "--ep", "1", "--pp", "2,1", "--recompute", "none", "--zero", "1",
            "--micro-batch-size", "1", "--schedule", "1f1b", "--closest", "0", "--workers", "1",
            "--quiet", "--json", "--cpu-offloading-num-layers", "1"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["pp"] for r in data["rows"]] == [1]
    assert data["rejected"] == {"--cpu-offloading-num-layers with --pp 2: currently there is "
                                "no support for pipeline parallelism with CPU offloading": 1}


def test_the_best_line_runs_the_same_job(capsys):
    # every layout's settings as typed (the eager kernels, 1 GiB outside PyTorch) join the
    # best layout's estimate command, and an HBM of whole GB stays exact
    args = ["fit", "--model", "deepseek-tiny", "--world-size", "1", "--hbm", "80GB",
            "--seq-length", "128", "--global-batch-size", "1", "--tp", "1", "--ep", "1",
            "--pp", "1", "--recompute", "none", "--zero", "1", "--kernels", "eager",
            "--non-pytorch-memory", "1GiB", "--workers", "1", "--quiet"]
    assert main(args) == 0
    best = next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith("best: "))
    command = shlex.split(best.removeprefix("best: "))
    assert command[-6:] == ["--kernels", "eager", "--non-pytorch-memory", "1GiB", "--hbm",
                            "80GB"]
    assert main(args + ["--json"]) == 0
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert main(command[1:] + ["--json", "--quiet"]) == 0
    rank = json.loads(capsys.readouterr().out)["ranks"][0]
    assert rank["peak_bytes"] == row["peak_bytes"]
    assert rank["reserved_peak_bytes"] + 2**30 == row["needed_bytes"]


def test_fit_takes_gpu_as_estimate_does(capsys):
    # mxfp8 runs on Blackwell only (TE _compute_mxfp8_support): the error says --gpu B200,
    # which fit now takes
    args = ["fit", "--model", "llama-tiny", "--world-size", "1", "--hbm", "40GiB",
            "--seq-length", "64", "--global-batch-size", "1", "--tp", "1", "--pp", "1",
            "--recompute", "none", "--zero", "1", "--workers", "1", "--quiet",
            "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"]
    assert main(args) == 2
    assert "give --gpu B200" in capsys.readouterr().err
    assert main(args + ["--gpu", "b200"]) == 0
    best = next(line for line in capsys.readouterr().out.splitlines()
                if line.startswith("best: "))
    assert "--fp8-format e4m3 --fp8-recipe mxfp8 --gpu B200 --hbm 40GiB" in best


def test_the_eta_and_the_order_weigh_layouts_by_their_microbatches():
    from tracemem.fit import Layout, _groups, _work

    def layout(ep, m):
        return Layout(tp=1, sp=False, cp=1, ep=ep, etp=1, pp=2, vpp=1,
                      pp_first_stage_layers=None, pp_last_stage_layers=None,
                      micro_batch_size=1, num_microbatches=m, recompute="none", zero=1,
                      schedule="1f1b")
    assert _work(layout(2, 64)) == 65  # M + 1: the allocator walk, then the traces
    # a family of one layout at M 512 before a family of three at M 8 (27 < 513)
    small, big = [layout(2, 8), layout(2, 8), layout(2, 8)], [layout(4, 512)]
    assert [len(g) for g in _groups(small + big)] == [1, 3]
