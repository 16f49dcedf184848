"""Megatron-LM arguments in, a ``Job`` out; and a job back as Megatron-LM arguments.

A Megatron user's job is a ``pretrain_gpt.py`` command line (or an ``@file``, or a functional
test's ``model_config.yaml``: ``megatron_args_from_yaml``). ``megatron_job_kwargs`` turns it
into the keyword arguments of ``tracemem.job.Job``: every argument of Megatron-LM's
``megatron/training/arguments.py`` at the pinned commit (``megatron_tables.PIN``) is honoured,
memory-neutral, or refused by name (``megatron_tables``), and the checks Megatron itself runs
on them (``validate_args``, ``TransformerConfig.__post_init__``, ``MoELayer.forward``,
``validate_layer_layout``, ...) refuse with Megatron's reason, each cited where it is made.

Megatron takes two things from outside its arguments: the world size (the launcher's
``WORLD_SIZE``; here ``world_size=``, tracemem's ``--world-size``) and, with a tokenizer file,
the vocabulary size (here ``vocab_size=``, tracemem's ``--vocab-size``). The model keeps the
vocabulary unpadded and the keywords carry ``make_vocab_size_divisible_by``: the ``Job`` pads
it to a multiple of that x TP as Megatron does (at d98e8a6:
megatron/core/tokenizers/utils/build_tokenizer.py ``vocab_size_with_padding``, and
megatron/training/vocab_utils.py ``calculate_padded_vocab_size`` for the model builders;
``--padded-vocab-size`` is used as given: megatron/training/argument_utils.py
``gpt_config_from_args``).

Decisions, each also written in its table entry: fp16 and fp32 training, ``--transformer-impl
local``, the allgather (Megatron's default) and flex MoE dispatchers, MoE experts without
``--moe-grouped-gemm`` or ``--moe-permute-fusion``, and context parallelism with
``--cp-comm-type`` a2a or a2a+p2p are refused (tracemem models bf16, Transformer Engine, the
alltoall dispatcher with TE's fused permute and GroupedLinear, and CP as TE's ring attention,
``p2p``, Megatron's default, or all-gathered K and V, ``allgather``);
``--overlap-grad-reduce`` and its bucket flags, the default attention mask of the dataloader,
the aux loss and the default fused RoPE are honoured with the approximation stated
(``megatron_approximations`` lists those that apply to a job).

``to_megatron_args`` is the inverse on the honoured arguments (``--print-megatron-args``),
``megatron_flag_changes`` prints a change of Job fields as the Megatron arguments to change.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import MISSING
from dataclasses import fields as dataclass_fields
from typing import Any, Callable, Mapping

from tracemem.errors import TracememError
from tracemem.frontdoors.megatron_args import (expand_megatron_args, megatron_arguments,
                                               parse_with_given)
from tracemem.frontdoors.megatron_layout import (format_layout_string, moe_layer_fields,
                                                 moe_pattern_text, parse_layout_string,
                                                 uneven_virtual_layout)
from tracemem.frontdoors.megatron_tables import (ENV_HONOURED, ENV_NEUTRAL,
                                                 ENV_NEUTRAL_PREFIXES, ENV_REFUSED, PIN,
                                                 REFUSED)

__all__ = ["megatron_job_kwargs", "megatron_job", "megatron_approximations",
           "in_megatron_terms", "to_megatron_args", "megatron_flag_changes",
           "following_changes", "fp8_options",
           "REFUSED_WHEN",
           "APPROXIMATIONS_WHEN",
           "MODEL_NAME", "RECOMPUTE_MODULE_NAMES"]

MODEL_NAME = "megatron-lm arguments"  # the ModelConfig's name (its error messages' source)
_AT = f"Megatron-LM {PIN[:7]}"

# Megatron's --recompute-modules names -> tracemem's (modeling/common/block.py
# RECOMPUTE_MODULES); the rest of Megatron's (TransformerConfig.__post_init__'s
# allowed_modules) are refused by name
RECOMPUTE_MODULE_NAMES = {"core_attn": "core_attn", "mla_up_proj": "mla_up_proj",
                          "layernorm": "layernorm", "mlp": "mlp", "moe": "moe",
                          "moe_act": "moe_act", "shared_experts": "shared_experts"}
_RECOMPUTE_MISSING = {
    "gdn_norm_out": "gated delta net layers",
    "gdp_in_proj": "gated delta product layers",
    "gdp_qkv": "gated delta product layers",
    "mhc": "mHC residual streams",
}
# --attention-backend -> the NVTE_* values Megatron-Core sets and asserts
# (megatron/core/models/common/language_module/language_module.py _set_attention_backend)
_NVTE = {"local": (0, 0, 0), "flash": (1, 0, 0), "fused": (0, 1, 0), "unfused": (0, 0, 1),
         "auto": (1, 1, 1)}
_NVTE_NAMES = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
_AUX_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss")


def _bf16_grads(ns) -> bool:
    return ns.grad_reduce_in_bf16 or ns.main_grads_dtype == "bf16"


# REFUSED flags refused only in the case that changes memory (otherwise: given with a value
# other than Megatron's default). Each predicate takes the namespace.
REFUSED_WHEN: dict[str, Callable[[argparse.Namespace], bool]] = {
    "--no-bias-gelu-fusion": lambda ns: ns.add_bias_linear and not ns.swiglu
    and not ns.squared_relu,
    "--no-bias-swiglu-fusion": lambda ns: ns.swiglu,
    "--no-bias-dropout-fusion": lambda ns: ns.hidden_dropout > 0,
    "--ddp-reduce-scatter-with-fp32-accumulation": _bf16_grads,
    "--microbatch-group-size-per-virtual-pipeline-stage":
        lambda ns: ns.microbatch_group_size_per_vp_stage != ns.pipeline_model_parallel_size,
    "--output-logit-dtype": lambda ns: ns.logit_dtype not in (None, "bf16"),
    "--eval-micro-batch-size": lambda ns: ns.eval_micro_batch_size != ns.micro_batch_size,
    "--tensor-parallel-num-weight-shards": lambda ns: ns.tensor_parallel_num_weight_shards
    not in (None, ns.tensor_model_parallel_size),
    "--expert-tensor-parallel-num-weight-shards":
        lambda ns: ns.expert_tensor_parallel_num_weight_shards
        not in (None, ns.expert_tensor_parallel_size or ns.tensor_model_parallel_size),
    "--no-pad-vocab-size": lambda ns: ns.padded_vocab_size is None,
    # FP8 flags with no effect unless FP8 runs (--fp8-format) / the MXFP8 output layer
    "--no-fp8-wgrad": lambda ns: ns.fp8 is not None,
    "--fp8-output-proj": lambda ns: ns.fp8 is not None and ns.fp8_recipe == "mxfp8",
}


def fp8_options(ns) -> dict:
    """The megatron-te FP8 options of ``--fp8-format`` / ``--fp8-recipe`` (Megatron's
    ``fp8_utils.py`` ``get_fp8_recipe``), ``--fp8-param-gather``, ``--fp8-amax-history-len``
    and ``--first-last-layers-bf16`` with ``--num-layers-at-start-in-bf16`` /
    ``--num-layers-at-end-in-bf16`` (``is_first_last_bf16_layer``). DeepSeek-V3's own FP8
    scheme and torchao's Float8 are not these flags and not modelled yet. ``ns``: a namespace
    with Megatron's dests (``fp8``, ``fp8_recipe``, ``fp8_param_gather``, ...); shared with
    tracemem's own FP8 flags (``tracemem.cli``), so the two doors give the same job;
    ``to_megatron_args`` writes the inverse (``_fp8_args``).

    Raises:
        TracememError: ``--fp8-recipe custom`` (a user quantizer factory), ``--fp8-param-gather``
            with mxfp8 (MXFP8 weights in the shared gradient buffer), FP8 under
            ``--use-megatron-fsdp``: not modelled yet, by name.
    """
    if ns.fp8_recipe == "custom":
        raise TracememError("--fp8-recipe custom is not modelled yet (a user quantizer "
                            "factory's tensors); use delayed, tensorwise, mxfp8 or blockwise")
    if ns.fp8_param_gather and ns.fp8_recipe == "mxfp8":
        raise TracememError("--fp8-param-gather with --fp8-recipe mxfp8 is not modelled yet "
                            "(MXFP8 weights share the gradient buffer: param_and_grad_buffer."
                            "py shared_buffer)")
    if getattr(ns, "use_megatron_fsdp", False):
        raise TracememError("--fp8-format with --use-megatron-fsdp is not modelled yet (FP8 "
                            "weights sharded by Megatron FSDP)")
    if ns.fp8_param_gather:
        _megatron(ns.use_distributed_optimizer or bool(getattr(ns, "use_torch_fsdp2", False)),
                  "--fp8-param-gather only supported with distributed optimizer, torch fsdp2, "
                  "megatron fsdp, or inference mode", "validate_args")
    bf16 = bool(ns.first_last_layers_bf16)
    # validate_args turns --fp8-param-gather off under --use-torch-fsdp2 (TE >= 2.0: "FSDP2
    # FP8 param gather is not supported yet")
    gather = bool(ns.fp8_param_gather) and not getattr(ns, "use_torch_fsdp2", False)
    return {"fp8_recipe": ns.fp8_recipe, "fp8_format": ns.fp8,
            "fp8_param_gather": gather,
            "fp8_amax_history_len": int(ns.fp8_amax_history_len),
            "fp8_layers_at_start_in_bf16": int(ns.num_layers_at_start_in_bf16) if bf16 else 0,
            "fp8_layers_at_end_in_bf16": int(ns.num_layers_at_end_in_bf16) if bf16 else 0}


def _fp8_args(options: Mapping[str, Any]) -> list[str]:
    """``fp8_options``' inverse: the megatron-te options of a job that runs FP8 (``fp8_recipe``
    not "none") as Megatron-LM arguments, ``--fp8-format`` and ``--fp8-recipe`` always, each
    other argument where it differs from Megatron's default (read from the pinned argument
    data: ``--fp8-amax-history-len`` 1, ``--num-layers-at-start-in-bf16`` /
    ``--num-layers-at-end-in-bf16`` 1). ``fp8_arch`` is the GPU's (``--gpu``), not an argument.
    """
    default = {record["dest"]: record["default"] for record in megatron_arguments()}
    out = ["--fp8-format", options["fp8_format"], "--fp8-recipe", options["fp8_recipe"]]
    if options["fp8_param_gather"]:
        out += ["--fp8-param-gather"]
    if options["fp8_amax_history_len"] != default["fp8_amax_history_len"]:
        out += ["--fp8-amax-history-len", str(options["fp8_amax_history_len"])]
    counts = {"num_layers_at_start_in_bf16": options["fp8_layers_at_start_in_bf16"],
              "num_layers_at_end_in_bf16": options["fp8_layers_at_end_in_bf16"]}
    if any(counts.values()):  # both counts apply under --first-last-layers-bf16
        out += ["--first-last-layers-bf16"]
        out += [token for dest, n in counts.items() if n != default[dest]
                for token in ("--" + dest.replace("_", "-"), str(n))]
    return out


def _uses_rope(ns) -> bool:
    return ns.multi_latent_attention or ns.use_rotary_position_embeddings \
        or ns.position_embedding_type in ("rope", "yarn")


def _aux_loss(ns) -> bool:
    kinds = ns.moe_router_load_balancing_type
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    coeffs = ns.moe_aux_loss_coeff
    coeffs = [coeffs] * len(kinds) if isinstance(coeffs, (int, float)) else list(coeffs)
    return any(k in _AUX_LOSSES and c > 0 for k, c in zip(kinds, coeffs))


# when each "approximation:" of HONOURED / ENV_HONOURED applies to a job
APPROXIMATIONS_WHEN: dict[str, Callable[[argparse.Namespace], bool]] = {
    "--deterministic-mode": lambda ns: ns.deterministic_mode,
    "--moe-router-force-load-balancing": lambda ns: ns.moe_router_force_load_balancing,
    "--empty-unused-memory-level": lambda ns: ns.empty_unused_memory_level >= 1,
    "--no-rope-fusion": lambda ns: _uses_rope(ns) and ns.apply_rope_fusion,
    "--overlap-grad-reduce": lambda ns: ns.overlap_grad_reduce,
    "--ddp-num-buckets": lambda ns: ns.ddp_num_buckets is not None,
    "--ddp-bucket-size": lambda ns: ns.ddp_bucket_size is not None,
    "--ddp-pad-buckets-for-high-nccl-busbw": lambda ns: ns.ddp_pad_buckets_for_high_nccl_busbw,
    "--overlap-param-gather": lambda ns: ns.overlap_param_gather,
    "--create-all-gather-group": lambda ns: ns.create_all_gather_group,
    "--moe-router-load-balancing-type": lambda ns: bool(ns.num_experts) and _aux_loss(ns),
    "--log-num-zeros-in-grad": lambda ns: ns.log_num_zeros_in_grad,
    "--use-megatron-fsdp": lambda ns: ns.use_megatron_fsdp,
    "--overlap-cpu-optimizer-d2h-h2d": lambda ns: ns.optimizer_cpu_offload
    and ns.overlap_cpu_optimizer_d2h_h2d,
}


def _show(record, value) -> str:
    if record["action"] in ("store_true", "store_false"):
        return record.flag
    if isinstance(value, list):
        return f"{record.flag} {' '.join(map(str, value))}"
    return f"{record.flag} {value}"


def _refuse_tables(ns: argparse.Namespace, given: set[str], argv: list[str]) -> None:
    """The REFUSED flags the arguments give with a non-default value, all in one line."""
    position = {}
    for i, token in enumerate(argv):
        position.setdefault(token.split("=", 1)[0], i)
    hits = []
    for record in megatron_arguments():
        flag = record.flag
        if flag not in REFUSED or record["dest"] not in given:
            continue
        if not any(f in position for f in record["flags"]):
            continue  # a shared dest given by another flag (--no-yarn-...)
        value = getattr(ns, record["dest"])
        when = REFUSED_WHEN.get(flag)
        if (when(ns) if when else value != record["default"]):
            at = min(position[f] for f in record["flags"] if f in position)
            hits.append((at, f"{_show(record, value)}: {REFUSED[flag]}"))
    if hits:
        raise TracememError("tracemem refuses these Megatron-LM arguments: "
                            + "; ".join(text for _, text in sorted(hits)))


def _check_env(env: Mapping[str, str], backend: str) -> None:
    refused = []
    for name, value in env.items():
        if name in ENV_HONOURED or name in ENV_NEUTRAL \
                or any(name.startswith(p) for p in ENV_NEUTRAL_PREFIXES):
            continue
        if name in ENV_REFUSED:
            refused.append(f"{name}={value}: {ENV_REFUSED[name]}")
        else:
            refused.append(f"{name}={value}: an environment variable tracemem does not know; "
                           f"it cannot tell whether it changes memory "
                           f"(tracemem/frontdoors/megatron_tables.py ENV_* tables)")
    if refused:
        raise TracememError("tracemem refuses these ENV_VARS: " + "; ".join(refused))
    for name, expected in zip(_NVTE_NAMES, _NVTE[backend]):
        if name in env and str(env[name]).strip() != str(expected):
            raise TracememError(  # Megatron-Core's assertion, its words
                f"{name} set to {env[name]}, but expected {expected} for attention backend "
                f"type {backend}. unset NVTE_FLASH_ATTN, NVTE_FUSED_ATTN and NVTE_UNFUSED_ATTN. "
                f"Use the --attention-backend argument if you want to choose between "
                f"(flash/fused/unfused/auto/local). Default is auto. ({_AT} "
                f"megatron/core/models/common/language_module/language_module.py "
                f"_set_attention_backend)")


def _megatron(ok: bool, message: str, where: str) -> None:
    """Megatron's own refusal: its message and where it is made."""
    if not ok:
        raise TracememError(f"Megatron-LM refuses this job: {message} ({_AT} {where})")


