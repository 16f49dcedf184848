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

import difflib
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from tracemem.errors import TracememError

__all__ = ["Job", "parse_bytes", "check_job", "NON_PYTORCH_MEMORY_DEFAULT", "MAX_TOKENS",
           "MAX_MICROBATCHES", "MAX_HBM_BYTES", "MAX_EP_CLASSES", "RENAMED", "job_fields",
           "padded_vocab_size", "check_fields", "GPUS"]

_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}

MAX_HBM_BYTES = 2**50  # 1 PiB: more than any accelerator holds
MAX_TOKENS = 2**32  # tokens per microbatch (b x s): beyond any machine's memory for one layer
MAX_MICROBATCHES = 2**20  # microbatches per step: the replay is linear in them
MAX_EP_CLASSES = 8  # default cap on EP-rank classes traced per pipeline stage

# Device memory outside PyTorch's caching allocator, added to the reserved peak when judging
# --hbm: the CUDA context. With CUDA's lazy module loading (11.7+) it is about 300 MB
# (pytorch/pytorch#107667, ptrblck, 2023) to 300-400 MB (pytorch/pytorch#20532), rounded up
# here; NCCL communicator buffers are not included (they depend on the job: measure them).
NON_PYTORCH_MEMORY_DEFAULT = "512MiB"

# Keywords of earlier releases -> their names now (the CLI's)
RENAMED = {"schedule_name": "schedule"}


