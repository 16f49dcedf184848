"""Static memory per rank: parameters, gradients, optimizer states under ZeRO 0-3.

Reference: arXiv 2502.07846 (text in shared/reference): a PP16@TP2@EP8@ETP1 stage of layers
4-7 holds 65,536 RMSNorm + 429,654,016 MLA + 5,820,645,376 MoE = 6,250,364,928 parameters
(12,500,729,856 B in BF16); with ZeRO over DP 32 (dense) and EDP 8 (experts) it needs
1,480,642,560 B of parameters, 2,961,285,120 B of gradients and 5,922,570,240 B of optimizer
states (the paper's 1.38, 2.76 and 5.52 "GB", which are GiB). Other figures by hand.
"""

import json

import pytest

from modeling.config import load_config
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
    (0, 2 * (DENSE + EXPERT), 4 * (DENSE + EXPERT), 8 * (DENSE + EXPERT)),
    (1, 2 * (DENSE + EXPERT), 4 * (DENSE + EXPERT), 8 * (DENSE // 32 + EXPERT // 8)),
    (2, 2 * (DENSE + EXPERT), 4 * (DENSE // 32 + EXPERT // 8), 8 * (DENSE // 32 + EXPERT // 8)),
    (3, 1_480_642_560, 2_961_285_120, 5_922_570_240),
])
def test_paper_static_bytes_under_each_zero_stage(zero, params, grads, optimizer):
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
