"""FP8 tensors of Transformer Engine on meta: each quantised tensor as the uint8 data and the
fp32 / uint8 scale tensors TE allocates for it, so the tracer records them as it would any
other tensor, and the FP8 flow of one TE ``Linear`` / ``LayerNormLinear`` / ``GroupedLinear``.

Mirrors TransformerEngine d0067d0 (2.20.0.dev0), with Megatron-LM d98e8a6 choosing the recipe
(``megatron/core/fp8_utils.py`` ``get_fp8_recipe``: ``--fp8-recipe delayed`` ->
``DelayedScaling``, ``tensorwise`` -> ``Float8CurrentScaling``, ``blockwise`` ->
``Float8BlockScaling``, ``mxfp8`` -> ``MXFP8BlockScaling``). What each recipe's quantiser
allocates (``transformer_engine/pytorch/csrc/quantizer.cpp`` ``*Quantizer::create_tensor``;
the Python mirror is each quantiser's ``inner_tensor_specs`` in ``pytorch/tensor/*.py``):

- ``delayed`` (``Float8Quantizer``) and ``tensorwise`` (``Float8CurrentScalingQuantizer``):
  a ``Float8Tensor``: ``_data`` uint8 of the tensor's shape when row-wise usage is asked *or*
  the GPU runs non-TN FP8 GEMMs, ``_transpose`` uint8 ``(in, rows)`` when column-wise usage is
  asked and it does not, and ``_scale_inv`` fp32 ``(1,)``. Non-TN FP8 GEMMs:
  ``nvte_is_non_tn_fp8_gemm_supported`` (``common/transformer_engine.cpp``): compute
  capability 10.x / 11.x or >= 13.0 (Blackwell), not 9.0 (Hopper): on Hopper the weight- and
  data-gradient GEMMs need the separately transposed copy, on Blackwell one ``_data`` serves
  both (``tensor/storage/float8_tensor_storage.py`` ``update_usage``).
- ``mxfp8`` (``MXFP8Quantizer``): ``_rowwise_data`` / ``_columnwise_data`` uint8, each of the
  tensor's shape, with E8M0 (uint8) scales, one per 32 values along the row (row-wise) or the
  column (column-wise), padded: row-wise ``(roundup(rows, 128), roundup(in / 32, 4))``,
  column-wise ``(roundup(rows / 32, 4), roundup(in, 128))`` (``MXFP8Quantizer::
  get_scale_shape``). Dimensions must be multiples of 32. Blackwell only
  (``quantization.py`` ``_compute_mxfp8_support``: 10.0 <= capability < 12.0).
- ``blockwise`` (``Float8BlockQuantizer``, ``Float8BlockScaling``: activations and gradients
  in 1x128 tiles, ``x_block_scaling_dim = grad_block_scaling_dim = 1``; weights in 128x128
  blocks, ``w_block_scaling_dim = 2``; ``common/recipe/__init__.py``): ``_rowwise_data``
  uint8 of the shape, ``_columnwise_data`` uint8 transposed ``(in, rows)``, fp32 scales
  (``Float8BlockQuantizer::get_scale_shape``): 1x128 row-wise ``(ceil(in / 128),
  roundup(rows, 4))``, column-wise ``(ceil(rows / 128), roundup(in, 4))``; 128x128 row-wise
  ``(ceil(rows / 128), roundup(ceil(in / 128), 4))``, column-wise ``(ceil(in / 128),
  roundup(ceil(rows / 128), 4))``. On Blackwell the GEMM converts the scales to MXFP8's on
  the fly (``csrc/extensions/gemm.cpp``: "Emulate the FP8 block scaling recipe with MXFP8"):
  the stored tensors are the same.

``--fp8-format`` (e4m3 or hybrid: E4M3 forward, E5M2 gradients) changes no byte: both are
one byte a value, in the same buffers.

Known limitations (each below the dispatcher or under a KiB): the GEMM's own transients
(MXFP8 scale swizzles, ``gemm.cpp`` ``swizzle_scales_for_gemm``; blockwise-to-MXFP8 scale
conversions on Blackwell) are scale-sized and not traced; a current-scaling quantiser's fp32
``amax`` / ``scale`` scalars (8 B each) are not counted; the norm kernel's own workspace is
not traced (as in bf16).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from tracemem.errors import TracememError

__all__ = ["FP8_RECIPES", "FP8_FORMATS", "FP8_ARCHS", "Quantized", "quantize", "make_empty",
           "split_quantize", "check_gemm_dims",
           "inner_specs", "fp8_arch", "check_fp8", "non_tn_gemm", "per_tensor",
           "supports_only_rowwise_all_gather", "saved_input_usage", "scale_bytes"]

FP8_RECIPES = ("none", "delayed", "tensorwise", "mxfp8", "blockwise")
FP8_FORMATS = ("e4m3", "hybrid")
# sm90: Hopper (TN-only FP8 GEMMs); sm100: Blackwell (any FP8 GEMM layout). "auto": from the
# job's GPU (tracemem.job.GPUS), Hopper when the GPU is not given
FP8_ARCHS = ("auto", "sm90", "sm100")

MXFP8_BLOCK = 32  # transformer_engine/pytorch/constants.py MXFP8_BLOCK_SCALING_SIZE
BLOCK_LEN = 128  # Float8BlockQuantizer.block_len (tensor/float8_blockwise_tensor.py)
# Float8BlockScaling's block dimensions per role (common/recipe/__init__.py)
_BLOCK_DIM = {"input": 1, "grad": 1, "weight": 2}


_SIZE = {torch.uint8: 1, torch.float32: 4}  # bytes an element of the buffers' dtypes


def _roundup(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _ceildiv(x: int, m: int) -> int:
    return (x + m - 1) // m


def fp8_arch(gpu_arch: tuple[int, int] | None) -> str:
    """The FP8 architecture class of a GPU's compute capability: "sm100" where TE runs
    non-TN FP8 GEMMs (``nvte_is_non_tn_fp8_gemm_supported``: 10.x, 11.x, >= 13.0), else
    "sm90"; None (GPU not given): "sm90", Hopper."""
    if gpu_arch is None:
        return "sm90"
    cc = gpu_arch[0] * 10 + gpu_arch[1]
    return "sm100" if (100 <= cc < 120) or cc >= 130 else "sm90"


def check_fp8(recipe: str, arch: str, gpu_arch: tuple[int, int] | None = None) -> None:
    """Refuse a recipe the GPU cannot run, as TE's ``check_recipe_support`` would
    (``quantization.py``): FP8 needs compute capability 8.9+ (``_compute_fp8_support``),
    MXFP8 10.0 <= capability < 12.0 (``_compute_mxfp8_support``), blockwise 9.0+
    (``_compute_fp8_block_scaling_support``).

    Raises:
        TracememError: the recipe, the GPU and what the recipe needs.
    """
    if recipe == "none":
        return
    if gpu_arch is not None and gpu_arch < (8, 9):
        default = " (Megatron's default)" if recipe == "delayed" else ""  # arguments.py
        raise TracememError(f"FP8 (--fp8-recipe {recipe}{default}) needs compute capability "
                            f"8.9 or higher, as every FP8 recipe does (TE check_fp8_support: "
                            f"Ada, Hopper and later); the GPU has {gpu_arch[0]}.{gpu_arch[1]}: "
                            f"train in bf16 (no --fp8-format)")
    if recipe == "blockwise" and gpu_arch is not None and gpu_arch < (9, 0):
        raise TracememError("--fp8-recipe blockwise needs compute capability 9.0 or higher "
                            "(TE _compute_fp8_block_scaling_support)")
    if recipe == "mxfp8":
        blackwell = arch == "sm100" if gpu_arch is None else (10, 0) <= gpu_arch < (12, 0)
        if not blackwell:
            raise TracememError(
                "--fp8-recipe mxfp8 runs on Blackwell only (TE _compute_mxfp8_support: "
                "compute capability 10.x / 11.x); this job's GPU is "
                + ("Hopper (sm90; no --gpu given: give --gpu B200)" if gpu_arch is None
                   else f"{gpu_arch[0]}.{gpu_arch[1]}"))


def non_tn_gemm(arch: str) -> bool:
    """Whether TE's FP8 GEMMs take any layout (Blackwell): no separate transpose kept."""
    return arch == "sm100"


