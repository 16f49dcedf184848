"""The Qwen2-MoE family's config (``model_type`` "qwen2_moe": Qwen1.5-MoE-A2.7B,
Qwen2-57B-A14B).

transformers ``models/qwen2_moe/modeling_qwen2_moe.py``:
- ``Qwen2MoeAttention``: q, k and v projections always with biases, o without (no
  ``attention_bias`` key: one in a config.json is ignored, as transformers ignores it);
- ``Qwen2MoeSparseMoeBlock``: the router as Qwen3-MoE's (softmax over all experts, ``topk``,
  renormalised when ``norm_topk_prob``); ``shared_expert``, one SwiGLU MLP of
  ``shared_expert_intermediate_size``; ``shared_expert_gate`` Linear(h, 1) without bias, the
  shared output times its sigmoid (``modeling.common.moe.MoE``);
- the MoE layers are chosen as Qwen3-MoE's (``decoder_sparse_step``, ``mlp_only_layers``).
"""

from __future__ import annotations

from typing import Any

from modeling.common.config import ModelConfig, REQUIRED
from modeling.families.llama.config import COMMON_KEYS
from modeling.families.qwen3_moe.config import MOE_KEYS, moe_gqa_config

__all__ = ["HF_KEYS", "MODEL_TYPES", "PRESETS", "PRESET_PACKAGE", "CHECKED", "TOLERATED",
           "config_from_dict"]

MODEL_TYPES = ("qwen2_moe",)
PRESETS = ("qwen1.5-moe-a2.7b", "qwen2-moe-tiny")
PRESET_PACKAGE = "modeling.families.qwen2_moe.presets"

HF_KEYS = COMMON_KEYS | MOE_KEYS | {
    "shared_expert_intermediate_size": ("shared_expert_intermediate_size", int, REQUIRED),
}
CHECKED = ("dtype", "mlp_only_layers")
TOLERATED = ("rope_scaling", "attention_dropout", "use_sliding_window", "sliding_window",
             "max_window_layers", "router_aux_loss_coef", "output_router_logits",
             "attention_bias", "qkv_bias")


def config_from_dict(data: dict[str, Any], source: str) -> ModelConfig:
    """A Qwen2-MoE ``ModelConfig`` from a Hugging Face config dict (module docstring).

    Raises:
        TracememError: see ``modeling.families.qwen3_moe.config.moe_gqa_config``;
            ``shared_expert_intermediate_size`` not a positive integer.
    """
    return moe_gqa_config(data, source, HF_KEYS, qkv_bias=True, o_bias=False,
                          num_shared_experts=1, shared_expert_gate=True)
