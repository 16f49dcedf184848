"""``Job``: one frozen, validated description of a training job, the one thing ``estimate``,
``--what-fits`` and ``fit`` take.

Every front door only translates into it: tracemem's own flags (``tracemem.cli``), Megatron-LM
arguments (``tracemem.frontdoors.megatron``), Python (``Job(model=..., ...)``). The fields are
the job as given, named as tracemem's CLI flags (``schedule``, ``micro_batch_size``, ``tp``,
...); ``__post_init__`` validates them once, where the job is built, and derives the rest
(``config``, ``parallel``, ``num_microbatches`` from the global batch, the schedule's steps,
the parsed sizes, the kernel profile, the routing model). A change is a new job:
``dataclasses.replace(job, recompute="full")`` validates again; nothing passes dictionaries of
keywords around.

Bounds: every size is bounded here, once, before anything is built or multiplied (so a huge
value is a one-line error, not an int64 overflow or a hang): at most ``MAX_WORLD_SIZE`` GPUs,
``MAX_VIRTUAL_STAGES`` pp x vpp, ``MAX_TOKENS`` tokens and ``MAX_MICROBATCHES`` microbatches,
``MAX_ROUNDING`` bytes of rounding, and no activation above ``MAX_TENSOR_BYTES``
(``_check_activation_bytes``); the model's own sizes are its config's
(``modeling.common.config``, ``modeling.registry.check_model_size``). The CLI's layout flags
pass the same ``check_layout_bounds``.

Batch: give ``num_microbatches`` (M, per pipeline per step) or ``global_batch_size`` (G,
sequences per step), or both when they agree. M = G / (b x DP) must be an integer
(Megatron-LM ``megatron/core/num_microbatches_calculator.py``,
``ConstantNumMicroBatchesCalculator``: "global batch size ... is not divisible by micro batch
size times data parallel size"). ``microbatches`` and ``global_batch`` are the derived pair.

Vocabulary: with ``make_vocab_size_divisible_by`` (Megatron's flag; None for a Hugging Face
config, whose vocabulary is already the checkpoint's) the model's vocabulary is padded to a
multiple of that times TP (Megatron-LM d98e8a6 ``megatron/core/tokenizers/utils/
build_tokenizer.py`` ``vocab_size_with_padding``, used by ``megatron/training/vocab_utils.py``:
``multiple = make_vocab_size_divisible_by * tensor_model_parallel_size``, rounded up);
``config`` is the model so padded.
"""

from __future__ import annotations

import decimal
import difflib
import functools
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from tracemem.errors import TracememError

__all__ = ["Job", "parse_bytes", "size_unit", "BINARY_UNITS", "DECIMAL_UNITS", "check_job",
           "NON_PYTORCH_MEMORY_DEFAULT", "MAX_TOKENS", "MAX_MICROBATCHES", "MAX_HBM_BYTES",
           "MAX_EP_CLASSES", "MAX_WORLD_SIZE", "MAX_VIRTUAL_STAGES", "MAX_ROUNDING",
           "MAX_TENSOR_BYTES", "RENAMED", "job_fields", "padded_vocab_size", "check_fields",
           "check_layout_bounds", "check_tensor_bytes", "GPUS", "TORCH_CUBLAS_DEFAULTS"]

