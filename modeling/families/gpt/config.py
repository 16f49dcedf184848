"""Megatron-LM's GPT model (``model_type`` "gpt": megatron/core/models/gpt/gpt_model.py
``GPTModel`` with the dense decoder layer of megatron/core/models/gpt/gpt_layer_specs.py
``get_gpt_layer_with_transformer_engine_spec``), not a Hugging Face model: its config file is
tracemem's own ``ModelConfig`` fields by name (``KEYS``), and a key that is absent takes
Megatron's default. The defaults, at Megatron-LM d98e8a6:

- ``normalization`` "layernorm": megatron/core/transformer/transformer_config.py
  ``TransformerConfig.normalization = "LayerNorm"``; ``rms_norm_eps`` 1e-5: its
  ``layernorm_epsilon`` (``--norm-epsilon``).
- ``position_embedding`` "learned_absolute": megatron/training/arguments.py
  ``--position-embedding-type`` default; ``max_position_embeddings`` is required there
  (``validate_args``: ``required_args``).
- ``hidden_act`` "gelu", ``gated_mlp`` false: ``TransformerConfig.activation_func = F.gelu``,
  ``gated_linear_unit = False``; ``--swiglu`` is "silu" with ``gated_mlp`` true and
  ``--squared-relu`` "squared_relu" (non-gated: megatron/training/argument_utils.py
  ``core_transformer_config_from_args`` asserts ``not args.swiglu``).
- ``qkv_bias``, ``o_bias``, ``mlp_bias`` true: ``TransformerConfig.add_bias_linear = True``
  (``--disable-bias-linear``), which ``validate_args`` copies to ``add_qkv_bias``.
- ``tie_word_embeddings`` true: ``--untie-embeddings-and-output-weights`` unset.
- ``hidden_dropout``, ``attention_dropout`` 0.1: ``TransformerConfig``.
- ``intermediate_size`` 4 h, or ``int(4 h * 2 / 3 / 64) * 64`` for SwiGLU: ``validate_args``
  (``ffn_hidden_size``); ``num_key_value_heads`` the heads (``num_query_groups`` None: MHA);
  ``head_dim`` h / heads (``kv_channels``).
- ``rope_theta`` 10000 (``--rotary-base``), ``partial_rotary_factor`` 1.0
  (``--rotary-percent``): RoPE only.
- ``dtype`` "bfloat16" (``--bf16``; without it Megatron keeps fp32 parameters).

The attention is Megatron's ``SelfAttention`` (grouped-query; MHA by default), the FFN the
dense ``MLP``: an MoE or MLA field (``num_routed_experts``, ``q_lora_rank``, ...) is refused, as
is any key ``KEYS`` does not name (one line listing the keys), and MTP with learned absolute
positions (``validate_args``' "MTP validation" asserts rope or none).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from modeling.common.config import REQUIRED, ModelConfig, read_keys, require_object, show
from tracemem.errors import TracememError

__all__ = ["KEYS", "HF_KEYS", "MODEL_TYPES", "PRESETS", "PRESET_PACKAGE", "CHECKED",
           "TOLERATED", "config_from_dict"]

MODEL_TYPES = ("gpt",)
PRESETS = ("gpt3-mcore-64m", "gpt-tiny")
PRESET_PACKAGE = "modeling.families.gpt.presets"

_NULLABLE_INT = (int, type(None))
_REAL = (int, float)
# ModelConfig field -> (field, type, Megatron's default); REQUIRED: no default. None for
# intermediate_size, num_key_value_heads and head_dim: derived in config_from_dict.
KEYS: dict[str, tuple[str, Any, Any]] = {
    "vocab_size": ("vocab_size", int, REQUIRED),
    "hidden_size": ("hidden_size", int, REQUIRED),
    "num_layers": ("num_layers", int, REQUIRED),
    "num_attention_heads": ("num_attention_heads", int, REQUIRED),
    "max_position_embeddings": ("max_position_embeddings", int, REQUIRED),
    "intermediate_size": ("intermediate_size", _NULLABLE_INT, None),
    "num_key_value_heads": ("num_key_value_heads", _NULLABLE_INT, None),
    "head_dim": ("head_dim", _NULLABLE_INT, None),
    "normalization": ("normalization", str, "layernorm"),
    "rms_norm_eps": ("rms_norm_eps", _REAL, 1e-5),
    "position_embedding": ("position_embedding", str, "learned_absolute"),
    "hidden_act": ("hidden_act", str, "gelu"),
    "gated_mlp": ("gated_mlp", bool, False),
    "qkv_bias": ("qkv_bias", bool, True),
    "o_bias": ("o_bias", bool, True),
    "mlp_bias": ("mlp_bias", bool, True),
    "qk_norm": ("qk_norm", bool, False),
    "tie_word_embeddings": ("tie_word_embeddings", bool, True),
    "hidden_dropout": ("hidden_dropout", _REAL, 0.1),
    "attention_dropout": ("attention_dropout", _REAL, 0.1),
    "rope_theta": ("rope_theta", _REAL, 10000.0),
    "partial_rotary_factor": ("partial_rotary_factor", _REAL, 1.0),
    "num_mtp_modules": ("num_mtp_modules", int, 0),
    "dtype": ("dtype", str, "bfloat16"),
}
HF_KEYS = KEYS  # the registry reads every family's key table under this name
CHECKED = ()
TOLERATED = ()


def config_from_dict(data: dict[str, Any], source: str) -> ModelConfig:
    """A GPT ``ModelConfig`` from a dict of ``ModelConfig`` fields (``KEYS``; keys starting with
    "_" are comments), Megatron's defaults for the rest.

    Raises:
        TracememError: a key ``KEYS`` does not name (an MoE or MLA field among them), MTP with
            learned absolute positions (Megatron-LM's ``validate_args`` asserts MTP runs with
            rope or none), squared ReLU gated, or any error of
            ``modeling.common.config.read_keys`` and ``ModelConfig``; one line naming the key
            and ``source``.
    """
    require_object(data, source)
    model_fields = {f.name for f in fields(ModelConfig)}
    for key, value in data.items():
        if key in KEYS or key == "model_type" or key.startswith("_"):
            continue
        what = ("a ModelConfig field model_type 'gpt' does not build (Megatron's GPT here is "
                "dense, with grouped-query attention)" if key in model_fields else
                "not a key of model_type 'gpt'")
        raise TracememError(f"{source}: {key}={show(value)} is {what}; keys: "
                            f"{', '.join(KEYS)}")
    values = read_keys(data, KEYS, source)
    if values["num_mtp_modules"] and values["position_embedding"] == "learned_absolute":
        # Megatron-Core's MultiTokenPredictionLayer._get_embeddings would re-embed the rolled
        # tokens and position ids (modeling.common.model builds that), but Megatron-LM refuses
        # the job first
        raise TracememError(f"{source}: num_mtp_modules={values['num_mtp_modules']} with "
                            f"position_embedding=\"learned_absolute\" is refused by Megatron-LM "
                            f"(megatron/training/arguments.py validate_args: MTP supports "
                            f"rope and none); set position_embedding \"rope\" or \"none\"")
    if values["hidden_act"] == "squared_relu" and values["gated_mlp"]:
        raise TracememError(f"{source}: hidden_act=\"squared_relu\" with gated_mlp=true is "
                            f"invalid: Megatron's --squared-relu is non-gated (it refuses "
                            f"--swiglu with it); set gated_mlp false")
    h, heads = values["hidden_size"], values["num_attention_heads"]
    if values["intermediate_size"] is None:  # validate_args: ffn_hidden_size
        swiglu = values["gated_mlp"] and values["hidden_act"] == "silu"
        values["intermediate_size"] = int((4 * h * 2 / 3) / 64) * 64 if swiglu else 4 * h
        if values["intermediate_size"] == 0:
            raise TracememError(f"{source}: hidden_size={h} gives Megatron's SwiGLU width "
                                f"int(4 * h * 2 / 3 / 64) * 64 = 0; set intermediate_size")
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = heads
    if values["head_dim"] is None:  # kv_channels = hidden_size // num_attention_heads
        if h % heads:
            raise TracememError(f"{source}: hidden_size={h} is not a multiple of "
                                f"num_attention_heads={heads} (Megatron's kv_channels "
                                f"default asserts it); set head_dim")
        values["head_dim"] = h // heads
    return ModelConfig(name=source, model_type="gpt", attention="gqa", **values)
