"""The MoE families' configs: what each reads from its config.json, and what it refuses
(issue 12 items 1-3).

References: transformers' modeling files of each family (modeling_qwen3_moe.py,
modeling_qwen2_moe.py, modeling_mixtral.py: which projections have biases, qk-norm, the router,
the shared expert and its gate, which layers are MoE); mistral-inference moe.py (Mixtral's
softmax over the chosen logits); the official config.json files copied into the presets; the
rule of issue 12 item 3 (one line naming the key, the value and the families known).
"""

import json
from importlib import resources

import pytest

from modeling import load_config
from modeling.common.router import RouterSpec
from modeling.registry import FAMILIES
from tracemem.errors import TracememError

KNOWN = ("families known: deepseek_v2, deepseek_v3, llama, qwen2, qwen3, qwen3_moe, qwen2_moe, "
         "mixtral, gpt$")


def _write(tmp_path, preset, **changes):
    family = next(f for f in FAMILIES.values() if preset in f.PRESETS)
    data = json.loads(resources.files(family.PRESET_PACKAGE).joinpath(f"{preset}.json")
                      .read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data | changes))
    return path


def test_qwen3_30b_a3b_reads_as_qwen3_moe():
    cfg = load_config("qwen3-30b-a3b")
    assert (cfg.attention, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == \
        ("gqa", 32, 4, 128)
    assert cfg.qk_norm and not (cfg.qkv_bias or cfg.o_bias)
    assert (cfg.num_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == \
        (128, 8, 768)
    assert cfg.shared_experts_width == 0 and not cfg.shared_expert_gate
    assert all(cfg.is_moe_layer(i) for i in range(48))
    assert RouterSpec.of(cfg) == RouterSpec(128, 8, "softmax", pre_softmax=True,
                                            norm_topk_prob=True, scaling_factor=None)


def test_qwen1_5_moe_reads_its_shared_expert_and_gate():
    cfg = load_config("qwen1.5-moe-a2.7b")
    assert cfg.qkv_bias and not (cfg.o_bias or cfg.qk_norm)
    assert (cfg.num_shared_experts, cfg.shared_experts_width, cfg.shared_expert_gate) == \
        (1, 5632, True)
    assert RouterSpec.of(cfg) == RouterSpec(60, 4, "softmax", pre_softmax=True,
                                            norm_topk_prob=False, scaling_factor=None)
    assert RouterSpec.of(cfg).megatron_pre_softmax  # Megatron: --moe-router-pre-softmax


def test_mixtral_routes_softmax_after_the_top_k():
    cfg = load_config("mixtral-8x7b")
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.moe_intermediate_size) == (8, 128, 14336)
    spec = RouterSpec.of(cfg)
    assert (spec.num_experts, spec.top_k, spec.pre_softmax, spec.megatron_pre_softmax) == \
        (8, 2, False, False)
    assert cfg.shared_experts_width == 0 and all(cfg.is_moe_layer(i) for i in range(32))


def test_qwen_moe_layers_follow_decoder_sparse_step_and_mlp_only_layers(tmp_path):
    # transformers Qwen3MoeDecoderLayer: MoE iff layer not in mlp_only_layers and
    # (layer + 1) % decoder_sparse_step == 0
    cfg = load_config(_write(tmp_path, "qwen3-moe-tiny", num_hidden_layers=6,
                             decoder_sparse_step=2, mlp_only_layers=[3]))
    assert [i for i in range(6) if cfg.is_moe_layer(i)] == [1, 5]
    assert [i for i in range(4) if load_config("qwen2-moe-tiny").is_moe_layer(i)] == [1, 3]


@pytest.mark.parametrize("preset, key, value, owners", [
    # issue 12: a Qwen3-MoE config.json given DeepSeek keys used to be estimated as MLA
    ("qwen3-30b-a3b", "q_lora_rank", 1536, "deepseek_v2, deepseek_v3"),
    ("qwen3-30b-a3b", "scoring_func", "sigmoid", "deepseek_v2, deepseek_v3"),
    ("qwen3-30b-a3b", "shared_expert_intermediate_size", 5632, "qwen2_moe"),
    ("mixtral-8x7b", "num_experts", 8, "qwen3_moe, qwen2_moe"),
    ("mixtral-8x7b", "norm_topk_prob", False, "deepseek_v2, deepseek_v3, qwen3_moe, qwen2_moe"),
    ("qwen1.5-moe-a2.7b", "n_shared_experts", 2, "deepseek_v2, deepseek_v3"),
    ("llama-3-8b", "num_local_experts", 8, "mixtral"),
])
def test_a_key_of_another_family_is_refused_in_one_line(tmp_path, preset, key, value, owners):
    path = _write(tmp_path, preset, **{key: value})
    model_type = json.loads(path.read_text())["model_type"]
    with pytest.raises(TracememError, match=rf"^{path}: {key}={json.dumps(value)} contradicts "
                                            rf"model_type '{model_type}' \(it is a key of "
                                            rf"{owners}\); {KNOWN}") as error:
        load_config(path)
    assert "\n" not in str(error.value)


def test_values_the_moe_families_cannot_hold_are_refused(tmp_path):
    path = _write(tmp_path, "qwen3-moe-tiny", mlp_only_layers=[0, 4])
    with pytest.raises(TracememError, match=rf"^{path}: mlp_only_layers=\[0, 4\] must be a list "
                                            r"of distinct layer numbers 0..num_hidden_layers - 1"):
        load_config(path)
    path = _write(tmp_path, "mixtral-tiny", hidden_act="gelu")
    with pytest.raises(TracememError, match=rf'^{path}: hidden_act="gelu" is not supported for '
                                            r"model_type 'mixtral': tracemem's routed experts "
                                            r"are SwiGLU \(silu\)"):
        load_config(path)
    path = _write(tmp_path, "qwen2-moe-tiny", num_experts_per_tok=9)
    with pytest.raises(TracememError, match=r"num_experts_per_tok=9 is invalid; it must be at "
                                            r"most n_routed_experts \(8\)"):
        load_config(path)
    path = _write(tmp_path, "qwen2-moe-tiny", shared_expert_intermediate_size=0)
    with pytest.raises(TracememError, match=r"shared_expert_intermediate_size=0 must be a "
                                            r"positive integer"):
        load_config(path)