def _missing(ok: bool, what: str) -> None:
    if not ok:
        raise TracememError(f"not modelled yet: {what}")


def _positive(flag: str, value) -> None:
    if value is None or value <= 0:
        raise TracememError(f"{flag} {value} must be a positive integer")


def _world_size(world_size, env) -> int:
    if world_size is None and "WORLD_SIZE" in env:
        try:
            world_size = int(env["WORLD_SIZE"])
        except ValueError:
            raise TracememError(f"WORLD_SIZE={env['WORLD_SIZE']!r} is not an integer") from None
    if world_size is None:
        raise TracememError("Megatron-LM takes the world size from its launcher (torchrun's "
                            "WORLD_SIZE), not from its arguments: give it with --world-size "
                            "(the number of GPUs)")
    return world_size


def _vocab(ns, vocab_size) -> tuple[int, int | None]:
    """(the model's vocabulary before padding, make_vocab_size_divisible_by).

    Raises:
        TracememError: tracemem's ``vocab_size`` not a positive integer.
    """
    if vocab_size is not None and (isinstance(vocab_size, bool)
                                   or not isinstance(vocab_size, int) or vocab_size <= 0):
        raise TracememError(f"--vocab-size {vocab_size!r} must be a positive integer (the "
                            f"tokenizer's vocabulary before padding)")
    if ns.padded_vocab_size is not None:  # used as given (argument_utils gpt_config_from_args)
        return ns.padded_vocab_size, None
    if vocab_size is not None:
        return vocab_size, ns.make_vocab_size_divisible_by
    files = [f"{flag} {value}" for flag, value in (
        ("--vocab-file", ns.vocab_file), ("--tokenizer-model", ns.tokenizer_model),
        ("--tokenizer-metadata", ns.metadata_path)) if value is not None]
    if files and ns.tokenizer_type != "NullTokenizer":
        raise TracememError(f"Megatron-LM reads the vocabulary from a tokenizer file "
                            f"({', '.join(files)}), which tracemem does not read: give its "
                            f"size with --vocab-size (tracemem's flag: the tokenizer's "
                            f"vocabulary before padding)")
    if ns.vocab_size is None:
        raise TracememError("Megatron-LM refuses this job: Either --padded-vocab-size or "
                            "--vocab-size must be specified. (megatron/training/"
                            "argument_utils.py gpt_config_from_args); give --vocab-size V "
                            "(the tokenizer's vocabulary before padding)")
    return ns.vocab_size, ns.make_vocab_size_divisible_by


def _model_config(ns, vocab: int, tp: int, sp: bool):
    """The ``modeling.ModelConfig`` of Megatron's GPTModel for these arguments."""
    from modeling import ModelConfig

    vs = "megatron/training/arguments.py validate_args"
    h, heads = ns.hidden_size, ns.num_attention_heads
    num_layers = ns.num_layers
    mla = ns.multi_latent_attention
    _megatron(not (mla and ns.group_query_attention),
              "Group query attention is mutually exclusive with multi latent attention.", vs)
    ffn = ns.ffn_hidden_size
    if ffn is None:  # validate_args
        ffn = int((4 * h * 2 / 3) / 64) * 64 if ns.swiglu else 4 * h
    kv_channels = ns.kv_channels
    if kv_channels is None:
        _megatron(h % heads == 0, f"assert args.hidden_size % args.num_attention_heads == 0 "
                                  f"({h} % {heads})", vs)
        kv_channels = h // heads
    # activation (argument_utils.py core_transformer_config_from_args)
    where_act = "megatron/training/argument_utils.py core_transformer_config_from_args"
    if ns.squared_relu:
        _megatron(not ns.swiglu, "--squared-relu with --swiglu: assert not args.swiglu",
                  where_act)
        act, gated = "squared_relu", False
    elif ns.swiglu:
        act, gated = "silu", True
    else:
        act, gated = "gelu", False
    bias = ns.add_bias_linear
    qkv_bias = bias or ns.add_qkv_bias  # validate_args: add_bias_linear sets add_qkv_bias
    experts = ns.num_experts or 0  # validate_args: 0 means None
    mtp = ns.mtp_num_layers or 0
    # position embeddings
    pos = ns.position_embedding_type
    if ns.use_rotary_position_embeddings:  # validate_args: the legacy flag
        pos = "rope"
    if not ns.add_position_embedding and pos != "rope":
        raise TracememError("Megatron-LM refuses this job: --no-position-embedding is "
                            f"deprecated, use --position-embedding-type ({_AT} {vs})")
    _missing(pos not in ("mrope", "relative"),
             f"--position-embedding-type {pos} (multimodal / relative position embeddings)")
    position_embedding = "rope" if pos == "yarn" else pos
    if mtp:
        _megatron(pos in ("rope", "none"),
                  f"Multi-Token Prediction (MTP) is not supported with {pos} position "
                  f"embedding type. The supported position embedding types are rope and none.",
                  vs + " (MTP validation)")
    _missing(0 < ns.rotary_percent <= 1, f"--rotary-percent {ns.rotary_percent} outside (0, 1]")
    fields: dict[str, Any] = dict(
        name=MODEL_NAME, model_type="gpt", vocab_size=vocab, hidden_size=h,
        intermediate_size=ffn, num_layers=num_layers, num_attention_heads=heads,
        rms_norm_eps=float(ns.layernorm_epsilon),
        max_position_embeddings=ns.max_position_embeddings,
        tie_word_embeddings=not ns.untie_embeddings_and_output_weights, dtype="bfloat16",
        normalization=ns.normalization.lower(), position_embedding=position_embedding,
        hidden_dropout=float(ns.hidden_dropout), attention_dropout=float(ns.attention_dropout),
        hidden_act=act, gated_mlp=gated, mlp_bias=bias, rope_theta=float(ns.rotary_base),
        num_mtp_modules=mtp)
    if mla:
        # multi_latent_attention.py MLASelfAttention.__init__: only linear_proj takes
        # add_bias_linear (every down / up projection is bias=False; --add-qkv-bias has no
        # effect); gpt_layer_specs.py: without --qk-layernorm the up projections are plain
        # TEColumnParallelLinear (q_layernorm, kv_layernorm IdentityOp): no latent norms
        fields.update(attention="mla", num_key_value_heads=heads, q_lora_rank=ns.q_lora_rank,
                      kv_lora_rank=ns.kv_lora_rank, qk_nope_head_dim=ns.qk_head_dim,
                      qk_rope_head_dim=ns.qk_pos_emb_head_dim, v_head_dim=ns.v_head_dim,
                      o_bias=bias, mla_latent_norms=bool(ns.qk_layernorm))
    else:
        groups = ns.num_query_groups if ns.group_query_attention else heads
        fields.update(attention="gqa", num_key_value_heads=groups, head_dim=kv_channels,
                      qk_norm=ns.qk_layernorm, qkv_bias=qkv_bias, o_bias=bias,
                      partial_rotary_factor=float(ns.rotary_percent))
    if experts:
        fields.update(_moe_fields(ns, experts, ffn, num_layers, mtp, bias, tp, sp))
    return ModelConfig(**fields)


