"""Megatron-LM's own memory formula, reimplemented term by term: ``report_theoretical_memory``
and the three functions it calls in ``megatron/training/theoretical_memory_usage.py`` at
NVIDIA/Megatron-LM d98e8a64ddf34856e74b24714e3bedb2f5a39553 (the project's pin, ``PIN``).
"Line N" below is a line of that file unless another file is named; every term keeps the
source's name, its integer or float operations and their order, so each float is the one
Megatron computes.

Who prints it, when, and in what units (``megatron/training/training.py`` at the pin):

- ``training_log`` calls ``report_theoretical_memory(args, num_microbatches=
  get_num_microbatches(), verbose=True)`` (training.py line 3683) only on global rank 0
  (``if torch.distributed.get_rank() == 0``, line 3681), inside ``if iteration %
  args.log_interval == 0 or is_first_iteration`` (line 3539) while ``report_memory_flag`` holds
  (set in ``train``, line 4396; cleared at line 3692 after a print at ``iteration >
  loaded_iteration + 1``): at the first logged iteration, and again at each logged one up to
  the first past the second (from scratch with ``--log-interval 1``: iterations 1 and 2). No flag
  turns it on or off (not ``--log-memory-to-tensorboard``, not ``--log-memory-interval``).
  The figures repeat at every print: only ``num_microbatches`` could change between them
  (under ``--step-batch-size-schedule``).
- It prints ``Theoretical memory footprints: weight and optimizer=X MB, activation=Y MB,
  total=Z MB`` (line 481, ``:.2f``), each figure bytes / ``NUM_BYTES_IN_MEGABYTE`` =
  1024 * 1024 (line 9): its "MB" is 2**20 bytes (a MiB). ``TheoreticalMemory.report_line``
  writes that line.
- Which rank it describes: its weight term is the "most loaded model shard" (comment at line
  247): 1 / PP of the decoder layers, the whole MTP block and the input embedding, plus the
  untied output layer at PP 1 only (lines 265-267); its activation term is "for the first
  pipeline stage" (lines 310-311). At PP > 1 with MTP no rank holds both the embedding (first
  stage) and the MTP block (last stage). Megatron's functional tests record the peak of the
  last rank (world_size - 1), not of rank 0, which prints this.
- Hybrid Mamba-Transformer models (``is_hybrid_model``: ``args.hybrid_layer_pattern is not
  None``, megatron/training/utils/common_utils.py line 502) get no figures (lines 457-459):
  ``TheoreticalMemory`` then holds ``None`` for every term.

Which activation function: ``compute_activation_memory`` (Korthikanti et al. 2022 Table 2,
SP + selective recompute) only when ``args.sequence_parallel and args.recompute_granularity
== 'selective'`` (line 466); every other job, full recompute and no recompute included, gets
``compute_activation_memory_without_sp`` (line 473): s b h (10 + 24 / TP) per layer and a 5 %
overhead factor (line 450).

What the formula leaves out (so what its error on a measured run is made of):

- Weights: assumes bf16 parameters, fp32 main gradients, fp32 master weights and two Adam
  states (lines 294-296), whatever ``--fp16``, ``--optimizer``, ``--main-grads-dtype``,
  ``--use-precision-aware-optimizer``, FP8 or Megatron-FSDP say; the distributed optimizer's
  12 B are divided by DP alone, while Megatron shards them over DP x CP (``intra_dp_cp_group``,
  megatron/core/optimizer/__init__.py line 934); at PP > 1 neither the last stage's copy of
  tied word embeddings nor an untied output layer is counted; uneven pipelines
  (``--decoder-first/last-pipeline-num-layers``, layouts) still divide the layers by PP; no
  parameter-gather or gradient buckets beyond the 4 B main gradient, no buffer padding.
- Activations: CP and EP are ignored (the sequence is not divided by CP); MoE layers, MLA,
  GQA, SwiGLU and MTP get the dense GPT term with ``ffn_hidden_size`` (the source's own
  ``TODO``, lines 313-314, names the query projection); no attention-score term
  (5 a s / h), no full-recompute case; no loss or logits buffers beyond 4 s b h (1 + V / h)
  at PP 1 (without SP: 2 s b (V / TP + h)), and at PP > 1 no output layer at all; the
  in-flight factor is its own: PP microbatches on the first stage (``num_layers`` layers'
  worth), times 1 + (PP - 1) / (PP VPP) under interleaving, or min(1, M / PP) without.
- Below the dispatcher: no cuBLAS / Transformer Engine workspaces, NCCL buffers, allocator
  rounding or fragmentation, CUDA context.

``weight_and_optimizer_bytes_per_param`` (lines 293-296) is also used alone by
``tracemem crosscheck``.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass

from tracemem.errors import TracememError

__all__ = ["PIN", "NUM_BYTES_IN_MEGABYTE", "weight_and_optimizer_bytes_per_param",
           "DerivedArgs", "WeightAndOptimizerTerms", "ActivationTerms", "TheoreticalMemory",
           "derive_args", "compute_weight_and_optimizer_memory", "compute_activation_memory",
           "compute_activation_memory_without_sp", "theoretical_memory_usage",
           "formula_bytes_for_job"]

PIN = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"  # NVIDIA/Megatron-LM, the file reimplemented
NUM_BYTES_IN_MEGABYTE = 1024 * 1024  # line 9: Megatron's "MB" is 2**20 bytes

_SOURCE = f"megatron/training/theoretical_memory_usage.py at {PIN[:7]}"
_VALIDATE = f"megatron/training/arguments.py validate_args at {PIN[:7]}"


def weight_and_optimizer_bytes_per_param(dp: int, distributed_optimizer: bool) -> float:
    """``num_bytes_per_parameter`` (lines 293-296): 18 B per parameter (bf16 weight 2 + fp32
    main grad 4 + fp32 master weight and Adam m, v 12); with the distributed optimizer the 12
    optimizer bytes are sharded over DP: 6 + 12 / DP. (The source returns the int 18; 18.0
    here multiplies to the same float.)"""
    return 6 + 12 / dp if distributed_optimizer else 18.0


# ---------------------------------------------------------------------------------------------
# What validate_args (and the tokenizer, the microbatch calculator) would have set
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class DerivedArgs:
    """The arguments the formula reads that Megatron sets after parsing, as it would set them.
    Each field cites the line that sets it (``arguments.py`` is ``validate_args``'s file)."""

    world_size: int
    """GPUs; Megatron reads WORLD_SIZE (arguments.py line 145), here an explicit argument."""
    gtp_weight_remat_size: int
    """--tensor-parallel-num-weight-shards / TP, else 1 (arguments.py lines 417-423,
    ``resolve_tensor_parallel_weight_shards`` in megatron/core/model_parallel_config.py
    lines 10-42)."""
    data_parallel_size: int
    """world / (TP x PP x CP x gtp_weight_remat_size) (arguments.py lines 441-448, after the
    divisibility assert at lines 431-434)."""
    expert_tensor_parallel_size: int
    """--expert-tensor-parallel-size, default TP (arguments.py lines 587-588)."""
    recompute_granularity: str | None
    """'selective' when --recompute-activations (arguments.py lines 607-608)."""
    sequence_parallel: bool
    """False at TP 1 (arguments.py lines 1431-1439)."""
    hybrid_layer_pattern: str | None
    """--hybrid-override-pattern is copied here (arguments.py lines 745-755), and the legacy
    --mtp-hybrid-override-pattern makes one (lines 775-785); not None means hybrid."""
    virtual_pipeline_model_parallel_size: int | None
    """From --pipeline-model-parallel-layout (stages / PP), --num-layers-per-virtual-pipeline-
    stage ((layers + embedding / loss stages) / PP / that) or --num-virtual-stages-per-
    pipeline-rank; 1 becomes None (arguments.py lines 928-983)."""
    num_layers: int
    """--num-layers, else --encoder-num-layers (arguments.py lines 1305-1312)."""
    ffn_hidden_size: int
    """4 h, or with --swiglu int((4 h 2 / 3) / 64) * 64 (arguments.py lines 1320-1329)."""
    kv_channels: int
    """h // heads (arguments.py lines 1331-1333)."""
    num_experts: int | None
    """0 becomes None (arguments.py lines 1648-1649)."""
    moe_ffn_hidden_size: int | None
    """ffn_hidden_size for an MoE model without one (arguments.py lines 1650-1651)."""
    padded_vocab_size: int
    """--padded-vocab-size as given, else the vocabulary rounded up to a multiple of
    --make-vocab-size-divisible-by x TP (megatron/core/tokenizers/utils/build_tokenizer.py
    ``vocab_size_with_padding`` lines 133-145, set by ``_set_padded_vocab_size`` lines
    148-152 when ``pad_vocab_size``)."""
    num_microbatches: int | None
    """``get_num_microbatches()`` as ``training_log`` passes it (training.py line 3682): the
    constant calculator's global batch // (micro batch x DP x gtp_weight_remat_size)
    (megatron/core/num_microbatches_calculator.py ``ConstantNumMicroBatchesCalculator``
    lines 357-391, with DP x gtp from megatron/training/global_vars.py lines 148-156; the
    global batch defaults to micro batch x DP, arguments.py lines 702-703); rounded down to a
    multiple with --decrease-batch-size-if-needed (``_round``, lines 299-301)."""


def _unrolled_stage_count(layout: str) -> int:
    """``PipelineParallelLayerLayout.get_num_stages_from_str`` (megatron/core/transformer/
    pipeline_parallel_layer_layout.py lines 277-308): cosmetic commas dropped, ``(...)*n``
    and ``x*n`` unrolled, stages split on ``|``."""
    text = layout.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        text = re.sub(pattern, lambda m: m.group(1) * int(m.group(2)), text)
    return len(text.split("|"))


def _vpp(args, pp: int, num_layers: int) -> int | None:
    """arguments.py lines 928-983 (``virtual_pipeline_model_parallel_size``)."""
    given = [args.num_layers_per_virtual_pipeline_stage is not None,
             args.num_virtual_stages_per_pipeline_rank is not None,
             args.pipeline_model_parallel_layout is not None]
    if sum(given) > 1:
        raise TracememError(
            "Megatron-LM refuses this job: No more than one of the following arguments can be "
            "set at the same time: --num-layers-per-virtual-pipeline-stage, "
            f"--num-virtual-stages-per-pipeline-rank, --pipeline-model-parallel-layout "
            f"({_VALIDATE})")
    if args.pipeline_model_parallel_layout is not None:  # lines 943-952
        stages = _unrolled_stage_count(args.pipeline_model_parallel_layout)
        if stages % pp:
            raise TracememError(
                f"--pipeline-model-parallel-layout has {stages} stages, not a multiple of "
                f"--pipeline-model-parallel-size {pp} ({_VALIDATE})")
        vpp = stages // pp
    elif args.num_virtual_stages_per_pipeline_rank is not None:  # line 977
        vpp = args.num_virtual_stages_per_pipeline_rank
    elif args.num_layers_per_virtual_pipeline_stage is not None:  # lines 954-975
        layers = (num_layers + int(args.account_for_embedding_in_pipeline_split)
                  + int(args.account_for_loss_in_pipeline_split))
        per_stage = layers // pp
        if layers % pp or per_stage % args.num_layers_per_virtual_pipeline_stage:
            raise TracememError(
                f"--num-layers-per-virtual-pipeline-stage "
                f"{args.num_layers_per_virtual_pipeline_stage} must divide the {layers} layers "
                f"/ --pipeline-model-parallel-size {pp} ({_VALIDATE})")
        vpp = per_stage // args.num_layers_per_virtual_pipeline_stage
    else:  # lines 980-983: a GPT model has no VPP of its own
        return None
    return None if vpp == 1 else vpp  # lines 951-952, 978-979


def _padded_vocab(args, tp: int, vocab_size: int | None) -> int:
    if args.padded_vocab_size is not None:  # _set_padded_vocab_size: only if None (line 151)
        return args.padded_vocab_size
    vocab = vocab_size if vocab_size is not None else args.vocab_size
    if vocab is None:
        raise TracememError(
            "the formula reads padded_vocab_size, which Megatron takes from the tokenizer: give "
            "--vocab-size (or --padded-vocab-size) in the arguments, or vocab_size (the "
            "tokenizer's vocabulary before padding)")
    if not args.pad_vocab_size:
        raise TracememError(
            "pad_vocab_size is False without --padded-vocab-size: Megatron leaves "
            "padded_vocab_size unset (build_tokenizer.py lines 113-114), which the formula "
            "reads; give --padded-vocab-size")
    multiple = args.make_vocab_size_divisible_by * tp  # build_tokenizer.py line 138
    return int(math.ceil(vocab / multiple) * multiple)  # line 139


def _num_microbatches(args, dp_times_gtp: int, dp: int) -> int:
    if args.micro_batch_size is None:
        raise TracememError("the formula reads --micro-batch-size; give it")
    if args.step_batch_size_schedule is not None:
        raise TracememError(
            "--step-batch-size-schedule changes the number of microbatches during training; "
            "pass num_microbatches (the count at the logged iteration)")
    gbs = args.global_batch_size
    if gbs is None:
        gbs = args.micro_batch_size * dp  # arguments.py lines 702-703
    unit = args.micro_batch_size * dp_times_gtp  # num_microbatches_calculator.py line 367
    if args.decrease_batch_size_if_needed:
        gbs = (gbs // unit) * unit  # _round, lines 299-301
    elif gbs % unit:
        raise TracememError(
            f"Megatron-LM refuses this job: global batch size ({gbs}) is not divisible by "
            f"micro batch size ({args.micro_batch_size}) times data parallel size "
            f"({dp_times_gtp}) (megatron/core/num_microbatches_calculator.py)")
    if gbs // unit < 1:
        raise TracememError(f"--global-batch-size {gbs} gives no microbatch of "
                            f"{args.micro_batch_size} x DP {dp_times_gtp}")
    return gbs // unit


def derive_args(args: argparse.Namespace, world_size: int, *, vocab_size: int | None = None,
                num_microbatches: int | None = None) -> DerivedArgs:
    """What ``validate_args``, the tokenizer and the microbatch calculator would set from
    ``args`` (parsed, not validated: ``parse_megatron_args``), on ``world_size`` GPUs.
    ``vocab_size``: the tokenizer's vocabulary before padding where the arguments name a
    tokenizer file; ``num_microbatches``: overrides the constant calculator.

    Raises:
        TracememError: a value Megatron refuses, or one the formula needs and cannot get.
    """
    if args.num_layers is None and args.encoder_num_layers is None:
        raise TracememError("Megatron-LM requires --num-layers (validate_args); give it")
    for flag, dest in (("--hidden-size", "hidden_size"),
                       ("--num-attention-heads", "num_attention_heads")):
        if getattr(args, dest) is None:
            raise TracememError(f"Megatron-LM requires {flag} (validate_args); give it")
    if world_size is None or world_size < 1:
        raise TracememError(f"world_size {world_size} must be a positive number of GPUs")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    cp = args.context_parallel_size
    shards = args.tensor_parallel_num_weight_shards
    if shards is not None and (shards < tp or shards % tp):
        raise TracememError(f"--tensor-parallel-num-weight-shards {shards} must be a multiple "
                            f"of --tensor-model-parallel-size {tp}")
    gtp = 1 if shards is None else shards // tp
    model = tp * pp * cp * gtp
    if world_size % model:
        raise TracememError(
            f"Megatron-LM refuses this job: world size ({world_size}) is not divisible by "
            f"tp({tp}) * pp({pp}) * cp({cp}) * gtp({gtp}) = {model} ({_VALIDATE})")
    dp = world_size // model
    num_layers = args.num_layers if args.num_layers is not None else args.encoder_num_layers
    h, heads = args.hidden_size, args.num_attention_heads
    ffn = args.ffn_hidden_size
    if ffn is None:
        ffn = int((4 * h * 2 / 3) / 64) * 64 if args.swiglu else 4 * h
    kv_channels = args.kv_channels
    if kv_channels is None:
        if h % heads:
            raise TracememError(f"--hidden-size {h} must divide by --num-attention-heads "
                                f"{heads} without --kv-channels ({_VALIDATE})")
        kv_channels = h // heads
    experts = args.num_experts or None
    moe_ffn = args.moe_ffn_hidden_size
    if experts is not None and moe_ffn is None:
        moe_ffn = ffn
    hybrid = args.hybrid_layer_pattern
    if hybrid is None and args.hybrid_override_pattern is not None:
        hybrid = args.hybrid_override_pattern
    if (hybrid is None and args.mtp_hybrid_override_pattern is not None
            and args.mtp_num_layers is not None and args.mtp_num_layers > 0):
        # arguments.py lines 781-783, with Symbols.MTP_SEPARATOR "/" (megatron/core/models/
        # hybrid/hybrid_layer_allocation.py line 25)
        hybrid = "/" + "/".join([args.mtp_hybrid_override_pattern] * args.mtp_num_layers)
    if num_microbatches is None:
        num_microbatches = _num_microbatches(args, dp * gtp, dp)
    return DerivedArgs(
        world_size=world_size, gtp_weight_remat_size=gtp, data_parallel_size=dp,
        expert_tensor_parallel_size=(args.expert_tensor_parallel_size
                                     if args.expert_tensor_parallel_size is not None else tp),
        recompute_granularity=("selective" if args.recompute_activations
                               else args.recompute_granularity),
        sequence_parallel=bool(args.sequence_parallel) and tp > 1,
        hybrid_layer_pattern=hybrid,
        virtual_pipeline_model_parallel_size=_vpp(args, pp, num_layers),
        num_layers=num_layers, ffn_hidden_size=ffn, kv_channels=kv_channels,
        num_experts=experts, moe_ffn_hidden_size=moe_ffn,
        padded_vocab_size=_padded_vocab(args, tp, vocab_size),
        num_microbatches=num_microbatches)


def _validated(args: argparse.Namespace, derived: DerivedArgs) -> argparse.Namespace:
    """A copy of ``args`` with ``derived`` set, as Megatron's ``args`` reads after
    ``validate_args`` (the input is never changed)."""
    out = argparse.Namespace(**vars(args))
    for name in DerivedArgs.__dataclass_fields__:
        if name != "num_microbatches":
            setattr(out, name, getattr(derived, name))
    return out


# ---------------------------------------------------------------------------------------------
# compute_weight_and_optimizer_memory (lines 12-305)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class WeightAndOptimizerTerms:
    """Every term ``compute_weight_and_optimizer_memory`` computes, under its name, with the
    source's type: parameter counts are floats where the source divides (``/``) or multiplies
    by 3 / 2, ints otherwise. The comment of each field is the line it mirrors."""

    query_projection_size: int                       # line 14: kv_channels * heads
    query_projection_to_hidden_size_ratio: float     # line 15
    num_query_groups: int                            # lines 17-18: heads unless GQA
    num_experts: int                                 # line 20: 1 for a dense model
    gated_linear_multiplier: float                   # line 21: 3 / 2 with SwiGLU, else 1
    shared_expert_ffn_hidden_size: int               # lines 23-27
    moe_layer_pattern: tuple[int, ...]               # lines 29-46
    num_dense_layers: int                            # lines 42, 47
    num_moe_layers: int                              # lines 43, 48
    moe_ffn_hidden_size: int                         # lines 44, 49
    mtp_num_moe_layers: int                          # lines 51-57: MTP copies the last layer
    mtp_num_dense_layers: int                        # lines 51-57
    norm_size: int                                   # line 60: 1 RMSNorm, 2 LayerNorm
    self_attn_term: float                            # lines 62-93 (MLA: 62-80)
    embedding_size: int                              # line 95: h * padded vocab
    final_layernorm: int                             # line 96
    num_parameters_in_embedding_layers: int          # lines 97-100: x 2 if untied
    attention_params: float                          # line 102
    dense_mlp_params: float                          # line 103
    shared_expert_params: float                      # line 104
    routed_expert_hidden_size: int                   # lines 107-109
    routed_expert_params: float                      # lines 110-112: all experts of a layer
    active_routed_expert_params: float               # lines 113-121: top-k of them
    latent_projection_params: int                    # lines 122-126
    layernorm_params: int                            # line 127: two norms per layer
    router_params: int                               # lines 128-132
    shared_expert_gate_params: int                   # lines 133-137
    num_parameters_in_transformer_layer_dense: float       # lines 139-141
    num_parameters_in_transformer_layer_moe: float         # lines 142-150
    num_active_parameters_in_transformer_layer_moe: float  # lines 151-159
    num_parameters_in_transformer_block: float             # lines 160-164
    num_active_parameters_in_transformer_block: float      # lines 165-169
    num_parameters_in_mtp_block: float                     # lines 170-173
    num_total_parameters: float                            # lines 174-178
    num_active_parameters: float                           # lines 179-183
    expert_data_parallel_size: int                   # lines 205-212: world // (ETP EP PP)
    tp_sharded_params_in_transformer_block: float          # lines 215-218
    replicated_params_in_transformer_block: float          # lines 219-229
    expert_sharded_params_in_transformer_block: float      # line 230
    tp_sharded_params_in_mtp_block: float                  # lines 231-234
    replicated_params_in_mtp_block: float                  # lines 235-244
    expert_sharded_params_in_mtp_block: float              # line 245
    tp_sharded_params_on_most_loaded_shard: float          # lines 248-252, + line 266
    replicated_params_on_most_loaded_shard: float          # lines 253-255
    expert_sharded_params_on_most_loaded_shard: float      # lines 256-259
    num_parameters_on_most_loaded_model_shard: float       # lines 260-264, + line 267
    num_parameters_on_other_model_shards: float | None     # lines 274-286; None at PP 1
    bytes_per_parameter: float                       # line 300: num_bytes_per_parameter(DP)
    expert_bytes_per_parameter: float                # line 302: num_bytes_per_parameter(EDP)
    weight_and_optimizer_memory: float               # lines 298-303: bytes, the return value


def compute_weight_and_optimizer_memory(args: argparse.Namespace) -> WeightAndOptimizerTerms:
    """Lines 12-305 on a validated ``args`` (``_validated``), without line 18's side effect
    (the source writes ``args.num_query_groups``; here it is a local)."""
    h = args.hidden_size
    query_projection_size = args.kv_channels * args.num_attention_heads  # line 14
    query_projection_to_hidden_size_ratio = query_projection_size / h  # line 15
    num_query_groups = (args.num_query_groups if args.group_query_attention
                        else args.num_attention_heads)  # lines 17-18
    num_experts = 1 if args.num_experts is None else args.num_experts  # line 20
    gated_linear_multiplier = 3 / 2 if args.swiglu else 1  # line 21
    shared_expert_ffn_hidden_size = (0 if args.moe_shared_expert_intermediate_size is None
                                     else args.moe_shared_expert_intermediate_size)  # 23-27

    if args.num_experts is not None:  # lines 29-44
        if isinstance(args.moe_layer_freq, int):
            moe_layer_pattern = [1 if (i % args.moe_layer_freq == 0) else 0
                                 for i in range(args.num_layers)]
        elif isinstance(args.moe_layer_freq, list):
            moe_layer_pattern = list(args.moe_layer_freq)
            if len(moe_layer_pattern) != args.num_layers:  # the assert at lines 36-40
                raise TracememError(
                    f"Invalid length of moe_layer_pattern: {len(moe_layer_pattern)}, expected "
                    f"{args.num_layers}, current moe layer pattern: {args.moe_layer_freq} "
                    f"({_SOURCE} line 36)")
        else:
            raise TracememError(f"--moe-layer-freq {args.moe_layer_freq!r} is neither an int "
                                f"nor a list ({_SOURCE} lines 30-35)")
        num_dense_layers = args.num_layers - sum(moe_layer_pattern)
        num_moe_layers = sum(moe_layer_pattern)
        moe_ffn_hidden_size = args.moe_ffn_hidden_size
    else:  # lines 45-49
        moe_layer_pattern = [0] * args.num_layers
        num_dense_layers = args.num_layers
        num_moe_layers = 0
        moe_ffn_hidden_size = 0
    if args.mtp_num_layers is not None:  # lines 51-54
        mtp_layer_is_moe = moe_layer_pattern[-1]
        mtp_num_moe_layers = mtp_layer_is_moe * args.mtp_num_layers
        mtp_num_dense_layers = (1 - mtp_layer_is_moe) * args.mtp_num_layers
    else:  # lines 55-57
        mtp_num_moe_layers = 0
        mtp_num_dense_layers = 0

    norm_size = 1 if args.normalization == "RMSNorm" else 2  # line 60

    heads = args.num_attention_heads
    if args.multi_latent_attention:  # lines 62-80
        if args.group_query_attention:  # the assert at line 63
            raise TracememError("--multi-latent-attention with --group-query-attention: "
                                "Group query attention is mutually exclusive with multi latent "
                                f"attention ({_VALIDATE} line 1974)")
        if args.q_lora_rank is None:  # line 65
            q_term = h * heads * (args.qk_head_dim + args.qk_pos_emb_head_dim)
        else:  # line 68: q down projection, up projection with RoPE, q norm
            q_term = args.q_lora_rank * (
                h + heads * (args.qk_head_dim + args.qk_pos_emb_head_dim) + norm_size)
        self_attn_term = (
            q_term
            + args.kv_lora_rank * (h + heads * (args.qk_head_dim + args.v_head_dim)
                                   + norm_size)  # lines 74-75: kv lora + kv norm
            + h * args.qk_pos_emb_head_dim  # line 76: the shared RoPE key
            + (heads * args.v_head_dim) * h  # line 79: output projection
        )
    else:  # lines 82-93
        self_attn_term = (2 * h * h * (((1 + (num_query_groups / heads))
                                        * query_projection_to_hidden_size_ratio)))

    embedding_size = h * args.padded_vocab_size  # line 95
    final_layernorm = norm_size * h  # line 96
    if args.untie_embeddings_and_output_weights:  # lines 97-100
        num_parameters_in_embedding_layers = 2 * embedding_size
    else:
        num_parameters_in_embedding_layers = embedding_size

    attention_params = self_attn_term  # line 102
    dense_mlp_params = 2 * h * args.ffn_hidden_size * gated_linear_multiplier  # line 103
    shared_expert_params = (2 * h * shared_expert_ffn_hidden_size
                            * gated_linear_multiplier)  # line 104
    routed_expert_hidden_size = (args.moe_latent_size if args.moe_latent_size is not None
                                 else h)  # lines 107-109
    routed_expert_params = (2 * routed_expert_hidden_size * moe_ffn_hidden_size * num_experts
                            * gated_linear_multiplier)  # lines 110-112
    active_routed_expert_params = (
        2 * routed_expert_hidden_size * moe_ffn_hidden_size * args.moe_router_topk
        * gated_linear_multiplier if args.num_experts is not None else 0)  # lines 113-121
    latent_projection_params = (
        2 * h * args.moe_latent_size
        if args.num_experts is not None and args.moe_latent_size is not None
        else 0)  # lines 122-126
    layernorm_params = 2 * h * norm_size  # line 127
    router_params = ((h * num_experts) + (num_experts if args.add_bias_linear else 0)
                     if args.num_experts is not None else 0)  # lines 128-132
    shared_expert_gate_params = (
        h if shared_expert_ffn_hidden_size > 0
        and getattr(args, "moe_shared_expert_gate", False) else 0)  # lines 133-137

    num_parameters_in_transformer_layer_dense = (
        attention_params + dense_mlp_params + layernorm_params)  # lines 139-141
    num_parameters_in_transformer_layer_moe = (
        attention_params + shared_expert_params + routed_expert_params
        + latent_projection_params + layernorm_params + router_params
        + shared_expert_gate_params)  # lines 142-150
    num_active_parameters_in_transformer_layer_moe = (
        attention_params + shared_expert_params + active_routed_expert_params
        + latent_projection_params + layernorm_params + router_params
        + shared_expert_gate_params)  # lines 151-159
    num_parameters_in_transformer_block = (
        num_parameters_in_transformer_layer_dense * num_dense_layers
        + num_parameters_in_transformer_layer_moe * num_moe_layers
        + final_layernorm)  # lines 160-164
    num_active_parameters_in_transformer_block = (
        num_parameters_in_transformer_layer_dense * num_dense_layers
        + num_active_parameters_in_transformer_layer_moe * num_moe_layers
        + final_layernorm)  # lines 165-169
    num_parameters_in_mtp_block = (
        num_parameters_in_transformer_layer_dense * mtp_num_dense_layers
        + num_parameters_in_transformer_layer_moe * mtp_num_moe_layers)  # lines 170-173
    num_total_parameters = (num_parameters_in_transformer_block + num_parameters_in_mtp_block
                            + num_parameters_in_embedding_layers)  # lines 174-178
    num_active_parameters = (num_active_parameters_in_transformer_block
                             + num_parameters_in_mtp_block
                             + num_parameters_in_embedding_layers)  # lines 179-183

    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    etp, ep = args.expert_tensor_parallel_size, args.expert_model_parallel_size  # 205-206
    expert_tensor_model_pipeline_parallel_size = etp * ep * pp  # lines 207-211
    expert_data_parallel_size = (args.world_size
                                 // expert_tensor_model_pipeline_parallel_size)  # line 212

    tp_sharded_params_in_transformer_block = (
        (attention_params + dense_mlp_params) * num_dense_layers
        + (attention_params + shared_expert_params) * num_moe_layers)  # lines 215-218
    replicated_params_in_transformer_block = (
        layernorm_params * num_dense_layers
        + (layernorm_params + latent_projection_params + router_params
           + shared_expert_gate_params) * num_moe_layers
        + final_layernorm)  # lines 219-229
    expert_sharded_params_in_transformer_block = routed_expert_params * num_moe_layers  # 230
    tp_sharded_params_in_mtp_block = (
        (attention_params + dense_mlp_params) * mtp_num_dense_layers
        + (attention_params + shared_expert_params) * mtp_num_moe_layers)  # lines 231-234
    replicated_params_in_mtp_block = (
        layernorm_params * mtp_num_dense_layers
        + (layernorm_params + latent_projection_params + router_params
           + shared_expert_gate_params) * mtp_num_moe_layers)  # lines 235-244
    expert_sharded_params_in_mtp_block = routed_expert_params * mtp_num_moe_layers  # line 245

    tp_sharded_params_on_most_loaded_shard = (
        (tp_sharded_params_in_transformer_block / pp) + tp_sharded_params_in_mtp_block
        + embedding_size) / tp  # lines 248-252
    replicated_params_on_most_loaded_shard = (
        replicated_params_in_transformer_block / pp) + replicated_params_in_mtp_block  # 253-255
    expert_sharded_params_on_most_loaded_shard = (
        (expert_sharded_params_in_transformer_block / pp) + expert_sharded_params_in_mtp_block
    ) / (etp * ep)  # lines 256-259
    num_parameters_on_most_loaded_model_shard = (
        tp_sharded_params_on_most_loaded_shard + replicated_params_on_most_loaded_shard
        + expert_sharded_params_on_most_loaded_shard)  # lines 260-264
    if args.untie_embeddings_and_output_weights and pp == 1:  # lines 265-267
        tp_sharded_params_on_most_loaded_shard += embedding_size / tp
        num_parameters_on_most_loaded_model_shard += embedding_size / tp

    num_parameters_on_other_model_shards = None
    if pp > 1:  # lines 274-286
        num_parameters_on_other_model_shards = (
            tp_sharded_params_in_transformer_block / (pp * tp)
            + replicated_params_in_transformer_block / pp
            + expert_sharded_params_in_transformer_block / (pp * etp * ep))

    bytes_per_parameter = weight_and_optimizer_bytes_per_param(
        args.data_parallel_size, args.use_distributed_optimizer)  # line 300
    expert_bytes_per_parameter = weight_and_optimizer_bytes_per_param(
        expert_data_parallel_size, args.use_distributed_optimizer)  # line 302
    weight_and_optimizer_memory = (
        (tp_sharded_params_on_most_loaded_shard + replicated_params_on_most_loaded_shard)
        * bytes_per_parameter
        + expert_sharded_params_on_most_loaded_shard * expert_bytes_per_parameter)  # 298-303

    return WeightAndOptimizerTerms(
        query_projection_size=query_projection_size,
        query_projection_to_hidden_size_ratio=query_projection_to_hidden_size_ratio,
        num_query_groups=num_query_groups, num_experts=num_experts,
        gated_linear_multiplier=gated_linear_multiplier,
        shared_expert_ffn_hidden_size=shared_expert_ffn_hidden_size,
        moe_layer_pattern=tuple(moe_layer_pattern), num_dense_layers=num_dense_layers,
        num_moe_layers=num_moe_layers, moe_ffn_hidden_size=moe_ffn_hidden_size,
        mtp_num_moe_layers=mtp_num_moe_layers, mtp_num_dense_layers=mtp_num_dense_layers,
        norm_size=norm_size, self_attn_term=self_attn_term, embedding_size=embedding_size,
        final_layernorm=final_layernorm,
        num_parameters_in_embedding_layers=num_parameters_in_embedding_layers,
        attention_params=attention_params, dense_mlp_params=dense_mlp_params,
        shared_expert_params=shared_expert_params,
        routed_expert_hidden_size=routed_expert_hidden_size,
        routed_expert_params=routed_expert_params,
        active_routed_expert_params=active_routed_expert_params,
        latent_projection_params=latent_projection_params, layernorm_params=layernorm_params,
        router_params=router_params, shared_expert_gate_params=shared_expert_gate_params,
        num_parameters_in_transformer_layer_dense=num_parameters_in_transformer_layer_dense,
        num_parameters_in_transformer_layer_moe=num_parameters_in_transformer_layer_moe,
        num_active_parameters_in_transformer_layer_moe=(
            num_active_parameters_in_transformer_layer_moe),
        num_parameters_in_transformer_block=num_parameters_in_transformer_block,
        num_active_parameters_in_transformer_block=num_active_parameters_in_transformer_block,
        num_parameters_in_mtp_block=num_parameters_in_mtp_block,
        num_total_parameters=num_total_parameters, num_active_parameters=num_active_parameters,
        expert_data_parallel_size=expert_data_parallel_size,
        tp_sharded_params_in_transformer_block=tp_sharded_params_in_transformer_block,
        replicated_params_in_transformer_block=replicated_params_in_transformer_block,
        expert_sharded_params_in_transformer_block=expert_sharded_params_in_transformer_block,
        tp_sharded_params_in_mtp_block=tp_sharded_params_in_mtp_block,
        replicated_params_in_mtp_block=replicated_params_in_mtp_block,
        expert_sharded_params_in_mtp_block=expert_sharded_params_in_mtp_block,
        tp_sharded_params_on_most_loaded_shard=tp_sharded_params_on_most_loaded_shard,
        replicated_params_on_most_loaded_shard=replicated_params_on_most_loaded_shard,
        expert_sharded_params_on_most_loaded_shard=expert_sharded_params_on_most_loaded_shard,
        num_parameters_on_most_loaded_model_shard=num_parameters_on_most_loaded_model_shard,
        num_parameters_on_other_model_shards=num_parameters_on_other_model_shards,
        bytes_per_parameter=bytes_per_parameter,
        expert_bytes_per_parameter=expert_bytes_per_parameter,
        weight_and_optimizer_memory=weight_and_optimizer_memory)


# ---------------------------------------------------------------------------------------------
# compute_activation_memory (lines 308-379) and compute_activation_memory_without_sp (382-453)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class ActivationTerms:
    """The terms of the activation function ``report_theoretical_memory`` chose (line 466),
    in bytes as the source computes them (floats where it divides). ``activation_memory`` is
    the running total in the source's order, so it is the source's float, not the sum of the
    fields written out in another order."""

    function: str
    """"compute_activation_memory" (SP + selective recompute, lines 466-471) or
    "compute_activation_memory_without_sp" (every other job, lines 472-477)."""
    per_layer: float
    """One layer on one microbatch before the TP division: s b h (18 + 4 ffn / h) (lines
    317-319, Korthikanti Table 2's SP + selective row with 16 = 4 ffn / h), or
    s b h (10 + 24 / TP), already per rank (line 386)."""
    layers: float
    """``per_layer`` x num_layers, all of them: PP microbatches of L / PP layers on the first
    stage (lines 325, 395)."""
    embedding_input: int
    """8 s b PP: the embedding's input, PP microbatches in flight (lines 330-332, 399-401)."""
    embedding_dropout: int
    """s b h PP: the embedding dropout's mask, PP in flight (lines 334-339, 403-408)."""
    interleaved_schedule_memory_penalty: float | None
    """1 + (PP - 1) / (PP VPP), with VPP only (lines 342-346, 412-416)."""
    in_flight_microbatches: int | None
    """Only printed by the source: ceil(penalty x PP) with VPP (lines 347-349, 417-419),
    min(M, PP) or PP without at PP > 1 (lines 359-364, 428-433); None at PP 1."""
    pipeline_microbatch_discount: float | None
    """min(1, M / PP) without VPP at PP > 1 and M given (lines 360-361, 429-430)."""
    output_layer: float | None
    """At PP 1 only: s b h 4 (1 + V / h), the output layer's input and the cross entropy
    (lines 368-376); without SP (s b V / TP + s b h) x 2 (lines 438-447). None at PP > 1."""
    overhead_factor: float | None
    """1.05, "buffer for optimizer and miscellaneous temporaries" (lines 449-451), without SP
    only."""
    activation_memory: float
    """The return value: the total / TP (line 379), or the total x 1.05 (line 453), bytes."""


def _pipeline_factors(args, num_microbatches):
    """Lines 341-366 (identically 411-435): (penalty, in-flight, discount)."""
    pp, vpp = args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size
    penalty = in_flight = discount = None
    if vpp is not None:
        penalty = 1 + ((pp - 1) / (pp * vpp))
        in_flight = math.ceil(penalty * pp)
    if vpp is None and pp > 1:
        if num_microbatches is not None:
            discount = min(1, num_microbatches / pp)
            in_flight = min(num_microbatches, pp)
        else:
            in_flight = pp
    return penalty, in_flight, discount


def compute_activation_memory(args: argparse.Namespace,
                              num_microbatches: int | None) -> ActivationTerms:
    """Lines 308-379 (SP with selective recompute), on a validated ``args``."""
    s, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    per_layer = (s * b * h) * (18 + (4 * (args.ffn_hidden_size / h)))  # lines 317-319
    activation_memory = per_layer * args.num_layers  # line 325
    embedding_input = 8 * s * b * pp  # lines 330-332
    activation_memory += embedding_input
    embedding_dropout = s * b * h * pp  # lines 334-339
    activation_memory += embedding_dropout
    penalty, in_flight, discount = _pipeline_factors(args, num_microbatches)
    if penalty is not None:  # line 355
        activation_memory *= penalty
    if discount is not None:  # line 361
        activation_memory *= discount
    output_layer = None
    if pp == 1:  # lines 368-376
        output_layer = s * b * h * 4 * (1 + (args.padded_vocab_size / h))
        activation_memory += output_layer
    return ActivationTerms(
        function="compute_activation_memory", per_layer=per_layer,
        layers=per_layer * args.num_layers, embedding_input=embedding_input,
        embedding_dropout=embedding_dropout, interleaved_schedule_memory_penalty=penalty,
        in_flight_microbatches=in_flight, pipeline_microbatch_discount=discount,
        output_layer=output_layer, overhead_factor=None,
        activation_memory=activation_memory / tp)  # line 379


def compute_activation_memory_without_sp(args: argparse.Namespace,
                                         num_microbatches: int | None) -> ActivationTerms:
    """Lines 382-453 (every job but SP with selective recompute), on a validated ``args``."""
    s, b, h = args.seq_length, args.micro_batch_size, args.hidden_size
    pp, tp = args.pipeline_model_parallel_size, args.tensor_model_parallel_size
    per_layer_memory = s * b * h * (10 + (24 / tp))  # line 386
    total_activation_memory = per_layer_memory * args.num_layers  # line 395
    embedding_input = 8 * s * b * pp  # lines 399-401
    total_activation_memory += embedding_input
    embedding_dropout = s * b * h * pp  # lines 403-408
    total_activation_memory += embedding_dropout
    penalty, in_flight, discount = _pipeline_factors(args, num_microbatches)
    if penalty is not None:  # line 425
        total_activation_memory *= penalty
    if discount is not None:  # line 430
        total_activation_memory *= discount
    output_layer = None
    if pp == 1:  # lines 438-447
        logits_size = s * b * args.padded_vocab_size
        logits_size /= tp
        final_ln_output = s * b * h
        output_layer = (logits_size + final_ln_output) * 2
        total_activation_memory += output_layer
    overhead_factor = 1.05  # line 450
    total_activation_memory *= overhead_factor  # line 451
    return ActivationTerms(
        function="compute_activation_memory_without_sp", per_layer=per_layer_memory,
        layers=per_layer_memory * args.num_layers, embedding_input=embedding_input,
        embedding_dropout=embedding_dropout, interleaved_schedule_memory_penalty=penalty,
        in_flight_microbatches=in_flight, pipeline_microbatch_discount=discount,
        output_layer=output_layer, overhead_factor=overhead_factor,
        activation_memory=total_activation_memory)  # line 453


# ---------------------------------------------------------------------------------------------
# report_theoretical_memory (lines 456-486)
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class TheoreticalMemory:
    """What ``report_theoretical_memory`` computes for one job, in bytes.

    The source computes floats; ``*_exact`` keep them, and the ``*_bytes`` ints are those
    floats rounded to the nearest byte (Python's ``round``). ``total_bytes`` is
    ``round(weight + activation)``: the source adds the two MB figures (line 479), and since
    dividing by 2**20 is exact in binary floating point the sum in MB x 2**20 is the sum in
    bytes. Every figure is None for a hybrid model (lines 457-459), the only case the source
    computes nothing; otherwise it computes all of them.
    """

    derived: DerivedArgs
    weights: WeightAndOptimizerTerms | None
    activations: ActivationTerms | None
    weight_and_optimizer_exact: float | None  # line 462 x 2**20
    activation_exact: float | None  # lines 468-477 x 2**20
    total_exact: float | None  # line 479 x 2**20
    weight_and_optimizer_bytes: int | None
    activation_bytes: int | None
    total_bytes: int | None
    skipped: str | None = None
    """Why the source reports nothing (hybrid models), else None."""

    def report_line(self) -> str:
        """The line Megatron prints (line 481-484), or the one it prints instead (line 458)."""
        if self.skipped is not None:
            return ("Theoretical memory footprints not yet supported for hybrid "
                    "Mamba-Transformer models.")
        w = self.weight_and_optimizer_exact / NUM_BYTES_IN_MEGABYTE
        a = self.activation_exact / NUM_BYTES_IN_MEGABYTE
        return (f"Theoretical memory footprints: weight and optimizer={w:.2f} MB, "
                f"activation={a:.2f} MB, total={w + a:.2f} MB")


def theoretical_memory_usage(args: argparse.Namespace, world_size: int, *,
                             vocab_size: int | None = None,
                             num_microbatches: int | None = None) -> TheoreticalMemory:
    """``report_theoretical_memory(args, num_microbatches)`` (lines 456-486) for ``args`` as
    ``parse_megatron_args`` gives them (``derive_args`` sets what ``validate_args`` would) on
    ``world_size`` GPUs. ``args`` is not changed.

    Raises:
        TracememError: as ``derive_args``; a missing --seq-length; an MLA + GQA job.
    """
    derived = derive_args(args, world_size, vocab_size=vocab_size,
                          num_microbatches=num_microbatches)
    if derived.hybrid_layer_pattern is not None:  # lines 457-459
        return TheoreticalMemory(
            derived=derived, weights=None, activations=None, weight_and_optimizer_exact=None,
            activation_exact=None, total_exact=None, weight_and_optimizer_bytes=None,
            activation_bytes=None, total_bytes=None,
            skipped="hybrid Mamba-Transformer model (is_hybrid_model; lines 457-459)")
    if args.seq_length is None:
        raise TracememError("the formula's activations read --seq-length; give it")
    validated = _validated(args, derived)
    weights = compute_weight_and_optimizer_memory(validated)  # line 462
    if validated.sequence_parallel and validated.recompute_granularity == "selective":
        activations = compute_activation_memory(validated, derived.num_microbatches)  # 468
    else:
        activations = compute_activation_memory_without_sp(
            validated, derived.num_microbatches)  # line 474
    w, a = weights.weight_and_optimizer_memory, activations.activation_memory
    return TheoreticalMemory(
        derived=derived, weights=weights, activations=activations,
        weight_and_optimizer_exact=w, activation_exact=a, total_exact=w + a,
        weight_and_optimizer_bytes=round(w), activation_bytes=round(a),
        total_bytes=round(w + a))


def formula_bytes_for_job(argv, world_size: int, vocab_size: int | None = None
                          ) -> TheoreticalMemory:
    """``theoretical_memory_usage`` of Megatron-LM arguments ``argv`` (a list, ``@file``
    allowed) on ``world_size`` GPUs; ``vocab_size``: the tokenizer's vocabulary before
    padding, where the arguments name a tokenizer file."""
    from tracemem.frontdoors.megatron_args import parse_megatron_args

    return theoretical_memory_usage(parse_megatron_args(list(argv)), world_size,
                                    vocab_size=vocab_size)
