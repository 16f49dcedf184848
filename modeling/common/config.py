"""``ModelConfig``: the one frozen config every family produces and every consumer reads, and
the key-table reader the families' loaders share.

Design (docs/architecture.md, "Model families"): one shared, frozen, keyword-only dataclass
rather than a class per family. Consumers (plans, static memory, formulas, the estimator, the
parameter counts) read the same fields whatever the family; what differs is *which* fields a
family sets: ``attention`` says "mla" (the MLA fields are set) or "gqa" (``head_dim`` is set,
the MLA fields are None; MHA and MQA are GQA with ``num_key_value_heads`` equal to the heads
or 1); a dense model has ``num_routed_experts`` 0. Each family's loader
(``modeling/families/<name>/config.py``) reads a Hugging Face ``config.json`` through its own
key table (``read_keys`` below), refuses what contradicts the family, and fills the rest.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from tracemem.errors import TracememError

__all__ = ["ModelConfig", "parse_json", "ATTENTION_KINDS", "ACTIVATIONS", "REQUIRED", "read_keys",
           "require_object", "show", "MAX_SIZE", "MAX_LAYERS", "NORMALIZATIONS",
           "POSITION_EMBEDDINGS"]

ATTENTION_KINDS = ("mla", "gqa")
# Hugging Face hidden_act values of the dense MLP (transformers' ACT2FN names): silu (SwiGLU
# when gated), gelu (exact) and gelu_pytorch_tanh (tanh approximation).
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "squared_relu")
# Megatron-LM's --normalization choices (megatron/training/arguments.py), lower-cased; the
# Hugging Face families are all "rmsnorm".
NORMALIZATIONS = ("rmsnorm", "layernorm")
# Megatron-LM's --position-embedding-type choices that tracemem builds: "rope" (every Hugging
# Face family here), "learned_absolute" (a [max_position_embeddings, h] table added to the token
# embedding, Megatron's GPT default) and "none".
POSITION_EMBEDDINGS = ("rope", "learned_absolute", "none")
SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc", "sinkhorn")
DTYPES = ("bfloat16", "float16", "float32")

# Sizes above this are rejected: no real model is near it, and products of such sizes overflow
# the int64 storage sizes torch computes (2^24 = 16,777,216 elements per dimension).
MAX_SIZE = 2**24
# Decoder layers (MTP modules included) above this are rejected: each is a module to build.
MAX_LAYERS = 4096


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Sizes of a decoder-only transformer of any family. Counts are ``num_*``; sizes in
    elements unless stated. Fields a family does not use hold their neutral value (None for
    the MLA fields of a GQA model, 0 experts for a dense model)."""

    name: str  # preset name or the config file's path
    model_type: str  # Hugging Face model_type ("deepseek_v3", "llama", "qwen2", ...)
    vocab_size: int  # tokens in the vocabulary (embedding rows, head columns)
    hidden_size: int  # model width h
    intermediate_size: int  # dense MLP width
    num_layers: int  # decoder layers of the main model
    num_attention_heads: int  # query heads n_h
    num_key_value_heads: int  # key/value heads (query groups); MLA: = num_attention_heads
    attention: str  # "mla" or "gqa" (ATTENTION_KINDS)
    rms_norm_eps: float  # RMSNorm (or LayerNorm) epsilon
    max_position_embeddings: int  # longest sequence RoPE is set up for, in tokens; the rows
    #                               of the learned_absolute position table
    tie_word_embeddings: bool  # head shares the embedding matrix
    dtype: str  # parameter dtype of the checkpoint ("bfloat16", ...)
    normalization: str = "rmsnorm"  # every norm: "rmsnorm" (weight) or "layernorm" (weight and
    #                                 bias) (NORMALIZATIONS; Megatron's --normalization)
    position_embedding: str = "rope"  # POSITION_EMBEDDINGS (Megatron's --position-embedding-type)
    hidden_dropout: float = 0.0  # dropout probability after attention / MLP and on the
    #                              embedding (Megatron's --hidden-dropout; its default is 0.1)
    attention_dropout: float = 0.0  # dropout on the attention probabilities (Megatron's
    #                                 --attention-dropout; its default is 0.1)
    # GQA / MHA / MQA (attention == "gqa")
    head_dim: int | None = None  # per-head query/key/value width; None under MLA
    qk_norm: bool = False  # RMSNorm over head_dim on queries and keys before RoPE (Qwen3)
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2)
    o_bias: bool = False  # bias on the output projection (Llama attention_bias)
    partial_rotary_factor: float = 1.0  # fraction of head_dim RoPE rotates
    rope_theta: float = 10000.0  # RoPE base (frequencies only: no effect on memory)
    # MLA (attention == "mla")
    q_lora_rank: int | None = None  # query down-projection rank d_cq; None = full-rank wq
    kv_lora_rank: int | None = None  # compressed KV rank d_c
    qk_nope_head_dim: int | None = None  # per-head query/key dims without RoPE d_h
    qk_rope_head_dim: int | None = None  # per-head decoupled RoPE dims d_hr
    v_head_dim: int | None = None  # per-head value dims
    mla_latent_norms: bool = True  # norms on the q and kv latents (DeepSeek's q_a_layernorm /
    #                                kv_a_layernorm; Megatron's --qk-layernorm with
    #                                --multi-latent-attention, else IdentityOp)
    # dense MLP
    hidden_act: str = "silu"  # activation (ACTIVATIONS)
    gated_mlp: bool = True  # act(w1 x) * w3 x (SwiGLU / GeGLU); False: act(w1 x) (GELU MLP)
    mlp_bias: bool = False  # biases on the dense MLP's linears
    # MoE (num_routed_experts 0 = dense)
    moe_intermediate_size: int = 0  # width of one routed or shared expert
    num_routed_experts: int = 0  # routed experts per MoE layer N_r
    num_shared_experts: int = 0  # shared experts per MoE layer (one MLP of that many widths)
    num_experts_per_tok: int = 0  # routed experts each token goes to (top-k)
    first_k_dense_replace: int = 0  # the first k layers use the dense MLP instead of MoE
    moe_layer_freq: int = 1  # after those, every moe_layer_freq-th layer is MoE
    num_expert_groups: int = 1  # expert groups for group-limited routing (n_group)
    topk_group: int = 1  # groups each token may use
    scoring_func: str = "softmax"  # router scores: "softmax" or "sigmoid"
    topk_method: str = "greedy"  # "greedy", "group_limited_greedy", "noaux_tc" (with bias),
    # "sinkhorn" (Megatron's --moe-router-load-balancing-type sinkhorn; megatron-te only)
    norm_topk_prob: bool = False  # renormalise the top-k weights to sum to 1
    routed_scaling_factor: float | None = 1.0  # multiplier on the routed weights; None: none
    num_mtp_modules: int = 0  # multi-token-prediction modules (DeepSeek-V3: 1)
    # MoE variants beyond DeepSeek's (modeling.common.router, modeling.common.moe)
    router_pre_softmax: bool = True  # softmax over all experts, then top-k; False: top-k
    #                                  logits, then softmax of the k (Mixtral)
    router_gather: bool = True  # weights gathered at the chosen ids (DeepSeek-V3's reference)
    #                             rather than topk's own values (Qwen-MoE, Mixtral)
    shared_expert_intermediate_size: int = 0  # one shared expert's width when it is not
    #                                           moe_intermediate_size (Qwen2-MoE); 0: that
    shared_expert_gate: bool = False  # sigmoid gate Linear(h, 1) on the shared output
    mlp_only_layers: tuple[int, ...] = ()  # layers with a dense MLP whatever else says (Qwen)
    moe_layer_offset: int = 0  # MoE layers are those with (layer + offset) % moe_layer_freq
    #                            == 0: 0 DeepSeek's rule, 1 Qwen's decoder_sparse_step

    @property
    def is_mla(self) -> bool:
        return self.attention == "mla"

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width: MLA qk_nope_head_dim + qk_rope_head_dim; GQA head_dim."""
        if self.is_mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Channels per head RoPE rotates: MLA qk_rope_head_dim (MLA's decoupled RoPE key is
        part of its layout whatever ``position_embedding`` says: Megatron-Core's
        ``MLASelfAttention`` makes its own rotary embedding); GQA head_dim *
        partial_rotary_factor (transformers' ``_compute_default_rope_parameters``: int()), or
        0 when ``position_embedding`` is not "rope" (no RoPE anywhere)."""
        if self.is_mla:
            return self.qk_rope_head_dim
        if not self.has_rope:
            return 0
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def has_rope(self) -> bool:
        """Whether grouped-query attention rotates queries and keys (``position_embedding``
        "rope"); Megatron's GPTModel makes no rotary embedding otherwise
        (megatron/core/models/gpt/gpt_model.py ``GPTModel.__init__``)."""
        return self.position_embedding == "rope"

    @property
    def is_moe(self) -> bool:
        return self.num_routed_experts > 0

    @property
    def has_correction_bias(self) -> bool:
        """V3's aux-loss-free routing adds a per-expert bias (a buffer) to the scores."""
        return self.topk_method == "noaux_tc"

    @property
    def shared_experts_width(self) -> int:
        """The shared experts' total width: num_shared_experts times one's width."""
        return self.num_shared_experts * (self.shared_expert_intermediate_size
                                          or self.moe_intermediate_size)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has an MoE FFN; never for a dense model.
        Hugging Face's DeepSeek rule (``layer >= first_k_dense_replace and layer %
        moe_layer_freq == 0``) with offset 0; its Qwen-MoE rule (``layer not in mlp_only_layers
        and (layer + 1) % decoder_sparse_step == 0``, transformers ``Qwen3MoeDecoderLayer.
        __init__``) with offset 1."""
        return (self.num_routed_experts > 0 and layer >= self.first_k_dense_replace
                and (layer + self.moe_layer_offset) % self.moe_layer_freq == 0
                and layer not in self.mlp_only_layers)

    def __post_init__(self) -> None:
        src = self.name
        _check(self.attention in ATTENTION_KINDS, "attention", self.attention,
               f"one of {', '.join(ATTENTION_KINDS)}", src)
        _check(self.scoring_func in SCORING_FUNCS, "scoring_func", self.scoring_func,
               f"one of {', '.join(SCORING_FUNCS)}", src)
        _check(self.topk_method in TOPK_METHODS, "topk_method", self.topk_method,
               f"one of {', '.join(TOPK_METHODS)}", src)
        _check(self.dtype in DTYPES, "torch_dtype", self.dtype, f"one of {', '.join(DTYPES)}",
               src)
        _check(self.hidden_act in ACTIVATIONS, "hidden_act", self.hidden_act,
               f"one of {', '.join(ACTIVATIONS)}", src)
        _check(self.normalization in NORMALIZATIONS, "normalization", self.normalization,
               f"one of {', '.join(NORMALIZATIONS)}", src)
        _check(self.position_embedding in POSITION_EMBEDDINGS, "position_embedding",
               self.position_embedding, f"one of {', '.join(POSITION_EMBEDDINGS)}", src)
        for key in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, key)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool)
                   and 0 <= value < 1, key, value, "a probability in [0, 1)", src)
        _check(self.num_experts_per_tok <= self.num_routed_experts, "num_experts_per_tok",
               self.num_experts_per_tok, f"at most n_routed_experts ({self.num_routed_experts})",
               src)
        _check(self.num_routed_experts % self.num_expert_groups == 0, "n_group",
               self.num_expert_groups,
               f"a divisor of n_routed_experts ({self.num_routed_experts})", src)
        _check(self.topk_group <= self.num_expert_groups, "topk_group", self.topk_group,
               f"at most n_group ({self.num_expert_groups})", src)
        if self.is_mla:
            # RoPE rotates channel pairs (modeling.common.rope, Megatron's rope_utils)
            _check(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", self.qk_rope_head_dim,
                   "even (RoPE rotates pairs of channels)", src)
        else:
            _check(self.num_attention_heads % self.num_key_value_heads == 0,
                   "num_key_value_heads", self.num_key_value_heads,
                   f"a divisor of num_attention_heads ({self.num_attention_heads})", src)
        if not self.is_mla and self.has_rope:  # without RoPE no channel rotates
            _check(0 < self.partial_rotary_factor <= 1, "partial_rotary_factor",
                   self.partial_rotary_factor, "in (0, 1]", src)
            _check(self.rotary_dim > 0 and self.rotary_dim % 2 == 0, "head_dim",
                   self.head_dim, f"such that head_dim * partial_rotary_factor "
                   f"({self.rotary_dim}) is even and > 0 (RoPE rotates pairs of channels)",
                   src)
        _check(self.num_layers + self.num_mtp_modules <= MAX_LAYERS, "num_hidden_layers",
               self.num_layers, f"at most {MAX_LAYERS:,} with the MTP modules (the deepest "
               f"published models have about 130 layers)", src)


def _check(ok: bool, key: str, value: Any, valid: str, source: str) -> None:
    if not ok:
        raise TracememError(f"{source}: {key}={value!r} is invalid; it must be {valid}")


# A key table maps a Hugging Face key -> (field, type, default); REQUIRED: no default.
REQUIRED = object()
_POSITIVE_REALS = {"rms_norm_eps", "routed_scaling_factor", "rope_theta",
                   "partial_rotary_factor"}
_SIZE_FIELDS = {"vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "num_routed_experts", "num_experts_per_tok", "moe_layer_freq",
                "num_expert_groups", "topk_group", "max_position_embeddings",
                "shared_expert_intermediate_size"}
_NON_NEGATIVE = {"num_mtp_modules", "num_shared_experts", "first_k_dense_replace"}


def parse_json(text: str, where: str) -> Any:
    """``json.loads(text)``, or one ``TracememError`` line prefixed ``where`` (a config file,
    a ``--routing counts:`` file): malformed JSON, a huge integer, nesting too deep.

    Raises:
        TracememError: the text is not readable JSON.
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise TracememError(f"{where}: malformed JSON: {error}") from None
    except (ValueError, RecursionError) as error:  # a huge integer; nesting too deep
        reason = ("nested too deeply" if isinstance(error, RecursionError) else
                  str(error).splitlines()[0])
        raise TracememError(f"{where}: unreadable JSON: {reason}") from None


