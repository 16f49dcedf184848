"""ParallelConfig: derived degrees, layouts, and one clear error per invalid combination.

Reference: Megatron-Core's conventions (megatron/core/parallel_state.py): world = TP * CP * PP
* DP for dense layers and world = ETP * EP * PP * EDP for expert layers; hand arithmetic.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modeling import load_config
from tracemem.errors import TracememError
from tracemem.parallel import ParallelConfig, parse_layout

V3 = load_config("deepseek-v3")
LAYOUT = (4,) * 15 + (1,)
TINY = load_config("deepseek-tiny")  # 4 heads, 8 experts, 4 layers, intermediate 128 / 32


def test_paper_layout_derives_dp_and_edp():
    par = ParallelConfig.create(V3, world_size=1024, tp=2, pp=16, ep=8, pp_layout=(4,) * 15 + (1,))
    assert (par.dp, par.edp) == (32, 8)  # 1024 / (2 * 16), 1024 / (8 * 1 * 16)
    assert par.layers_of_stage(1) == [[4, 5, 6, 7]] and par.layers_of_stage(15) == [[60]]
    assert par.stage_of(0) == 0 and par.stage_of(63) == 0 and par.stage_of(64) == 1


def test_first_and_last_stage_layers_split_the_rest_evenly():
    par = ParallelConfig.create(V3, world_size=1024, tp=2, pp=16, ep=8,
                                pp_first_stage_layers=4, pp_last_stage_layers=1)
    assert par.pp_layout == (4,) * 15 + (1,)
    # one end given: the other 15 stages share the remaining 60 layers (Megatron-Core's
    # get_num_layers_to_build)
    par = ParallelConfig.create(V3, world_size=1024, tp=2, pp=16, pp_first_stage_layers=1)
    assert par.pp_layout == (1,) + (4,) * 15
    lite = load_config("deepseek-v2-lite")  # 27 layers
    par = ParallelConfig.create(lite, world_size=8, pp=2, pp_first_stage_layers=13)
    assert par.pp_layout == (13, 14)


def test_virtual_stages_interleave_chunks():
    par = ParallelConfig.create(TINY, world_size=2, pp=2, vpp=2)
    # virtual stage v = chunk * pp + rank: rank 0 holds v0 and v2, rank 1 v1 and v3
    assert par.layers_of_stage(0) == [[0], [2]] and par.layers_of_stage(1) == [[1], [3]]


def test_parse_layout():
    assert parse_layout("4*15,1") == (4,) * 15 + (1,)
    assert parse_layout("3, 2,2") == (3, 2, 2)
    for bad in ["four", "", "4*999999999999,1", "4*1_5,1", "\u0663,1", "4*-1,61", "4*0"]:
        with pytest.raises(TracememError, match="--pp-layout .* is invalid"):
            parse_layout(bad)


def test_tp_must_divide_the_vocabulary_under_the_paper_plan_and_the_hidden_size():
    import dataclasses
    odd = dataclasses.replace(TINY, vocab_size=257)
    with pytest.raises(TracememError, match=r"--tp 2 must divide vocab_size \(257\)"):
        ParallelConfig.create(odd, world_size=2, tp=2, plan="paper-2502.07846")
    assert ParallelConfig.create(odd, world_size=2, tp=2).tp == 2  # megatron pads it
    with pytest.raises(TracememError, match=r"--tp 4 must divide hidden_size \(66\)"):
        ParallelConfig.create(dataclasses.replace(TINY, hidden_size=66), world_size=4, tp=4)


@pytest.mark.parametrize("kwargs, message", [
    # 1000 / (8 x 16) = 7.8: the nearest multiples of 128 are 896 and 1024; or, the world
    # size given, the PPs nearest 16 that divide 1000 / 8 = 125: 5 and 25
    (dict(world_size=1000, tp=8, pp=16, ep=8, pp_layout=(4,) * 15 + (1,)),
     r"--world-size 1000 is not a multiple of tp\(8\) \* cp\(1\) \* pp\(16\) = 128; DP would "
     r"not be an integer; try --world-size 896 or 1024, or --pp 5 or 25$"),
    # the world sizes suggested satisfy the expert degrees too: lcm(3, 64 x 3) = 192, so 1920
    # or 2112 (2046 would fail EDP next); PPs 2 or 4 divide 2048 / lcm(TP, EP) = 32
    (dict(world_size=2048, tp=1, pp=3, ep=64),
     r"--world-size 2048 is not a multiple of tp\(1\) \* cp\(1\) \* pp\(3\) = 3; DP would not "
     r"be an integer; try --world-size 1920 or 2112, or --pp 2 or 4$"),
    # a TP that divides no head count is said before the world size (no world size helps)
    (dict(world_size=1024, tp=3, pp=16, ep=8, pp_layout=(4,) * 15 + (1,)),
     r"--tp 3 must divide num_attention_heads \(128\); try 1, 2, 4, 8"),
    # the suggestions divide the world size too: 96 = 2^5 x 3, so not 64 or 128
    (dict(world_size=96, tp=3, pp=16, ep=2, pp_layout=(4,) * 15 + (1,)),
     r"--tp 3 must divide num_attention_heads \(128\); try 1, 2, 4, 8, 16, 32$"),
    # more stages than layers is said before the world size (a world size suggested for
    # this PP would only lead to it)
    (dict(world_size=96, tp=1, pp=64), r"pp \* vpp = 64 stages is more than the model's 61 "
                                      r"layers; lower --pp or --vpp so that pp \* vpp <= 61$"),
    (dict(world_size=1008, tp=1, pp=16, ep=7, pp_layout=(4,) * 15 + (1,)),
     r"--ep 7 must divide n_routed_experts \(256\); try 1, 2, 4, 8, 16"),
    (dict(world_size=1024, tp=2, pp=16, ep=1, etp=2, pp_layout=(4,) * 15 + (1,)),
     "--etp 2 needs --ep > 1"),
    (dict(world_size=64, tp=2, pp=16, ep=8, pp_layout=(4,) * 15 + (1,)),
     r"--world-size 64 is not a multiple of etp\(1\) \* ep\(8\) \* pp\(16\) = 128; EDP would "
     r"not be an integer; try --world-size 128, or --pp 8$"),
    (dict(world_size=1024, tp=1, sp=True, pp=16, pp_layout=(4,) * 15 + (1,)),
     "--sp needs --tp > 1"),
    (dict(world_size=1024, tp=2, pp=16), r"61 layers do not divide into pp \* vpp = 16 stages; "
                                          r"give --pp-layout \(e.g. 4\*15,1\)"),
    (dict(world_size=1024, tp=2, pp=16, pp_layout=(4,) * 16),
     "--pp-layout sums to 64 layers; the model has 61"),
    (dict(world_size=1024, tp=2, pp=16, pp_layout=(4,) * 15),
     r"--pp-layout has 15 entries; it needs one per virtual pipeline stage, pp \* vpp = 16"),
    (dict(world_size=128, pp=64, ep=1), r"pp \* vpp = 64 stages is more than the model's 61"),
    (dict(world_size=1024, tp=2, pp=16, pp_first_stage_layers=5, pp_last_stage_layers=1),
     "leave 55 layers for 14 other stages, which do not divide evenly"),
    (dict(world_size=1024, tp=2, pp=16, pp_first_stage_layers=100),
     "--pp-first-stage-layers 100 must be between 0 and the model's 61 layers"),
    (dict(world_size=1024, tp=2, pp=1, pp_first_stage_layers=61),
     "--pp-first-stage-layers / --pp-last-stage-layers need --pp 2 or more"),
    (dict(world_size=1024, tp=2, pp=16, vpp=2, pp_first_stage_layers=1, pp_last_stage_layers=0),
     "with --vpp > 1 are not supported"),
    (dict(world_size=1024, tp=2, pp=16, pp_layout=LAYOUT, pp_first_stage_layers=4),
     "give either --pp-layout or --pp-first-stage-layers"),
    (dict(world_size=1024, tp=2, pp=16, pp_layout=(5,) * 15 + (-14,)),
     "--pp-layout .* is invalid; it needs one non-negative integer per virtual pipeline stage"),
    (dict(world_size=1024, tp=2, pp=16, zero=4, pp_layout=(4,) * 15 + (1,)),
     "--zero 4 is invalid; choose 0, 1, 2 or 3"),
    (dict(world_size=1024, tp=2, pp=16, precision="fp8", pp_layout=(4,) * 15 + (1,)),
     "--precision 'fp8' is invalid; choose one of megatron, paper-2502.07846, deepseek-v3"),
    (dict(world_size=1024, tp=2, pp=16, plan="fsdp", pp_layout=(4,) * 15 + (1,)),
     "--plan 'fsdp' is invalid"),
    (dict(world_size=0), "--world-size 0 must be a positive integer"),
    (dict(world_size=8, tp=-2), "--tp -2 must be a positive integer"),
])
def test_invalid_layouts_name_the_flag_and_a_fix(kwargs, message):
    with pytest.raises(TracememError, match=message):
        ParallelConfig.create(V3, **kwargs)


def test_rank_outside_the_world_is_an_error():
    par = ParallelConfig.create(TINY, world_size=4, pp=2)
    with pytest.raises(TracememError, match=r"rank 4 is outside \[0, 4\)"):
        par.stage_of(4)


degree = st.sampled_from([1, 2, 3, 4, 8])


@settings(max_examples=300, deadline=None)
@given(world=st.sampled_from([1, 2, 4, 6, 8, 16, 32, 64]), tp=degree, cp=degree, ep=degree,
       etp=degree, pp=degree, vpp=st.sampled_from([1, 2]), sp=st.booleans(),
       zero=st.integers(-1, 4))
def test_any_degrees_either_build_a_consistent_layout_or_raise_the_documented_error(
        world, tp, cp, ep, etp, pp, vpp, sp, zero):
    try:
        par = ParallelConfig.create(TINY, world_size=world, tp=tp, cp=cp, ep=ep, etp=etp,
                                    pp=pp, vpp=vpp, sp=sp, zero=zero)
    except TracememError as error:
        assert str(error).startswith(("--", "4 layers", "pp * vpp")), str(error)
        return
    assert par.tp * par.cp * par.pp * par.dp == world
    assert par.etp * par.ep * par.pp * par.edp == world
    assert sum(par.pp_layout) == TINY.num_layers and len(par.pp_layout) == pp * vpp
    assert TINY.num_attention_heads % tp == 0 and TINY.num_routed_experts % ep == 0
    assert not (sp and tp == 1) and not (etp > 1 and ep == 1) and zero in (0, 1, 2, 3)
    assert sorted(i for stage in range(pp) for chunk in par.layers_of_stage(stage)
                  for i in chunk) == list(range(TINY.num_layers))


def test_account_for_embedding_and_loss_in_pipeline_split():
    """Megatron-LM get_num_layers_to_build: (layers + 1 + 1) split evenly over pp * vpp, the
    first virtual stage one layer fewer (the embedding), the last one fewer (the loss).
    DeepSeek-V3's 61 layers + 2 = 63 do not divide by 16; on PP 3: 63 / 3 = 21 per stage, so
    20, 21, 20; with the embedding only, 62 / 2 = 31: 30, 31."""
    from modeling import load_config
    v3 = load_config("deepseek-v3")
    both = ParallelConfig.create(v3, world_size=3, pp=3,
                                 account_for_embedding_in_pipeline_split=True,
                                 account_for_loss_in_pipeline_split=True)
    assert both.pp_layout == (20, 21, 20)
    embedding = ParallelConfig.create(v3, world_size=2, pp=2,
                                      account_for_embedding_in_pipeline_split=True)
    assert embedding.pp_layout == (30, 31)
    with pytest.raises(TracememError, match="61 layers \\+ 2 = 63 must divide by pp \\(16\\)"):
        ParallelConfig.create(v3, world_size=16, pp=16,
                              account_for_embedding_in_pipeline_split=True,
                              account_for_loss_in_pipeline_split=True)
    with pytest.raises(TracememError, match="apply to an even split"):
        ParallelConfig.create(v3, world_size=16, pp=16, pp_first_stage_layers=4,
                              pp_last_stage_layers=1, account_for_loss_in_pipeline_split=True)


def test_accounted_embedding_and_loss_allow_more_virtual_stages_than_layers():
    """Megatron-LM's CI case gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_
    split: 6 layers + 1 + 1 = 8 over pp 4 x vpp 2, one each, the first virtual stage's one the
    embedding and the last one's the loss. The early "more stages than layers" check counts
    decoder layers only, so it leaves an accounted split to get_num_layers_to_build's rule."""
    import dataclasses
    six = dataclasses.replace(load_config("deepseek-tiny"), num_layers=6)
    par = ParallelConfig.create(six, world_size=8, pp=4, vpp=2,
                                account_for_embedding_in_pipeline_split=True,
                                account_for_loss_in_pipeline_split=True)
    assert par.pp_layout == (0, 1, 1, 1, 1, 1, 1, 0)
    with pytest.raises(TracememError, match="pp \\* vpp = 8 stages is more than the model's 6"):
        ParallelConfig.create(six, world_size=8, pp=4, vpp=2)
