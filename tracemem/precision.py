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

Parameters are bf16 in every recipe (2 B).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from tracemem.errors import TracememError

__all__ = ["Precision", "PRECISION_RECIPES", "PRECISION_FLAGS", "DTYPE_CHOICES", "DTYPE_BYTES",
           "resolve_precision"]

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
    source: str = ""

    param_bytes = 2

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
        out.update(param_bytes=self.param_bytes, grad_bytes=self.grad_bytes,
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
}


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