def _moe_fields(ns, experts, ffn, num_layers, mtp, bias, tp, sp) -> dict[str, Any]:
    _megatron(not (tp > 1 and not sp),
              "During training, performance may degrade if MoE and tensor parallelism are "
              "enabled without also enabling sequence parallelism.",
              "megatron/core/transformer/moe/moe_layer.py MoELayer.forward; add "
              "--sequence-parallel")
    _missing(not bias, "biases on the MoE experts and router (Megatron's default "
                       "add_bias_linear); add --disable-bias-linear")
    dispatcher = ns.moe_token_dispatcher_type
    _missing(dispatcher in ("alltoall", "allgather"),
             f"--moe-token-dispatcher-type {dispatcher} (DeepEP / HybridEP and their buffers); "
             f"tracemem models alltoall and allgather")
    where_cfg = "megatron/core/transformer/transformer_config.py TransformerConfig.__post_init__"
    _megatron(not (ns.moe_shared_expert_overlap and dispatcher not in ("alltoall", "flex")),
              "moe_shared_expert_overlap only works with alltoall or flex token dispatcher.",
              where_cfg)
    _missing(ns.moe_router_dtype != "fp64", "--moe-router-dtype fp64 (fp64 routing tensors)")
    score = ns.moe_router_score_function
    _missing(score in ("softmax", "sigmoid"), f"--moe-router-score-function {score}")
    balancing = ns.moe_router_load_balancing_type
    balancing = [balancing] if isinstance(balancing, str) else list(balancing)
    sinkhorn = balancing == ["sinkhorn"]
    bad = [b for b in balancing if b not in (*_AUX_LOSSES, "none")] if not sinkhorn else []
    _missing(not bad, f"--moe-router-load-balancing-type {' '.join(bad)} (its own routing "
                      f"computation)")
    topk = ns.moe_router_topk
    if sinkhorn:
        coeffs = ns.moe_aux_loss_coeff
        _megatron(not any(c for c in (coeffs if isinstance(coeffs, list) else [coeffs])),
                  "Sinkhorn routing does not support aux loss.",
                  "megatron/core/transformer/moe/router.py TopKRouter.sinkhorn_load_balancing")
    elif topk == 1 and score == "softmax" and not ns.moe_router_pre_softmax:
        _megatron(False, "Please use --moe-router-pre-softmax when topk is 1.", where_cfg)
    grouped = bool(ns.moe_router_num_groups and ns.moe_router_group_topk)  # moe_utils.py
    bias_corrected = ns.moe_router_enable_expert_bias
    shared = ns.moe_shared_expert_intermediate_size or 0
    return dict(
        num_routed_experts=experts, moe_intermediate_size=ns.moe_ffn_hidden_size or ffn,
        num_experts_per_tok=topk, num_shared_experts=1 if shared else 0,
        shared_expert_intermediate_size=shared, shared_expert_gate=ns.moe_shared_expert_gate,
        scoring_func=score,
        # Megatron renormalises sigmoid scores when top-k > 1 and never softmax scores
        # (moe_utils.py topk_routing_with_score_function)
        norm_topk_prob=score == "sigmoid" and topk > 1,
        router_pre_softmax=ns.moe_router_pre_softmax if score == "softmax" else True,
        router_gather=bias_corrected,
        num_expert_groups=ns.moe_router_num_groups if grouped else 1,
        topk_group=ns.moe_router_group_topk if grouped else 1,
        topk_method=("sinkhorn" if sinkhorn else "noaux_tc" if bias_corrected else
                     "group_limited_greedy" if grouped else "greedy"),
        routed_scaling_factor=ns.moe_router_topk_scaling_factor,
        **moe_layer_fields(ns.moe_layer_freq, num_layers, mtp))


def _layout(ns, num_layers: int, mtp: int, pp: int) -> dict[str, Any]:
    """vpp, pp_layout, pp_first / last_stage_layers and the schedule (validate_args'
    "Uneven virtual pipeline parallelism" block, get_num_layers_to_build)."""
    vs = "megatron/training/arguments.py validate_args"
    first, last = ns.decoder_first_pipeline_num_layers, ns.decoder_last_pipeline_num_layers
    accounts = int(ns.account_for_embedding_in_pipeline_split) + int(
        ns.account_for_loss_in_pipeline_split)
    chosen = [ns.num_layers_per_virtual_pipeline_stage is not None,
              ns.num_virtual_stages_per_pipeline_rank is not None,
              ns.pipeline_model_parallel_layout is not None]
    _megatron(sum(chosen) <= 1,
              "No more than one of the following arguments can be set at the same time: "
              "--num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank,"
              "--pipeline-model-parallel-layout.", vs)
    out: dict[str, Any] = {"vpp": 1, "pp_layout": None, "pp_first_stage_layers": None,
                           "pp_last_stage_layers": None}
    if (first is not None or last is not None) and accounts:
        _megatron(False, "Does not support standalone embedding stage and standalone loss "
                         "stage with uneven pp",
                  "megatron/core/transformer/transformer_block.py get_num_layers_to_build")
    if ns.pipeline_model_parallel_layout is not None:
        _missing(first is None and last is None and not accounts,
                 "--pipeline-model-parallel-layout with --decoder-first/last-pipeline-num-"
                 "layers or --account-for-*-in-pipeline-split (the layout places every layer)")
        layout, vpp = parse_layout_string(ns.pipeline_model_parallel_layout, pp, num_layers,
                                          mtp)
        out.update(vpp=vpp, pp_layout=layout)
    elif chosen[0] or chosen[1]:
        if chosen[0]:
            _megatron(first is None and last is None,
                      "please use --num-virtual-stages-per-pipeline-rank to specify virtual "
                      "pipeline parallel degree when enable uneven pipeline parallelism", vs)
            total = num_layers + accounts
            _megatron(total % pp == 0, "number of layers of the model must be divisible "
                                       "pipeline model parallel size", vs)
            per_stage = total // pp
            per_virtual = ns.num_layers_per_virtual_pipeline_stage
            _positive("--num-layers-per-virtual-pipeline-stage", per_virtual)
            _megatron(per_stage % per_virtual == 0,
                      "number of layers per pipeline stage must be divisible number of "
                      "layers per virtual pipeline stage", vs)
            vpp = per_stage // per_virtual
        else:
            vpp = ns.num_virtual_stages_per_pipeline_rank
            _positive("--num-virtual-stages-per-pipeline-rank", vpp)
        out["vpp"] = vpp
        if vpp > 1 and (first is not None or last is not None):
            out["pp_layout"] = uneven_virtual_layout(num_layers, pp, vpp, first, last)
            first = last = None
    elif first is None and last is None:
        _megatron((num_layers + accounts) % pp == 0,
                  "Number of layers should be divisible by the pipeline-model-parallel size",
                  vs)
    if out["vpp"] > 1:
        if ns.overlap_p2p_comm:
            _megatron(pp > 1, "When interleaved schedule is used, pipeline-model-parallel "
                              "size should be greater than 1", vs)
        else:
            _megatron(pp > 2, "When interleaved schedule is used and p2p communication "
                              "overlap is disabled, pipeline-model-parallel size should be "
                              "greater than 2 to avoid having multiple p2p sends and recvs "
                              "between same 2 ranks per communication batch", vs)
    if out["pp_layout"] is None:
        out.update(pp_first_stage_layers=first, pp_last_stage_layers=last)
    out["schedule"] = "interleaved-1f1b" if out["vpp"] > 1 else "1f1b"
    return out


def _recompute(ns, mla: bool) -> dict[str, Any]:
    """recompute, recompute_modules, recompute_method, recompute_num_layers
    (validate_args; TransformerConfig.__post_init__)."""
    tc = "megatron/core/transformer/transformer_config.py TransformerConfig.__post_init__"
    vs = "megatron/training/arguments.py validate_args"
    granularity = "selective" if ns.recompute_activations else ns.recompute_granularity
    modules = list(ns.recompute_modules or ["core_attn"])
    if ns.moe_layer_recompute:
        _megatron(granularity != "full",
                  "Do not set --moe-layer-recompute with full recompute granularity. ", tc)
        granularity = "selective"
        if "moe" not in modules:
            modules.append("moe")
    out = {"recompute": "none", "recompute_modules": ("core_attn",),
           "recompute_method": "uniform", "recompute_num_layers": 1,
           "distribute_saved_activations": bool(ns.distribute_saved_activations)}
    if ns.distribute_saved_activations:  # validate_args
        _megatron(ns.tensor_model_parallel_size > 1, "can distribute recomputed activations "
                  "only across tensor model parallel groups", vs)
        _megatron(granularity == "full", "distributed recompute activations is only "
                  "application to full recompute granularity", vs)
        _megatron(ns.recompute_method is not None, "for distributed recompute activations to "
                  "work you need to use a recompute method", vs)
    if granularity == "selective":
        _megatron(ns.recompute_method is None, "recompute method is not yet supported for "
                                               "selective recomputing granularity", vs)
        _megatron(ns.recompute_num_layers is None,
                  "When using recompute_granularity: selective recompute_num_layers must be "
                  "None.", tc)
        known = set(RECOMPUTE_MODULE_NAMES) | set(_RECOMPUTE_MISSING)
        invalid = sorted(set(modules) - known)
        _megatron(not invalid, f"Invalid choices for recompute_modules: {invalid}. "
                               f"Allowed modules are: {sorted(known)}", tc)
        _megatron(mla or "mla_up_proj" not in modules,
                  "mla_up_proj in recompute_modules is only supported with "
                  "multi_latent_attention.", tc)
        _megatron("moe_act" not in modules or bool(ns.moe_grouped_gemm),
                  "moe_act in recompute_modules is only supported with moe_grouped_gemm.", tc)
        _megatron("shared_experts" not in modules
                  or not (ns.moe_shared_expert_intermediate_size is not None
                          and ns.moe_shared_expert_overlap),
                  "shared_experts recompute cannot work with --moe-shared-expert-overlap.", tc)
        missing = [m for m in modules if m in _RECOMPUTE_MISSING]
        _missing(not missing, "; ".join(f"--recompute-modules {m} ({_RECOMPUTE_MISSING[m]})"
                                        for m in missing))
        out.update(recompute="selective",
                   recompute_modules=tuple(RECOMPUTE_MODULE_NAMES[m] for m in modules))
    elif granularity == "full":
        _megatron(ns.recompute_method is not None,
                  'Using recompute_granularity: full so recompute_method must be "block" or '
                  '"uniform"', tc)
        _megatron(ns.recompute_num_layers is not None,
                  "When using recompute_granularity: full recompute_num_layers must be between "
                  "1 and num_layers_per_pipeline_rank", tc)
        out.update(recompute="full", recompute_method=ns.recompute_method,
                   recompute_num_layers=ns.recompute_num_layers)
    return out


