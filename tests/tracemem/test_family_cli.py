"""The CLI on the dense families: presets and config.json paths (issue 12 item 2).

References: the hand-derived counts of tests/modeling/test_family_params.py; Megatron-Core's
ZeRO-1 static bytes under --precision megatron (2 B bf16 weights per parameter on every rank
of a TP group holding 1 / TP of each split matrix; tests/tracemem/test_static.py).
"""

import json
import shutil
from importlib import resources

from tracemem.cli import main


def test_params_of_llama_3_70b(capsys):
    assert main(["params", "--model", "llama-3-70b"]) == 0
    out = capsys.readouterr().out
    assert "70,553,706,496" in out and "69,503,033,344" in out  # total, less the embedding


def test_params_of_a_qwen2_config_json_and_its_folder(tmp_path, capsys):
    preset = resources.files("modeling.families.qwen.presets").joinpath("qwen2.5-14b.json")
    path = tmp_path / "config.json"
    shutil.copyfile(str(preset), path)
    assert main(["params", "--model", str(path)]) == 0
    assert "14,770,033,664" in capsys.readouterr().out
    assert main(["params", "--model", str(tmp_path)]) == 0  # a Hugging Face model folder
    capsys.readouterr()


def test_estimate_of_llama_3_70b_runs_and_splits_the_weights(capsys):
    args = ["estimate", "--model", "llama-3-70b", "--world-size", "64", "--tp", "8", "--sp",
            "--pp", "8", "--micro-batch-size", "1", "--seq-length", "1024",
            "--num-microbatches", "8", "--json", "--quiet"]
    assert main(args) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    assert [r["pp_stage"] for r in ranks] == list(range(8))
    # a middle stage holds 10 layers, each 855,654,400 parameters of which only the two
    # RMSNorms (16,384) are not split over TP 8: bf16 weights, 2 B each
    layer = (855_654_400 - 16_384) // 8 + 16_384
    assert ranks[3]["parameter_bytes"] == 2 * 10 * layer


def test_a_refused_config_exits_2_with_one_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mamba", "hidden_size": 8}))
    assert main(["params", "--model", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and 'model_type="mamba" has no family' in err
