"""Static memory per rank: parameters, gradients, optimizer states under ZeRO 0-3.

Reference: arXiv 2502.07846 (text in shared/reference): a PP16@TP2@EP8@ETP1 stage of layers
4-7 holds 65,536 RMSNorm + 429,654,016 MLA + 5,820,645,376 MoE = 6,250,364,928 parameters
(12,500,729,856 B in BF16); with ZeRO over DP 32 (dense) and EDP 8 (experts) it needs
1,480,642,560 B of parameters, 2,961,285,120 B of gradients and 5,922,570,240 B of optimizer
states (the paper's 1.38, 2.76 and 5.52 "GB", which are GiB). Other figures by hand.
"""

import json

import pytest

from modeling import load_config
from modeling.parallel.build import build_rank
from tracemem.cli import main
from tracemem.parallel import ParallelConfig
from tracemem.static import static_memory

V3 = load_config("deepseek-v3")
LAYOUT = (4,) * 15 + (1,)
DENSE, EXPERT = 65_536 + 429_654_016 + 4 * 1_835_008, 132 * 3 * 7168 * 2048


def paper(zero, rank=64):
    par = ParallelConfig.create(V3, world_size=1024, tp=2, pp=16, ep=8, pp_layout=LAYOUT,
                                zero=zero, plan="paper-2502.07846", precision="paper-2502.07846")
    return static_memory(build_rank(V3, par, rank), par)


def test_paper_stage_parameter_counts():
    memory = paper(zero=3)
    c = memory.by_component
    assert c["norms"] == 65_536 and c["attention"] == 429_654_016
    assert c["router"] + c["routed_experts"] + c["shared_experts"] == 5_820_645_376
    assert memory.dense_params + memory.expert_params == 6_250_364_928 == DENSE + EXPERT
    assert (memory.dense_params, memory.expert_params) == (DENSE, EXPERT)


