"""The Llama family's config (``model_type`` "llama": Llama 2, 3, 3.1): its Hugging Face key
table ``HF_KEYS`` (transformers' ``LlamaConfig`` key -> ``ModelConfig`` field), presets, and
``dense_gqa_config``, the loader the dense grouped-query families share (Qwen2 and Qwen3 call
it with their own tables).

Defaults are ``LlamaConfig``'s (transformers ``models/llama/configuration_llama.py``):
``num_key_value_heads`` None means the heads (MHA), ``head_dim`` None means hidden_size /
num_attention_heads, ``attention_bias`` puts biases on q, k, v and o, ``mlp_bias`` on the MLP.
``rope_scaling`` (Llama 3.1's "llama3" frequency scaling) changes RoPE's frequencies only, not
any tensor's size: it is accepted and not stored.
"""

from __future__ import annotations

from typing import Any

from modeling.common.config import REQUIRED, ModelConfig, read_keys, require_object

__all__ = ["HF_KEYS", "MODEL_TYPES", "PRESETS", "PRESET_PACKAGE", "CHECKED", "TOLERATED",
           "config_from_dict", "dense_gqa_config"]

MODEL_TYPES = ("llama",)
PRESETS = ("llama-3-8b", "llama-3-70b", "llama-3.1-405b", "llama-tiny")
PRESET_PACKAGE = "modeling.families.llama.presets"

_NULLABLE_INT = (int, type(None))
# Keys every dense GQA family reads the same way: Hugging Face key -> (field, type, default).
COMMON_KEYS: dict[str, tuple[str, Any, Any]] = {
    "vocab_size": ("vocab_size", int, REQUIRED),
    "hidden_size": ("hidden_size", int, REQUIRED),
    "intermediate_size": ("intermediate_size", int, REQUIRED),
    "num_hidden_layers": ("num_layers", int, REQUIRED),
    "num_attention_heads": ("num_attention_heads", int, REQUIRED),
    "num_key_value_heads": ("num_key_value_heads", _NULLABLE_INT, None),
    "head_dim": ("head_dim", _NULLABLE_INT, None),
    "hidden_act": ("hidden_act", str, "silu"),
    "rms_norm_eps": ("rms_norm_eps", (int, float), 1e-6),
    "max_position_embeddings": ("max_position_embeddings", int, 2048),
    "tie_word_embeddings": ("tie_word_embeddings", bool, False),
    "torch_dtype": ("dtype", str, "bfloat16"),
    "rope_theta": ("rope_theta", (int, float), 10000.0),
    "partial_rotary_factor": ("partial_rotary_factor", (int, float), 1.0),
}
HF_KEYS = COMMON_KEYS | {
    "attention_bias": ("o_bias", bool, False),  # and qkv_bias: see config_from_dict
    "mlp_bias": ("mlp_bias", bool, False),
}
CHECKED = ("dtype",)  # newer transformers write "dtype" for "torch_dtype"
# Keys another family reads that a Llama config.json may carry with no effect on memory.
TOLERATED = ("rope_scaling", "attention_dropout", "pretraining_tp", "sliding_window")


def dense_gqa_config(data: dict[str, Any], source: str, table: dict[str, tuple[str, Any, Any]],
                     **fixed: Any) -> ModelConfig:
    """A dense grouped-query ``ModelConfig`` read through ``table``; ``fixed`` sets the fields
    the family decides without a key (Qwen2's q, k, v biases, Qwen3's qk-norm).

    Raises:
        TracememError: see ``modeling.common.config.read_keys`` and ``ModelConfig``.
    """
    require_object(data, source)
    if "torch_dtype" not in data and "dtype" in data:
        data = data | {"torch_dtype": data["dtype"]}
    values = read_keys(data, table, source)
    heads = values["num_attention_heads"]
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = heads
    if values["head_dim"] is None:
        values["head_dim"] = values["hidden_size"] // heads
    return ModelConfig(name=source, model_type=str(data.get("model_type")), attention="gqa",
                       **(values | fixed))


def config_from_dict(data: dict[str, Any], source: str) -> ModelConfig:
    """A Llama ``ModelConfig`` from a Hugging Face config dict (``attention_bias`` sets the
    q, k, v and o biases, as ``LlamaAttention`` does).

    Raises:
        TracememError: see ``dense_gqa_config``.
    """
    require_object(data, source)
    return dense_gqa_config(data, source, HF_KEYS,
                            qkv_bias=data.get("attention_bias") is True)