def _optimizer_offload(ns) -> dict[str, Any]:
    """The Job's optimizer CPU offload fields from ``--optimizer-cpu-offload`` and its flags
    (tracemem.offload); none without it (the flags have no effect then)."""
    if not ns.optimizer_cpu_offload:
        return {}
    return {"optimizer_cpu_offload": True,
            "optimizer_offload_fraction": ns.optimizer_offload_fraction,
            "pin_cpu_grads": bool(ns.pin_cpu_grads), "pin_cpu_params": bool(ns.pin_cpu_params)}


def _activation_offload(ns) -> dict[str, Any]:
    """The Job's fine-grained activation offloading fields (``modeling.common.offload``);
    none without ``--fine-grained-activation-offloading`` (its flags have no effect then)."""
    if not ns.fine_grained_activation_offloading:
        return {}
    return {"fine_grained_activation_offloading": True,
            "offload_modules": tuple(ns.offload_modules or ()),
            "min_offloaded_tensor_size": int(ns.min_offloaded_tensor_size)}


def _te_cpu_offload(ns, env: Mapping[str, str]) -> dict[str, Any]:
    """The Job's TE CPU offloading field (``modeling.common.cpu_offload``) from
    ``--cpu-offloading-num-layers`` (which sets ``cpu_offloading`` when above 0,
    ``validate_args`` at Megatron-LM d98e8a6, arguments.py: 0 or a negative count leaves it
    off, so none then), and ``te_cpu_offload_v1`` under ``NVTE_CPU_OFFLOAD_V1=1`` (the Job refuses
    it with CPU offloading on, whoever sets N: TE's v1 path is not modelled)."""
    out = {}
    if str(env.get("NVTE_CPU_OFFLOAD_V1", "0")).strip() == "1":
        out["te_cpu_offload_v1"] = True  # the Job refuses it with CPU offloading on
    n = ns.cpu_offloading_num_layers
    if n and n > 0:
        out["cpu_offloading_num_layers"] = int(n)
    return out


def _zero(ns) -> int:
    if ns.use_megatron_fsdp:
        strategy = ns.data_parallel_sharding_strategy
        _missing(strategy in ("optim_grads", "optim_grads_params"),
                 f"--data-parallel-sharding-strategy {strategy} under Megatron-FSDP "
                 f"(tracemem's ZeRO-2 / 3 are optim_grads / optim_grads_params)")
        return 2 if strategy == "optim_grads" else 3
    return 1 if ns.use_distributed_optimizer else 0


