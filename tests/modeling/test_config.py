"""ModelConfig loading: presets, Hugging Face config.json files, and clear errors.

Reference: the official Hugging Face configs of deepseek-ai/DeepSeek-V3, DeepSeek-V2 and
DeepSeek-V2-Lite (values copied into the presets), and the rules in the issue.
"""

import json

import pytest

from modeling import PRESETS, load_config
from tracemem.errors import TracememError


def test_presets_carry_the_official_sizes():
    v3 = load_config("deepseek-v3")
    assert (v3.hidden_size, v3.num_layers, v3.num_routed_experts, v3.num_experts_per_tok,
            v3.first_k_dense_replace, v3.vocab_size, v3.num_mtp_modules) == \
        (7168, 61, 256, 8, 3, 129280, 1)
    assert (v3.qk_head_dim, v3.v_head_dim, v3.q_lora_rank, v3.kv_lora_rank) == (192, 128, 1536, 512)
    assert v3.scoring_func == "sigmoid" and v3.has_correction_bias
    lite = load_config("deepseek-v2-lite")
    assert lite.q_lora_rank is None and lite.num_mtp_modules == 0
    assert [load_config(p).name for p in PRESETS] == list(PRESETS)


def test_moe_layers_follow_first_k_dense_replace():
    v3 = load_config("deepseek-v3")
    assert [v3.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]


def _write(tmp_path, **changes):
    data = json.loads(_preset_text("deepseek-v2-lite"))
    data.update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in data.items() if v is not _DROP}))
    return path


_DROP = object()


def _preset_text(name):
    from importlib import resources
    presets = resources.files("modeling.families.deepseek.presets")
    return presets.joinpath(f"{name}.json").read_text()


def test_a_config_file_loads_and_unknown_keys_are_ignored(tmp_path):
    path = _write(tmp_path, rope_scaling={"type": "yarn"}, some_future_key=3)
    cfg = load_config(path)
    assert cfg.name == str(path) and cfg.hidden_size == 2048
    assert load_config(tmp_path).hidden_size == 2048  # a Hugging Face model folder


def test_missing_required_key_names_the_key_and_the_file(tmp_path):
    path = _write(tmp_path, kv_lora_rank=_DROP)
    with pytest.raises(TracememError, match=rf"{path}: required key 'kv_lora_rank' is missing"):
        load_config(path)


@pytest.mark.parametrize("key, value, message", [
    ("hidden_size", "2048", 'hidden_size="2048" must be an integer'),
    ("hidden_size", 2**40, "hidden_size=1099511627776 must be a positive integer no larger "
                           "than 16,777,216"),
    ("rms_norm_eps", -1.0, "rms_norm_eps=-1.0 must be a finite number > 0"),
    ("rms_norm_eps", "1e-6", 'rms_norm_eps="1e-6" must be a number'),
    ("hidden_act", "gelu", 'hidden_act="gelu" is not supported; tracemem\'s MLP and experts are '
                           'SwiGLU'),
    ("hidden_size", 0, "hidden_size=0 must be a positive integer"),
    ("num_experts_per_tok", True, "num_experts_per_tok=true must be an integer"),
    ("q_lora_rank", -1, "q_lora_rank=-1 must be a positive integer or null"),
    ("scoring_func", "relu", "scoring_func='relu' is invalid; it must be one of softmax, sigmoid"),
    ("num_experts_per_tok", 65, "num_experts_per_tok=65 is invalid; it must be at most "
                                "n_routed_experts \\(64\\)"),
    ("n_group", 5, "n_group=5 is invalid; it must be a divisor of n_routed_experts \\(64\\)"),
])
def test_ill_typed_or_invalid_values_are_clear_errors(tmp_path, key, value, message):
    path = _write(tmp_path, **{key: value})
    with pytest.raises(TracememError, match=message):
        load_config(path)


def test_malformed_json_and_unknown_model_are_clear_errors(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(TracememError, match="config.json: malformed JSON"):
        load_config(bad)
    with pytest.raises(TracememError, match="--model 'deepseek-v4' is neither a preset"):
        load_config("deepseek-v4")
    bad.write_text("[1, 2]")
    with pytest.raises(TracememError, match="expected a JSON object, got list"):
        load_config(bad)


def test_odd_rope_dim_too_many_layers_and_unaligned_grouped_experts_are_refused():
    # issue 9 item 8: RoPE rotates channel pairs; a layer count no machine could build; and
    # torch._grouped_mm needs sizes in multiples of 8 (auto falls back to one Linear each)
    import dataclasses

    import torch

    from modeling.common.model import resolve_experts
    tiny = load_config("deepseek-tiny")
    with pytest.raises(TracememError, match="qk_rope_head_dim=7 is invalid; it must be even"):
        dataclasses.replace(tiny, qk_rope_head_dim=7)
    with pytest.raises(TracememError, match="num_hidden_layers=5000 is invalid; it must be at "
                                            "most 4,096"):
        dataclasses.replace(tiny, num_layers=5000)
    assert resolve_experts("auto", torch.bfloat16, (60, 32)) == "sequential"
    assert resolve_experts("auto", torch.bfloat16, (64, 32)) == "grouped"
    with pytest.raises(TracememError, match="multiples of 8"):
        resolve_experts("grouped", torch.bfloat16, (60, 32))