def per_tensor(recipe: str) -> bool:
    """delayed and tensorwise: one fp32 scale per tensor (``Float8Tensor``)."""
    return recipe in ("delayed", "tensorwise")


def supports_only_rowwise_all_gather(recipe: str) -> bool:
    """``Quantizer.supports_only_rowwise_all_gather``: True for ``Float8Quantizer`` and
    ``Float8CurrentScalingQuantizer`` (``tensor/float8_tensor.py``), False for MXFP8 and
    blockwise (``quantized_tensor.py``)."""
    return per_tensor(recipe)


def _scale_shape(recipe: str, shape: tuple[int, ...], columnwise: bool,
                 role: str) -> tuple[int, ...]:
    rows = math.prod(shape[:-1])
    cols = shape[-1] if shape else 1
    if recipe == "mxfp8":  # MXFP8Quantizer::get_scale_shape
        if columnwise:
            return (_roundup(rows // MXFP8_BLOCK, 4), _roundup(cols, 128))
        return (_roundup(rows, 128), _roundup(cols // MXFP8_BLOCK, 4))
    # Float8BlockQuantizer::get_scale_shape
    if _BLOCK_DIM[role] == 2:
        if columnwise:
            return (_ceildiv(cols, BLOCK_LEN), _roundup(_ceildiv(rows, BLOCK_LEN), 4))
        return (_ceildiv(rows, BLOCK_LEN), _roundup(_ceildiv(cols, BLOCK_LEN), 4))
    if columnwise:
        return (_ceildiv(rows, BLOCK_LEN), _roundup(cols, 4))
    return (_ceildiv(cols, BLOCK_LEN), _roundup(rows, 4))


def inner_specs(recipe: str, shape: Iterable[int], rowwise: bool, columnwise: bool,
                arch: str, role: str = "input") -> dict[str, tuple[tuple[int, ...],
                                                              torch.dtype]]:
    """The buffers of one quantised tensor of logical ``shape``: name -> (shape, dtype), in
    the order TE's ``create_tensor`` allocates them (the quantisers' ``inner_tensor_specs``).
    ``role``: "input", "weight" or "grad" (blockwise: weights in 128x128 blocks, the others
    in 1x128 tiles)."""
    shape = tuple(shape)
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    if per_tensor(recipe):
        non_tn = non_tn_gemm(arch)
        if rowwise or non_tn:
            specs["_data"] = (shape, torch.uint8)
        if columnwise and not non_tn:
            specs["_transpose"] = ((shape[-1], *shape[:-1]), torch.uint8)
        specs["_scale_inv"] = ((1,), torch.float32)
        return specs
    scale_dtype = torch.uint8 if recipe == "mxfp8" else torch.float32  # E8M0 / fp32
    if rowwise:
        specs["_rowwise_data"] = (shape, torch.uint8)
        specs["_rowwise_scale_inv"] = (_scale_shape(recipe, shape, False, role), scale_dtype)
    if columnwise:
        col_shape = shape if recipe == "mxfp8" else (shape[-1], *shape[:-1])
        specs["_columnwise_data"] = (col_shape, torch.uint8)
        specs["_columnwise_scale_inv"] = (_scale_shape(recipe, shape, True, role),
                                          scale_dtype)
    return specs


def scale_bytes(recipe: str, shape: Iterable[int], rowwise: bool, columnwise: bool,
                arch: str, role: str = "input") -> int:
    """Bytes of one quantised tensor's buffers (data and scales), from ``inner_specs``."""
    return sum(math.prod(s) * _SIZE[d] for s, d in
               inner_specs(recipe, shape, rowwise, columnwise, arch, role).values())


class Quantized:
    """One TE quantised tensor (``Float8Tensor``, ``MXFP8Tensor``, ``Float8BlockwiseQTensor``)
    as its buffers on ``device``: ``parts`` name -> tensor (uint8 data, fp32 or uint8
    scales), allocated with ``torch.empty`` so a tracer records each. ``shape`` is the
    logical shape ``(..., in)``."""

    def __init__(self, recipe: str, shape: tuple[int, ...], arch: str, role: str,
                 parts: dict[str, Tensor]):
        self.recipe, self.shape, self.arch, self.role = recipe, tuple(shape), arch, role
        self.parts = parts

    def __repr__(self) -> str:
        return (f"Quantized({self.recipe}, {self.shape}, "
                f"{ {k: tuple(v.shape) for k, v in self.parts.items()} })")

    @property
    def tensors(self) -> list[Tensor]:
        return list(self.parts.values())

    def update_usage(self, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        """TE's ``update_usage``: drop the buffers a usage no longer needs; for a
        ``Float8Tensor`` on Hopper, make the transpose (``_create_transpose``: a new
        ``(in, rows)`` uint8) when column-wise usage is asked and only ``_data`` exists
        (``float8_tensor_storage.py``). MXFP8 and blockwise only drop
        (``mxfp8_tensor_storage.py`` ``update_usage``)."""
        p = self.parts
        if per_tensor(self.recipe):
            if non_tn_gemm(self.arch):  # one _data serves both usages
                return
            need_data = "_data" in p if rowwise is None else rowwise
            need_t = "_transpose" in p if columnwise is None else columnwise
            if need_t and "_transpose" not in p:
                data = p["_data"]
                p["_transpose"] = torch.empty((self.shape[-1], *self.shape[:-1]),
                                              dtype=torch.uint8, device=data.device)
            if not need_data:
                p.pop("_data", None)
            if not need_t:
                p.pop("_transpose", None)
            return
        if rowwise is False:
            p.pop("_rowwise_data", None)
            p.pop("_rowwise_scale_inv", None)
        if columnwise is False:
            p.pop("_columnwise_data", None)
            p.pop("_columnwise_scale_inv", None)


def make_empty(recipe: str, shape: Iterable[int], rowwise: bool, columnwise: bool, arch: str,
               device: torch.device, role: str = "input") -> Quantized:
    """An uninitialised quantised tensor (TE's ``quantizer.make_empty`` / ``create_tensor``):
    every buffer of ``inner_specs`` allocated on ``device``."""
    shape = tuple(shape)
    parts = {name: torch.empty(s, dtype=d, device=device)
             for name, (s, d) in inner_specs(recipe, shape, rowwise, columnwise, arch,
                                             role).items()}
    return Quantized(recipe, shape, arch, role, parts)


def quantize(x: Tensor, recipe: str, arch: str, rowwise: bool = True, columnwise: bool = True,
             role: str = "input") -> Quantized:
    """``quantizer(x)`` (``tex.quantize`` into ``create_tensor``'s buffers): ``x``
    ``(..., in)`` in high precision to a ``Quantized`` of its shape, with the usages asked.

    Raises:
        TracememError: an MXFP8 tensor whose flattened dimensions are not multiples of 32
            (``MXFP8Quantizer::create_tensor``'s check).
    """
    shape = tuple(x.shape)
    if recipe == "mxfp8" and (math.prod(shape[:-1]) % MXFP8_BLOCK or shape[-1] % MXFP8_BLOCK):
        raise TracememError(f"--fp8-recipe mxfp8 needs tensor dimensions that are multiples "
                            f"of 32 (TE MXFP8Quantizer::create_tensor); got {list(shape)}")
    return make_empty(recipe, shape, rowwise, columnwise, arch, x.device, role)


def check_gemm_dims(*shapes: tuple[int, ...]) -> None:
    """TE's ``assert_dim_for_fp8_exec`` (``pytorch/utils.py``), which ``_Linear`` and
    ``_LayerNormLinear`` run on the input and the weight under FP8: the product of the leading
    dimensions a multiple of 8, the last a multiple of 16.

    Raises:
        TracememError: the first shape that is not, with TE's rule.
    """
    for shape in shapes:
        if math.prod(shape[:-1]) % 8 or shape[-1] % 16:
            raise TracememError(f"FP8 needs the product of all dimensions but the last to be "
                                f"a multiple of 8 and the last a multiple of 16 (TE "
                                f"assert_dim_for_fp8_exec); got {list(shape)}")


def saved_input_usage(recipe: str, arch: str, gathered_in_backward: bool) -> dict[str, bool]:
    """Which usage of a linear's quantised input TE keeps for backward (``module/linear.py``
    ``_linear_forward_impl``, "Discard unneeded data in input tensor"): row-wise only when the
    backward re-gathers it (column-parallel with SP) and the recipe gathers only row-wise data
    (per-tensor FP8); otherwise column-wise only (the wgrad GEMM's operand)."""
    if gathered_in_backward and supports_only_rowwise_all_gather(recipe):
        return {"rowwise": True, "columnwise": False}
    return {"rowwise": False, "columnwise": True}


_BULK_DATA_ALIGN, _BULK_SCALE_ALIGN = 256, 16  # cast.cpp bulk_allocate_*_tensors alignments


def split_quantize(x: Tensor, counts: list[int], recipe: str, arch: str, rowwise: bool,
                   columnwise: bool, role: str = "input", bulk: bool = True) -> list[Quantized]:
    """TE's ``_split_quantize`` (``module/_split_quantization.py`` -> ``tex.split_quantize``,
    ``csrc/extensions/cast.cpp``) of ``x`` ``(rows, in)`` into one quantised tensor per
    expert of ``counts`` rows. Per-tensor FP8 allocates each expert's tensor on its own
    (``AllocationMethod::UNFUSED``); MXFP8 and blockwise bulk-allocate one uint8 buffer per
    usage (``bulk_allocate_mxfp8_tensors`` / ``bulk_allocate_fp8_blockwise_tensors``: every
    expert's data at 256-byte offsets, then every expert's scales at 16-byte offsets, plus
    256 bytes of alignment pad: ``allocate.cpp`` ``bulk_allocate``), whose views the experts'
    tensors are: a usage's buffer is freed when every expert has dropped it. ``bulk`` False
    (``disable_bulk_allocation``, which ``_GroupedLinear`` passes under TE's CPU offloading):
    each expert's tensors allocated on their own, as per-tensor FP8's."""
    h = x.shape[-1]
    shapes = [(m, h) for m in counts]
    if recipe == "mxfp8" and (h % MXFP8_BLOCK or any(m % MXFP8_BLOCK for m in counts)):
        raise TracememError(f"--fp8-recipe mxfp8 needs each expert's rows and the hidden size "
                            f"to be multiples of 32 (TE MXFP8Quantizer); got rows {counts}, "
                            f"hidden {h}")
    if per_tensor(recipe) or not bulk:
        return [make_empty(recipe, s, rowwise, columnwise, arch, x.device, role)
                for s in shapes]
    parts: list[dict[str, Tensor]] = [{} for _ in shapes]
    for usage, wanted in (("rowwise", rowwise), ("columnwise", columnwise)):
        if not wanted:
            continue
        specs = [inner_specs(recipe, s, usage == "rowwise", usage == "columnwise", arch, role)
                 for s in shapes]
        items = [(i, name, s, d) for i, sp in enumerate(specs)
                 for name, (s, d) in sp.items() if name.endswith("data")]
        items += [(i, name, s, d) for i, sp in enumerate(specs)
                  for name, (s, d) in sp.items() if name.endswith("scale_inv")]
        offsets, size = [], 0
        for _, name, s, d in items:
            align = _BULK_DATA_ALIGN if name.endswith("data") else _BULK_SCALE_ALIGN
            offset = _roundup(size, align)
            offsets.append(offset)
            size = offset + math.prod(s) * _SIZE[d]
        base = torch.empty(size + _BULK_DATA_ALIGN, dtype=torch.uint8, device=x.device)
        for (i, name, s, d), offset in zip(items, offsets):
            n = math.prod(s) * _SIZE[d]
            parts[i][name] = base.narrow(0, offset, n).view(d).view(s)
        del base
    return [Quantized(recipe, s, arch, role, p) for s, p in zip(shapes, parts)]
