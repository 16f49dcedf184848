"""Every MoE family (qwen3_moe, qwen2_moe, mixtral) under every kernel profile, EP / ETP / TP /
SP / CP / PP layout, schedule and recompute mode (issue 12 item 2): a small smoke matrix on the
tiny configs.

Reference: invariants that hold whatever the family (tests/tracemem/test_family_matrix.py):
every pipeline stage is reported, the peak holds at least the static bytes and some
activations; full recompute keeps less than none; recomputing the MoE layer (Megatron's
``--recompute-modules moe``) keeps less than none. And EP's static bytes by hand: with EP 2 a
rank holds 4 of the 8 routed experts of each MoE layer, so its parameters are those of EP 1
less 4 experts per MoE layer held (3 * h * moe_intermediate_size each, bf16 weights under
--precision megatron: 2 B).
"""

import pytest

from modeling import load_config
from tracemem.estimator import estimate

FAMILIES = ["qwen3-moe-tiny", "qwen2-moe-tiny", "mixtral-tiny"]
STEP = dict(micro_batch_size=1, seq_length=32, num_microbatches=4)


def _sane(result, stages):
    assert sorted({r.pp_stage for r in result.ranks}) == list(range(stages))
    for rank in result.ranks:
        static = rank.parameter_bytes + rank.gradient_bytes + rank.optimizer_state_bytes
        assert 0 < static < rank.peak_bytes
        assert rank.activation_bytes > 0 and rank.peak_bytes <= rank.reserved_peak_bytes


@pytest.mark.parametrize("layout", [
    dict(world_size=16, tp=2, sp=True, cp=2, pp=2, ep=2),
    dict(world_size=8, tp=2, sp=True, pp=2, ep=2, etp=2),
], ids=["tp2-sp-cp2-pp2-ep2", "tp2-sp-pp2-ep2-etp2"])
@pytest.mark.parametrize("kernels", ["eager", "torch", "megatron-te"])
@pytest.mark.parametrize("preset", FAMILIES)
def test_every_moe_family_runs_under_every_kernel_profile_and_layout(preset, kernels, layout):
    result = estimate(preset, zero=1, kernels=kernels, **layout, **STEP)
    _sane(result, 2)


@pytest.mark.parametrize("preset", FAMILIES)
def test_ep_holds_half_the_routed_experts(preset):
    cfg = load_config(preset)
    base = dict(world_size=2, kernels="eager", precision="megatron", **STEP)
    one = estimate(preset, **base).ranks[0]
    two = estimate(preset, ep=2, **base).ranks[0]
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    assert one.parameter_bytes - two.parameter_bytes == 2 * moe_layers * 4 * expert


@pytest.mark.parametrize("schedule, layout", [
    ("gpipe", dict(pp=2)),
    ("interleaved-1f1b", dict(pp=2, vpp=2)),
    ("zb-h1", dict(pp=2)),
    ("zbv", dict(pp=2, vpp=2)),
    ("dualpipev", dict(pp=2, vpp=2)),
])
@pytest.mark.parametrize("preset", FAMILIES)
def test_every_moe_family_runs_under_every_schedule(preset, schedule, layout):
    result = estimate(preset, world_size=2, schedule=schedule, kernels="eager", **layout,
                      **STEP)
    _sane(result, 2)


@pytest.mark.parametrize("preset", FAMILIES)
def test_recompute_modes_keep_less(preset):
    base = dict(world_size=2, tp=2, sp=True, ep=2, kernels="eager", rounding=None, **STEP)
    none = estimate(preset, **base).ranks[0]
    full = estimate(preset, recompute="full", **base).ranks[0]
    moe = estimate(preset, recompute="selective", recompute_modules=("moe",), **base).ranks[0]
    attn = estimate(preset, recompute="selective", recompute_modules=("core_attn", "layernorm"),
                    **base).ranks[0]
    assert full.activation_bytes < moe.activation_bytes < none.activation_bytes
    assert attn.activation_bytes < none.activation_bytes
