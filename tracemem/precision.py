"""Precision recipes in Megatron-LM's terms: the bytes per parameter element of the model's
parameters, the main-grad buffer and the optimizer states.

Fields are Megatron's flags (megatron/training/arguments.py, ``_add_mixed_precision_args`` and
the precision-aware-optimizer group; megatron/core/optimizer/optimizer_config.py
``OptimizerConfig``), at NVIDIA/Megatron-LM d98e8a6:

- ``use_precision_aware_optimizer`` (``--use-precision-aware-optimizer``, default off): TE's
  FusedAdam keeps the master weights and moments in the dtypes below. Megatron supports it only
  with the distributed optimizer (optimizer/__init__.py ``get_megatron_optimizer``), i.e.
  ``--zero`` 1 or more here, and only for Adam.
- ``main_grads_dtype`` (fp32 | bf16), ``main_params_dtype`` (fp32 | fp16), ``exp_avg_dtype``,
  ``exp_avg_sq_dtype`` (fp32 | fp16 | bf16 | fp8), each default fp32; other than fp32 only with
  the precision-aware optimizer (``OptimizerConfig.__post_init__`` asserts it).
- ``grad_reduce_in_bf16`` (``--grad-reduce-in-bf16``): the main-grad buffer is bf16.
  arguments.py ``validate_args``: gradients accumulate and reduce in fp32
  (``accumulate_allreduce_grads_in_fp32``) when main grads are fp32 and this flag is off; the
  DDP grad buffer's dtype is fp32 then, else the parameters' (distributed_data_parallel.py,
  ``grad_reduce_in_fp32``).
- ``store_param_remainders`` (``OptimizerConfig``, default True; no command-line flag in
  Megatron): with the precision-aware optimizer, fp32 master weights and bf16 parameters, TE's
  FusedAdam keeps only the 16 low bits of each fp32 master weight as int16, the high 16 being
  the bf16 parameter (transformer_engine/pytorch/optimizers/fused_adam.py ``FusedAdam.__init__``:
  "Works only when master params is in FP32"; distrib_optimizer.py: ``master_param`` state is
  ``torch.int16`` when ``store_param_remainders and bf16``).
- ``gradient_accumulation_fusion`` (Megatron's default on, ``--no-gradient-accumulation-fusion``
  turns it off): linear layers write their weight gradient straight into the main grad
  (megatron/core/tensor_parallel/layers.py ``LinearWithGradAccumulationAndAsyncCommunication``;
  TE ``fuse_wgrad_accumulation``), so no transient bf16 weight gradient exists. It changes the
  trace, not static memory. None (the default) leaves it to the kernel profile: on under
  ``megatron-te`` (its TE linears write into ``main_grad``), off under ``eager`` / ``torch``;
  set, it is the megatron-te kernels' option, and under eager / torch ``tracemem.estimate``
  drops the weight gradients from the trace.

Parameters are bf16 (2 B) in every recipe but ``fsdp2``. ``fsdp2`` is torchtitan's FSDP2 mixed
precision (torchtitan 0.3.0 ``torchtitan/distributed/fsdp.py`` ``apply_fsdp_to_decoder``:
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``, from
``training.mixed_precision_param`` / ``mixed_precision_reduce``, ``torchtitan/config/configs.py``
``TrainingConfig``; the model is built in ``training.dtype`` float32): ``fully_shard`` keeps each
parameter as an fp32 sharded DTensor, its gradient is reduce-scattered in fp32 into the sharded
``.grad``, and AdamW steps those fp32 shards with two fp32 moments: 4 + 4 + 8 = 16 B per sharded
parameter, no separate master weights (``params_dtype`` fp32, ``master_weights`` False). The bf16
copies exist only while a unit is gathered (torch 2.13
``torch/distributed/fsdp/_fully_shard/_fsdp_param.py`` ``FSDPParam.init_unsharded_param``: the
all-gather output in ``param_dtype``): ``gathered_param_bytes``, 2 B in every recipe.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from tracemem.errors import TracememError

__all__ = ["Precision", "PRECISION_RECIPES", "PRECISION_FLAGS", "DTYPE_CHOICES", "DTYPE_BYTES",
           "FSDP2_RECIPES", "resolve_precision"]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
DTYPE_CHOICES = {
    "main_grads_dtype": ("fp32", "bf16"),
    "main_params_dtype": ("fp32", "fp16"),
    "exp_avg_dtype": ("fp32", "fp16", "bf16", "fp8"),
    "exp_avg_sq_dtype": ("fp32", "fp16", "bf16", "fp8"),
}
_BOOLS = ("use_precision_aware_optimizer", "grad_reduce_in_bf16", "store_param_remainders",
          "gradient_accumulation_fusion")
# the keywords of ParallelConfig.create / estimate that override a recipe's field
PRECISION_FLAGS = ("use_precision_aware_optimizer", "main_grads_dtype", "main_params_dtype",
                   "exp_avg_dtype", "exp_avg_sq_dtype", "grad_reduce_in_bf16",
                   "store_param_remainders", "gradient_accumulation_fusion")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Precision:
    """A precision recipe (module docstring for each field). Bytes per parameter element,
    before ZeRO sharding: ``param_bytes`` (bf16 parameters), ``grad_bytes`` (the main-grad
    buffer), ``master_bytes`` and ``optimizer_bytes`` (master weights + Adam's two moments)."""

    name: str
    use_precision_aware_optimizer: bool = False
    main_grads_dtype: str = "fp32"
    main_params_dtype: str = "fp32"
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    grad_reduce_in_bf16: bool = False
    store_param_remainders: bool = True
    gradient_accumulation_fusion: bool | None = None
    params_dtype: str = "bf16"  # the parameters as the rank keeps them (sharded under FSDP2)
    master_weights: bool = True  # the optimizer keeps its own fp32 copy (False: fsdp2)
    source: str = ""

    @property
    def param_bytes(self) -> int:
        """Bytes per element of the parameters as kept (fp32 shards under ``fsdp2``)."""
        return DTYPE_BYTES[self.params_dtype]

    @property
    def gathered_param_bytes(self) -> int:
        """Bytes per element of a parameter as the forward and backward use it: bf16 (the
        model's parameters, or FSDP2's all-gathered ``param_dtype`` copies)."""
        return 2

    @property
    def grad_bytes(self) -> int:
        fp32 = self.main_grads_dtype == "fp32" and not self.grad_reduce_in_bf16
        return 4 if fp32 else 2

    @property
    def remainders(self) -> bool:
        """Whether the fp32 master weights are kept as int16 remainders."""
        return (self.use_precision_aware_optimizer and self.store_param_remainders
                and self.main_params_dtype == "fp32")

    @property
    def master_bytes(self) -> int:
        if not self.master_weights:
            return 0  # fsdp2: AdamW steps the fp32 parameters themselves
        if not self.use_precision_aware_optimizer:
            return 4  # Megatron's own fp32 main params (distrib_optimizer.py)
        return 2 if self.remainders else DTYPE_BYTES[self.main_params_dtype]

    @property
    def optimizer_bytes(self) -> int:
        return (self.master_bytes + DTYPE_BYTES[self.exp_avg_dtype]
                + DTYPE_BYTES[self.exp_avg_sq_dtype])

    def as_dict(self) -> dict:
        """The fields and the bytes per parameter, for JSON."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "source"}
        out.update(param_bytes=self.param_bytes,
                   gathered_param_bytes=self.gathered_param_bytes, grad_bytes=self.grad_bytes,
                   master_bytes=self.master_bytes, optimizer_bytes=self.optimizer_bytes)
        return out


PRECISION_RECIPES = {
    "megatron": Precision(
        "megatron",
        source="Megatron-LM defaults (arguments.py; theoretical_memory_usage.py): bf16 "
               "parameters 2 B, fp32 main gradients 4 B, fp32 master weights and Adam m, v "
               "12 B; 18 B per parameter without the distributed optimizer"),
    "paper-2502.07846": Precision(
        "paper-2502.07846", use_precision_aware_optimizer=True, exp_avg_dtype="bf16",
        exp_avg_sq_dtype="bf16", store_param_remainders=False,
        source="arXiv 2502.07846, static-memory table: parameters 2 B, gradients 4 B, "
               "optimizer states 8 B per parameter (fp32 master, bf16 moments)"),
    "deepseek-v3": Precision(
        "deepseek-v3", use_precision_aware_optimizer=True, exp_avg_dtype="bf16",
        exp_avg_sq_dtype="bf16", store_param_remainders=False,
        source="DeepSeek-V3 technical report (arXiv 2412.19437) section 3.3.3: bf16 "
               "parameters, fp32 master weights and gradients, bf16 AdamW moments: "
               "2 + 4 + (4 + 2 + 2) B"),
    "fsdp2": Precision(
        "fsdp2", params_dtype="fp32", master_weights=False,
        source="torchtitan 0.3.0 torchtitan/distributed/fsdp.py apply_fsdp_to_decoder: "
               "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over fp32 "
               "parameters: fp32 sharded parameters 4 B, fp32 sharded gradients 4 B, AdamW "
               "m, v 8 B: 16 B per sharded parameter; bf16 unsharded copies only while "
               "gathered"),
}
# recipes that are FSDP2's own (ZeRO-3 only; Megatron's precision flags do not apply)
FSDP2_RECIPES = ("fsdp2",)


def resolve_precision(recipe: str, zero: int, **overrides) -> Precision:
    """The recipe ``recipe`` (a ``PRECISION_RECIPES`` key) with ``overrides`` (the
    ``PRECISION_FLAGS``; None keeps the recipe's value), checked as Megatron checks them.

    Raises:
        TracememError: an unknown recipe or keyword, a value of the wrong type or outside its
            choices, a dtype other than fp32 without the precision-aware optimizer, or the
            precision-aware optimizer without the distributed optimizer (``zero`` 0).
    """
    if not isinstance(recipe, str) or recipe not in PRECISION_RECIPES:
        raise TracememError(f"--precision {recipe!r} is invalid; choose one of "
                            f"{', '.join(PRECISION_RECIPES)}")
    unknown = set(overrides) - set(PRECISION_FLAGS)
    if unknown:
        raise TracememError(f"unknown precision keyword {sorted(unknown)[0]!r}; valid: "
                            f"{', '.join(PRECISION_FLAGS)}")
    for name, value in overrides.items():
        if value is None:
            continue
        if name in _BOOLS and not isinstance(value, bool):  # None: the recipe's / profile's
            raise TracememError(f"{_flag(name)} {value!r} must be True or False")
        if name in DTYPE_CHOICES and value not in DTYPE_CHOICES[name]:
            raise TracememError(f"{_flag(name)} {value!r} is invalid; choose one of "
                                f"{', '.join(DTYPE_CHOICES[name])}")
    chosen = {k: v for k, v in overrides.items() if v is not None}
    if recipe in FSDP2_RECIPES:
        if zero != 3:
            raise TracememError(f"--precision {recipe} is FSDP2's mixed precision (fp32 "
                                f"sharded parameters); use --zero 3")
        if chosen:
            name = sorted(chosen)[0]
            raise TracememError(f"{_flag(name)} is a Megatron-LM precision flag; it does not "
                                f"apply to --precision {recipe} (FSDP2's MixedPrecisionPolicy)")
    spec = replace(PRECISION_RECIPES[recipe], **chosen)
    if not spec.use_precision_aware_optimizer:
        for name in DTYPE_CHOICES:
            if getattr(spec, name) != "fp32":
                raise TracememError(
                    f"{_flag(name)} {getattr(spec, name)} needs --use-precision-aware-optimizer "
                    f"(Megatron's OptimizerConfig: only fp32 without it)")
    elif zero == 0:
        via = "" if "use_precision_aware_optimizer" in chosen else \
            f" (--precision {recipe} uses it)"
        raise TracememError(
            f"--use-precision-aware-optimizer{via} needs Megatron's distributed optimizer: "
            f"use --zero 1 or more")
    return spec
