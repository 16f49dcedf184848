"""The DeepSeek-V2 / V3 family's config: its Hugging Face key table ``HF_KEYS`` (DeepseekV3 /
DeepseekV2 ``config.json`` key -> ``ModelConfig`` field), like the name mapping in DeepSeek-V3's
``inference/convert.py``, its presets, and ``config_from_dict``. Keys no family reads are
ignored; keys of another family are refused by ``modeling.registry``.
"""

from __future__ import annotations

from typing import Any

from modeling.common.config import (
    REQUIRED,
    ModelConfig,
    read_keys,
    require_object,
    show,
)
from tracemem.errors import TracememError

__all__ = ["ModelConfig", "HF_KEYS", "MODEL_TYPES", "PRESETS", "PRESET_PACKAGE", "CHECKED",
           "TOLERATED", "config_from_dict"]

MODEL_TYPES = ("deepseek_v2", "deepseek_v3")
PRESETS = ("deepseek-v3", "deepseek-v2", "deepseek-v2-lite", "moonlight-16b-a3b", "deepseek-tiny")
PRESET_PACKAGE = "modeling.families.deepseek.presets"

# Hugging Face key -> (field, type, default). REQUIRED: no default.
_REQUIRED = REQUIRED
HF_KEYS: dict[str, tuple[str, type | tuple[type, ...], Any]] = {
    "vocab_size": ("vocab_size", int, _REQUIRED),
    "hidden_size": ("hidden_size", int, _REQUIRED),
    "intermediate_size": ("intermediate_size", int, _REQUIRED),
    "moe_intermediate_size": ("moe_intermediate_size", int, _REQUIRED),
    "num_hidden_layers": ("num_layers", int, _REQUIRED),
    "num_nextn_predict_layers": ("num_mtp_modules", int, 0),
    "num_attention_heads": ("num_attention_heads", int, _REQUIRED),
    "q_lora_rank": ("q_lora_rank", (int, type(None)), _REQUIRED),
    "kv_lora_rank": ("kv_lora_rank", int, _REQUIRED),
    "qk_nope_head_dim": ("qk_nope_head_dim", int, _REQUIRED),
    "qk_rope_head_dim": ("qk_rope_head_dim", int, _REQUIRED),
    "v_head_dim": ("v_head_dim", int, _REQUIRED),
    "n_routed_experts": ("num_routed_experts", int, _REQUIRED),
    "n_shared_experts": ("num_shared_experts", int, _REQUIRED),
    "num_experts_per_tok": ("num_experts_per_tok", int, _REQUIRED),
    "first_k_dense_replace": ("first_k_dense_replace", int, _REQUIRED),
    "moe_layer_freq": ("moe_layer_freq", int, 1),
    "n_group": ("num_expert_groups", int, 1),
    "topk_group": ("topk_group", int, 1),
    "scoring_func": ("scoring_func", str, "softmax"),
    "topk_method": ("topk_method", str, "greedy"),
    "norm_topk_prob": ("norm_topk_prob", bool, False),
    "routed_scaling_factor": ("routed_scaling_factor", (int, float), 1.0),
    "rms_norm_eps": ("rms_norm_eps", (int, float), 1e-6),
    "max_position_embeddings": ("max_position_embeddings", int, 4096),
    "tie_word_embeddings": ("tie_word_embeddings", bool, False),
    "torch_dtype": ("dtype", str, "bfloat16"),
    "rope_theta": ("rope_theta", (int, float), 10000.0),
}
# Read, checked against the family, and not stored: MLA has one latent KV for all heads; the
# reference model has no attention biases.
CHECKED = ("num_key_value_heads", "attention_bias", "hidden_act")
# Keys another family reads that a DeepSeek config.json may carry with no effect here.
TOLERATED = ("rope_scaling", "attention_dropout", "pretraining_tp",
             "dtype")  # newer transformers' name of torch_dtype (a gpt key), not read here


def config_from_dict(data: dict[str, Any], source: str) -> ModelConfig:
    """Build a DeepSeek ``ModelConfig`` (MLA attention) from a Hugging Face config dict.

    Raises:
        TracememError: a required key is missing, a value has the wrong type or is out of
            range, or contradicts MLA (``num_key_value_heads`` other than
            ``num_attention_heads``, ``attention_bias`` true); the message names the key and
            ``source``.
    """
    require_object(data, source)
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise TracememError(f"{source}: hidden_act={show(act)} is not supported; tracemem's "
                            f"MLP and experts are SwiGLU (silu)")
    values = read_keys(data, HF_KEYS, source)
    model_type = data.get("model_type", "deepseek_v3")
    heads = values["num_attention_heads"]
    kv_heads = data.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        from modeling.registry import FAMILIES  # at call time: the registry imports this module

        raise TracememError(
            f"{source}: num_key_value_heads={show(kv_heads)} contradicts model_type "
            f"{model_type!r}: MLA keeps one compressed KV for all heads, so it must equal "
            f"num_attention_heads ({heads}); for grouped-query attention use a family that "
            f"has it (model_type "
            f"{', '.join(t for t, f in FAMILIES.items() if f.__name__ != __name__)})")
    if data.get("attention_bias") not in (None, False):
        raise TracememError(
            f"{source}: attention_bias={show(data['attention_bias'])} contradicts model_type "
            f"{model_type!r}: DeepSeek's MLA projections have no biases")
    return ModelConfig(name=source, model_type=str(model_type), attention="mla",
                       num_key_value_heads=heads, **values)
