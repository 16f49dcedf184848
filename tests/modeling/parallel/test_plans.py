"""One test per sharding rule: the shapes one rank holds under each plan.

References: Megatron-Core (file per rule in modeling/parallel/plans.py's docstring) for the
``megatron`` plan; arXiv 2502.07846's stated assumptions for ``paper-2502.07846``; shapes by
hand from DeepSeek-V3's config (h 7168, 128 heads of 128 + 64 query/key and 128 value dims,
q_lora 1536, kv_lora 512, 256 experts of width 2048, 1 shared expert, vocab 129280).
"""

import pytest

from modeling import load_config
from modeling.parallel.build import build_rank, coordinates
from modeling.parallel.plans import padded_vocab
from tracemem.parallel import ParallelConfig

V3 = load_config("deepseek-v3")
LAYOUT = (4,) * 15 + (1,)


def layout(plan, **degrees):
    degrees = {"tp": 2, "pp": 16, "ep": 8, **degrees}
    return ParallelConfig.create(V3, world_size=1024, pp_layout=LAYOUT, plan=plan, **degrees)


@pytest.fixture(scope="module")
def megatron_stage1():
    return build_rank(V3, layout("megatron", etp=2), rank=64)  # stage 1, layers 4-7


@pytest.fixture(scope="module")
def paper_stage1():
    return build_rank(V3, layout("paper-2502.07846"), rank=64)


def shape(model, name):
    return tuple(dict(model.named_parameters())[name].shape)


def test_mla_down_projections_and_norms_are_replicated(megatron_stage1):
    m = megatron_stage1
    assert shape(m, "layers.4.attn.wq_a.weight") == (1536, 7168)
    assert shape(m, "layers.4.attn.wkv_a.weight") == (512 + 64, 7168)
    assert shape(m, "layers.4.attn.q_norm.weight") == (1536,)
    assert shape(m, "layers.4.attn.kv_norm.weight") == (512,)


def test_mla_up_projections_are_column_parallel_and_wo_row_parallel(megatron_stage1):
    m = megatron_stage1
    assert shape(m, "layers.4.attn.wq_b.weight") == (64 * 192, 1536)  # 64 of 128 heads
    assert shape(m, "layers.4.attn.wkv_b.weight") == (64 * (128 + 128), 512)
    assert shape(m, "layers.4.attn.wo.weight") == (7168, 64 * 128)


def test_router_is_replicated_with_its_bias(megatron_stage1):
    gate = megatron_stage1.layers["4"].ffn.gate
    assert tuple(gate.weight.shape) == (256, 7168)
    assert tuple(gate.e_score_correction_bias.shape) == (256,)


def test_routed_experts_split_over_ep_then_etp(megatron_stage1):
    moe = megatron_stage1.layers["4"].ffn
    assert moe.expert_ids == range(0, 32)  # rank 64 is EP rank 0 of its stage
    assert tuple(moe.experts.w1.shape) == (32, 2048 // 2, 7168)  # ETP 2 halves each expert
    assert tuple(moe.experts.w2.shape) == (32, 7168, 2048 // 2)


def test_shared_experts_and_dense_mlp_split_over_tp(megatron_stage1):
    assert shape(megatron_stage1, "layers.4.ffn.shared_experts.w1.weight") == (1024, 7168)
    assert shape(megatron_stage1, "layers.4.ffn.shared_experts.w2.weight") == (7168, 1024)
    stage0 = build_rank(V3, layout("megatron"), rank=0)
    assert shape(stage0, "layers.0.ffn.w1.weight") == (18432 // 2, 7168)
    assert shape(stage0, "layers.0.ffn.w2.weight") == (7168, 18432 // 2)


def test_embedding_and_head_split_the_padded_vocabulary_and_sit_on_the_ends():
    assert padded_vocab(129280, 2) == 129280 and padded_vocab(129280, 3) == 129408
    stage0 = build_rank(V3, layout("megatron"), rank=0)
    last = build_rank(V3, layout("megatron"), rank=1023)
    assert shape(stage0, "embed.weight") == (129280 // 2, 7168)
    assert not hasattr(stage0, "head")
    assert shape(last, "head.weight") == (129280 // 2, 7168)  # (out, in)
    # the MTP stage keeps its own embedding (Megatron-Core gpt_model.py, mtp_process)
    assert shape(last, "embed.weight") == (129280 // 2, 7168)
    assert shape(last, "mtp.0.eh_proj.weight") == (7168 // 2, 2 * 7168)
    assert list(last.layers) == ["60"] and list(stage0.layers) == ["0", "1", "2", "3"]


def test_paper_plan_replicates_the_query_rope_projection_and_the_shared_expert(paper_stage1):
    m = paper_stage1
    assert shape(m, "layers.4.attn.wq_b.weight") == (64 * 128, 1536)  # W^UQ: no-RoPE, split
    assert shape(m, "layers.4.attn.wq_r.weight") == (128 * 64, 1536)  # W^QR: all heads
    assert shape(m, "layers.4.ffn.shared_experts.w1.weight") == (2048, 7168)
    assert tuple(m.layers["4"].ffn.experts.w1.shape) == (32, 2048, 7168)


def test_ep_rank_picks_the_experts():
    par = layout("megatron")
    # Rank 70 is the 7th rank of stage 1 (ranks 64-127). Dense groups: TP fastest, so TP rank
    # 0, DP rank 3. Expert groups fold independently (ETP 1 fastest, then EP): EP rank 6.
    where = coordinates(par, 70)
    assert (where.pp_rank, where.tp_rank, where.dp_rank, where.ep_rank, where.edp_rank) == \
        (1, 0, 3, 6, 0)
    assert build_rank(V3, par, 70).layers["4"].ffn.expert_ids == range(192, 224)