def megatron_job_kwargs(argv, *, env: Mapping[str, str] | None = None,
                        world_size: int | None = None,
                        vocab_size: int | None = None) -> dict[str, Any]:
    """The ``tracemem.job.Job`` keywords of a Megatron-LM ``pretrain_gpt.py`` job.

    Args:
        argv: Megatron-LM arguments as on the command line (``@file`` expanded; a
            ``model_config.yaml``'s through ``megatron_args_from_yaml``).
        env: the job's environment variables (a ``model_config.yaml``'s ``ENV_VARS``), each
            honoured, neutral or refused (``megatron_tables.ENV_*``); not ``os.environ``.
        world_size: GPUs (Megatron takes it from its launcher); else ``env["WORLD_SIZE"]``.
        vocab_size: the tokenizer's vocabulary before padding, needed when Megatron reads it
            from a tokenizer file (``--vocab-file``, ``--tokenizer-model``); overrides
            Megatron's ``--vocab-size``.

    Returns:
        ``Job`` keywords: ``model`` (a ``ModelConfig``, model_type "gpt", the vocabulary
        unpadded: the Job pads it), the layout, batch, schedule, recompute, precision,
        kernels, ``origin="megatron"`` and ``megatron_args`` (the arguments, ``@file``
        expanded).

    Raises:
        TracememError: an unknown or refused argument (all refused ones in one line), a
            missing world size or vocabulary size, or Megatron's own refusal (its message
            and the Megatron-LM file that makes it).
    """
    argv = expand_megatron_args(argv)
    ns, given = parse_with_given(argv)
    env = dict(env or {})
    _refuse_tables(ns, given, argv)
    _check_env(env, ns.attention_backend)
    vs = "megatron/training/arguments.py validate_args"
    _megatron(not (ns.fp16 and ns.bf16), "--fp16 and --bf16: assert not args.bf16", vs)
    _megatron(ns.non_persistent_ckpt_type in ("global", "local", None),
              "Currently only global and local checkpoints are supported", vs)
    if not ns.bf16:
        raise TracememError("neither --bf16 nor --fp16: Megatron-LM then trains in fp32 "
                            "(params_dtype torch.float); not modelled yet: fp32 training "
                            "(tracemem's recipes keep bf16 parameters): add --bf16")
    world = _world_size(world_size, env)
    # validate_args: required arguments and their stand-ins
    if ns.num_layers is not None:
        _megatron(ns.encoder_num_layers is None,
                  "cannot have both num-layers and encoder-num-layers specified", vs)
    else:
        ns.num_layers = ns.encoder_num_layers
    if ns.seq_length is None:
        ns.seq_length = ns.encoder_seq_length
    for flag, dest in (("--num-layers", "num_layers"), ("--hidden-size", "hidden_size"),
                       ("--num-attention-heads", "num_attention_heads"),
                       ("--max-position-embeddings", "max_position_embeddings"),
                       ("--micro-batch-size", "micro_batch_size"),
                       ("--seq-length", "seq_length")):
        if getattr(ns, dest) is None:
            raise TracememError(f"Megatron-LM requires {flag} (validate_args); give it")
    _megatron(ns.max_position_embeddings >= ns.seq_length,
              f"max_position_embeddings ({ns.max_position_embeddings}) must be greater than or "
              f"equal to seq_length ({ns.seq_length}).", vs)
    # transformer implementation, attention, fusions
    impl = ns.transformer_impl
    _missing(impl == "transformer_engine",
             f"--transformer-impl {impl} (Megatron-Core's "
             + ("local layer spec: ColumnParallelLinear / RowParallelLinear, separate norms, "
                "DotProductAttention); tracemem's Megatron kernels are Transformer Engine's"
                if impl == "local" else "inference-optimized layers)"))
    backend = ns.attention_backend
    _megatron(backend != "local", "--attention-backend local is only supported with --spec "
                                  "local", vs)
    _megatron(not (ns.cross_entropy_loss_fusion and ns.cross_entropy_fusion_impl == "te"),
              "Transformer Engine cross entropy loss fusion is disabled due to stability "
              "issues. Use --cross-entropy-fusion-impl native, or omit "
              "--cross-entropy-loss-fusion.", vs)
    _megatron(not (ns.deterministic_mode and ns.cross_entropy_loss_fusion),
              "--deterministic-mode requires: cross_entropy_loss_fusion=False",
              "megatron/training/determinism.py apply_determinism_to_args")
    _missing(ns.optimizer == "adam", f"--optimizer {ns.optimizer} (tracemem's optimizer step "
                                     f"is Adam)")
    # parallel layout
    tp, pp, cp, ep = (ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size,
                      ns.context_parallel_size, ns.expert_model_parallel_size)
    for flag, value in (("--tensor-model-parallel-size", tp),
                        ("--pipeline-model-parallel-size", pp),
                        ("--context-parallel-size", cp), ("--expert-model-parallel-size", ep)):
        _positive(flag, value)
    # the model's sizes as given (Megatron's argparse takes any int)
    for flag, value in (("--num-layers", ns.num_layers), ("--hidden-size", ns.hidden_size),
                        ("--num-attention-heads", ns.num_attention_heads),
                        ("--seq-length", ns.seq_length)):
        if value is not None:
            _positive(flag, value)
    for flag, value in (("--ffn-hidden-size", ns.ffn_hidden_size),
                        ("--kv-channels", ns.kv_channels), ("--num-experts", ns.num_experts),
                        ("--moe-ffn-hidden-size", ns.moe_ffn_hidden_size)):
        if value is not None and value < 0:
            _positive(flag, value)
    sp = bool(ns.sequence_parallel and tp > 1)  # validate_args turns SP off at TP 1
    experts = ns.num_experts or 0
    if ep > 1:
        _megatron(bool(experts), "num_experts must be non None to use expert model "
                                 "parallelism", vs)
        _megatron(experts % ep == 0, "Number of experts should be a multiple of expert model "
                                     "parallel_size.", vs)
    etp = (ns.expert_tensor_parallel_size or tp) if experts else 1  # default: TP (validate_args)
    if experts and etp > 1 and ep == 1:
        _missing(False, f"--expert-tensor-parallel-size {etp}"
                        + (" (Megatron's default: the TP size)"
                           if ns.expert_tensor_parallel_size is None else "")
                        + " with --expert-model-parallel-size 1 (expert tensor parallelism "
                          "without expert parallelism); give --expert-tensor-parallel-size 1")
    if experts and ns.expert_tensor_parallel_size is None and etp > 1 \
            and isinstance(world, int) and world % (etp * ep * pp):
        # ParallelConfig's own message names etp(2) but not where the 2 came from
        raise TracememError(
            f"--world-size {world} is not a multiple of etp({etp}) * ep({ep}) * pp({pp}) = "
            f"{etp * ep * pp}: --expert-tensor-parallel-size was not given, so it is "
            f"Megatron's default, the TP size ({tp}; arguments.py validate_args); give "
            f"--expert-tensor-parallel-size 1 or a size that makes EDP an integer")
    if cp > 1:
        _megatron(ns.seq_length % (2 * cp) == 0, "seq-length should be a multiple of 2 * "
                                                 "context-parallel-size if "
                                                 "context-parallel-size > 1.", vs)
    cp_comm_type = _cp_comm_type(ns, cp)
    if ns.overlap_param_gather:
        _megatron(ns.use_distributed_optimizer or ns.use_megatron_fsdp,
                  "--overlap-param-gather only supported with distributed optimizer, megatron "
                  "fsdp, or dist_muon", vs)
        _megatron(ns.overlap_grad_reduce, "Must use --overlap-param-gather with "
                                          "--overlap-grad-reduce", vs)
    if ns.use_megatron_fsdp:
        _megatron(ns.ckpt_format == "fsdp_dtensor",
                  "Megatron-FSDP requires the `fsdp_dtensor` checkpointing format.", vs)
        _megatron(env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1",
                  "FSDP requires CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset.", vs)
    if ns.deterministic_mode:  # megatron/training/determinism.py apply_determinism_env
        where = "megatron/training/determinism.py apply_determinism_env"
        tokens = [t.strip() for t in env.get("NCCL_ALGO", "Ring").split(",") if t.strip()]
        accepted = ["CollnetChain", "CollnetDirect", "Ring", "^NVLS"]
        _megatron(bool(tokens) and all(t in accepted for t in tokens),
                  f"NCCL_ALGO={env.get('NCCL_ALGO')!r}: each token must be in {accepted}.",
                  where)
        for name, values in (("NVTE_ALLOW_NONDETERMINISTIC_ALGO", ["0"]),
                             ("CUBLAS_WORKSPACE_CONFIG", [":16:8", ":4096:8"])):
            _megatron(env.get(name) in (None, *values),
                      f"{name}={env.get(name)!r} is not a deterministic setting. Accepted: "
                      f"{values}.", where)
    if ns.accumulate_allreduce_grads_in_fp32:
        _megatron(ns.main_grads_dtype == "fp32", "--main-grads-dtype can only be fp32 when "
                                                 "--accumulate-allreduce-grads-in-fp32 is set",
                  vs)
    vocab, divisible_by = _vocab(ns, vocab_size)
    model = _model_config(ns, vocab, tp, sp)
    layout = _layout(ns, ns.num_layers, ns.mtp_num_layers or 0, pp)
    if ns.overlap_param_gather_with_optimizer_step:
        _megatron(ns.use_distributed_optimizer, "--overlap-param-gather-with-optimizer-step "
                                                "only supported with distributed optimizer", vs)
        _megatron(ns.overlap_param_gather, "Must use --overlap-param-gather-with-optimizer-step "
                                           "with --overlap-param-gather", vs)
        _megatron(layout["vpp"] > 1, "--overlap-param-gather-with-optimizer-step only "
                                     "supported with interleaved pipeline parallelism", vs)
    # batch: validate_args sets G = b x DP when it is not given (M = 1)
    b, g = ns.micro_batch_size, ns.global_batch_size
    _positive("--micro-batch-size", b)
    if g is not None and ns.decrease_batch_size_if_needed:
        dp = world // (tp * cp * pp) if world % (tp * cp * pp) == 0 else 0
        if dp:
            g = g // (b * dp) * (b * dp)
            if g == 0:
                raise TracememError(f"--decrease-batch-size-if-needed: --global-batch-size "
                                    f"{ns.global_batch_size} is below one microbatch per DP "
                                    f"rank (b x DP = {b * dp})")
    kernel_options = {"moe_shared_expert_overlap": bool(ns.moe_shared_expert_overlap),
                      "gradient_accumulation_fusion": bool(ns.gradient_accumulation_fusion),
                      "cross_entropy_fusion": ("native" if ns.cross_entropy_loss_fusion
                                               else "none"),
                      # TE's UnfusedDotProductAttention reads it (softmax.py): int, default 1
                      "masked_softmax_fusion": str(env.get("NVTE_MASKED_SOFTMAX_FUSION",
                                                           "1")).strip() != "0"}
    if ns.num_experts:  # the MoE layer's kernels (token dispatch, router dtype)
        kernel_options.update(
            moe_permute_fusion=bool(ns.moe_permute_fusion),
            moe_token_dispatcher=("allgather" if ns.moe_token_dispatcher_type == "allgather"
                                  else "alltoall"),
            moe_router_dtype="fp32" if ns.moe_router_dtype == "fp32" else "input")
    if ns.fp8 is not None:  # --fp8-format: TE's FP8 recipes (modeling.kernels.fp8)
        kernel_options.update(fp8_options(ns))
    if cp_comm_type == "p2p":  # allgather is the profile's default: left unset
        kernel_options["cp_comm_type"] = "p2p"
    if backend == "flash":  # TE's FlashAttention backend (unfused is the attention kind
        # below). fused is the profile's default, and so is auto: TE's choice resolves to fused
        # on every GPU kind while flash-attn's presence in the container is not known
        # (modeling.kernels.attention te_auto_attention_backend): both left unset
        kernel_options["attention_backend"] = "flash"
    return {
        "model": model, "world_size": world, "micro_batch_size": b,
        "seq_length": ns.seq_length, "num_microbatches": 1 if g is None else None,
        "global_batch_size": g,
        "tp": tp, "sp": sp, "cp": cp, "ep": ep, "etp": etp, "pp": pp,
        "vpp": layout["vpp"], "pp_layout": layout["pp_layout"],
        "pp_first_stage_layers": layout["pp_first_stage_layers"],
        "pp_last_stage_layers": layout["pp_last_stage_layers"],
        "account_for_embedding_in_pipeline_split":
            bool(ns.account_for_embedding_in_pipeline_split),
        "account_for_loss_in_pipeline_split": bool(ns.account_for_loss_in_pipeline_split),
        "zero": _zero(ns), "precision": "megatron", "plan": "megatron",
        "num_distributed_optimizer_instances": ns.num_distributed_optimizer_instances,
        "use_precision_aware_optimizer": bool(ns.use_precision_aware_optimizer),
        "main_grads_dtype": ns.main_grads_dtype, "main_params_dtype": ns.main_params_dtype,
        "exp_avg_dtype": ns.exp_avg_dtype, "exp_avg_sq_dtype": ns.exp_avg_sq_dtype,
        "grad_reduce_in_bf16": bool(ns.grad_reduce_in_bf16),
        "store_param_remainders": True,  # OptimizerConfig's default; no Megatron flag
        "gradient_accumulation_fusion": bool(ns.gradient_accumulation_fusion),
        "schedule": layout["schedule"],
        **_recompute(ns, ns.multi_latent_attention),
        "attention": "unfused" if backend == "unfused" else "flash",
        # TEGroupedMLP with --moe-grouped-gemm, else SequentialMLP (get_gpt_layer_with_
        # transformer_engine_spec / get_moe_module_spec_for_backend)
        "experts": ("grouped" if ns.moe_grouped_gemm else "sequential") if experts else "auto",
        "kernels": "megatron-te", "kernel_options": kernel_options,
        "routing": "balanced", "optimizer": "fused", **_optimizer_offload(ns),
        **_activation_offload(ns), **_te_cpu_offload(ns, env),
        "deallocate_pipeline_outputs": True,  # core_transformer_config_from_args sets it
        # --no-overlap-p2p-communication (validate_args turns it off without VPP, where
        # tracemem's 1F1B does not read it)
        "overlap_p2p_comm": bool(ns.overlap_p2p_comm),
        # validate_args turns the mask off under --dataloader-inter-document-masking
        "create_attention_mask_in_dataloader": bool(
            ns.create_attention_mask_in_dataloader
            and not getattr(ns, "dataloader_inter_document_masking", False)),
        "alloc_conf": env.get("PYTORCH_CUDA_ALLOC_CONF"),
        "cublas_workspace_config": env.get("CUBLAS_WORKSPACE_CONFIG"),
        "make_vocab_size_divisible_by": divisible_by,
        "origin": "megatron", "megatron_args": tuple(argv),
    }


def _cp_comm_type(ns, cp: int) -> str | None:
    """The context-parallel attention of the job (megatron-te option ``cp_comm_type``): None
    at CP 1, else ``--cp-comm-type``'s one value (its default ``p2p``: TE's ring attention,
    ``modeling.kernels.context_parallel``; ``allgather``: K and V all-gathered). Megatron
    takes one value for all layers or one per layer (``argument_utils.py``
    ``core_transformer_config_from_args`` passes a single value on as a string,
    ``TransformerConfig.__post_init__`` checks a list's length); tracemem models one for all.
    Megatron hands the string to TE unchanged (``TEDotProductAttention.__init__``), whose
    ``attn_forward_func_with_cp`` (TE d0067d0) takes ``all_gather`` and raises ValueError
    ("Unsupported communication type") on Megatron's documented ``allgather``: both spellings
    are the allgather option here, and ``to_megatron_args`` writes ``all_gather``.

    Raises:
        TracememError: a list whose length is not --num-layers (Megatron's refusal), types
            that differ by layer, a2a or a2a+p2p (not modelled)."""
    if cp == 1:
        return None
    comm = list(ns.cp_comm_type)
    if len(comm) > 1:
        _megatron(len(comm) == ns.num_layers,
                  f"Length of cp_comm_type ({len(comm)}) should equal to the total number of "
                  f"transformer layers ({ns.num_layers})!",
                  "megatron/core/transformer/transformer_config.py "
                  "TransformerConfig.__post_init__")
        _missing(len(set(comm)) == 1, f"--cp-comm-type {' '.join(comm)} (a communication "
                                      f"type per layer); give one for all layers")
    if comm[0] == "all_gather":  # TE's spelling (attn_forward_func_with_cp), which TE takes
        return "allgather"
    _missing(comm[0] in ("p2p", "allgather"),
             f"context parallelism with --cp-comm-type {comm[0]} (TE's "
             f"{'AttnFuncWithCPAndQKVOA2A' if comm[0] == 'a2a' else 'hierarchical a2a+p2p'}"
             f"); tracemem models p2p (TE's ring attention) and allgather"
             if comm[0] in ("a2a", "a2a+p2p") else
             f"--cp-comm-type {comm[0]} (TE takes p2p, all_gather, a2a, a2a+p2p)")
    return comm[0]


def megatron_job(argv, *, env=None, world_size=None, vocab_size=None, **fields):
    """``tracemem.job.Job`` of ``megatron_job_kwargs(argv, ...)``, with ``fields`` (tracemem's
    own settings: ``hbm``, ``routing``, ...) given beside them overriding its keywords.

    Raises:
        TracememError: as ``megatron_job_kwargs``, or the ``Job``'s refusal with the layout
            flags it names in Megatron-LM's terms (``in_megatron_terms``)."""
    from tracemem.job import Job

    kwargs = megatron_job_kwargs(argv, env=env, world_size=world_size, vocab_size=vocab_size)
    kwargs.update(fields | following_changes(argv, kwargs, fields))
    try:
        return Job(**kwargs)
    except TracememError as error:
        raise in_megatron_terms(error, set(fields)) from None