def parse_bytes(text: str, flag: str = "--hbm", zero: bool = False) -> int:
    """``"80GiB"`` -> 85899345920. Units: B, KiB, MiB, GiB, TiB (binary). ``zero`` also
    accepts a size of 0.

    Raises:
        TracememError: not a string, not a number followed by one of those units, below one
            byte (other than 0 with ``zero``), or more than 1 PiB (``MAX_HBM_BYTES``: no device
            holds that); the message names ``flag``.
    """
    if not isinstance(text, str):
        raise TracememError(f"{flag} {text!r} is invalid; give a size as text, such as 80GiB")
    for unit in sorted(_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            try:
                value = float(text[:-len(unit)]) * _UNITS[unit]
            except (ValueError, OverflowError):
                break
            if 1 <= value <= MAX_HBM_BYTES or (zero and value == 0):
                return int(value)
            if value > MAX_HBM_BYTES:  # inf included; NaN compares false
                raise TracememError(f"{flag} {text!r} is more than 1 PiB; no device holds that")
            break
    raise TracememError(f"{flag} {text!r} is invalid; give a {'' if zero else 'positive '}"
                        f"size of whole bytes such as 80GiB or 141GiB (units "
                        f"{', '.join(_UNITS)})")


def padded_vocab_size(vocab_size: int, divisible_by: int | None, tp: int) -> int:
    """Megatron's padded vocabulary: ``vocab_size`` rounded up to a multiple of
    ``divisible_by * tp`` (``vocab_size_with_padding``, module docstring); unchanged when
    ``divisible_by`` is None."""
    if divisible_by is None:
        return vocab_size
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def _positive(flag: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise TracememError(f"{flag} {value!r} must be a positive integer")


def check_job(par, *, micro_batch_size: int, seq_length: int, num_microbatches: int,
              schedule: str, recompute: str, moe: bool = False):
    """The checks of a job beyond its layout (``ParallelConfig.create``), which ``Job`` runs
    and ``tracemem fit`` uses to enumerate valid layouts: b, s and M positive and bounded,
    SP with TP and EP (Megatron-Core's ``ModelParallelConfig``), s divisible by CP x SP, the
    schedule's own rules (``tracemem.schedules.schedule``) and what its W steps do not yet
    trace, and for an MoE model (``moe``) Megatron-Core's refusal of TP without SP. Returns the
    schedule's steps per rank.

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
        raise TracememError(f"--num-microbatches {num_microbatches} is more than 2^20; the "
                            f"replay's work grows with it (and no job runs that many)")
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
        if recompute != "none":
            raise TracememError(f"--schedule {schedule} defers weight gradients (W "
                                f"steps), which tracemem does not yet trace with --recompute "
                                f"{recompute} (checkpointed tensors unpack once); use "
                                f"--recompute none")
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
                  "store_param_remainders", "gradient_accumulation_fusion")
ORIGINS = ("python", "flags", "megatron")
# GPU kinds by name -> CUDA compute capability (NVIDIA's CUDA GPUs table)
GPUS = {"A100": (8, 0), "H100": (9, 0), "H200": (9, 0), "H800": (9, 0), "B200": (10, 0),
        "GB200": (10, 0)}


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
            gradient_accumulation_fusion; None keeps the recipe's): ``ParallelConfig.create``.
        schedule: ``tracemem.schedules.SCHEDULES``.
        recompute ("none", "selective", "full"), recompute_modules (under selective;
            ``modeling.common.block.RECOMPUTE_MODULES``, default core_attn),
            recompute_method ("uniform", "block") and recompute_num_layers (under full).
        attention, experts: the attention and expert kernels. kernels, kernel_options: the
            kernel profile and its options (``modeling.kernels``).
        routing, seed: the routing model (``modeling.common.routing.parse_routing``);
            max_ep_classes: the most EP-rank classes traced per pipeline stage.
        rounding: CUDA block rounding in bytes (512), or 0 / None for exact bytes.
        deallocate_pipeline_outputs: Megatron's sent-output deallocation (on).
        zero3_prefetch: FSDP2's backward prefetch under ZeRO-3 (on).
        optimizer: the step's Adam, "fused" or "torch" (``tracemem.optimizer_step``).
        hbm: device memory per GPU ("80GiB"), or None; non_pytorch_memory: memory outside
            PyTorch's allocator added to the reserved peak (``NON_PYTORCH_MEMORY_DEFAULT``);
            alloc_conf: a ``PYTORCH_CUDA_ALLOC_CONF`` string for the simulated allocator.
        replace: the user's own layers (``modeling.common.custom.resolve_replacements``).
        make_vocab_size_divisible_by: Megatron's vocabulary padding (module docstring).
        gpu: the GPU kind (``GPUS``), what the allocations below the dispatcher depend on
            (``tracemem.workspaces``: cuBLAS workspaces per architecture); None counts none
            of them.
        origin: the front door that built the job ("python", "flags", "megatron");
            megatron_args: the Megatron-LM arguments as given (origin "megatron"), so answers
            can be printed in them.

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
    # the step
    schedule: str = "1f1b"
    recompute: str = "none"
    recompute_modules: tuple[str, ...] = ("core_attn",)
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
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
    zero3_prefetch: bool = True
    optimizer: str = "fused"
    hbm: str | None = None
    non_pytorch_memory: str = NON_PYTORCH_MEMORY_DEFAULT
    alloc_conf: str | None = None
    replace: Any = None
    make_vocab_size_divisible_by: int | None = None
    gpu: str | None = None
    # where it came from
    origin: str = "python"
    megatron_args: tuple[str, ...] = ()
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

    def __post_init__(self) -> None:
        from modeling import ModelConfig, load_config
        from modeling.common.block import RECOMPUTE_MODES, RECOMPUTE_MODULES
        from modeling.common.custom import resolve_replacements
        from modeling.common.routing import parse_routing
        from modeling.kernels import get_profile
        from tracemem.memory import parse_alloc_conf
        from tracemem.optimizer_step import check_optimizer
        from tracemem.parallel import ParallelConfig
        from tracemem.recompute import check_recompute_method

        put = object.__setattr__
        if self.origin not in ORIGINS:
            raise TracememError(f"Job origin {self.origin!r} is invalid; choose one of "
                                f"{', '.join(ORIGINS)}")
        model = self.model if isinstance(self.model, ModelConfig) else load_config(self.model)
        put(self, "model", model)
        _positive("--world-size", self.world_size)
        if self.make_vocab_size_divisible_by is not None:
            _positive("--make-vocab-size-divisible-by", self.make_vocab_size_divisible_by)
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
        put(self, "recompute_modules", tuple(self.recompute_modules))
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
        _positive("--max-ep-classes", self.max_ep_classes)
        rounding = self.rounding
        if rounding is not None and (isinstance(rounding, bool) or not isinstance(rounding, int)
                                     or rounding < 0):
            raise TracememError(f"--rounding {rounding!r} must be 0 (exact bytes) or a positive "
                                f"number of bytes")
        put(self, "rounding", rounding or None)  # 0: exact bytes, as None
        check_recompute_method(self.recompute, self.recompute_method, self.recompute_num_layers)
        hbm_bytes = parse_bytes(self.hbm) if self.hbm is not None else None
        put(self, "hbm_bytes", hbm_bytes)
        options = dict(self.kernel_options or {})
        fusion = par.precision_spec.gradient_accumulation_fusion
        if fusion is not None and self.kernels == "megatron-te":  # one flag: the precision's
            if options.setdefault("gradient_accumulation_fusion", fusion) != fusion:
                raise TracememError(f"gradient_accumulation_fusion={fusion} and kernel_options' "
                                    f"gradient_accumulation_fusion disagree; give one")
        put(self, "profile", get_profile(self.kernels, **options))
        put(self, "kernel_options", dict(self.kernel_options or {}))
        check_optimizer(self.optimizer, par)
        put(self, "alloc_config", parse_alloc_conf(self.alloc_conf))
        outside = parse_bytes(self.non_pytorch_memory, "--non-pytorch-memory", zero=True)
        put(self, "non_pytorch_memory_bytes", outside)
        if hbm_bytes is not None and hbm_bytes - outside <= 0:
            raise TracememError(f"--non-pytorch-memory {self.non_pytorch_memory} leaves "
                                f"nothing of --hbm {self.hbm} for PyTorch")
        put(self, "routing_model", parse_routing(self.routing, self.seed))
        put(self, "replacements", resolve_replacements(self.replace))
        put(self, "megatron_args", tuple(self.megatron_args))
        if self.gpu is not None and self.gpu not in GPUS:
            raise TracememError(f"--gpu {self.gpu!r} is invalid; choose one of "
                                f"{', '.join(GPUS)}")

    def _microbatches(self, par) -> int:
        """M from ``num_microbatches`` or ``global_batch_size`` (module docstring)."""
        m, g, b = self.num_microbatches, self.global_batch_size, self.micro_batch_size
        if m is None and g is None:
            raise TracememError("give --num-microbatches (M, per pipeline per step) or "
                                "--global-batch-size (G sequences per step; M = G / (b x DP))")
        if g is None:
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
                "recompute_modules": list(self.recompute_modules)
                if self.recompute == "selective" else [],
                "attention": self.attention, "experts": self.experts,
                "routing": self.routing, "seed": self.seed, "rounding": self.rounding or 0,
                "kernels": self.profile.name, "kernel_options": dict(self.profile.options),
                "deallocate_pipeline_outputs": self.deallocate_pipeline_outputs,
                "zero3_prefetch": self.zero3_prefetch, "alloc_conf": self.alloc_config.text,
                "non_pytorch_memory_bytes": self.non_pytorch_memory_bytes,
                "optimizer": self.optimizer,
                "replace": {kind: getattr(f, "__qualname__", repr(f))
                            for kind, f in self.replacements.items()},
                "vocab_size": self.config.vocab_size, "origin": self.origin, "gpu": self.gpu}


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
        close = difflib.get_close_matches(name, valid, n=1)
        raise TracememError(f"unknown job keyword {name!r}"
                            + (f"; did you mean {close[0]!r}?" if close else
                               f"; valid: {', '.join(valid)}"))
