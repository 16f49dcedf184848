"""``ModelConfig``: the DeepSeek MoE family's sizes, loaded from a Hugging Face ``config.json``
(DeepseekV3 / DeepseekV2 format) or a preset shipped with the package.

Loading goes through one explicit key table, ``HF_KEYS`` (Hugging Face key -> field), like the
name mapping in DeepSeek-V3's ``inference/convert.py``. Unknown keys are ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from tracemem.errors import TracememError

__all__ = ["ModelConfig", "HF_KEYS", "PRESETS", "load_config"]

PRESETS = ("deepseek-v3", "deepseek-v2", "deepseek-v2-lite", "moonlight-16b-a3b", "deepseek-tiny")

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes of a DeepSeek-V2/V3-style MoE transformer. Counts are ``num_*``; sizes in
    elements unless stated."""

    name: str  # preset name or the config file's path
    vocab_size: int  # tokens in the vocabulary (embedding rows, head columns)
    hidden_size: int  # model width h
    intermediate_size: int  # dense SwiGLU MLP width (first_k_dense_replace layers)
    moe_intermediate_size: int  # width of one routed or shared expert
    num_layers: int  # decoder layers of the main model
    num_mtp_modules: int  # multi-token-prediction modules (V3: 1; V2: 0)
    num_attention_heads: int  # MLA heads n_h
    q_lora_rank: int | None  # query down-projection rank d_cq; None = full-rank wq (V2-Lite)
    kv_lora_rank: int  # compressed KV rank d_c
    qk_nope_head_dim: int  # per-head query/key dims without RoPE d_h
    qk_rope_head_dim: int  # per-head decoupled RoPE dims d_hr (key shared across heads)
    v_head_dim: int  # per-head value dims
    num_routed_experts: int  # routed experts per MoE layer N_r
    num_shared_experts: int  # shared experts per MoE layer (one MLP of that many times the width)
    num_experts_per_tok: int  # routed experts each token goes to (top-k)
    first_k_dense_replace: int  # the first k layers use the dense MLP instead of MoE
    moe_layer_freq: int  # after those, every moe_layer_freq-th layer is MoE
    num_expert_groups: int  # expert groups for group-limited routing (n_group)
    topk_group: int  # groups each token may use
    scoring_func: str  # router scores: "softmax" (V2) or "sigmoid" (V3)
    topk_method: str  # "greedy", "group_limited_greedy" (V2), "noaux_tc" (V3, with bias)
    norm_topk_prob: bool  # renormalise the top-k weights to sum to 1
    routed_scaling_factor: float  # multiplier on the routed experts' output
    rms_norm_eps: float  # RMSNorm epsilon
    max_position_embeddings: int  # longest sequence RoPE is set up for, in tokens
    tie_word_embeddings: bool  # head shares the embedding matrix
    dtype: str  # parameter dtype of the checkpoint ("bfloat16", ...)

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: qk_nope_head_dim + qk_rope_head_dim."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def has_correction_bias(self) -> bool:
        """V3's aux-loss-free routing adds a per-expert bias (a buffer) to the scores."""
        return self.topk_method == "noaux_tc"

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has an MoE FFN (Hugging Face's rule)."""
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    def __post_init__(self) -> None:
        _check(self.scoring_func in SCORING_FUNCS, "scoring_func", self.scoring_func,
               f"one of {', '.join(SCORING_FUNCS)}", self.name)
        _check(self.topk_method in TOPK_METHODS, "topk_method", self.topk_method,
               f"one of {', '.join(TOPK_METHODS)}", self.name)
        _check(self.dtype in DTYPES, "torch_dtype", self.dtype, f"one of {', '.join(DTYPES)}",
               self.name)
        _check(self.num_experts_per_tok <= self.num_routed_experts, "num_experts_per_tok",
               self.num_experts_per_tok, f"at most n_routed_experts ({self.num_routed_experts})",
               self.name)
        _check(self.num_routed_experts % self.num_expert_groups == 0, "n_group",
               self.num_expert_groups,
               f"a divisor of n_routed_experts ({self.num_routed_experts})", self.name)
        _check(self.topk_group <= self.num_expert_groups, "topk_group", self.topk_group,
               f"at most n_group ({self.num_expert_groups})", self.name)
        # RoPE rotates channel pairs (modeling.common.attention.mla.apply_rope, Megatron's
        # rope_utils)
        _check(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", self.qk_rope_head_dim,
               "even (RoPE rotates pairs of channels)", self.name)
        _check(self.num_layers + self.num_mtp_modules <= MAX_LAYERS, "num_hidden_layers",
               self.num_layers, f"at most {MAX_LAYERS:,} with the MTP modules (the deepest "
               f"published models have about 130 layers)", self.name)


def _check(ok: bool, key: str, value: Any, valid: str, source: str) -> None:
    if not ok:
        raise TracememError(f"{source}: {key}={value!r} is invalid; it must be {valid}")


# Hugging Face key -> (field, type, default). Default None = required.
_REQUIRED = object()
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
}
assert {f for f, _, _ in HF_KEYS.values()} | {"name"} == {f.name for f in fields(ModelConfig)}