# tracemem's layout flags (and --recompute) and the Megatron-LM argument each stands for
_MEGATRON_NAMES = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
                   "cp": "--context-parallel-size", "ep": "--expert-model-parallel-size",
                   "etp": "--expert-tensor-parallel-size", "sp": "--sequence-parallel",
                   "vpp": "--num-virtual-stages-per-pipeline-rank",
                   "recompute": "--recompute-granularity"}


def megatron_dest(field_name: str) -> str | None:
    """The dest of the Megatron-LM argument that gives the ``Job`` field ``field_name``
    (``tp``: ``tensor_model_parallel_size``; a field named as its argument, such as
    ``global_batch_size``, itself), or None where no one argument gives it (kernel options,
    fields of several arguments)."""
    if field_name in _MEGATRON_NAMES:
        return _MEGATRON_NAMES[field_name][2:].replace("-", "_")
    from tracemem.frontdoors.megatron_args import megatron_arguments

    dests = {a["dest"] for a in megatron_arguments()}
    return field_name if field_name in dests else None


def in_megatron_terms(error: TracememError, typed=frozenset()) -> TracememError:
    """``error`` (a ``Job``'s refusal of a job built from Megatron-LM arguments) with each of
    tracemem's layout flags (``--tp``, ``--pp``, ``--cp``, ``--ep``, ``--etp``, ``--sp``,
    ``--vpp``) and ``--recompute`` that it names written as the Megatron-LM argument the user gave
    (``--tensor-model-parallel-size`` ...), so the message points at the user's own words;
    a field in ``typed`` (set by tracemem's flag over the job) keeps tracemem's name.
    Returns a new error of the same type, or ``error`` itself when nothing changes."""
    message = str(error)
    for field_name, flag in _MEGATRON_NAMES.items():
        if field_name not in typed:
            message = re.sub(rf"(?<![\w-])--{field_name}(?![\w-])", flag, message)
    return error if message == str(error) else type(error)(message)


def following_changes(argv, kwargs: Mapping[str, Any], changes: Mapping[str, Any]
                      ) -> dict[str, Any]:
    """The Job fields that follow ``changes`` made to the job of ``argv`` (its
    ``megatron_job_kwargs`` ``kwargs``) where Megatron derives one flag from another: without
    ``--expert-tensor-parallel-size`` a MoE job's ETP is its TP (megatron/training/
    arguments.py validate_args: ``args.expert_tensor_parallel_size =
    args.tensor_model_parallel_size``), so a new TP moves it too."""
    out: dict[str, Any] = {}
    if "tp" in changes and "etp" not in changes and kwargs["model"].num_routed_experts:
        _, given = parse_with_given(argv)
        if "expert_tensor_parallel_size" not in given:
            out["etp"] = changes["tp"]
    return out


def megatron_approximations(argv, *, env: Mapping[str, str] | None = None) -> list[str]:
    """The approximations (``megatron_tables``' "approximation:" entries) that apply to this
    job, one line each ("--flag: what is not traced"; "without --no-flag (Megatron's
    default): ..." where the job keeps Megatron's default behaviour), for a front end to print
    beside the estimate."""
    from tracemem.frontdoors.megatron_tables import HONOURED

    argv = expand_megatron_args(argv)
    ns, _ = parse_with_given(argv)
    typed = {token.split("=", 1)[0] for token in argv}

    def named(flag: str) -> str:  # a "--no-..." flag not typed: Megatron's default behaviour
        return (f"without {flag} (Megatron's default)"
                if flag.startswith("--no-") and flag not in typed else flag)

    notes = [f"{named(flag)}: {HONOURED[flag].split('approximation: ', 1)[1]}"
             for flag, applies in APPROXIMATIONS_WHEN.items() if applies(ns)]
    for name in (env or {}):
        if ENV_HONOURED.get(name, "").startswith("approximation: "):
            notes.append(f"{name}: {ENV_HONOURED[name].removeprefix('approximation: ')}")
    return notes


# ---- the inverse: a job as Megatron-LM arguments ------------------------------------------

# each group of Job fields and the Megatron flags that decide it (to replace a group of the
# original arguments when the job changes it); in Megatron's order
_GROUP_FLAGS: dict[str, tuple[str, ...]] = {
    "tp": ("--tensor-model-parallel-size",),
    "pp": ("--pipeline-model-parallel-size",),
    "sp": ("--sequence-parallel",),
    "cp": ("--context-parallel-size", "--cp-comm-type"),
    "ep": ("--expert-model-parallel-size",),
    "etp": ("--expert-tensor-parallel-size",),
    "model": (
        "--bf16", "--num-layers", "--encoder-num-layers", "--mtp-num-layers", "--hidden-size",
        "--num-attention-heads", "--num-query-groups", "--ffn-hidden-size", "--kv-channels",
        "--hidden-dropout", "--attention-dropout", "--norm-epsilon", "--disable-bias-linear",
        "--add-qkv-bias", "--normalization", "--qk-layernorm", "--multi-latent-attention",
        "--moe-shared-expert-intermediate-size", "--moe-shared-expert-gate",
        "--moe-ffn-hidden-size", "--moe-router-topk", "--moe-router-num-groups",
        "--moe-router-group-topk", "--moe-router-pre-softmax",
        "--moe-router-topk-scaling-factor", "--moe-router-score-function",
        "--moe-router-enable-expert-bias", "--moe-grouped-gemm", "--group-query-attention",
        "--max-position-embeddings", "--position-embedding-type",
        "--use-rotary-position-embeddings", "--rotary-base", "--rotary-percent",
        "--no-position-embedding", "--squared-relu", "--swiglu",
        "--untie-embeddings-and-output-weights", "--num-experts", "--moe-layer-freq",
        "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
        "--v-head-dim"),
    "vocab": ("--make-vocab-size-divisible-by", "--vocab-size", "--padded-vocab-size",
              "--tokenizer-type"),
    "attention": ("--attention-backend",),
    "kernels": ("--transformer-impl", "--cross-entropy-loss-fusion",
                "--cross-entropy-fusion-impl", "--moe-shared-expert-overlap",
                "--moe-router-dtype", "--moe-token-dispatcher-type", "--moe-permute-fusion"),
    "fp8": ("--fp8-format", "--fp8-recipe", "--fp8-param-gather", "--fp8-amax-history-len",
            "--first-last-layers-bf16", "--num-layers-at-start-in-bf16",
            "--num-layers-at-end-in-bf16"),
    "layout": ("--account-for-embedding-in-pipeline-split",
               "--account-for-loss-in-pipeline-split", "--decoder-first-pipeline-num-layers",
               "--decoder-last-pipeline-num-layers", "--pipeline-model-parallel-layout",
               "--num-layers-per-virtual-pipeline-stage",
               "--num-virtual-stages-per-pipeline-rank", "--no-overlap-p2p-communication"),
    "recompute": ("--recompute-granularity", "--recompute-method", "--recompute-num-layers",
                  "--recompute-modules", "--recompute-activations", "--moe-layer-recompute",
                  "--distribute-saved-activations"),
    "micro_batch_size": ("--micro-batch-size",),
    "global_batch_size": ("--global-batch-size", "--decrease-batch-size-if-needed"),
    "seq_length": ("--seq-length", "--encoder-seq-length"),
    "data": ("--no-create-attention-mask-in-dataloader",),
    "zero": ("--use-distributed-optimizer", "--use-megatron-fsdp",
             "--data-parallel-sharding-strategy", "--num-distributed-optimizer-instances"),
    "optimizer_offload": ("--optimizer-cpu-offload", "--optimizer-offload-fraction",
                          "--no-pin-cpu-grads", "--no-pin-cpu-params"),
    "activation_offload": ("--fine-grained-activation-offloading", "--offload-modules",
                           "--min-offloaded-tensor-size", "--cpu-offloading-num-layers"),
    "precision": ("--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32",
                  "--no-gradient-accumulation-fusion", "--use-precision-aware-optimizer",
                  "--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype",
                  "--exp-avg-sq-dtype"),
}

def _num(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value)) if value >= 1 or value == 0 else repr(value)
    return str(value)


def _fields_of(job) -> dict[str, Any]:
    """The Job fields of a ``Job`` or of a keyword dict (the model as a ``ModelConfig``)."""
    from modeling import ModelConfig, load_config
    from tracemem.job import Job

    if isinstance(job, Job):
        out = {f.name: getattr(job, f.name) for f in dataclass_fields(Job) if f.init}
        out["_profile_options"] = dict(job.profile.options)
        out["_dp"] = job.parallel.dp
        out["_microbatches"] = job.microbatches
        return out
    if not isinstance(job, Mapping):
        raise TracememError(f"to_megatron_args takes a Job or its keywords, not "
                            f"{type(job).__name__}")
    out = {}
    for field in dataclass_fields(Job):
        if not field.init:
            continue
        if field.default is not MISSING:
            out[field.name] = field.default
        elif field.default_factory is not MISSING:
            out[field.name] = field.default_factory()
        else:
            out[field.name] = None  # model, world_size, micro_batch_size, seq_length
    out.update(job)
    if not isinstance(out.get("model"), ModelConfig) and out.get("model") is not None:
        out["model"] = load_config(out["model"])
    return out


