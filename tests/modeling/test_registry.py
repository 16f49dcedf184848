"""The family registry: model_type -> family, and what it refuses (issue 12 items 1-3).

References: transformers' config classes (LlamaConfig, Qwen2Config, Qwen3Config: their key
names and defaults), the official config.json files copied into the presets, and the rule of
issue 12 item 3 (one line naming the key, the value and the families known).
"""

import json

import pytest

from modeling import PRESETS, load_config
from modeling.registry import FAMILIES
from tracemem.errors import TracememError

KNOWN = "families known: deepseek_v2, deepseek_v3, llama, qwen2, qwen3"


def _write(tmp_path, preset, **changes):
    from importlib import resources

    family = next(f for f in FAMILIES.values() if preset in f.PRESETS)
    data = json.loads(resources.files(family.PRESET_PACKAGE).joinpath(f"{preset}.json")
                      .read_text())
    data.update(changes)
    data = {k: v for k, v in data.items() if v is not _DROP}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


_DROP = object()


def test_every_preset_loads_with_its_family():
    kinds = {p: load_config(p).attention for p in PRESETS}
    assert {p for p, k in kinds.items() if k == "mla"} == {
        "deepseek-v3", "deepseek-v2", "deepseek-v2-lite", "moonlight-16b-a3b", "deepseek-tiny"}
    assert {"llama-3-8b", "llama-3-70b", "llama-3.1-405b", "qwen2.5-14b", "llama-tiny",
            "qwen2-tiny", "qwen3-tiny"} <= {p for p, k in kinds.items() if k == "gqa"}
    assert set(FAMILIES) >= {"deepseek_v2", "deepseek_v3", "llama", "qwen2", "qwen3"}


def test_llama_config_file_reads_gqa_and_tolerates_rope_scaling(tmp_path):
    cfg = load_config(_write(tmp_path, "llama-3.1-405b"))
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (128, 8, 128)
    assert cfg.rope_theta == 500000.0 and cfg.max_position_embeddings == 131072
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.qk_norm or cfg.is_moe)
    assert cfg.q_lora_rank is None and cfg.kv_lora_rank is None


def test_llama_2_defaults_mha_and_head_dim(tmp_path):
    # Llama-2-7B's config.json has no head_dim; LlamaConfig: num_key_value_heads None -> MHA
    cfg = load_config(_write(tmp_path, "llama-3-8b", num_key_value_heads=None, head_dim=_DROP,
                             rope_theta=10000.0, vocab_size=32000, intermediate_size=11008))
    assert cfg.num_key_value_heads == cfg.num_attention_heads == 32 and cfg.head_dim == 128


def test_qwen_families_set_their_biases_and_qk_norm():
    qwen2, qwen3 = load_config("qwen2.5-14b"), load_config("qwen3-tiny")
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm) == (True, False, False)
    assert (qwen3.qkv_bias, qwen3.o_bias, qwen3.qk_norm) == (False, False, True)
    assert qwen3.head_dim == 32 != qwen3.hidden_size // qwen3.num_attention_heads


def test_newer_transformers_dtype_key_is_read(tmp_path):
    cfg = load_config(_write(tmp_path, "llama-tiny", torch_dtype=_DROP, dtype="bfloat16"))
    assert cfg.dtype == "bfloat16"


def test_unknown_model_type_names_the_value_and_the_families(tmp_path):
    path = _write(tmp_path, "llama-tiny", model_type="gpt_neox")
    with pytest.raises(TracememError, match=rf'^{path}: model_type="gpt_neox" has no family in '
                                            rf'tracemem; {KNOWN}'):
        load_config(path)
    path = _write(tmp_path, "llama-tiny", model_type=_DROP)
    with pytest.raises(TracememError, match=rf"{path}: has no model_type; {KNOWN}"):
        load_config(path)


def test_a_deepseek_key_in_a_llama_config_is_refused(tmp_path):
    path = _write(tmp_path, "llama-3-70b", q_lora_rank=1536)
    with pytest.raises(TracememError, match=rf"^{path}: q_lora_rank=1536 contradicts model_type "
                                            rf"'llama' \(it is a key of deepseek_v2, "
                                            rf"deepseek_v3\); {KNOWN}"):
        load_config(path)


def test_grouped_kv_heads_under_mla_are_refused(tmp_path):
    path = _write(tmp_path, "deepseek-tiny", num_key_value_heads=2)
    with pytest.raises(TracememError, match=rf"^{path}: num_key_value_heads=2 contradicts "
                                            rf"model_type 'deepseek_v3': MLA keeps one "
                                            rf"compressed KV for all heads"):
        load_config(path)


def test_a_qwen3_moe_config_with_deepseek_keys_never_estimates_mla(tmp_path):
    # issue 12: a Qwen3-MoE config.json given DeepSeek keys as well used to load as MLA
    deepseek = json.loads(_write(tmp_path, "deepseek-tiny").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps(deepseek | {
        "model_type": "qwen3_moe", "num_experts": 8, "num_key_value_heads": 2,
        "head_dim": 16, "decoder_sparse_step": 1, "mlp_only_layers": []}))
    with pytest.raises(TracememError, match=rf"^{path}: .*qwen3_moe.*; families known: ") as e:
        load_config(path)
    assert "\n" not in str(e.value)


def test_values_out_of_family_range_are_refused(tmp_path):
    path = _write(tmp_path, "llama-tiny", num_key_value_heads=3)
    with pytest.raises(TracememError, match="num_key_value_heads=3 is invalid; it must be a "
                                            "divisor of num_attention_heads \\(4\\)"):
        load_config(path)
    path = _write(tmp_path, "llama-tiny", partial_rotary_factor=0.2)
    with pytest.raises(TracememError, match=r"head_dim=16 is invalid; it must be such that "
                                            r"head_dim \* partial_rotary_factor \(3\) is even"):
        load_config(path)
    path = _write(tmp_path, "llama-tiny", hidden_act="relu")
    with pytest.raises(TracememError, match="hidden_act='relu' is invalid; it must be one of "
                                            "silu, gelu, gelu_pytorch_tanh"):
        load_config(path)