# Sizes above this are rejected: no real model is near it, and products of such sizes overflow
# the int64 storage sizes torch computes (2^24 = 16,777,216 elements per dimension).
MAX_SIZE = 2**24
# Decoder layers (MTP modules included) above this are rejected: each is a module to build.
MAX_LAYERS = 4096
_POSITIVE_REALS = {"rms_norm_eps", "routed_scaling_factor"}
_SIZE_FIELDS = {"vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                "num_layers", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim", "num_routed_experts", "num_experts_per_tok",
                "moe_layer_freq", "num_expert_groups", "topk_group", "max_position_embeddings"}


def config_from_dict(data: dict[str, Any], source: str) -> ModelConfig:
    """Build a ``ModelConfig`` from a Hugging Face config dict.

    Raises:
        TracememError: a required key is missing, a value has the wrong type or is out of
            range; the message names the key and ``source``.
    """
    if not isinstance(data, dict):
        raise TracememError(f"{source}: expected a JSON object, got {type(data).__name__}")
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise TracememError(f"{source}: hidden_act={_show(act)} is not supported; tracemem's "
                            f"MLP and experts are SwiGLU (silu)")
    values: dict[str, Any] = {"name": source}
    for key, (field, types, default) in HF_KEYS.items():
        if key not in data or (data[key] is None and default is not _REQUIRED
                               and type(None) not in _as_tuple(types)):
            if default is _REQUIRED:
                raise TracememError(f"{source}: required key {key!r} is missing")
            values[field] = default
            continue
        value = data[key]
        if isinstance(value, bool) and bool not in _as_tuple(types):
            raise TracememError(f"{source}: {key}={_show(value)} must be {_type_names(types)}")
        if not isinstance(value, types):
            raise TracememError(f"{source}: {key}={_show(value)} must be {_type_names(types)}")
        if field in _SIZE_FIELDS and not 0 < value <= MAX_SIZE:
            raise TracememError(f"{source}: {key}={_show(value)} must be a positive integer "
                                f"no larger than {MAX_SIZE:,}")
        if field in _POSITIVE_REALS and not (math.isfinite(value) and value > 0):
            raise TracememError(f"{source}: {key}={_show(value)} must be a finite number > 0")
        if field in ("num_mtp_modules", "num_shared_experts", "first_k_dense_replace") \
                and value < 0:
            raise TracememError(f"{source}: {key}={_show(value)} must be >= 0")
        if field == "q_lora_rank" and value is not None and value <= 0:
            raise TracememError(f"{source}: {key}={_show(value)} must be a positive integer or "
                                f"null")
        values[field] = float(value) if float in _as_tuple(types) else value
    return ModelConfig(**values)


def _show(value: Any) -> str:
    """A value as JSON writes it (null, true, "text")."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _as_tuple(types) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _type_names(types) -> str:
    types = _as_tuple(types)
    if set(types) == {int, float}:
        return "a number"
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
             type(None): "null"}
    return " or ".join(names[t] for t in types)


def load_config(model: str | Path) -> ModelConfig:
    """A preset name (``PRESETS``), the path of a Hugging Face ``config.json``, or a folder
    holding one.

    Raises:
        TracememError: unknown preset and no such file, unreadable or malformed JSON, or any
            error of ``config_from_dict``.
    """
    name = str(model)
    if name in PRESETS:
        presets = resources.files("modeling.families.deepseek.presets")
        text = presets.joinpath(f"{name}.json").read_text()
        return config_from_dict(json.loads(text), name)
    path = Path(name)
    if path.is_dir() and (path / "config.json").is_file():  # a Hugging Face model folder
        path = path / "config.json"
    if not path.is_file():
        raise TracememError(f"--model {name!r} is neither a preset ({', '.join(PRESETS)}) nor "
                            f"a config.json file (or a folder holding one)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise TracememError(f"{path}: cannot read: {error}") from None
    except json.JSONDecodeError as error:
        raise TracememError(f"{path}: malformed JSON: {error}") from None
    except (ValueError, RecursionError) as error:  # a huge integer; nesting too deep
        reason = ("nested too deeply" if isinstance(error, RecursionError) else
                  str(error).splitlines()[0])
        raise TracememError(f"{path}: unreadable JSON: {reason}") from None
    return config_from_dict(data, str(path))
