"""The Qwen3-MoE family's config (``model_type`` "qwen3_moe": Qwen3-30B-A3B, Qwen3-235B-A22B),
and ``moe_gqa_config``, the loader the grouped-query MoE families share (Qwen2-MoE and Mixtral
call it with their own tables and fixed fields).

transformers ``models/qwen3_moe/modeling_qwen3_moe.py``:
- ``Qwen3MoeAttention``: q, k, v, o with biases when ``attention_bias``; ``q_norm`` /
  ``k_norm`` (RMSNorm over head_dim) before RoPE, always;
- ``Qwen3MoeSparseMoeBlock``: ``gate`` Linear(h, num_experts) without bias; softmax over all
  experts in fp32, ``topk``, renormalised when ``norm_topk_prob``, cast to the hidden dtype; no
  shared expert, no scaling; experts SwiGLU of ``moe_intermediate_size``;
- ``Qwen3MoeDecoderLayer.__init__``: MoE when ``layer_idx not in mlp_only_layers`` and
  ``(layer_idx + 1) % decoder_sparse_step == 0``, else the dense MLP of ``intermediate_size``.

Sliding-window keys are accepted and not stored (a causal window masks scores; no traced
tensor changes size); ``router_aux_loss_coef`` and ``output_router_logits`` change no tensor
tracemem traces (the load-balancing loss is not modelled).
"""

from __future__ import annotations

from typing import Any

from modeling.common.config import REQUIRED, ModelConfig, require_object, show
from modeling.families.llama.config import COMMON_KEYS, dense_gqa_config
from tracemem.errors import TracememError

__all__ = ["HF_KEYS", "MODEL_TYPES", "PRESETS", "PRESET_PACKAGE", "CHECKED", "TOLERATED",
           "MOE_KEYS", "config_from_dict", "moe_gqa_config"]

MODEL_TYPES = ("qwen3_moe",)
PRESETS = ("qwen3-30b-a3b", "qwen3-moe-tiny")
PRESET_PACKAGE = "modeling.families.qwen3_moe.presets"

# The Qwen MoE keys (Qwen3-MoE and Qwen2-MoE alike): Hugging Face key -> (field, type, default)
MOE_KEYS: dict[str, tuple[str, Any, Any]] = {
    "moe_intermediate_size": ("moe_intermediate_size", int, REQUIRED),
    "num_experts": ("num_routed_experts", int, REQUIRED),
    "num_experts_per_tok": ("num_experts_per_tok", int, REQUIRED),
    "norm_topk_prob": ("norm_topk_prob", bool, False),
    "decoder_sparse_step": ("moe_layer_freq", int, 1),
}
HF_KEYS = COMMON_KEYS | MOE_KEYS | {
    "attention_bias": ("o_bias", bool, False),  # and qkv_bias: see config_from_dict
}
# Read and checked by moe_gqa_config, not through the table: a list of layer numbers.
CHECKED = ("dtype", "mlp_only_layers")
TOLERATED = ("rope_scaling", "attention_dropout", "use_sliding_window", "sliding_window",
             "max_window_layers", "router_aux_loss_coef", "output_router_logits")

# What every Qwen / Mixtral router shares: softmax, topk's own values, no scaling multiply.
_HF_ROUTER = dict(scoring_func="softmax", router_gather=False, routed_scaling_factor=None)


def moe_gqa_config(data: dict[str, Any], source: str, table: dict[str, tuple[str, Any, Any]],
                   **fixed: Any) -> ModelConfig:
    """A grouped-query MoE ``ModelConfig`` read through ``table`` (``dense_gqa_config``), with
    ``mlp_only_layers`` read here and ``fixed`` the fields the family decides without a key.

    Raises:
        TracememError: see ``dense_gqa_config``; ``mlp_only_layers`` not a list of distinct
            layer numbers; ``hidden_act`` other than silu (tracemem's experts are SwiGLU).
    """
    require_object(data, source)
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise TracememError(f"{source}: hidden_act={show(act)} is not supported for "
                            f"model_type {data.get('model_type')!r}: tracemem's routed experts "
                            f"are SwiGLU (silu)")
    dense = data.get("mlp_only_layers") or []
    layers = data.get("num_hidden_layers")
    if not isinstance(dense, list) or not all(
            isinstance(i, int) and not isinstance(i, bool)
            and (not isinstance(layers, int) or 0 <= i < layers) for i in dense) \
            or len(set(dense)) != len(dense):
        raise TracememError(f"{source}: mlp_only_layers={show(dense)} must be a list of "
                            f"distinct layer numbers 0..num_hidden_layers - 1")
    return dense_gqa_config(data, source, table, **(_HF_ROUTER | {
        "mlp_only_layers": tuple(sorted(dense)), "moe_layer_offset": 1} | fixed))


def config_from_dict(data: dict[str, Any], source: str) -> ModelConfig:
    """A Qwen3-MoE ``ModelConfig`` from a Hugging Face config dict (module docstring).

    Raises:
        TracememError: see ``moe_gqa_config``.
    """
    return moe_gqa_config(data, source, HF_KEYS, qk_norm=True,
                          qkv_bias=isinstance(data, dict) and data.get("attention_bias") is True)