# Size units: binary (IEC, 2^10 steps) and decimal (SI, 10^3 steps, as GPU data sheets print
# "80 GB"); a plain number is bytes. Matched without regard to case ("80gib", "80 GB").
BINARY_UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
DECIMAL_UNITS = {"kB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS = {"B": 1, **BINARY_UNITS, **DECIMAL_UNITS}

# --hbm and other device sizes: 4 TiB, more than any accelerator holds (the largest, B300 and
# MI355X, 288 GB)
MAX_HBM_BYTES = 2**42
MAX_TOKENS = 2**32  # tokens per microbatch (b x s): beyond any machine's memory for one layer
# Microbatches per step: the replay simulates every allocation of every microbatch through the
# caching allocator, linear in M: deepseek-tiny on PP 2 takes about 25 ms per microbatch
# (M 1,000: 40 s; M 4,000: 110 s, this 2-core machine), a real model more per microbatch. 2^12
# keeps the worst case to minutes and is above what jobs run (M = G / (b x DP): 1,024 at G 1,024
# sequences on DP 1).
MAX_MICROBATCHES = 2**12
MAX_EP_CLASSES = 8  # default cap on EP-rank classes traced per pipeline stage
MAX_WORLD_SIZE = 2**20  # GPUs: the largest clusters hold about 2^17-2^18
MAX_VIRTUAL_STAGES = 4096  # pp x vpp: more than any model has layers (ModelConfig MAX_LAYERS)
MAX_ROUNDING = 2**30  # --rounding: the caching allocator's block is 512 B; 1 GiB is past any use
# One tensor above this is refused before tracing: no device holds it, and a size near 2^63
# bytes overflows the int64 storage size torch computes (a traceback, not an estimate).
MAX_TENSOR_BYTES = 2**50  # 1 PiB

# Device memory outside PyTorch's caching allocator, added to the reserved peak when judging
# --hbm: the CUDA context. With CUDA's lazy module loading (11.7+) it is about 300 MB
# (pytorch/pytorch#107667, ptrblck, 2023) to 300-400 MB (pytorch/pytorch#20532), rounded up
# here; NCCL communicator buffers are not included (they depend on the job: measure them).
NON_PYTORCH_MEMORY_DEFAULT = "512MiB"

# Keywords of earlier releases -> their names now (the CLI's)
RENAMED = {"schedule_name": "schedule"}


def check_cublas_workspace_config(text: str | None) -> None:
    """``CUBLAS_WORKSPACE_CONFIG`` as cuBLAS documents it: one or more ``:SIZE:COUNT`` (SIZE
    KiB, COUNT buffers), such as ``:4096:8``, at most 1 TiB in all. torch 2.13
    (``CublasHandlePool.cpp`` ``parseChosenWorkspaceSize``) sums the matches and only warns
    on a value with none, taking its default: refused here, so a typo is not a silent default.

    Raises:
        TracememError: any other text, or more than 1 TiB.
    """
    if text is None:
        return
    if not re.fullmatch(r"(:[0-9]{1,12}:[0-9]{1,12})+", text):
        raise TracememError(f"--cublas-workspace-config {_show(text)} is invalid; give "
                            f":SIZE:COUNT (SIZE in KiB), one or more, such as :4096:8 "
                            f"(Megatron-LM's deterministic runs) or :4096:2:16:8")
    total = sum(int(size) * 1024 * int(count)
                for size, count in re.findall(r":([0-9]+):([0-9]+)", text))
    if total > 2**40:
        raise TracememError(f"--cublas-workspace-config {text} is {total:,} B a cuBLAS handle, "
                            f"more than 1 TiB; no GPU holds that")


def parse_bytes(text: str, flag: str = "--hbm", zero: bool = False) -> int:
    """``"80GiB"`` -> 85899345920, ``"80GB"`` -> 80000000000, ``"1024"`` or ``1024`` -> 1024.
    Units: B, KiB, MiB, GiB, TiB (binary: 2^10 steps), kB, MB, GB, TB (decimal: 10^3 steps, as
    GPU data sheets write "80 GB"), or none (bytes); case and a space before the unit do not matter
    (``size_unit`` says which kind a text used). ``zero`` also accepts a size of 0. The number
    is read exactly (as a decimal, not a float), then rounded to the nearest byte
    (``"1.1GiB"``: 1,181,116,006.4 B -> 1181116006).

    Raises:
        TracememError: not a string or an int, not a number (and a unit), below one byte
            (other than 0 with ``zero``), or more than 4 TiB
            (``MAX_HBM_BYTES``: no device holds that); the message names ``flag``.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        text = str(text)  # a byte count, as the CLI takes "80000000000" and JSON prints
    if not isinstance(text, str):
        raise TracememError(f"{flag} {_show(text)} is invalid; give a size as text, such as "
                            f"80GiB, or a byte count (an int)")
    number, unit = _split_size(text)
    written = text.strip()[len(text.strip()) - len(unit):] if unit is not None else ""
    if re.fullmatch(r"[KMGT]b", written):  # 80Gb: gigabits, as network links are written
        raise TracememError(f"{flag} {text!r}: {written} reads as {written[0]}-bits; give "
                            f"{number}{written[0]}B (decimal bytes) or {number}{written[0]}iB "
                            f"(binary)")
    if unit is not None and len(number) <= 40:
        try:
            value = decimal.Decimal(number) * _UNITS[unit]
            if not value.is_finite():
                value = None if value.is_nan() else decimal.Decimal(MAX_HBM_BYTES + 1)
        except (decimal.InvalidOperation, ValueError):
            value = None  # "x", "1_0" (Decimal reads underscores; a size does not)
        if "_" in number:
            value = None
        # a small plain number reads as a size without its unit; a negative one (hbm=-1) is
        # not a size at all, said below
        if value is not None and unit == "B" and 1 <= value < 2**20 \
                and text.strip()[-1:] not in "bB":
            scale = "G" if flag == "--hbm" else "M"  # a device's memory; an overhead
            example = number if value < 10**4 else "80" if flag == "--hbm" else "512"
            raise TracememError(f"{flag} {text!r} is {_big(int(value))} bytes; give a unit, "
                                f"such as {example}{scale}B (decimal) or {example}{scale}iB "
                                f"(binary)")
        if value is not None:
            if value > MAX_HBM_BYTES:
                raise TracememError(f"{flag} {text!r} is more than 4 TiB; no device holds "
                                    f"that")
            value = value.to_integral_value(decimal.ROUND_HALF_EVEN)  # a byte's fraction
            if 1 <= value or (zero and value == 0):
                return int(value)
    example = "80G" if flag == "--hbm" else "512M"  # a device's memory; an overhead
    raise TracememError(f"{flag} {_show(text)} is invalid; give a {'' if zero else 'positive '}"
                        f"size of whole bytes such as {example}iB (binary: KiB, MiB, GiB, TiB), "
                        f"{example}B (decimal: kB, MB, GB, TB) or a byte count of 1 MiB or more"
                        f"{' (or 0)' if zero else ''}")


def _split_size(text: str) -> tuple[str, str | None]:
    """``"80 GB"`` -> ``("80", "GB")``; ``"1024"`` -> ``("1024", "B")``; an unknown unit ->
    ``(text, None)``."""
    stripped = text.strip()
    lower = stripped.lower()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if lower.endswith(unit.lower()):
            return stripped[:-len(unit)].strip(), unit
    if stripped[-1:].isdigit() or stripped.endswith("."):
        return stripped, "B"
    return stripped, None


def size_unit(text: str) -> str:
    """The kind of unit a size text (``parse_bytes``) used: "binary", "decimal" or "bytes"."""
    unit = _split_size(text)[1]
    return "binary" if unit in BINARY_UNITS else "decimal" if unit in DECIMAL_UNITS else \
        "bytes"


def padded_vocab_size(vocab_size: int, divisible_by: int | None, tp: int) -> int:
    """Megatron's padded vocabulary: ``vocab_size`` rounded up to a multiple of
    ``divisible_by * tp`` (``vocab_size_with_padding``, module docstring); unchanged when
    ``divisible_by`` is None."""
    if divisible_by is None:
        return vocab_size
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def _positive(flag: str, value: Any, limit: int | None = None, why: str = "") -> None:
    """Raises: TracememError: ``value`` is not a positive int, or is above ``limit`` (the
    message says ``why``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TracememError(f"{flag} {_show(value)} must be a positive integer")
    if limit is not None and value > limit:
        raise TracememError(f"{flag} {value} is more than {_power(limit)}{why}")


def _show(value: Any) -> str:
    """``repr``, cut short (a huge integer or a long string stays one short line)."""
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else \
        f"2^{value.bit_length() - 1}+"
    return text if len(text) <= 60 else text[:57] + "..."


def _power(n: int) -> str:
    """``2**20`` -> ``"2^20"``; other numbers with thousands separators."""
    return f"2^{n.bit_length() - 1}" if n > 1 and n & (n - 1) == 0 else f"{n:,}"


def check_layout_bounds(world_size: Any, **degrees: Any) -> None:
    """The sizes of a layout bounded where they enter (a ``Job``, the CLI's layout flags), so
    that no later step builds a list of 2^31 stages or multiplies past int64: the world size at
    most ``MAX_WORLD_SIZE``, pp x vpp at most ``MAX_VIRTUAL_STAGES``. Types, degrees and
    divisibility are ``ParallelConfig``'s (each degree divides the world size).

    Raises:
        TracememError: the first size out of bounds, naming the flag.
    """
    _positive("--world-size", world_size, MAX_WORLD_SIZE,
              " GPUs; the largest clusters hold about 2^18")
    vpp, pp = degrees.get("vpp"), degrees.get("pp")
    ints = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (vpp, pp))
    if ints and pp * vpp > MAX_VIRTUAL_STAGES:
        raise TracememError(f"--pp {pp} x --vpp {vpp} = {pp * vpp:,} virtual stages is more "
                            f"than {MAX_VIRTUAL_STAGES:,}; no model has that many layers to "
                            f"place")


def check_tensor_bytes(what: str, nbytes: int) -> None:
    """Raises: TracememError: one tensor of ``nbytes`` (``what`` says which, with its
    factors) is more than ``MAX_TENSOR_BYTES``."""
    if nbytes > MAX_TENSOR_BYTES:
        raise TracememError(f"{what} = {_big(nbytes)} B in one tensor is more than 1 PiB; no "
                            f"device holds it (lower the sizes)")


def _big(n: int) -> str:
    return f"{n:,}" if n.bit_length() < 100 else f"about 2^{n.bit_length() - 1}"


def _check_activation_bytes(config, micro_batch_size: int, seq_length: int,
                            attention: str) -> None:
    """The largest activation of a microbatch bounded before tracing (``check_tensor_bytes``),
    conservatively: b x s tokens before any split, times the widest per-token row (the
    vocabulary's logits, the MLP, the attention projections, the routed experts' rows), at 4
    bytes (fp32); and, for an attention kernel that keeps the s x s scores (all but flash),
    b x heads x s x s x 4. A bound, not an estimate."""
    tokens = micro_batch_size * seq_length
    widths = {"vocab_size": config.vocab_size, "intermediate_size": config.intermediate_size,
              "hidden_size": config.hidden_size,
              "heads x head dim": config.num_attention_heads * (config.qk_head_dim or 1),
              "top-k x hidden_size": config.num_experts_per_tok * config.hidden_size,
              "top-k x moe_intermediate_size": config.num_experts_per_tok * max(
                  config.moe_intermediate_size, config.shared_experts_width)}
    name, width = max(widths.items(), key=lambda kv: kv[1])
    check_tensor_bytes(f"b {micro_batch_size} x s {seq_length} x {name} {width:,} x 4 B",
                       tokens * width * 4)
    if attention != "flash":
        heads = config.num_attention_heads
        check_tensor_bytes(f"--attention {attention} keeps the s x s scores: b "
                           f"{micro_batch_size} x {heads} heads x s {seq_length} x s "
                           f"{seq_length} x 4 B", tokens * heads * seq_length * 4)


def check_job(par, *, micro_batch_size: int, seq_length: int, num_microbatches: int,
              schedule: str, recompute: str, moe: bool = False):
    """The checks of a job beyond its layout (``ParallelConfig.create``), which ``Job`` runs
    and ``tracemem fit`` uses to enumerate valid layouts: b, s and M positive and bounded,
    SP with TP and EP (Megatron-Core's ``ModelParallelConfig``), s divisible by CP x SP, the
    schedule's own rules (``tracemem.schedules.schedule``) and what its W steps do not yet
    trace (ZeRO-3), and for an MoE model (``moe``) Megatron-Core's refusal of TP without SP.
    Returns the schedule's steps per rank.

    Raises:
        TracememError: the first check that fails, naming the flag, the value and a fix.
    """
    from tracemem.schedules import SCHEDULES

    for flag, value in (("--micro-batch-size", micro_batch_size), ("--seq-length", seq_length),
                        ("--num-microbatches", num_microbatches)):
        _positive(flag, value)
    if micro_batch_size * seq_length > MAX_TOKENS:
        raise TracememError(
            f"--micro-batch-size {micro_batch_size} x --seq-length {seq_length} = "
            f"{micro_batch_size * seq_length:,} tokens per microbatch is more than 2^32; no "
            f"machine holds one layer's activations for that")
    if num_microbatches > MAX_MICROBATCHES:
        raise TracememError(f"--num-microbatches {num_microbatches} is more than 2^12 "
                            f"(4,096): the replay simulates every allocation of every "
                            f"microbatch (about 25 ms each on a tiny model), and jobs run "
                            f"fewer per step")
    if par.tp > 1 and par.ep > 1 and not par.sp:
        raise TracememError("--tp > 1 with --ep > 1 needs --sp (Megatron-Core's "
                            "ModelParallelConfig: with expert and tensor parallelism, sequence "
                            "parallelism must be used)")
    if par.tp > 1 and moe and not par.sp:
        raise TracememError("--tp > 1 on an MoE model needs --sp (Megatron-Core d98e8a6 "
                            "megatron/core/transformer/moe/moe_layer.py MoELayer.forward: "
                            "\"During training, performance may degrade if MoE and tensor "
                            "parallelism are enabled without also enabling sequence "
                            "parallelism\", a ValueError)")
    split = par.cp * (par.tp if par.sp else 1)
    if seq_length % split:
        raise TracememError(f"--seq-length {seq_length} must be a multiple of cp * sp = "
                            f"{split} (the sequence is split across them)")
    if not isinstance(schedule, str):
        raise TracememError(f"--schedule {schedule!r} is invalid; choose one of "
                            f"{', '.join(SCHEDULES)}")
    steps_by_rank = _schedule(schedule, par.pp, par.vpp, num_microbatches)
    if any(s.kind == "W" for steps in steps_by_rank for s in steps):
        # recompute with W steps: every checkpoint mechanism's backward splits
        # (tracemem.split_backward: reentrant CheckpointFunction / CheckpointWithoutOutput
        # through kernels.wgrad.inner_backward, torch.utils.checkpoint's holders read in I)
        if par.zero == 3:
            raise TracememError(f"--schedule {schedule} defers weight gradients (W "
                                f"steps), which tracemem does not yet trace with --zero 3 "
                                f"(W would gather the parameters again); use --zero 1 or 2")
    return steps_by_rank


@functools.lru_cache(maxsize=256)
def _schedule(name: str, pp: int, vpp: int, num_microbatches: int):
    """``tracemem.schedules.schedule``, once per arguments (its DAG check grows with pp * M;
    a ``fit`` sweep asks for the same few many times). Callers do not mutate the lists."""
    from tracemem.schedules import schedule

    return schedule(name, pp, vpp, num_microbatches)


# ParallelConfig.create keywords that are Job fields (all but the model)
_LAYOUT_FIELDS = ("tp", "sp", "cp", "ep", "etp", "pp", "vpp", "pp_layout",
                  "pp_first_stage_layers", "pp_last_stage_layers",
                  "account_for_embedding_in_pipeline_split",
                  "account_for_loss_in_pipeline_split", "zero", "precision", "plan",
                  "use_precision_aware_optimizer", "main_grads_dtype", "main_params_dtype",
                  "exp_avg_dtype", "exp_avg_sq_dtype", "grad_reduce_in_bf16",
                  "store_param_remainders", "gradient_accumulation_fusion",
                  "num_distributed_optimizer_instances")
ORIGINS = ("python", "flags", "megatron", "torchtitan")
EMA_PLACES = ("none", "host")  # where an EMA of the weights lives (Job.ema)
# GPU kinds by name -> CUDA compute capability (NVIDIA's CUDA GPUs table)
# Which PyTorch default sizes its cuBLAS workspaces where CUBLAS_WORKSPACE_CONFIG is unset
# (tracemem.workspaces.torch_cublas_workspace_bytes): "2.13", 32 MiB on compute capability
# majors 9, 10 and 12 (since pytorch/pytorch#175344, merged 2026-02-19); "sm90", 32 MiB on
# 9.0 only, the code before it (Blackwell then took 8,519,680 B)
TORCH_CUBLAS_DEFAULTS = ("2.13", "sm90")

GPUS = {"A100": (8, 0), "H100": (9, 0), "H200": (9, 0), "H800": (9, 0), "B200": (10, 0),
        "GB200": (10, 0)}
# GPU kinds by name -> (device memory as --hbm takes it, its source), what `estimate --gpu`
# without --hbm judges against. NVIDIA's data sheets print "80GB" for HBM built of 2^30-byte
# stacks (5 x 16 GiB on the H100), so the figure is read as GiB: the memory the driver
# leaves to CUDA is a little less (cudaMemGetInfo), so give --hbm for a rank near the line.
# None: the kind is sold in more than one size.
GPU_MEMORY = {
    "A100": None,  # 40 GB and 80 GB (NVIDIA A100 Tensor Core GPU data sheet)
    "H100": ("80GiB", "NVIDIA H100 Tensor Core GPU data sheet, H100 SXM: 80GB"),
    "H200": ("141GiB", "NVIDIA H200 Tensor Core GPU data sheet, H200 SXM: 141GB"),
    "H800": ("80GiB", "NVIDIA H800 SXM5 data sheet: 80GB"),
    "B200": ("180GiB", "NVIDIA DGX B200 data sheet: 1,440GB total GPU memory, 8 GPUs"),
    "GB200": ("186GiB", "NVIDIA GB200 NVL72 data sheet: up to 13.4TB HBM3e, 72 GPUs"),
}


@dataclass(frozen=True, kw_only=True)
class Job:
    """A training job: model, parallel layout, batch, schedule, recompute, precision and
    optimizer, kernels, routing, allocator settings. Fields are the job as given (their names
    are tracemem's CLI flags without ``--``); derived fields follow them.

    Fields:
        model: a preset name, a Hugging Face config.json path (or its folder), or a
            ``modeling.ModelConfig``; held as the ``ModelConfig``.
        world_size: GPUs. micro_batch_size: b, sequences per microbatch. seq_length: s,
            tokens per sequence. num_microbatches: M per step per pipeline, or
            global_batch_size: G sequences per step (module docstring).
        tp, sp, cp, ep, etp, pp, vpp, pp_layout (decoder layers per virtual stage),
            pp_first_stage_layers, pp_last_stage_layers,
            account_for_embedding_in_pipeline_split, account_for_loss_in_pipeline_split,
            zero (0-3), precision (a recipe), plan, and Megatron's precision flags
            (use_precision_aware_optimizer, main_grads_dtype, main_params_dtype,
            exp_avg_dtype, exp_avg_sq_dtype, grad_reduce_in_bf16, store_param_remainders,
            gradient_accumulation_fusion; None keeps the recipe's),
            num_distributed_optimizer_instances (Megatron's; ZeRO 1 shards over DP x CP / N):
            ``ParallelConfig.create``.
        schedule: ``tracemem.schedules.SCHEDULES``.
        recompute ("none", "selective", "full"), recompute_modules (under selective;
            ``modeling.common.block.RECOMPUTE_MODULES``, default core_attn; ``("op",)``:
            torchtitan's op-level SelectiveAC, ``modeling.common.sac``, --kernels torch or
            eager, CP = 1),
            recompute_method ("uniform", "block") and recompute_num_layers (under full);
            distribute_saved_activations: Megatron's --distribute-saved-activations (full
            recompute, TP > 1 without SP: each checkpoint keeps 1 / TP of its input).
        attention, experts: the attention and expert kernels. kernels, kernel_options: the
            kernel profile and its options (``modeling.kernels``).
        routing, seed: the routing model (``modeling.common.routing.parse_routing``);
            max_ep_classes: the most EP-rank classes traced per pipeline stage.
        rounding: CUDA block rounding in bytes (512), or 0 / None for exact bytes.
        deallocate_pipeline_outputs: Megatron's sent-output deallocation (on).
        overlap_p2p_comm: Megatron-Core's p2p overlap in its interleaved schedule (on, as
            Megatron-LM runs it; ``--no-overlap-p2p-communication``): the next forward's input
            received before the backward (``tracemem.schedules.megatron_refs``). Neutral for
            other schedules (Megatron-LM turns it off there) and other orchestrations.
        create_attention_mask_in_dataloader: Megatron-LM's dataloader attention mask, ``[b,
            1, s / CP, s]`` bool on the ranks whose stage reads the batch, alive through each
            forward (on, as Megatron-LM runs; ``--no-create-attention-mask-in-dataloader``;
            ``tracemem.estimator._dataloader_mask``). Neutral outside the megatron
            orchestration (the megatron-te profile) and outside the schedules Megatron-LM's
            training loop runs (1f1b, interleaved-1f1b).
        zero3_prefetch: FSDP2's backward prefetch under ZeRO-3 (on).
        optimizer: the step's Adam, "fused" or "torch" (``tracemem.optimizer_step``).
        optimizer_cpu_offload, optimizer_offload_fraction, pin_cpu_grads, pin_cpu_params:
            Megatron's optimizer CPU offload (``--optimizer-cpu-offload`` and its flags,
            refused without it; ``tracemem.offload``). fine_grained_activation_offloading,
            offload_modules, min_offloaded_tensor_size: Megatron-Core's fine-grained activation offloading
            (``--fine-grained-activation-offloading``, ``--offload-modules``,
            ``--min-offloaded-tensor-size`` elements; ``modeling.common.offload``, the
            decisions of an iteration after the first). cpu_offloading_num_layers: TE's CPU
            offloading of that many decoder layers' activations (Megatron's
            ``--cpu-offloading-num-layers``; 0: off; ``modeling.common.cpu_offload``).
            ranks_per_node: GPUs per node, for the host memory a node needs (8).
        hbm: device memory per GPU ("80GiB"), or None; non_pytorch_memory: memory outside
            PyTorch's allocator added to the reserved peak (``NON_PYTORCH_MEMORY_DEFAULT``);
            alloc_conf: a ``PYTORCH_CUDA_ALLOC_CONF`` string for the simulated allocator.
            cublas_workspace_config: a ``CUBLAS_WORKSPACE_CONFIG`` string (``:SIZE:COUNT``
            pairs, KiB), the size of PyTorch's cuBLAS workspaces (``tracemem.workspaces``);
            None: torch's default for the GPU. torch_cublas_default: which PyTorch default
            that is (``TORCH_CUBLAS_DEFAULTS``): "2.13" (32 MiB on Hopper and Blackwell), or
            "sm90" for a torch before pytorch/pytorch#175344 (2026-02-19; NGC PyTorch
            containers up to 26.02), where Blackwell's default was 8,519,680 B.
        replace: the user's own layers (``modeling.common.custom.resolve_replacements``).
        make_vocab_size_divisible_by: Megatron's vocabulary padding (module docstring).
        gpu: the GPU kind (``GPUS``), what the allocations below the dispatcher depend on
            (``tracemem.workspaces``: cuBLAS workspaces per architecture); None counts none
            of them.
        origin: the front door that built the job ("python", "flags", "megatron", "torchtitan");
            megatron_args: the Megatron-LM arguments as given (origin "megatron"), so answers
            can be printed in them.
        recipe, recipe_fields, recipe_off: the named setup (``tracemem.recipes``), the fields
            it set, and its kernel options ``recipe_job`` turned off ("option: why"); a
            ``recipe`` is recorded by ``tracemem.recipes.recipe_job``, which applies it.
        ema: "none", or "host": an fp32 EMA of the rank's parameters in host memory
            (``tracemem.offload.ema_host_bytes``; 0 device bytes).

    Derived: ``config`` (the model, vocabulary padded), ``parallel`` (``ParallelConfig``),
    ``microbatches`` (M), ``global_batch`` (G = b x M x DP), ``steps`` (per pipeline rank),
    ``hbm_bytes``, ``non_pytorch_memory_bytes``, ``profile`` (``KernelProfile``),
    ``alloc_config``, ``routing_model``, ``replacements``.

    Raises:
        TracememError: any invalid field or combination, naming the flag, the value and a fix.
    """

    model: Any
    world_size: int
    micro_batch_size: int
    seq_length: int
    num_microbatches: int | None = None
    global_batch_size: int | None = None
    # parallel layout (ParallelConfig.create)
    tp: int = 1
    sp: bool = False
    cp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1
    vpp: int = 1
    pp_layout: tuple[int, ...] | None = None
    pp_first_stage_layers: int | None = None
    pp_last_stage_layers: int | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    zero: int = 1
    precision: str = "megatron"
    plan: str = "megatron"
    use_precision_aware_optimizer: bool | None = None
    main_grads_dtype: str | None = None
    main_params_dtype: str | None = None
    exp_avg_dtype: str | None = None
    exp_avg_sq_dtype: str | None = None
    grad_reduce_in_bf16: bool | None = None
    store_param_remainders: bool | None = None
    gradient_accumulation_fusion: bool | None = None
    num_distributed_optimizer_instances: int = 1
    # the step
    schedule: str = "1f1b"
    recompute: str = "none"
    recompute_modules: tuple[str, ...] = ("core_attn",)
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    distribute_saved_activations: bool = False
    # kernels
    attention: str = "flash"
    experts: str = "auto"
    kernels: str = "megatron-te"
    kernel_options: Mapping[str, Any] = field(default_factory=dict)
    # routing
    routing: str = "balanced"
    seed: int = 0
    max_ep_classes: int = MAX_EP_CLASSES
    # tracing and memory model
    rounding: int | None = 512
    deallocate_pipeline_outputs: bool = True
    overlap_p2p_comm: bool = True
    create_attention_mask_in_dataloader: bool = True
    zero3_prefetch: bool = True
    optimizer: str = "fused"
    optimizer_cpu_offload: bool = False
    optimizer_offload_fraction: float = 1.0  # arguments.py's default (OptimizerConfig: 0.0)
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True
    fine_grained_activation_offloading: bool = False
    offload_modules: tuple[str, ...] = ()
    min_offloaded_tensor_size: int = 1024 * 1024
    cpu_offloading_num_layers: int = 0
    # NVTE_CPU_OFFLOAD_V1=1 in the job's environment (the Megatron front door sets it): TE's
    # v1 CPU offload path, refused with cpu_offloading_num_layers
    te_cpu_offload_v1: bool = False
    ranks_per_node: int = 8
    hbm: str | None = None
    non_pytorch_memory: str = NON_PYTORCH_MEMORY_DEFAULT
    alloc_conf: str | None = None
    cublas_workspace_config: str | None = None
    torch_cublas_default: str = "2.13"
    replace: Any = None
    make_vocab_size_divisible_by: int | None = None
    gpu: str | None = None
    # where it came from
    origin: str = "python"
    megatron_args: tuple[str, ...] = ()
    # the named setup the job came from (tracemem.recipes.recipe_job), and its fields kept
    recipe: str | None = None
    recipe_fields: tuple[str, ...] = ()
    # the recipe's kernel options recipe_job turned off, "option: why" each
    recipe_off: tuple[str, ...] = ()
    # an EMA of the weights: "none", or "host" (DeepSeek-V3's, arXiv 2412.19437 3.2.3: kept
    # in CPU memory, 0 device bytes; its host bytes: tracemem.offload.ema_host_bytes)
    ema: str = "none"
    # derived
    config: Any = field(init=False, repr=False, compare=False)
    parallel: Any = field(init=False, repr=False, compare=False)
    microbatches: int = field(init=False, repr=False, compare=False)
    global_batch: int = field(init=False, repr=False, compare=False)
    steps: list = field(init=False, repr=False, compare=False)
    hbm_bytes: int | None = field(init=False, repr=False, compare=False)
    non_pytorch_memory_bytes: int = field(init=False, repr=False, compare=False)
    profile: Any = field(init=False, repr=False, compare=False)
    alloc_config: Any = field(init=False, repr=False, compare=False)
    routing_model: Any = field(init=False, repr=False, compare=False)
    replacements: dict = field(init=False, repr=False, compare=False)
    optimizer_offload: Any = field(init=False, repr=False, compare=False)
    activation_offload: Any = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from modeling import ModelConfig, load_config
        from modeling.common.config import MAX_SIZE
        from modeling.registry import check_model_size
        from modeling.common.block import RECOMPUTE_MODES, RECOMPUTE_MODULES
        from modeling.common.custom import resolve_replacements
        from modeling.common.routing import parse_routing
        from modeling.kernels import get_profile
        from tracemem.memory import parse_alloc_conf
        from tracemem.offload import OptimizerOffload, check_optimizer_offload
        from tracemem.optimizer_step import check_optimizer
        from tracemem.parallel import ParallelConfig
        from tracemem.recompute import check_recompute_method

        put = object.__setattr__
        if self.origin not in ORIGINS:
            raise TracememError(f"Job origin {self.origin!r} is invalid; choose one of "
                                f"{', '.join(ORIGINS)}")
        self._check_types()
        model = self.model if isinstance(self.model, ModelConfig) else load_config(self.model)
        check_model_size(model)  # load_config checked a file's; a ModelConfig given as is
        put(self, "model", model)
        check_layout_bounds(self.world_size, pp=self.pp, vpp=self.vpp)
        _positive("--micro-batch-size", self.micro_batch_size)  # before any product of them
        _positive("--seq-length", self.seq_length)
        if self.make_vocab_size_divisible_by is not None:
            _positive("--make-vocab-size-divisible-by", self.make_vocab_size_divisible_by,
                      MAX_SIZE, " (no vocabulary is that large)")
        if self.tp is not None and isinstance(self.tp, int) and not isinstance(self.tp, bool) \
                and self.tp > 0:
            config = replace(model, vocab_size=padded_vocab_size(
                model.vocab_size, self.make_vocab_size_divisible_by, self.tp))
        else:
            config = model  # ParallelConfig names the bad --tp below
        put(self, "config", config)
        par = ParallelConfig.create(config, world_size=self.world_size, **{
            name: getattr(self, name) for name in _LAYOUT_FIELDS})
        put(self, "parallel", par)
        modules = self.recompute_modules
        put(self, "recompute_modules", (modules,) if isinstance(modules, str) else
            tuple(modules))
        if self.recompute not in RECOMPUTE_MODES:
            raise TracememError(f"--recompute {self.recompute!r} is invalid; choose one of "
                                f"{', '.join(RECOMPUTE_MODES)}")
        for name in self.recompute_modules:
            if name not in RECOMPUTE_MODULES:
                raise TracememError(f"--recompute-modules {name!r} is invalid; choose from "
                                    f"{', '.join(RECOMPUTE_MODULES)}")
        m = self._microbatches(par)
        put(self, "microbatches", m)
        put(self, "global_batch", self.micro_batch_size * m * par.dp)
        put(self, "steps", check_job(par, micro_batch_size=self.micro_batch_size,
                                     seq_length=self.seq_length, num_microbatches=m,
                                     schedule=self.schedule, recompute=self.recompute,
                                     moe=config.is_moe))
        _check_activation_bytes(config, self.micro_batch_size, self.seq_length, self.attention)
        _positive("--max-ep-classes", self.max_ep_classes)
        rounding = self.rounding
        if rounding is not None and (isinstance(rounding, bool) or not isinstance(rounding, int)
                                     or rounding < 0):
            raise TracememError(f"--rounding {_show(rounding)} must be 0 (exact bytes) or a "
                                f"positive number of bytes")
        if rounding is not None and rounding > MAX_ROUNDING:
            raise TracememError(f"--rounding {rounding} is more than 2^30 (1 GiB); the CUDA "
                                f"caching allocator rounds to 512 B")
        if rounding and rounding & (rounding - 1):
            # allocators align blocks to a power of two: CUDA's caching allocator 512 B
            # (kMinBlockSize, c10/cuda/CUDACachingAllocator.cpp), CPU allocators 64 B
            raise TracememError(f"--rounding {rounding} is not a power of two; allocators "
                                f"round to one (the CUDA caching allocator: 512), or give 0 "
                                f"for exact bytes")
        put(self, "rounding", rounding or None)  # 0: exact bytes, as None
        check_recompute_method(self.recompute, self.recompute_method, self.recompute_num_layers)
        check_cublas_workspace_config(self.cublas_workspace_config)
        if self.torch_cublas_default not in TORCH_CUBLAS_DEFAULTS:
            raise TracememError(f"--torch-cublas-default {_show(self.torch_cublas_default)} is "
                                f"invalid; choose one of {', '.join(TORCH_CUBLAS_DEFAULTS)} "
                                f"(sm90: a torch before pytorch/pytorch#175344, such as NGC "
                                f"PyTorch 26.02's)")
        if self.torch_cublas_default != "2.13" and self.gpu is None:
            raise TracememError("--torch-cublas-default sizes PyTorch's cuBLAS workspaces, "
                                "which are counted with --gpu only: give --gpu (e.g. GB200)")
        hbm_bytes = parse_bytes(self.hbm) if self.hbm is not None else None
        put(self, "hbm_bytes", hbm_bytes)
        options = dict(self.kernel_options or {})
        fusion = par.precision_spec.gradient_accumulation_fusion
        if fusion is not None and self.kernels == "megatron-te":  # one flag: the precision's
            if options.setdefault("gradient_accumulation_fusion", fusion) != fusion:
                raise TracememError(f"gradient_accumulation_fusion={fusion} and kernel_options' "
                                    f"gradient_accumulation_fusion disagree; give one")
        # megatron-te's attention_backend "auto" is TE's choice per GPU architecture
        put(self, "profile", get_profile(self.kernels, gpu_arch=GPUS.get(self.gpu), **options))
        put(self, "kernel_options", dict(self.kernel_options or {}))
        if (not self.overlap_p2p_comm and self.schedule == "interleaved-1f1b"
                and self.profile.orchestration == "megatron" and par.pp <= 2):
            # Megatron-LM d98e8a6 megatron/training/arguments.py validate_args
            raise TracememError(
                f"--no-overlap-p2p-communication with the interleaved schedule needs --pp "
                f"above 2 (here {par.pp}): Megatron-LM refuses it, to avoid several p2p sends "
                f"and receives between the same two ranks per communication batch "
                f"(validate_args); keep the overlap (Megatron-LM's default)")
        _check_op_recompute(self, par)
        _check_fp8_moe_act_cache(self)
        _check_fp8_dispatch(self, par)
        if self.profile.options.get("fp8_param_gather") and par.zero == 0:
            raise TracememError("kernel option fp8_param_gather (--fp8-param-gather) needs "
                                "Megatron's distributed optimizer: give --zero 1 or more "
                                "(validate_args: \"--fp8-param-gather only supported with "
                                "distributed optimizer, torch fsdp2, megatron fsdp, or "
                                "inference mode\")")
        if self.profile.options.get("e5m6_attention_output") \
                and self.profile.fp8_recipe != "blockwise":
            raise TracememError("kernel option e5m6_attention_output (DeepSeek-V3's E5M6 cache "
                                "of the attention output, 1x128 tiles) needs --fp8-format and "
                                "--fp8-recipe blockwise")
        check_optimizer(self.optimizer, par)
        if not self.optimizer_cpu_offload:  # its flags alone would change nothing: say so
            for flag, given in (("--optimizer-offload-fraction",
                                 self.optimizer_offload_fraction != 1.0),
                                ("--no-pin-cpu-grads", self.pin_cpu_grads is False),
                                ("--no-pin-cpu-params", self.pin_cpu_params is False)):
                if given:
                    raise TracememError(f"{flag} needs --optimizer-cpu-offload")
        offload = OptimizerOffload(self.optimizer_offload_fraction, self.pin_cpu_grads,
                                   self.pin_cpu_params) if self.optimizer_cpu_offload else None
        check_optimizer_offload(offload, par, self.optimizer, self.profile.name)
        put(self, "optimizer_offload", offload)
        put(self, "activation_offload", _check_activation_offload(self, par))
        _check_te_cpu_offload(self, par)
        _positive("--ranks-per-node", self.ranks_per_node, MAX_WORLD_SIZE)
        put(self, "alloc_config", parse_alloc_conf(self.alloc_conf))
        outside = parse_bytes(self.non_pytorch_memory, "--non-pytorch-memory", zero=True)
        put(self, "non_pytorch_memory_bytes", outside)
        if hbm_bytes is not None and hbm_bytes - outside <= 0:
            raise TracememError(f"--non-pytorch-memory {self.non_pytorch_memory} leaves "
                                f"nothing of --hbm {self.hbm} for PyTorch")
        put(self, "routing_model", parse_routing(self.routing, self.seed))
        if not config.is_moe and self.routing != "balanced":
            raise TracememError(f"--routing {self.routing}: {config.name} is dense (no routed "
                                f"experts to route to); drop --routing")
        put(self, "replacements", resolve_replacements(self.replace))
        put(self, "megatron_args", tuple(self.megatron_args))
        if self.ema not in EMA_PLACES:
            raise TracememError(f"--ema {self.ema!r} is invalid; choose one of "
                                f"{', '.join(EMA_PLACES)}")
        if isinstance(self.recipe_fields, str) or not isinstance(
                self.recipe_fields, (tuple, list)) or not all(
                isinstance(f, str) for f in self.recipe_fields):
            raise TracememError(f"recipe_fields {self.recipe_fields!r} must be a tuple of Job "
                                f"field names (tracemem.recipes.recipe_job sets it)")
        if self.recipe is not None and not isinstance(self.recipe, str):
            raise TracememError(f"--recipe {self.recipe!r} must be a recipe name "
                                f"(tracemem.recipes.RECIPES)")
        if self.recipe is not None and not self.recipe_fields:
            from tracemem.recipes import RECIPES

            raise TracememError(f"Job(recipe={self.recipe!r}) only records a recipe; apply one "
                                f"with tracemem.recipes.recipe_job(name, **overrides) (recipes: "
                                f"{', '.join(RECIPES)})")
        if isinstance(self.recipe_off, str) or not isinstance(self.recipe_off, (tuple, list)) \
                or not all(isinstance(f, str) for f in self.recipe_off):
            raise TracememError(f"recipe_off {self.recipe_off!r} must be a tuple of strings "
                                f"(tracemem.recipes.recipe_job sets it)")
        put(self, "recipe_fields", tuple(self.recipe_fields))
        put(self, "recipe_off", tuple(self.recipe_off))
        if isinstance(self.gpu, str) and self.gpu.upper() in GPUS:
            put(self, "gpu", self.gpu.upper())  # "h100" is the H100, as the CLI takes it
        if self.gpu is not None and self.gpu not in GPUS:
            raise TracememError(f"--gpu {self.gpu!r} is invalid; choose one of "
                                f"{', '.join(GPUS)}")

    def _check_types(self) -> None:
        """The fields whose wrong type would otherwise end in a raw ``TypeError`` deeper down
        (a list where a name goes, a string where a mapping goes). First, a field holding an
        integer of another library (``numpy.int64``: any type with ``__index__``), or a list or
        tuple of them, is set to the Python int(s) it stands for, and a numpy bool scalar to
        the bool.

        Raises:
            TracememError: the first such field, named as its flag, with what it takes.
        """
        def refuse(flag: str, value: Any, takes: str):
            raise TracememError(f"{flag} {_show(value)} is invalid; give {takes}")

        import operator
        from dataclasses import fields

        from modeling.kernels import KernelProfile

        # an integer of another library (numpy.int64 from a sweep's array) is the int it
        # stands for (operator.index: integers only, never a float), in a list or tuple too
        # (pp_layout); a numpy bool scalar is the bool it stands for
        def plain(value):
            if not isinstance(value, (int, str)) and hasattr(type(value), "__index__"):
                return operator.index(value)
            if getattr(value, "ndim", None) == 0 and getattr(
                    getattr(value, "dtype", None), "kind", None) == "b":
                return bool(value)
            return value

        for f in fields(self):
            if not f.init:
                continue
            value = getattr(self, f.name)
            if isinstance(value, (list, tuple)):
                new = type(value)(plain(v) for v in value)
            else:
                new = plain(value)
            if new is not value:
                object.__setattr__(self, f.name, new)

        if not isinstance(self.kernels, (str, KernelProfile)):
            refuse("--kernels", self.kernels, "a profile name as a string, such as "
                                              "'megatron-te'")
        if self.kernel_options is not None and not isinstance(self.kernel_options, Mapping):
            refuse("kernel_options", self.kernel_options,
                   "a dict of option names to values, such as {'te_version': '2.17'}")
        modules = self.recompute_modules
        if not isinstance(modules, (str, tuple, list)) or (
                not isinstance(modules, str) and not all(isinstance(m, str) for m in modules)):
            refuse("--recompute-modules", modules, "module names (a tuple of strings), such "
                                                   "as ('core_attn',)")
        for flag, value in (("--alloc-conf", self.alloc_conf), ("--gpu", self.gpu),
                            ("cublas_workspace_config", self.cublas_workspace_config),
                            ("--torch-cublas-default", self.torch_cublas_default)):
            if value is not None and not isinstance(value, str):
                refuse(flag, value, "a string")
        for name in ("attention", "experts", "recompute", "recompute_method", "optimizer"):
            value = getattr(self, name)  # a name, looked up in a table (a list is unhashable)
            if not isinstance(value, str):
                refuse("--" + name.replace("_", "-"), value, "a name as a string")
        if self.pp_layout is not None and not isinstance(self.pp_layout, (tuple, list)):
            refuse("--pp-layout", self.pp_layout, "one integer per virtual pipeline stage "
                                                  "(a tuple), such as (4, 4, 4, 1)")
        if isinstance(self.megatron_args, str) or not isinstance(
                self.megatron_args, (tuple, list)) or not all(
                    isinstance(a, str) for a in self.megatron_args):
            refuse("megatron_args", self.megatron_args, "a tuple of strings")
        if self.replace is not None and not isinstance(self.replace, (Mapping, tuple, list)):
            refuse("--replace", self.replace, "a list of 'kind=module:Name' strings or a dict "
                                              "of kind to layer")
        for flag, value in (("deallocate_pipeline_outputs", self.deallocate_pipeline_outputs),
                            ("overlap_p2p_comm", self.overlap_p2p_comm),
                            ("create_attention_mask_in_dataloader",
                             self.create_attention_mask_in_dataloader),
                            ("zero3_prefetch", self.zero3_prefetch),
                            ("account_for_embedding_in_pipeline_split",
                             self.account_for_embedding_in_pipeline_split),
                            ("account_for_loss_in_pipeline_split",
                             self.account_for_loss_in_pipeline_split),
                            ("--optimizer-cpu-offload", self.optimizer_cpu_offload),
                            ("pin_cpu_grads", self.pin_cpu_grads),
                            ("pin_cpu_params", self.pin_cpu_params)):
            if not isinstance(value, bool):
                refuse(flag, value, "True or False")

    def _microbatches(self, par) -> int:
        """M from ``num_microbatches`` or ``global_batch_size`` (module docstring)."""
        m, g, b = self.num_microbatches, self.global_batch_size, self.micro_batch_size
        if m is None and g is None:
            raise TracememError("give --num-microbatches (M, per pipeline per step) or "
                                "--global-batch-size (G sequences per step; M = G / (b x DP))")
        if g is None:
            _positive("--num-microbatches", m)
            return m
        _positive("--global-batch-size", g)
        _positive("--micro-batch-size", b)
        if g % (b * par.dp):
            raise TracememError(
                f"--global-batch-size {g} is not divisible by --micro-batch-size {b} x DP "
                f"{par.dp} = {b * par.dp} (Megatron's ConstantNumMicroBatchesCalculator); try "
                f"{max(b * par.dp, g // (b * par.dp) * b * par.dp)}")
        if m is not None and m != g // (b * par.dp):
            raise TracememError(
                f"--num-microbatches {m} disagrees with --global-batch-size {g} / "
                f"(--micro-batch-size {b} x DP {par.dp}) = {g // (b * par.dp)}; give one")
        return g // (b * par.dp)

    @classmethod
    def create(cls, model, **fields_) -> Job:
        """``Job(model=model, **fields_)``, with a one-line error for a keyword that is not a
        field (an old name gets its new one: ``RENAMED``; a typo a close match).

        Raises:
            TracememError: an unknown keyword, or any invalid field (the class docstring).
        """
        check_fields(fields_)
        if isinstance(model, Mapping):
            raise TracememError("the model is a dict: give a preset name, a config.json path "
                                "or a ModelConfig, and the job's fields as keywords "
                                "(estimate(model, world_size=..., ...) or Job(model=..., ...))")
        required = [f.name for f in fields(cls) if f.init and f.name != "model"
                    and f.default is MISSING and f.default_factory is MISSING
                    and f.name not in fields_]
        if required:
            raise TracememError(f"a Job needs {', '.join(required)} (keywords) beside the model"
                                f"{'' if model is not None else ' (model is None)'}")
        return cls(model=model, **fields_)

    def with_changes(self, **changes) -> Job:
        """``dataclasses.replace(self, **changes)`` after the same keyword check as
        ``create``: a new, validated job."""
        check_fields(changes)
        return replace(self, **changes)

    def layout_fields(self) -> dict[str, Any]:
        """The ``ParallelConfig.create`` keywords of this job (all but the model and the world
        size)."""
        return {name: getattr(self, name) for name in _LAYOUT_FIELDS}

    def settings(self) -> dict[str, Any]:
        """The step's settings as plain data (the ``settings`` of an estimate's JSON)."""
        full = self.recompute == "full"
        return {"micro_batch_size": self.micro_batch_size, "seq_length": self.seq_length,
                "num_microbatches": self.microbatches, "global_batch_size": self.global_batch,
                "schedule": self.schedule, "recompute": self.recompute,
                "recompute_method": self.recompute_method if full else None,
                "recompute_num_layers": self.recompute_num_layers if full else None,
                "distribute_saved_activations": self.distribute_saved_activations,
                "recompute_modules": list(self.recompute_modules)
                if self.recompute == "selective" else [],
                "attention": self.attention, "experts": self.experts,
                "routing": self.routing, "seed": self.seed, "rounding": self.rounding or 0,
                "kernels": self.profile.name, "kernel_options": dict(self.profile.options),
                "deallocate_pipeline_outputs": self.deallocate_pipeline_outputs,
                "overlap_p2p_comm": self.overlap_p2p_comm,
                "create_attention_mask_in_dataloader": self.create_attention_mask_in_dataloader,
                "zero3_prefetch": self.zero3_prefetch, "alloc_conf": self.alloc_config.text,
                "non_pytorch_memory_bytes": self.non_pytorch_memory_bytes,
                "optimizer": self.optimizer,
                "optimizer_cpu_offload": self.optimizer_cpu_offload,
                "optimizer_offload_fraction": self.optimizer_offload_fraction
                if self.optimizer_cpu_offload else None,
                "pin_cpu_grads": self.pin_cpu_grads, "pin_cpu_params": self.pin_cpu_params,
                "fine_grained_activation_offloading": self.fine_grained_activation_offloading,
                "offload_modules": list(self.offload_modules),
                "min_offloaded_tensor_size": self.min_offloaded_tensor_size,
                "cpu_offloading_num_layers": self.cpu_offloading_num_layers,
                "te_cpu_offload_v1": self.te_cpu_offload_v1,
                "ranks_per_node": self.ranks_per_node,
                "replace": {kind: getattr(f, "__qualname__", repr(f))
                            for kind, f in self.replacements.items()},
                "vocab_size": self.config.vocab_size, "origin": self.origin, "gpu": self.gpu,
                "cublas_workspace_config": self.cublas_workspace_config,
                "torch_cublas_default": self.torch_cublas_default}


def job_fields() -> tuple[str, ...]:
    """The names ``Job`` takes (its init fields)."""
    return tuple(f.name for f in fields(Job) if f.init)


def check_fields(given: Mapping[str, Any]) -> None:
    """Raises: TracememError: a keyword that is not a ``Job`` field (the first, named with its
    new name or a close match)."""
    valid = job_fields()
    for name in given:
        if name in valid:
            continue
        if name in RENAMED:
            raise TracememError(f"keyword {name!r} is now {RENAMED[name]!r} (the CLI's "
                                f"--{RENAMED[name].replace('_', '-')})")
        from modeling.kernels.profile import MEGATRON_TE_OPTIONS, TORCH_OPTIONS

        if name in MEGATRON_TE_OPTIONS or name in TORCH_OPTIONS:  # a kernel option
            raise TracememError(f"{name!r} is a kernel option, not a job keyword: give "
                                f"kernel_options={{{name!r}: ...}}")
        close = difflib.get_close_matches(name, valid, n=1)
        raise TracememError(f"unknown job keyword {name!r}"
                            + (f"; did you mean {close[0]!r}?" if close else
                               f"; valid: {', '.join(valid)}"))


def _check_fp8_moe_act_cache(job) -> None:
    """The megatron-te option ``fp8_moe_act_cache`` (DeepSeek-V3's FP8 cache of the routed
    experts' SwiGLU input) changes what ``moe_act``'s checkpoint keeps under FP8, so it needs
    both; alone it would do nothing.

    Raises:
        TracememError: set without an FP8 recipe or without ``--recompute-modules moe_act``.
    """
    if not job.profile.options.get("fp8_moe_act_cache"):
        return
    if job.profile.fp8_recipe == "none":
        raise TracememError("kernel option fp8_moe_act_cache (DeepSeek-V3's FP8 cache of the "
                            "SwiGLU input) needs FP8: give --fp8-format (and --fp8-recipe)")
    if job.recompute != "selective" or "moe_act" not in job.recompute_modules:
        raise TracememError("kernel option fp8_moe_act_cache caches moe_act's input in FP8: "
                            "give --recompute selective --recompute-modules moe_act")


def _check_fp8_dispatch(job, par) -> None:
    """The megatron-te option ``fp8_dispatch`` (DeepSeek-V3's FP8 dispatch,
    ``modeling.kernels.fp8_dispatch``) is modelled on Megatron's alltoall dispatcher with TE's
    fused permute and grouped experts, under blockwise FP8 (the 1x128 tiles of arXiv
    2412.19437 3.3.2), with the experts not tensor-split and more than one EP rank (else no
    all-to-all carries anything).

    Raises:
        TracememError: the first of these not met, naming the flag to change.
    """
    options = job.profile.options
    if not options.get("fp8_dispatch"):
        return
    name = "kernel option fp8_dispatch (DeepSeek-V3's FP8 dispatch)"
    if not job.config.is_moe:
        raise TracememError(f"{name} needs an MoE model; {job.config.name} has no experts")
    if job.profile.fp8_recipe != "blockwise":
        raise TracememError(f"{name} sends 1x128-tile FP8 tokens: give --fp8-format and "
                            f"--fp8-recipe blockwise")
    checks = (
        (par.ep > 1, "EP 1 sends no tokens over an all-to-all: give --ep > 1"),
        (par.etp == 1, f"the experts' tensor-parallel gather is not modelled with it: give "
                       f"--etp 1 (not {par.etp})"),
        (options.get("moe_token_dispatcher") == "alltoall",
         "it is modelled on the alltoall dispatcher: kernel option moe_token_dispatcher "
         "'alltoall' (Megatron's --moe-token-dispatcher-type alltoall)"),
        (bool(options.get("moe_permute_fusion")),
         "it is modelled on TE's fused permute: kernel option moe_permute_fusion True "
         "(Megatron's --moe-permute-fusion)"),
        (job.experts != "sequential", "it feeds the grouped experts' fc1: give --experts "
                                      "grouped (or auto)"),
        (job.config.hidden_size % 128 == 0,
         f"DeepEP's FP8 dispatch needs the hidden size to be a multiple of 128 (one scale "
         f"per 1x128 tile); it is {job.config.hidden_size}"),
        (not job.fine_grained_activation_offloading and not job.cpu_offloading_num_layers,
         "activation offloading of its FP8 payloads is not modelled: drop "
         "--fine-grained-activation-offloading / --cpu-offloading-num-layers"),
    )
    for ok, why in checks:
        if not ok:
            raise TracememError(f"{name}: {why}")


def _check_activation_offload(job: Job, par) -> tuple[frozenset[str], int] | None:
    """The fine-grained activation offloading settings, (modules, min size), or None when it
    is off.

    Raises:
        TracememError: modules or a size other than the default without the flag, the flag
            without modules, an unknown
            module, ``attn_proj`` without ``core_attn`` (``TransformerConfig.__post_init__``'s
            rules at Megatron-LM 4e85d74ae9), a size below 0, and what tracemem does not model
            with it: a profile other than megatron-te (Megatron: "only supported with
            transformer_engine implementation"), a schedule other than Megatron's 1F1B and
            interleaved 1F1B, full recompute, ``moe`` recompute with ``expert_fc1`` /
            ``moe_act``."""
    from modeling.common.offload import MIN_OFFLOADED_TENSOR_SIZE, OFFLOAD_MODULES

    modules = job.offload_modules
    if modules is None:
        modules = ()
    if not isinstance(modules, (str, tuple, list)) or (
            not isinstance(modules, str) and not all(isinstance(m, str) for m in modules)):
        raise TracememError(f"--offload-modules {_show(modules)} is invalid; give module names "
                            f"(a tuple of strings), such as ('core_attn', 'moe_act')")
    modules = (modules,) if isinstance(modules, str) else tuple(modules)
    object.__setattr__(job, "offload_modules", modules)
    on = job.fine_grained_activation_offloading
    if not isinstance(on, bool):
        raise TracememError(f"--fine-grained-activation-offloading {_show(on)} is invalid; "
                            f"give True or False")
    if not on:
        for flag, given in (("--offload-modules", bool(modules)),
                            ("--min-offloaded-tensor-size",
                             job.min_offloaded_tensor_size != MIN_OFFLOADED_TENSOR_SIZE)):
            if given:
                raise TracememError(f"{flag} needs --fine-grained-activation-offloading")
        return None
    if not modules:
        raise TracememError("--fine-grained-activation-offloading needs --offload-modules "
                            f"(one or more of {', '.join(OFFLOAD_MODULES)})")
    later = [m for m in modules if m in ("fused_group_mlp", "gdp_qkv")]
    if later:
        raise TracememError(f"--offload-modules {', '.join(later)} is not modelled yet "
                            f"(Megatron-LM d98e8a6's; tracemem models the groups as at "
                            f"4e85d74ae9: {', '.join(OFFLOAD_MODULES)})")
    unknown = [m for m in modules if m not in OFFLOAD_MODULES]
    if unknown:
        raise TracememError(f"--offload-modules {', '.join(map(str, unknown))} is invalid; "
                            f"choose from {', '.join(OFFLOAD_MODULES)}")
    if "attn_proj" in modules and "core_attn" not in modules:
        raise TracememError("--offload-modules attn_proj cannot be set alone without core_attn "
                            "because the input of attn_proj is the output of core_attn, "
                            "which is needed in core_attn.backward() (Megatron's rule: add "
                            "core_attn)")
    size = job.min_offloaded_tensor_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise TracememError(f"--min-offloaded-tensor-size {_show(size)} is invalid; give a "
                            f"number of elements (0 or more; Megatron's default 1048576)")
    if job.profile.name != "megatron-te":
        raise TracememError(f"--fine-grained-activation-offloading is only supported with "
                            f"the transformer_engine implementation: use --kernels "
                            f"megatron-te, not --kernels {job.profile.name}")
    if job.schedule not in ("1f1b", "interleaved-1f1b"):
        raise TracememError(f"--fine-grained-activation-offloading with --schedule "
                            f"{job.schedule} is not modelled: Megatron's offload manager "
                            f"queues chunks in its 1F1B / interleaved 1F1B order; use "
                            f"--schedule 1f1b or interleaved-1f1b")
    if job.recompute == "full":
        raise TracememError("--fine-grained-activation-offloading with --recompute full is not "
                            "modelled (the groups would start again inside the recompute); "
                            "use --recompute selective or none")
    if job.recompute == "selective" and "moe" in job.recompute_modules \
            and {"expert_fc1", "moe_act"} & set(modules):
        raise TracememError("--offload-modules expert_fc1 / moe_act with --recompute-modules "
                            "moe is not modelled (the groups would start again inside the "
                            "MoE recompute); drop one")
    return frozenset(modules), size


def _check_te_cpu_offload(job: Job, par) -> None:
    """TE's CPU offloading of ``job.cpu_offloading_num_layers`` layers (0: off).

    Raises:
        TracememError: a count that is not an int of 0 or more; Megatron-Core's refusals
            (``TransformerConfig.__post_init__`` at Megatron-LM d98e8a6: N >= num_layers,
            pipeline parallelism, activation recompute; fine-grained activation offloading
            with it; TE absent: a profile other than megatron-te); what tracemem does not model
            with it: TE's v1 path (``te_cpu_offload_v1``), a schedule other than 1F1B (Megatron's no-pipelining order), ZeRO-3 /
            Megatron-FSDP (its gathered weights would pass TE's offload check here)."""
    n = job.cpu_offloading_num_layers
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise TracememError(f"--cpu-offloading-num-layers {_show(n)} is invalid; give a number "
                            f"of layers (0, the default, is off)")
    if n == 0:
        return
    if job.te_cpu_offload_v1:
        raise TracememError("--cpu-offloading-num-layers with NVTE_CPU_OFFLOAD_V1=1 is not "
                            "modelled (TE's v1 CPU offload path, transformer_engine/pytorch/"
                            "cpu_offload_v1.py; the default path is)")
    layers = job.config.num_layers
    if n >= layers:
        raise TracememError(f"--cpu-offloading-num-layers {n}: CPU offloading can be done only "
                            f"for layers less than {layers} (Megatron's TransformerConfig)")
    if par.pp > 1:
        raise TracememError(f"--cpu-offloading-num-layers with --pp {par.pp}: currently there "
                            f"is no support for pipeline parallelism with CPU offloading "
                            f"(Megatron's TransformerConfig)")
    if job.recompute != "none":
        raise TracememError(f"--cpu-offloading-num-layers with --recompute {job.recompute}: CPU "
                            f"offloading does not work when activation recomputation is "
                            f"enabled (Megatron's TransformerConfig)")
    if job.schedule != "1f1b":
        raise TracememError(f"--cpu-offloading-num-layers with --schedule {job.schedule} is not "
                            f"modelled: without pipeline parallelism Megatron runs each "
                            f"microbatch's forward then its backward "
                            f"(forward_backward_no_pipelining); use --schedule 1f1b")
    if job.fine_grained_activation_offloading:
        raise TracememError("--fine-grained-activation-offloading cannot be enabled with "
                            "--cpu-offloading-num-layers (Megatron's TransformerConfig)")
    if job.profile.name != "megatron-te":
        raise TracememError(f"--cpu-offloading-num-layers is Transformer Engine's CPU "
                            f"offloading (Megatron asserts TE is present): use --kernels "
                            f"megatron-te, not --kernels {job.profile.name}")
    if par.zero == 3:
        raise TracememError("--cpu-offloading-num-layers with ZeRO-3 / Megatron-FSDP is not "
                            "modelled (the gathered weights' offload check); use ZeRO 0-2")


def _check_op_recompute(job, par) -> None:
    """``--recompute selective --recompute-modules op`` (torchtitan's op-level
    ``SelectiveAC``, ``modeling.common.sac``): alone, under an eager-orchestration profile,
    and without CP, whose collectives tracemem stands in for with ops the policy cannot see
    (``modeling.common.sac.SAC_COLLECTIVES_NOTE``).

    Raises:
        TracememError: any of these not met, naming the flag.
    """
    if job.recompute != "selective" or "op" not in job.recompute_modules:
        return
    if len(set(job.recompute_modules)) > 1:
        raise TracememError(f"--recompute-modules op (torchtitan's op-level policy around the "
                            f"whole layer) cannot be combined with "
                            f"{', '.join(m for m in job.recompute_modules if m != 'op')}")
    if job.profile.orchestration == "megatron":
        raise TracememError(f"--recompute-modules op is torchtitan's SelectiveAC and needs "
                            f"--kernels torch (or eager), not --kernels {job.profile.name}")
    if par.cp > 1:
        raise TracememError(f"--recompute-modules op with --cp {par.cp}: not modelled yet: "
                            f"context parallelism's K / V collectives are stand-ins the op "
                            f"policy cannot see (modeling.kernels.context_parallel); use --cp 1")
