"""tracemem estimate on the DeepSeek models.

References: Megatron's 1F1B in-flight counts (stage p of PP holds min(PP - p, M) microbatches;
tests/tracemem/schedules); shapes by hand (eager attention's (b, n_h / TP, s, s) scores);
the closed-form static bytes of tests/tracemem/test_static.py.
"""

import json

import pytest
import torch

from tracemem.cli import main
from tracemem.errors import TracememError
from tracemem.estimator import estimate, parse_bytes

V3_ARGS = ["--model", "deepseek-v3", "--world-size", "1024", "--tp", "2", "--sp", "--pp", "16",
           "--ep", "8", "--etp", "1", "--micro-batch-size", "1", "--seq-length", "4096",
           "--num-microbatches", "16", "--schedule", "1f1b", "--recompute", "none",
           "--attention", "flash", "--zero", "1", "--precision", "megatron", "--hbm", "80GiB",
           "--pp-first-stage-layers", "4", "--pp-last-stage-layers", "1"]

TINY = dict(world_size=4, tp=2, sp=True, pp=2, micro_batch_size=2, seq_length=64,
            num_microbatches=4, experts="sequential")


def test_v3_json_has_every_stage_and_stage_0_holds_16_microbatches(capsys):
    assert main(["estimate", *V3_ARGS, "--json", "--quiet"]) == 0
    result = json.loads(capsys.readouterr().out)
    ranks = result["ranks"]
    assert [r["pp_stage"] for r in ranks] == list(range(16))
    assert [r["inflight_microbatches"] for r in ranks] == [16 - p for p in range(16)]
    for r in ranks:
        assert r["ep_rank"] is None  # balanced routing: every EP rank alike
        assert r["peak_bytes"] >= sum(r[k] for k in (
            "parameter_bytes", "optimizer_state_bytes", "activation_bytes"))
        assert r["fits"] == (r["peak_bytes"] <= 80 * 2**30)
    # stage 1 static memory: the closed forms of the megatron recipe under ZeRO-1
    dense, expert = 499_974_144, 4 * 32 * 3 * 7168 * 2048
    assert ranks[1]["parameter_bytes"] == 2 * (dense + expert)
    assert ranks[1]["optimizer_state_bytes"] == 12 * (dense // 32 + expert // 8)


def test_v3_table_names_the_worst_rank(capsys):
    assert main(["estimate", *V3_ARGS, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "fits in 80 GiB" in out and "Worst rank: stage 1" in out


def test_full_recompute_drops_activations():
    none = estimate("deepseek-tiny", **TINY)
    full = estimate("deepseek-tiny", recompute="full", **TINY)
    # Megatron's CheckpointFunction is reentrant: in backward a layer is recomputed whole and
    # its activations are alive at the peak (held per layer against Megatron-Core itself by
    # tests/tracemem/test_oracle_megatron.py), so the drop is less than half on the last stage
    for a, b in zip(none.ranks, full.ranks):
        assert b.activation_bytes < a.activation_bytes * 0.6
        assert b.peak_bytes < a.peak_bytes


def test_eager_attention_holds_the_s_by_s_scores():
    eager = estimate("deepseek-tiny", attention="eager", kernels="eager", rounding=None, **TINY)
    flash = estimate("deepseek-tiny", attention="flash", kernels="eager", rounding=None, **TINY)
    scores = [2, 4 // 2, 64, 64]  # (b, n_h / TP, s, s)
    assert any(s["shape"] == scores for s in eager.ranks[0].largest)
    assert not any(s["shape"] == scores for s in flash.ranks[0].largest)
    assert eager.ranks[0].activation_bytes > flash.ranks[0].activation_bytes


def test_selective_recompute_of_core_attention_drops_the_scores():
    none = estimate("deepseek-tiny", attention="eager", kernels="eager", rounding=None, **TINY)
    selective = estimate("deepseek-tiny", attention="eager", kernels="eager", rounding=None,
                         recompute="selective", recompute_modules=("core_attn",), **TINY)
    scores = [2, 2, 64, 64]
    assert not any(s["shape"] == scores and s["category"] == "activation"
                   for s in selective.ranks[0].largest)
    assert selective.ranks[0].activation_bytes < none.ranks[0].activation_bytes
    # DeepSeek-V3's own choice (report section 3.2.3): RMSNorm and the MLA up projections
    v3_style = estimate("deepseek-tiny", recompute="selective",
                        recompute_modules=("layernorm", "mla_up_proj"), **TINY)
    assert v3_style.ranks[0].activation_bytes < estimate("deepseek-tiny", **TINY).ranks[0] \
        .activation_bytes


def test_tracemem_estimate_is_the_python_api():
    import tracemem

    result = tracemem.estimate("deepseek-tiny", **TINY)
    assert [r.pp_stage for r in result.ranks] == [0, 1]
    assert result.worst.peak_bytes == max(r.peak_bytes for r in result.ranks)


def test_skewed_routing_traces_every_ep_rank_class():
    from modeling import load_config
    from modeling.common.routing import parse_routing

    result = estimate("deepseek-tiny", world_size=4, ep=4, pp=1, micro_batch_size=2,
                      seq_length=32, num_microbatches=2, routing="hot:1:0.5",
                      experts="sequential")
    # by hand from the routing model: 64 tokens, top-2, 8 experts, 2 per EP rank, over the MoE
    # layers 2 and 3 and the MTP's, 4; EP ranks with equal counts in all of them share a class
    cfg, hot = load_config("deepseek-tiny"), parse_routing("hot:1:0.5")
    assert cfg.num_routed_experts == 8
    local = {e: tuple(tuple(hot.counts(64, 2, 8, layer)[2 * e:2 * e + 2]) for layer in (2, 3, 4))
             for e in range(4)}
    classes = {}
    for e, key in local.items():
        classes.setdefault(key, []).append(e)
    assert [r.ep_ranks for r in result.ranks] == [tuple(c) for c in classes.values()]
    assert all(r.rank == r.ep_rank == r.ep_ranks[0] for r in result.ranks)
    balanced = estimate("deepseek-tiny", world_size=4, ep=4, pp=1, micro_batch_size=2,
                        seq_length=32, num_microbatches=2, experts="sequential")
    assert balanced.ranks[0].ep_rank is None
    # balanced gives every expert 64 * 2 / 8 = 16 slots: a rank whose experts get at most 16
    # in every layer peaks no higher, one that gets more somewhere peaks higher
    for r in result.ranks:
        if max(max(c) for c in local[r.ep_rank]) <= 16:
            assert r.peak_bytes <= balanced.ranks[0].peak_bytes
    assert result.worst.peak_bytes > balanced.ranks[0].peak_bytes  # the hot expert's rank


def test_parse_bytes():
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("512MiB") == 2**29
    assert parse_bytes("80GB") == 80 * 10**9  # decimal, as GPU data sheets write it


def _v3_argv(**overrides):
    """V3_ARGS with flags replaced (value None: a switch added; value False: removed)."""
    flags, i = {}, 0
    while i < len(V3_ARGS):
        if i + 1 < len(V3_ARGS) and not V3_ARGS[i + 1].startswith("--"):
            flags[V3_ARGS[i]] = V3_ARGS[i + 1]
            i += 2
        else:
            flags[V3_ARGS[i]] = None
            i += 1
    for name, value in overrides.items():
        flag = "--" + name.replace("_", "-")
        if value is False:
            flags.pop(flag, None)
        else:
            flags[flag] = value
    return [part for flag, value in flags.items() for part in (flag, value) if part is not None]


@pytest.mark.parametrize("overrides, message", [
    (dict(model="deepseek-v4"), "--model 'deepseek-v4' is neither a preset"),
    (dict(tp="3"), "--tp 3 must divide num_attention_heads (128)"),  # before the world size
    (dict(tp="1"), "--sp needs --tp > 1"),
    (dict(micro_batch_size="-1"), "--micro-batch-size -1 must be a positive integer"),
    (dict(schedule="interleaved-1f1b", vpp="2", num_microbatches="6", pp_first_stage_layers=False,
          pp_last_stage_layers=False, pp_layout="2*29,1,1,1"),
     "--num-microbatches 6 must be a multiple of --pp 16"),
    (dict(schedule="zb"), "argument --schedule: invalid choice: 'zb'"),
    (dict(hbm="lots"), "--hbm 'lots' is invalid"),
    (dict(seq_length="4095"), "--seq-length 4095 must be a multiple of cp * sp = 2"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, overrides, message):
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["estimate", *_v3_argv(**overrides), "--quiet"]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_wide_column_is_shown_where_it_holds_a_rows_largest_item():
    import dataclasses

    from tracemem.report import estimate_columns, format_estimate

    result = estimate("deepseek-tiny", world_size=2, pp=2, micro_batch_size=1, seq_length=16,
                      num_microbatches=2)
    keys, _ = estimate_columns(result, "MiB")
    assert "temporaries" not in keys  # activations or the static memory lead here
    # stage 1's temporaries made its largest item (TE's deferred W-step inputs on the recipe's
    # stage 7): the default table shows the column, and the legend says why
    big = dataclasses.replace(result.ranks[1], temporary_bytes=10 * 2**30)
    assert big.dominant() == ("temporaries", 10 * 2**30)
    result = dataclasses.replace(result, ranks=[result.ranks[0], big])
    keys, rows = estimate_columns(result, "MiB")
    assert "temporaries" in keys and rows[1][keys.index("temporaries")] == "10,240.00"
    text = format_estimate(result, "MiB")
    assert "temporaries: storages neither kept for backward" in text
    assert "temporaries:" not in format_estimate(result, "MiB", wide=True)


def test_megatron_lms_dataloader_mask_lives_through_each_forward_of_the_batch_stages():
    # pretrain_gpt.py get_batch / megatron/core/utils.py get_batch_on_this_tp_rank: the
    # (b, 1, s, s) bool mask on the first and last stages, CP's share [b, 1, s / CP, s] kept
    # (get_batch_on_this_cp_rank), freed when forward_step_func returns
    from tracemem.estimator import TraceCache, rank_classes, trace_classes
    from tracemem.job import Job

    def masks(**fields):
        job = Job(model="deepseek-tiny", rounding=None,
                  **{**TINY, "world_size": 8, "cp": 2, "kernels": "megatron-te", **fields})
        out = {}
        for traced in trace_classes(job, rank_classes(job), TraceCache()):
            events = next(v for k, v in traced.segments.events.items()
                          if k[0] == 0 and k[1] in ("F", "Fs") and k[2] == 0)
            out[traced.unit.stage] = sorted(
                e.nbytes for e in events if e.action == "alloc" and e.dtype == torch.bool
                and e.shape and len(e.shape) == 4 and e.shape[1] == 1)
        return out
    b, s = 2, 64
    # the whole mask, then CP rank's half of the queries; both stages read the batch (PP 2)
    assert masks() == {0: [b * s * s // 2, b * s * s], 1: [b * s * s // 2, b * s * s]}
    assert masks(create_attention_mask_in_dataloader=False) == {0: [], 1: []}
    # not Megatron-LM's training loop (another orchestration, another schedule): no mask
    assert masks(kernels="eager") == {0: [], 1: []}
    assert masks(schedule="zb-h1") == {0: [], 1: []}