def require_object(data: Any, source: str) -> None:
    """Raises: TracememError: ``data`` is not a JSON object."""
    if not isinstance(data, dict):
        raise TracememError(f"{source}: expected a JSON object, got {type(data).__name__}")


def read_keys(data: dict[str, Any], table: dict[str, tuple[str, Any, Any]],
              source: str) -> dict[str, Any]:
    """The fields ``table`` (Hugging Face key -> (field, type(s), default or ``REQUIRED``))
    reads from ``data``; a null value takes the default unless the type admits None.

    Raises:
        TracememError: a required key is missing, a value has the wrong type or is out of
            range; the message names the key and ``source``.
    """
    values: dict[str, Any] = {}
    for key, (field, types, default) in table.items():
        if key not in data or (data[key] is None and default is not REQUIRED
                               and type(None) not in _as_tuple(types)):
            if default is REQUIRED:
                raise TracememError(f"{source}: required key {key!r} is missing")
            values[field] = default
            continue
        value = data[key]
        if isinstance(value, bool) and bool not in _as_tuple(types):
            raise TracememError(f"{source}: {key}={show(value)} must be {_type_names(types)}")
        if not isinstance(value, types):
            raise TracememError(f"{source}: {key}={show(value)} must be {_type_names(types)}")
        if field in _SIZE_FIELDS and value is not None and not 0 < value <= MAX_SIZE:
            raise TracememError(f"{source}: {key}={show(value)} must be a positive integer "
                                f"no larger than {MAX_SIZE:,}")
        if field in _POSITIVE_REALS and not (math.isfinite(value) and value > 0):
            raise TracememError(f"{source}: {key}={show(value)} must be a finite number > 0")
        if field in _NON_NEGATIVE and value < 0:
            raise TracememError(f"{source}: {key}={show(value)} must be >= 0")
        if field == "q_lora_rank" and value is not None and value <= 0:
            raise TracememError(f"{source}: {key}={show(value)} must be a positive integer or "
                                f"null")
        values[field] = float(value) if float in _as_tuple(types) else value
    return values


def show(value: Any) -> str:
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
