"""The Mixtral family's config (``model_type`` "mixtral": Mixtral-8x7B, 8x22B).

transformers ``models/mixtral/modeling_mixtral.py`` ``MixtralAttention`` (grouped-query, no
biases) and ``MixtralSparseMoeBlock`` (``gate`` Linear(h, num_local_experts) without bias;
experts SwiGLU of ``intermediate_size``: w1, w2, w3; every layer MoE; no shared expert). The
router is the reference's order, mistral-inference ``moe.py`` ``MoeLayer.forward``: ``topk``
of the gate logits, then an fp32 softmax over those k, cast to the input dtype (the same
weights as transformers' softmax over all experts renormalised over the k); under megatron-te
Megatron's ``--moe-router-pre-softmax`` off, as its Mixtral recipes run.

``sliding_window`` (null in Mixtral's published configs) is accepted and not stored.
"""

from __future__ import annotations

from typing import Any

from modeling.common.config import ModelConfig, REQUIRED, require_object
from modeling.families.llama.config import COMMON_KEYS
from modeling.families.qwen3_moe.config import moe_gqa_config

__all__ = ["HF_KEYS", "MODEL_TYPES", "PRESETS", "PRESET_PACKAGE", "CHECKED", "TOLERATED",
           "config_from_dict"]

MODEL_TYPES = ("mixtral",)
PRESETS = ("mixtral-8x7b", "mixtral-tiny")
PRESET_PACKAGE = "modeling.families.mixtral.presets"

HF_KEYS = COMMON_KEYS | {
    "num_local_experts": ("num_routed_experts", int, REQUIRED),
    "num_experts_per_tok": ("num_experts_per_tok", int, REQUIRED),
}
CHECKED = ("dtype",)
TOLERATED = ("rope_scaling", "attention_dropout", "sliding_window", "router_aux_loss_coef",
             "output_router_logits", "router_jitter_noise")


def config_from_dict(data: dict[str, Any], source: str) -> ModelConfig:
    """A Mixtral ``ModelConfig`` from a Hugging Face config dict (module docstring): the
    experts' width is ``intermediate_size``.

    Raises:
        TracememError: see ``modeling.families.qwen3_moe.config.moe_gqa_config``.
    """
    require_object(data, source)
    width = data.get("intermediate_size")
    return moe_gqa_config(data, source, HF_KEYS, moe_intermediate_size=width,
                          router_pre_softmax=False, norm_topk_prob=True, moe_layer_offset=0)