def _model_args(cfg, divisible_by, experts: str = "grouped") -> tuple[list[str], list[str]]:
    """(the model group, the vocab group) of ``cfg`` (``experts`` the job's expert kernel:
    "sequential" is Megatron without ``--moe-grouped-gemm``)."""
    def no(what):
        raise TracememError(f"{cfg.name}: {what} has no Megatron-LM argument")

    # cfg.dtype is the checkpoint's; every tracemem estimate trains in bf16 (tracemem.estimator)
    a = ["--bf16", "--num-layers", str(cfg.num_layers)]
    if cfg.num_mtp_modules:
        a += ["--mtp-num-layers", str(cfg.num_mtp_modules)]
    a += ["--hidden-size", str(cfg.hidden_size), "--num-attention-heads",
          str(cfg.num_attention_heads)]
    if not cfg.is_mla and cfg.num_key_value_heads != cfg.num_attention_heads:
        a += ["--group-query-attention", "--num-query-groups", str(cfg.num_key_value_heads)]
    a += ["--ffn-hidden-size", str(cfg.intermediate_size)]
    if not cfg.is_mla:
        a += ["--kv-channels", str(cfg.head_dim)]
    a += ["--hidden-dropout", _num(cfg.hidden_dropout), "--attention-dropout",
          _num(cfg.attention_dropout), "--norm-epsilon", _num(cfg.rms_norm_eps)]
    if cfg.is_mla:  # add_bias_linear sets linear_proj's bias (and --add-qkv-bias, unused)
        bias = (cfg.o_bias, cfg.o_bias, cfg.mlp_bias)
    else:
        bias = (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias)
    if bias == (False, False, False):
        a += ["--disable-bias-linear"]
    elif bias == (True, False, False):
        a += ["--disable-bias-linear", "--add-qkv-bias"]
    elif bias != (True, True, True):
        no(f"biases qkv={bias[0]} o={bias[1]} mlp={bias[2]}")
    a += ["--normalization", {"rmsnorm": "RMSNorm", "layernorm": "LayerNorm"}[cfg.normalization]]
    if (cfg.is_mla and cfg.mla_latent_norms) or (not cfg.is_mla and cfg.qk_norm):
        a += ["--qk-layernorm"]
    if cfg.is_mla:
        a += ["--multi-latent-attention"]
    if cfg.is_moe:
        width = cfg.shared_experts_width
        if width:
            a += ["--moe-shared-expert-intermediate-size", str(width)]
            if cfg.shared_expert_gate:
                a += ["--moe-shared-expert-gate"]
        a += ["--moe-ffn-hidden-size", str(cfg.moe_intermediate_size),
              "--moe-router-topk", str(cfg.num_experts_per_tok)]
        grouped = cfg.topk_method != "greedy" and cfg.num_expert_groups > 1
        if grouped:
            a += ["--moe-router-num-groups", str(cfg.num_expert_groups),
                  "--moe-router-group-topk", str(cfg.topk_group)]
        if cfg.scoring_func == "softmax":
            if cfg.router_pre_softmax and not cfg.norm_topk_prob:  # RouterSpec's rule
                a += ["--moe-router-pre-softmax"]
        elif cfg.num_experts_per_tok > 1 and not cfg.norm_topk_prob:
            no("a sigmoid router that does not renormalise its top-k weights (Megatron "
               "always does)")
        if cfg.routed_scaling_factor is not None:
            a += ["--moe-router-topk-scaling-factor", _num(cfg.routed_scaling_factor)]
        a += ["--moe-router-score-function", cfg.scoring_func]
        if cfg.topk_method == "sinkhorn":
            a += ["--moe-router-load-balancing-type", "sinkhorn"]
        if cfg.has_correction_bias:
            a += ["--moe-router-enable-expert-bias"]
        if experts != "sequential":
            a += ["--moe-grouped-gemm"]
    a += ["--max-position-embeddings", str(cfg.max_position_embeddings),
          "--position-embedding-type", cfg.position_embedding]
    if cfg.rope_theta != 10000.0:
        a += ["--rotary-base", _num(cfg.rope_theta)]
    if not cfg.is_mla and cfg.partial_rotary_factor != 1.0:
        a += ["--rotary-percent", _num(cfg.partial_rotary_factor)]
    if cfg.hidden_act == "squared_relu" and not cfg.gated_mlp:
        a += ["--squared-relu"]
    elif cfg.hidden_act == "silu" and cfg.gated_mlp:
        a += ["--swiglu"]
    elif not (cfg.hidden_act == "gelu" and not cfg.gated_mlp):
        no(f"hidden_act {cfg.hidden_act} with gated_mlp {cfg.gated_mlp}")
    if not cfg.tie_word_embeddings:
        a += ["--untie-embeddings-and-output-weights"]
    if cfg.is_moe:
        pattern = [int(cfg.is_moe_layer(i)) for i in range(cfg.num_layers)]
        mtp = [int(cfg.is_moe_layer(cfg.num_layers + k)) for k in range(cfg.num_mtp_modules)]
        if any(m != pattern[-1] for m in mtp):
            no("MTP layers of another kind (dense / MoE) than the last decoder layer")
        a += ["--num-experts", str(cfg.num_routed_experts)]
        freq = next((n for n in range(1, cfg.num_layers + 1)
                     if pattern == [int(i % n == 0) for i in range(cfg.num_layers)]), None)
        if freq is None:
            a += ["--moe-layer-freq", moe_pattern_text(pattern)]
        elif freq != 1:
            a += ["--moe-layer-freq", str(freq)]
    if cfg.is_mla:
        if cfg.q_lora_rank is not None:
            a += ["--q-lora-rank", str(cfg.q_lora_rank)]
        a += ["--kv-lora-rank", str(cfg.kv_lora_rank), "--qk-head-dim",
              str(cfg.qk_nope_head_dim), "--qk-pos-emb-head-dim", str(cfg.qk_rope_head_dim),
              "--v-head-dim", str(cfg.v_head_dim)]
    if divisible_by is None:
        vocab = ["--padded-vocab-size", str(cfg.vocab_size)]
    else:
        vocab = (["--make-vocab-size-divisible-by", str(divisible_by)]
                 if divisible_by != 128 else []) + ["--tokenizer-type", "NullTokenizer",
                                                    "--vocab-size", str(cfg.vocab_size)]
    return a, vocab


class _Unstated(str):
    """A group Megatron-LM has no arguments for (the message says why)."""


def _no(what: str):
    raise TracememError(f"{what} has no Megatron-LM argument")


