"""Every dense family under every kernel profile, parallel layout, schedule and recompute mode
(issue 12 item 2): a small smoke matrix on the tiny configs.

Reference: invariants that hold whatever the family: every pipeline stage is reported, the
peak holds at least the static bytes (parameters, gradients, optimizer states) and some
activations; full recompute keeps less than none (Megatron's full recompute keeps one input per
layer); eager attention keeps the (b, n_h / TP, s, s) scores that flash does not; Megatron-Core
refuses TP not dividing the query groups (megatron/core/transformer/attention.py
``Attention.__init__``: ``divide(num_query_groups, world_size)``).
"""

import dataclasses

import pytest

from modeling import load_config
from tracemem.errors import TracememError
from tracemem.estimator import estimate

FAMILIES = ["llama-tiny", "qwen2-tiny", "qwen3-tiny", "gpt-tiny"]
STEP = dict(micro_batch_size=1, seq_length=32, num_microbatches=4)


def _sane(result, stages):
    assert sorted({r.pp_stage for r in result.ranks}) == list(range(stages))
    for rank in result.ranks:
        static = rank.parameter_bytes + rank.gradient_bytes + rank.optimizer_state_bytes
        assert 0 < static < rank.peak_bytes
        assert rank.activation_bytes > 0 and rank.peak_bytes <= rank.reserved_peak_bytes


@pytest.mark.parametrize("kernels", ["eager", "torch", "megatron-te"])
@pytest.mark.parametrize("preset", FAMILIES)
def test_every_family_runs_under_every_kernel_profile_with_tp_sp_cp_pp_dp(preset, kernels):
    result = estimate(preset, world_size=16, tp=2, sp=True, cp=2, pp=2, zero=1,
                      kernels=kernels, **STEP)
    assert result.parallel.dp == 2
    _sane(result, 2)


@pytest.mark.parametrize("schedule, layout", [
    ("gpipe", dict(pp=2)),
    ("interleaved-1f1b", dict(pp=2, vpp=2)),
    ("zb-h1", dict(pp=2)),
    ("zbv", dict(pp=2, vpp=2)),
    ("dualpipev", dict(pp=2, vpp=2)),
])
@pytest.mark.parametrize("preset", FAMILIES)
def test_every_family_runs_under_every_schedule(preset, schedule, layout):
    result = estimate(preset, world_size=2, schedule=schedule, kernels="eager", **layout,
                      **STEP)
    _sane(result, 2)


@pytest.mark.parametrize("preset", FAMILIES)
def test_recompute_modes_keep_less(preset):
    base = dict(world_size=2, tp=2, sp=True, kernels="eager", attention="eager",
                rounding=None, **STEP)
    none = estimate(preset, **base).ranks[0]
    full = estimate(preset, recompute="full", **base).ranks[0]
    attn = estimate(preset, recompute="selective", recompute_modules=("core_attn",),
                    **base).ranks[0]
    rest = estimate(preset, recompute="selective", recompute_modules=("layernorm", "mlp"),
                    **base).ranks[0]
    assert full.activation_bytes < attn.activation_bytes < none.activation_bytes
    assert rest.activation_bytes < none.activation_bytes
    # eager attention keeps fp32 probabilities (b, n_h / TP, s, s) per layer; at least those
    # of the 4 layers go with selective core_attn recompute
    cfg = load_config(preset)
    heads = cfg.num_attention_heads // 2
    assert none.activation_bytes - attn.activation_bytes >= 4 * heads * 32 * 32 * 4


def test_mla_up_proj_is_refused_for_grouped_query_attention():
    with pytest.raises(TracememError, match="--recompute-modules mla_up_proj applies to MLA "
                                            r"\(DeepSeek\) only; this model has grouped-query "
                                            "attention: use core_attn"):
        estimate("llama-tiny", world_size=1, recompute="selective",
                 recompute_modules=("mla_up_proj",), **STEP)


def test_tp_must_divide_the_query_groups():
    cfg = dataclasses.replace(load_config("llama-tiny"), num_key_value_heads=1)  # MQA
    with pytest.raises(TracememError, match=r"^--tp 2 must divide num_key_value_heads \(1\): "
                                            r"Megatron splits the query groups over TP; try 1$"):
        estimate(cfg, world_size=2, tp=2, **STEP)
    assert estimate(cfg, world_size=1, kernels="megatron-te", **STEP).ranks[0].peak_bytes > 0


def test_a_dense_model_refuses_expert_parallelism():
    with pytest.raises(TracememError, match=r"--ep 2 --etp 1: llama-tiny is dense"):
        estimate("llama-tiny", world_size=2, ep=2, **STEP)
