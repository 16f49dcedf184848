"""The dense Qwen families' configs: ``model_type`` "qwen2" (Qwen2, Qwen2.5) and "qwen3".

- qwen2 (transformers ``models/qwen2/modeling_qwen2.py`` ``Qwen2Attention``): q, k and v
  projections always have biases, o has none; no ``attention_bias`` key.
- qwen3 (``models/qwen3/modeling_qwen3.py`` ``Qwen3Attention``): ``q_norm`` and ``k_norm``
  (RMSNorm over head_dim) on queries and keys before RoPE, always; ``attention_bias`` puts
  biases on q, k, v and o; ``head_dim`` is a key of its own (Qwen3-0.6B: 128 with h 1024 and
  16 heads).

Sliding-window keys (``use_sliding_window``, ``sliding_window``, ``max_window_layers``) are
accepted and not stored: a causal window changes which scores are masked, not the size of any
tensor the traced kernels keep.
"""

from __future__ import annotations

from typing import Any

from modeling.common.config import ModelConfig, require_object
from modeling.families.llama.config import COMMON_KEYS, dense_gqa_config

__all__ = ["HF_KEYS", "MODEL_TYPES", "PRESETS", "PRESET_PACKAGE", "CHECKED", "TOLERATED",
           "config_from_dict"]

MODEL_TYPES = ("qwen2", "qwen3")
PRESETS = ("qwen2.5-14b", "qwen2-tiny", "qwen3-tiny")
PRESET_PACKAGE = "modeling.families.qwen.presets"

HF_KEYS = COMMON_KEYS | {
    "attention_bias": ("o_bias", bool, False),  # qwen3 only; and qkv_bias
}
CHECKED = ("dtype",)
TOLERATED = ("rope_scaling", "attention_dropout", "use_sliding_window", "sliding_window",
             "max_window_layers")


def config_from_dict(data: dict[str, Any], source: str) -> ModelConfig:
    """A Qwen2 or Qwen3 ``ModelConfig`` from a Hugging Face config dict.

    Raises:
        TracememError: see ``modeling.families.llama.config.dense_gqa_config``. A qwen2
            config's ``attention_bias`` is ignored, as transformers' Qwen2 ignores it.
    """
    require_object(data, source)
    if data.get("model_type") == "qwen3":
        return dense_gqa_config(data, source, HF_KEYS, qk_norm=True,
                                qkv_bias=data.get("attention_bias") is True)
    table = {k: v for k, v in HF_KEYS.items() if k != "attention_bias"}
    return dense_gqa_config(data, source, table, qkv_bias=True, o_bias=False)