def _canonical(f: Mapping[str, Any]) -> dict[str, list[str] | _Unstated]:
    """Every group of Job fields ``f`` as Megatron-LM arguments (``_GROUP_FLAGS``' groups);
    a group Megatron cannot state is an ``_Unstated`` message instead."""
    from modeling.kernels import MEGATRON_TE_OPTIONS
    from tracemem.precision import resolve_precision

    cfg = f.get("model")
    moe = cfg is not None and cfg.is_moe

    def etp():
        if moe:
            return ["--expert-tensor-parallel-size", str(f["etp"])]
        if f["etp"] != 1:
            _no(f"etp {f['etp']} on a dense model")
        return []

    def cp_comm_type():  # the megatron-te option, written as the job has it; allgather in
        # TE's spelling all_gather: Megatron passes the string to TE unchanged, and TE's
        # attn_forward_func_with_cp raises on "allgather" (_cp_comm_type)
        options = {key: spec[1] for key, spec in MEGATRON_TE_OPTIONS.items()}
        options.update(f.get("_profile_options") or {})
        options.update(f.get("kernel_options") or {})
        return "all_gather" if options["cp_comm_type"] == "allgather" else "p2p"

    def attention():  # the megatron-te option attention_backend, as the job has it (auto,
        # Megatron's default, not written); unfused is the attention kind
        if f["attention"] == "unfused":
            return ["--attention-backend", "unfused"]
        if f["attention"] != "flash":
            _no(f"attention {f['attention']!r}")
        options = {key: spec[1] for key, spec in MEGATRON_TE_OPTIONS.items()}
        options.update(f.get("_profile_options") or {})
        options.update(f.get("kernel_options") or {})
        backend = options["attention_backend"]
        return [] if backend == "auto" else ["--attention-backend", backend]

    def kernels():
        if f["kernels"] != "megatron-te":
            _no(f"kernels {f['kernels']!r} (Megatron runs Transformer Engine: megatron-te)")
        options = {key: spec[1] for key, spec in MEGATRON_TE_OPTIONS.items()}
        options.update(f.get("_profile_options") or {})
        options.update(f.get("kernel_options") or {})
        out = []
        fusion = options.get("cross_entropy_fusion", "none")
        if options.get("fp8_moe_act_cache"):
            _no("kernel option fp8_moe_act_cache (DeepSeek-V3's FP8 cache of the SwiGLU "
                "input, arXiv 2412.19437 3.3.3)")
        if options.get("e5m6_attention_output"):
            _no("kernel option e5m6_attention_output (DeepSeek-V3's E5M6 cache of the "
                "attention output, arXiv 2412.19437 3.3.3)")
        if options.get("fp8_dispatch"):
            _no("kernel option fp8_dispatch (DeepSeek-V3's FP8 dispatch, arXiv 2412.19437 "
                "3.3.3; Megatron's own --moe-dispatch-fwd-dtype mxfp8 is the flex "
                "dispatcher's)")
        if fusion == "native":
            out += ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native"]
        elif fusion != "none":
            raise TracememError(
                f"--cross-entropy-fusion {fusion} (megatron-te's default) has no Megatron-LM "
                f"argument (Megatron-LM refuses --cross-entropy-fusion-impl te: validate_args); "
                f"give --cross-entropy-fusion native or none to print the job")
        if options.get("moe_shared_expert_overlap") and moe and cfg.shared_experts_width:
            out += ["--moe-shared-expert-overlap"]
        if moe:
            if options["moe_router_dtype"] == "fp32":
                out += ["--moe-router-dtype", "fp32"]
            out += ["--moe-token-dispatcher-type", options["moe_token_dispatcher"]]
            if options["moe_permute_fusion"]:
                out += ["--moe-permute-fusion"]
        return out

    def fp8():  # the megatron-te FP8 options (fp8_options' inverse: _fp8_args)
        if f["kernels"] != "megatron-te":
            return []  # the kernels group says why
        options = {key: spec[1] for key, spec in MEGATRON_TE_OPTIONS.items()}
        options.update(f.get("_profile_options") or {})
        options.update(f.get("kernel_options") or {})
        if options["fp8_recipe"] != "none":
            return _fp8_args(options)
        # without FP8 Megatron has no FP8 argument to give (fp8_arch is the GPU's)
        stray = [key for key in ("fp8_format", "fp8_param_gather", "fp8_amax_history_len",
                                 "fp8_layers_at_start_in_bf16", "fp8_layers_at_end_in_bf16")
                 if options[key] != MEGATRON_TE_OPTIONS[key][1]]
        if stray:
            _no(f"kernel_options {stray[0]} {options[stray[0]]!r} without an fp8_recipe "
                f"(Megatron-LM runs FP8 only with --fp8-format)")
        return []

    def layout():
        out = []
        if f["account_for_embedding_in_pipeline_split"]:
            out += ["--account-for-embedding-in-pipeline-split"]
        if f["account_for_loss_in_pipeline_split"]:
            out += ["--account-for-loss-in-pipeline-split"]
        if f["pp_first_stage_layers"] is not None:
            out += ["--decoder-first-pipeline-num-layers", str(f["pp_first_stage_layers"])]
        if f["pp_last_stage_layers"] is not None:
            out += ["--decoder-last-pipeline-num-layers", str(f["pp_last_stage_layers"])]
        if f["pp_layout"] is not None:
            mtp = cfg.num_mtp_modules if cfg is not None else 0
            out += ["--pipeline-model-parallel-layout",
                    format_layout_string(tuple(f["pp_layout"]), mtp)]
        elif f["vpp"] > 1:
            out += ["--num-virtual-stages-per-pipeline-rank", str(f["vpp"])]
        if f["vpp"] > 1 and not f.get("overlap_p2p_comm", True):
            out += ["--no-overlap-p2p-communication"]
        expected = "interleaved-1f1b" if f["vpp"] > 1 else "1f1b"
        if f["schedule"] != expected:
            _no(f"schedule {f['schedule']!r} with vpp {f['vpp']} (Megatron runs {expected})")
        return out

    def recompute():
        if f["recompute"] == "selective":
            return ["--recompute-granularity", "selective", "--recompute-modules",
                    *f["recompute_modules"]]
        if f["recompute"] == "full":
            return ["--recompute-granularity", "full", "--recompute-method",
                    f["recompute_method"], "--recompute-num-layers",
                    str(f["recompute_num_layers"])] + (
                        ["--distribute-saved-activations"]
                        if f.get("distribute_saved_activations") else [])
        return []

    def global_batch():
        g = f.get("global_batch_size")
        if g is None and f.get("world_size") and f["micro_batch_size"] is not None:
            dense = f["tp"] * f["cp"] * f["pp"]
            m = f.get("_microbatches") or f.get("num_microbatches")
            if m is not None and f["world_size"] % dense == 0:
                g = f["micro_batch_size"] * m * (f["world_size"] // dense)
        return [] if g is None else ["--global-batch-size", str(g)]

    def zero():
        fsdp = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy"]
        n = f.get("num_distributed_optimizer_instances") or 1
        return {0: [], 1: ["--use-distributed-optimizer"],
                2: [*fsdp, "optim_grads", "--ckpt-format", "fsdp_dtensor"],
                3: [*fsdp, "optim_grads_params", "--ckpt-format", "fsdp_dtensor"]}[f["zero"]] \
            + (["--num-distributed-optimizer-instances", str(n)] if n > 1 else [])

    def precision():
        if f["optimizer"] != "fused":
            _no(f"optimizer {f['optimizer']!r} (Megatron's Adam is fused)")
        spec = resolve_precision(f["precision"], f["zero"], **{
            key: f.get(key) for key in ("use_precision_aware_optimizer", "main_grads_dtype",
                                        "main_params_dtype", "exp_avg_dtype",
                                        "exp_avg_sq_dtype", "grad_reduce_in_bf16",
                                        "store_param_remainders",
                                        "gradient_accumulation_fusion")})
        out = []
        if spec.grad_reduce_in_bf16:
            out += ["--grad-reduce-in-bf16"]
        if spec.gradient_accumulation_fusion is False:
            out += ["--no-gradient-accumulation-fusion"]
        if spec.use_precision_aware_optimizer:
            out += ["--use-precision-aware-optimizer"]
            if not spec.store_param_remainders and spec.main_params_dtype == "fp32":
                _no("store_param_remainders False (OptimizerConfig's field has no flag)")
        for key in ("main_grads_dtype", "main_params_dtype", "exp_avg_dtype",
                    "exp_avg_sq_dtype"):
            if getattr(spec, key) != "fp32":
                out += ["--" + key.replace("_", "-"), getattr(spec, key)]
        return out

    model = (lambda: _model_args(cfg, f["make_vocab_size_divisible_by"], f["experts"])) \
        if cfg is not None \
        else (lambda: ([], []))
    makers = {
        "tp": lambda: ["--tensor-model-parallel-size", str(f["tp"])],
        "pp": lambda: ["--pipeline-model-parallel-size", str(f["pp"])],
        "sp": lambda: ["--sequence-parallel"] if f["sp"] else [],
        "cp": lambda: ["--context-parallel-size", str(f["cp"])] + (
            ["--cp-comm-type", cp_comm_type()] if f["cp"] > 1 else []),
        "ep": lambda: ["--expert-model-parallel-size", str(f["ep"])],
        "etp": etp,
        "model": lambda: model()[0],
        "vocab": lambda: model()[1],
        "attention": attention, "kernels": kernels, "fp8": fp8, "layout": layout,
        "recompute": recompute,
        "micro_batch_size": lambda: [] if f["micro_batch_size"] is None else [
            "--micro-batch-size", str(f["micro_batch_size"])],
        "global_batch_size": global_batch,
        "seq_length": lambda: [] if f["seq_length"] is None else [
            "--seq-length", str(f["seq_length"])],
        "data": lambda: [] if f.get("create_attention_mask_in_dataloader", True) else [
            "--no-create-attention-mask-in-dataloader"],
        "zero": zero, "precision": precision,
        "optimizer_offload": lambda: [] if not f.get("optimizer_cpu_offload") else [
            "--optimizer-cpu-offload", "--optimizer-offload-fraction",
            _num(f.get("optimizer_offload_fraction", 1.0))]
        + ([] if f.get("pin_cpu_grads", True) else ["--no-pin-cpu-grads"])
        + ([] if f.get("pin_cpu_params", True) else ["--no-pin-cpu-params"]),
        "activation_offload": lambda: ([] if not f.get("fine_grained_activation_offloading")
                                       else ["--fine-grained-activation-offloading",
                                             "--offload-modules",
                                             *f.get("offload_modules", ())]
                                       + ([] if f.get("min_offloaded_tensor_size",
                                                      1024 * 1024) == 1024 * 1024 else [
                                           "--min-offloaded-tensor-size",
                                           str(f["min_offloaded_tensor_size"])]))
        + ([] if not f.get("cpu_offloading_num_layers") else [
            "--cpu-offloading-num-layers", str(f["cpu_offloading_num_layers"])]),
    }
    out: dict[str, list[str] | _Unstated] = {}
    for name in _GROUP_FLAGS:
        try:
            out[name] = makers[name]()
        except TracememError as error:
            out[name] = _Unstated(str(error))
    return out


def _stated(groups: dict[str, list[str] | _Unstated]) -> dict[str, list[str]]:
    """``groups`` with every group stated. Raises: TracememError: the first that is not."""
    for value in groups.values():
        if isinstance(value, _Unstated):
            raise TracememError(str(value))
    return groups  # type: ignore[return-value]


def _segments(argv: list[str]) -> list[tuple[str, list[str]]]:
    """``argv`` as (flag, its tokens) in order (``--flag=value`` kept as one token)."""
    known = {f for record in megatron_arguments() for f in record["flags"]}
    out: list[tuple[str, list[str]]] = []
    for token in argv:
        flag = token.split("=", 1)[0]
        if flag in known:
            out.append((flag, [token]))
        elif out:
            out[-1][1].append(token)
        else:
            out.append(("", [token]))
    return out


def _aliases() -> dict[str, str]:
    """Every option string -> the first one of its argument."""
    return {f: record.flag for record in megatron_arguments() for f in record["flags"]}


def to_megatron_args(job) -> list[str]:
    """A ``Job`` (or its keywords) as Megatron-LM arguments: the inverse of
    ``megatron_job_kwargs`` on the honoured arguments. A job that came from Megatron
    arguments (``megatron_args``) keeps them, with each group of flags the job changed
    replaced (so paths, learning rates and every neutral argument stay as the user wrote
    them); any other job gets its arguments in Megatron's order. A job that runs FP8 (the
    megatron-te option ``fp8_recipe``) gets ``--fp8-format``, ``--fp8-recipe`` and the other FP8
    arguments that leave Megatron's defaults (``_fp8_args``). The world size is not an
    argument (Megatron's launcher gives it), nor is ``alloc_conf`` (PYTORCH_CUDA_ALLOC_CONF),
    nor the GPU (``gpu``, and with it the megatron-te option ``fp8_arch``).

    Raises:
        TracememError: a field with no Megatron-LM argument (another schedule, kernel profile,
            precision recipe Megatron cannot state), naming it.
    """
    f = _fields_of(job)
    target = _stated(_canonical(f))
    original = list(f.get("megatron_args") or ())
    if not original:
        return [token for group in target.values() for token in group]
    kwargs = megatron_job_kwargs(original, world_size=f["world_size"],
                                 vocab_size=f["model"].vocab_size)
    before = _canonical(_fields_of(kwargs))
    changed = _with_dependents({name for name in target if target[name] != before[name]}, f)
    drop = {flag for name in changed for flag in _GROUP_FLAGS[name]}
    alias = _aliases()
    out = [token for flag, tokens in _segments(original) if alias.get(flag, flag) not in drop
           for token in tokens]
    for name in _GROUP_FLAGS:
        if name in changed:
            out += target[name]
    return out


def _with_dependents(changed: set[str], f: Mapping[str, Any]) -> set[str]:
    """``changed`` groups and the groups whose flags mean something else after them: with
    VPP, Megatron's layout flags (``--num-layers-per-virtual-pipeline-stage``, a layout
    string) depend on PP, so a new PP restates the layout."""
    if "pp" in changed and f.get("vpp", 1) > 1:
        return changed | {"layout"}
    return changed


def _flag_runs(tokens: list[str]) -> list[list[str]]:
    """``["--a", "1", "--b"]`` -> ``[["--a", "1"], ["--b"]]``."""
    runs: list[list[str]] = []
    for token in tokens:
        if token.startswith("--") or not runs:
            runs.append([token])
        else:
            runs[-1].append(token)
    return runs


def megatron_flag_changes(changes: Mapping[str, Any], job=None) -> str:
    """Job-field ``changes`` (``{"recompute": "full", "pp": 32}``) as the Megatron-LM arguments
    to change: ``"--recompute-granularity full --recompute-method uniform
    --recompute-num-layers 1 --pipeline-model-parallel-size 32"``, with "drop --flag" for
    flags the change removes. With ``job`` (a ``Job`` or its keywords) the change is read
    against it; without, against the Job's defaults (a change that needs the model or the
    world size, such as ``num_microbatches``, then needs ``job``).

    Raises:
        TracememError: an unknown field, or a field with no Megatron-LM argument.
    """
    from tracemem.job import job_fields

    unknown = sorted(set(changes) - set(job_fields()))
    if unknown:
        raise TracememError(f"megatron_flag_changes: {unknown[0]!r} is not a Job field")
    base = _fields_of(job if job is not None else {"model": None})
    if job is None and ("model" in changes or "num_microbatches" in changes):
        raise TracememError(f"megatron_flag_changes({', '.join(sorted(changes))}) needs the "
                            f"job (job=...): the change depends on its model and world size")
    after = dict(base)
    after.update(changes)
    if "num_microbatches" in changes:
        after["global_batch_size"] = None
        after["_microbatches"] = changes["num_microbatches"]
    if job is not None and not isinstance(job, Mapping):  # a Job: M follows G, b, DP
        from tracemem.job import Job

        if isinstance(job, Job):
            moved = dict(changes)
            if "num_microbatches" in changes and "global_batch_size" not in changes:
                moved["global_batch_size"] = None  # M given: G follows from it
            after = _fields_of(job.with_changes(**moved))
    old, new = _canonical(base), _canonical(after)
    changed = _with_dependents({name for name in _GROUP_FLAGS if old[name] != new[name]},
                               after)
    words: list[str] = []
    dropped: list[str] = []
    for name in _GROUP_FLAGS:
        if name not in changed:
            continue
        if isinstance(new[name], _Unstated):
            raise TracememError(str(new[name]))
        before = [] if isinstance(old[name], _Unstated) else _flag_runs(old[name])
        after_runs = _flag_runs(new[name])
        words += [token for run in after_runs if run not in before for token in run]
        kept = {run[0] for run in after_runs}
        dropped += [run[0] for run in before if run[0] not in kept]
    if dropped:
        words += ["drop", *dropped]
    return " ".join(words)