@pytest.mark.parametrize("zero, params, grads, optimizer", [
    (1, 2 * (DENSE + EXPERT), 4 * (DENSE + EXPERT), 8 * (DENSE // 32 + EXPERT // 8)),
    (2, 2 * (DENSE + EXPERT), 4 * (DENSE // 32 + EXPERT // 8), 8 * (DENSE // 32 + EXPERT // 8)),
    (3, 1_480_642_560, 2_961_285_120, 5_922_570_240),
])
def test_paper_static_bytes_under_each_zero_stage(zero, params, grads, optimizer):
    # (ZeRO 0 is refused: the paper's recipe is Megatron's precision-aware optimizer, which
    # needs the distributed optimizer; tests/tracemem/test_precision.py)
    memory = paper(zero)
    assert (memory.param_bytes, memory.grad_bytes, memory.optimizer_bytes) == \
        (params, grads, optimizer)
    assert memory.param_bytes == 12_500_729_856 or zero == 3
    assert memory.buffer_bytes == 4 * 256 * 4  # 4 layers' fp32 correction biases
    # ZeRO-3 all-gathers one layer at a time: the largest is one MoE layer of this rank
    layer = DENSE // 4 + EXPERT // 4
    assert memory.zero3_gather_bytes == (2 * layer if zero == 3 else 0)


def test_megatron_plan_differs_where_the_plans_differ():
    par = ParallelConfig.create(V3, world_size=1024, tp=2, pp=16, ep=8, pp_layout=LAYOUT)
    memory = static_memory(build_rank(V3, par, 64), par)
    # W^QR split over TP instead of replicated: 4 layers * 1536 * 8192 / 2 fewer
    assert memory.by_component["attention"] == 429_654_016 - 4 * 1536 * 8192 // 2
    # the shared expert split over TP (and sharded over DP, as a dense parameter)
    assert memory.by_component["shared_experts"] == 4 * 3 * 7168 * 2048 // 2
    assert memory.expert_params == 4 * 32 * 3 * 7168 * 2048
    # megatron recipe, ZeRO-1: 2 + 4 B unsharded, 12 B over DP / EDP
    assert memory.optimizer_bytes == 12 * (memory.dense_params // 32 + memory.expert_params // 8)
    assert memory.grad_bytes == 4 * (memory.dense_params + memory.expert_params)


def test_static_cli_json_gives_every_stage(capsys):
    assert main(["static", "--model", "deepseek-v3", "--plan", "paper-2502.07846",
                 "--precision", "paper-2502.07846", "--world-size", "1024", "--tp", "2",
                 "--pp", "16", "--ep", "8", "--etp", "1", "--zero", "3",
                 "--pp-first-stage-layers", "4", "--pp-last-stage-layers", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    stages = result["stages"]
    assert [s["layers"] for s in stages[:2]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert stages[15]["layers"] == [60]
    assert (stages[1]["param_bytes"], stages[1]["grad_bytes"], stages[1]["optimizer_bytes"]) \
        == (1_480_642_560, 2_961_285_120, 5_922_570_240)
    assert all(s == stages[1] | {"pp_stage": s["pp_stage"], "layers": s["layers"]}
               for s in stages[1:15])  # stages 1-14 are alike
    assert stages[0]["params_by_component"]["embedding"] == 129280 * 7168 // 2
    assert stages[0]["params_by_component"]["dense_mlp"] == 3 * 3 * 7168 * 18432 // 2
    assert stages[15]["params_by_component"]["output_head"] == 129280 * 7168 // 2
    assert result["parallel"]["dp"] == 32 and result["parallel"]["edp"] == 8


def test_static_cli_uneven_layers_is_a_usage_error(capsys):
    assert main(["static", "--model", "deepseek-v3", "--world-size", "1024", "--tp", "2",
                 "--pp", "16", "--ep", "8"]) == 2
    assert "give --pp-layout (e.g. 4*15,1)" in capsys.readouterr().err


TINY = load_config("deepseek-tiny")


def tiny_stage1(zero):
    """deepseek-tiny, world 16 = TP 1 x CP 2 x PP 2 x DP 4; experts ETP 2 x EP 2 x PP 2 x EDP 2.
    Rank 8 is the last stage: layers 2-3 (MoE), final norm, head, MTP (with its embedding)."""
    par = ParallelConfig.create(TINY, world_size=16, cp=2, pp=2, ep=2, etp=2, zero=zero)
    return par, static_memory(build_rank(TINY, par, 8), par)


# Elements of rank 8, by hand (h 64, vocab 256, 4 heads, q LoRA 48, kv LoRA 32, rope 8, nope 16,
# v 16; 8 experts of width 32, top-2, 1 shared):
MLA = 64 * 48 + 48 * 4 * (16 + 8) + 64 * (32 + 8) + 32 * 4 * (16 + 16) + 4 * 16 * 64  # 18,432
NORMS = 64 + 64 + 48 + 32  # attn_norm, ffn_norm, q_norm, kv_norm
MOE_DENSE = MLA + NORMS + 8 * 64 + 3 * 64 * 32  # + router + shared expert (TP 1)
STAGE1_DENSE = (2 * MOE_DENSE + 64 + 256 * 64  # layers 2, 3, final norm, head
                + 64 + 64 + 2 * 64 * 64 + MOE_DENSE + 64  # MTP enorm, hnorm, eh_proj, layer, norm
                + 256 * 64)  # the MTP stage's embedding
STAGE1_EXPERT = 3 * (8 // 2) * 3 * 64 * (32 // 2)  # 3 MoE layers x 4 experts x ETP-halved SwiGLU
DP_CP, EDP = 16 // (1 * 2 * 2) * 2, 16 // (2 * 2 * 2)  # DP 4 x CP 2 = 8; EDP 2


def test_sharding_table_every_row_with_cp_ep_etp_and_pp():
    """Each SHARDING row: dense quantities over DP x CP (8), expert over EDP (2), from the
    row's ZeRO stage up (megatron recipe: 2 / 4 / 12 B)."""
    assert (STAGE1_DENSE, STAGE1_EXPERT) == (117_104, 36_864)
    assert (DP_CP, EDP) == (8, 2)
    dense_shard, expert_shard = -(-STAGE1_DENSE // DP_CP), STAGE1_EXPERT // EDP  # 14,638; 18,432
    full = STAGE1_DENSE + STAGE1_EXPERT
    expected = {  # zero -> (param, grad, optimizer) bytes
        0: (2 * full, 4 * full, 12 * full),
        1: (2 * full, 4 * full, 12 * (dense_shard + expert_shard)),
        2: (2 * full, 4 * (dense_shard + expert_shard), 12 * (dense_shard + expert_shard)),
        3: (2 * (dense_shard + expert_shard), 4 * (dense_shard + expert_shard),
            12 * (dense_shard + expert_shard)),
    }
    for zero, want in expected.items():
        par, memory = tiny_stage1(zero)
        assert (par.dp_cp, par.edp) == (DP_CP, EDP)
        assert (memory.dense_params, memory.expert_params) == (STAGE1_DENSE, STAGE1_EXPERT)
        assert (memory.param_bytes, memory.grad_bytes, memory.optimizer_bytes) == want
    assert expected[3] == (66_140, 132_280, 396_840)


def test_step_grad_copies_rows_with_cp_ep_etp_and_pp():
    """The step_grad_copies rows: under --grad-reduce-in-bf16 the distributed optimizer makes an
    fp32 copy of this rank's shard of the grad buffer: 4 B x (dense / DP x CP + expert / EDP)."""
    import torch

    from tracemem.optimizer_step import trace_optimizer_step
    from tracemem.tracer import MemoryTracer
    par = ParallelConfig.create(TINY, world_size=16, cp=2, pp=2, ep=2, etp=2,
                                grad_reduce_in_bf16=True)
    model = build_rank(TINY, par, 8, dtype=torch.bfloat16)
    tracer = MemoryTracer(devices={"meta"})
    tracer.track_external(model)
    trace_optimizer_step(model, par, tracer)
    allocs = [e.nbytes for e in tracer.events
              if e.action == "alloc" and e.phase.value != "external"]
    assert sorted(allocs) == sorted([4 * -(-STAGE1_DENSE // DP_CP), 4 * (STAGE1_EXPERT // EDP)])
    assert sum(allocs) == 4 * (14_638 + 18_432)


def test_sharding_table_rows_are_cited():
    from tracemem.parallel import GROUPS, SHARDING
    quantities = {(rule.quantity, rule.kind) for rule in SHARDING}
    assert quantities >= {(q, k) for q in ("parameters", "gradients", "optimizer_states",
                                           "zero3_gathers", "step_grad_copies")
                          for k in ("dense", "expert")}
    assert all(rule.group in GROUPS and "megatron/core/" in rule.source for rule in SHARDING)


def test_context_parallelism_does_not_change_the_optimizer_shard(capsys):
    """Issue 9 item 2: DeepSeek-V2-Lite, world 8, ZeRO-1: the distributed optimizer shards dense
    states over DP x CP = 8 whatever CP is: 23,559,726,336 B with CP 1 and CP 2."""
    for cp in (1, 2):
        assert main(["static", "--model", "deepseek-v2-lite", "--world-size", "8", "--cp",
                     str(cp), "--zero", "1", "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["parallel"]["dp_cp"] == 8
        assert result["stages"][0]["optimizer_bytes"] == 23_559_726_336


def test_docs_show_the_sharding_table():
    from pathlib import Path

    from tracemem.parallel import SHARDING
    doc = Path(__file__).parents[2].joinpath("docs", "parallel.md").read_text()
    for rule in SHARDING:
        assert f"| {rule.quantity} | {rule.kind} | {rule.group} | {rule.zero} |" in doc


# ---------------------------------------------------------------------------- Megatron's layout
# Megatron-Core 0.16.1 distributed/param_and_grad_buffer.py _ParamAndGradBuffer.__init__ (the
# same rules at Megatron-LM d98e8a6 optimizer/param_layout.py): parameters laid out in reverse
# registration order, each starting at a multiple of 64 elements, each bucket ending at a
# multiple of lcm(DP, 128); DP rank r owns [r, r + 1) x bucket / DP of each bucket.
def test_megatron_buffer_pads_like_param_and_grad_buffer():
    from tracemem.static import MegatronBuffer
    # registered (100, 64, 30): laid out 30 at [0, 30), 64 at [64, 128), 100 at [128, 228);
    # the bucket ends at 256 (lcm(2, 128) = 128 divides it)
    buffer = MegatronBuffer(0, "dense", (100, 64, 30), group=2)
    padded, params, buckets = buffer.layout()
    assert (padded, params, buckets) == (256, [(0, 30), (64, 128), (128, 228)], [(0, 256)])
    # rank 0 owns [0, 128): 30 + 64 elements; rank 1 [128, 256): 100 (the rest is padding)
    assert (buffer.shard_elements(0), buffer.shard_elements(1)) == (94, 100)
    # DP 3: lcm(3, 128) = 384, each rank 128 elements: [0, 128) holds 30 + 64, [128, 256)
    # the 100, [256, 384) nothing
    three = MegatronBuffer(0, "dense", (100, 64, 30), group=3)
    assert three.padded == 384
    assert [three.shard_elements(r) for r in range(3)] == [94, 100, 0]


def test_megatron_buffer_buckets_close_at_bucket_size():
    from tracemem.static import MegatronBuffer
    # bucket_size 64: 30 at [0, 30) (bucket still short), 64 at [64, 128): 128 >= 64 closes
    # bucket 0 at pad(128, 128) = 128; 100 at [128, 228) closes bucket 1 at 256
    buffer = MegatronBuffer(0, "dense", (100, 64, 30), group=2, bucket_size=64)
    assert buffer.layout() == (256, [(0, 30), (64, 128), (128, 228)], [(0, 128), (128, 256)])
    # rank 0: [0, 64) of bucket 0 (30) and [128, 192) of bucket 1 (64 of the 100)
    assert (buffer.shard_elements(0), buffer.shard_elements(1)) == (30 + 64, 64 + 36)


def test_megatron_tensors_are_megatron_cores_parameters_in_its_order():
    import dataclasses

    import torch

    from tracemem.static import megatron_tensors
    # deepseek-tiny, 2 layers (0 dense, 1 MoE), TP 1: h 64, q_lora 48, kv_lora 32, rope 8,
    # 4 heads of q 24 / v 16, dense inter 128, 8 experts of inter 32, one shared of 32
    cfg = dataclasses.replace(load_config("deepseek-tiny"), num_layers=2, num_mtp_modules=0,
                              first_k_dense_replace=1, dtype="bfloat16")
    par = ParallelConfig.create(cfg, world_size=1)
    model = build_rank(cfg, par, 0, dtype=torch.bfloat16, kernels="megatron-te")
    tensors = megatron_tensors(model)
    numels = [n for _, n, _, _ in tensors]
    attention = [64 * 64, 48 * 64, 48, 96 * 48, 40 * 64, 32, 128 * 32]  # wo first
    dense = [64, 2 * 128 * 64, 64 * 128]  # fc1 = [w1; w3]
    moe = [64, 8 * 64] + [2 * 32 * 64] * 8 + [64 * 32] * 8 + [2 * 32 * 64, 64 * 32]
    assert numels == ([256 * 64] + [64] + attention + dense + [64] + attention + moe
                      + [64, 256 * 64])
    # Megatron's no-weight-decay group: the 1-D tensors (norms): 2 x (64 + 48 + 32 + 64) + 64
    assert sum(n for _, n, _, no_decay in tensors if no_decay) == 2 * 208 + 64


def test_a_shared_embedding_has_a_bucket_of_its_own():
    from tracemem.static import MegatronBuffer
    # registered (embedding 100, 64, 30), the embedding shared (tied, PP > 1): laid out 30 at
    # [0, 30), 64 at [64, 128); the embedding closes that bucket at pad(128, 128) = 128 and
    # takes [128, 228) alone, its bucket ending at 256 (Megatron-Core's
    # _does_param_require_new_bucket)
    buffer = MegatronBuffer(0, "dense", (100, 64, 30), group=2,
                            own_bucket=(True, False, False))
    assert buffer.layout() == (256, [(0, 30), (64, 128), (128, 228)], [(0, 128), (128, 256)])
    # DP 2: rank 0 owns [0, 64) and [128, 192); rank 1 [64, 128) and [192, 256)
    assert (buffer.shard_elements(0), buffer.shard_elements(1)) == (30 + 64, 64 + 36)
