"""The CLI on the MoE families: a preset and a Qwen3-MoE config.json (issue 12 item 2).

References: the hand-derived counts of tests/modeling/test_moe_family_params.py; one rank's
parameters under TP 2 and EP 8 multiplied out by hand below from Qwen3-30B-A3B's config
(Megatron-Core's split: q / k / v column-parallel over TP, o row-parallel, q_norm / k_norm and
the RMSNorms and the router replicated, 128 / 8 = 16 routed experts per EP rank), 2 B bf16
weights per parameter under --precision megatron.
"""

import json
import shutil
from importlib import resources

from tracemem.cli import main

# one Qwen3-30B-A3B layer on one rank of TP 2, EP 8, ETP 1
ATTENTION = 2048 * 2048 + 2 * 2048 * 256 + 2048 * 2048 + 2 * 128  # q, k + v, o, q/k norms
EXPERTS = 16 * 3 * 2048 * 768
LAYER = ATTENTION + EXPERTS + 128 * 2048 + 2 * 2048  # + router, the two RMSNorms
ARGS = ["--world-size", "64", "--tp", "2", "--sp", "--pp", "4", "--ep", "8",
        "--micro-batch-size", "1", "--seq-length", "1024", "--num-microbatches", "4",
        "--json", "--quiet"]


def test_params_of_the_moe_presets(capsys):
    for preset, total in [("qwen3-30b-a3b", "30,532,122,624"), ("mixtral-8x7b", "46,702,792,704"),
                          ("qwen1.5-moe-a2.7b", "14,315,784,192")]:
        assert main(["params", "--model", preset]) == 0
        assert total in capsys.readouterr().out


def test_estimate_of_qwen3_30b_a3b_preset_and_config_json_agree(tmp_path, capsys):
    assert main(["estimate", "--model", "qwen3-30b-a3b", *ARGS]) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert [r["pp_stage"] for r in ranks] == [0, 1, 2, 3]
    assert ranks[1]["parameter_bytes"] == 2 * 12 * LAYER  # 12 layers, no embedding or head

    preset = resources.files("modeling.families.qwen3_moe.presets").joinpath(
        "qwen3-30b-a3b.json")
    path = tmp_path / "config.json"
    shutil.copyfile(str(preset), path)
    assert main(["estimate", "--model", str(path), *ARGS]) == 0
    from_file = json.loads(capsys.readouterr().out)["ranks"]
    assert [r["peak_bytes"] for r in from_file] == [r["peak_bytes"] for r in ranks]


def test_a_contradictory_moe_config_exits_2_with_one_line(tmp_path, capsys):
    preset = resources.files("modeling.families.qwen3_moe.presets").joinpath(
        "qwen3-30b-a3b.json")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(json.loads(preset.read_text()) | {"kv_lora_rank": 512}))
    assert main(["estimate", "--model", str(path), *ARGS]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "kv_lora_rank=512 contradicts model_type 'qwen3_moe'" in err
