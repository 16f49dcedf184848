"""Transformer Engine linear layers with their tensor- and sequence-parallel communication:
``Linear`` (duplicated, column- or row-parallel) and ``LayerNormLinear`` (an RMSNorm or a
LayerNorm fused in front of a column-parallel linear).

Mirrors TransformerEngine d0067d0 (2.20.0.dev0), ``transformer_engine/pytorch/module/linear.py``
``_Linear.forward`` / ``backward`` and ``module/layernorm_linear.py`` ``_LayerNormLinear``:

- forward, column-parallel with sequence parallelism: the local input ``(b, s / sp, in)`` is
  all-gathered into a buffer ``(b, s, in)`` for the GEMM and that buffer is freed after it
  (``clear_tensor_data(inputmat_total)``); only the *local* input is saved
  (``backward_input_needs_gather``). Row-parallel: the GEMM output ``(b, s, out)`` is
  reduce-scattered to ``(b, s / sp, out)``; the input is saved.
- ``LayerNormLinear``: the norm's input (a contiguous copy when the caller passes a view that
  is not contiguous: ``inputmat = inp.view(...)`` needs one), its output ``ln_out`` (local) and
  the fp32 rsigma ``(tokens,)`` are saved, and with ``normalization="LayerNorm"`` (the norm has
  a bias) the fp32 mu ``(tokens,)`` too (``apply_normalization`` returns ``ln_out, mu,
  rsigma``; ``prepare_for_saving(inputmat, ..., ln_out_to_save, mu, rsigma)``); ``ln_out`` is
  all-gathered for the GEMM and re-gathered in backward, whose ``layernorm_bwd`` /
  ``rmsnorm_bwd`` allocates dx, dgamma (and dbeta).
- backward: the input is re-gathered for the weight gradient (launched before the dgrad GEMM),
  the dgrad GEMM output ``(b, s, in)`` is reduce-scattered (column) and freed; row-parallel
  gathers the output gradient first and frees it after the wgrad GEMM. With Megatron's
  ``--gradient-accumulation-fusion`` (its default with TE) the weight gradient is written into
  the fp32 ``main_grad`` (no allocation; TE's cached dummy wgrad is not counted: see
  docs/kernels.md), else a weight gradient in the weight's dtype is allocated. Inside
  ``modeling.kernels.wgrad.delayed_wgrad`` the weight gradient is deferred to a W step
  (``delay_wgrad_compute``).

Under an FP8 recipe (``fp8_recipe``) ``_TEFp8Linear`` runs instead: the same communication
with the quantised tensors of ``modeling.kernels.fp8`` (docs/kernels.md, "FP8").

Several weights give one output of their summed widths, as Megatron's fused ``linear_fc1``
(gate and up projections in one ``(2f, h)`` weight) does. All shapes here are this rank's.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from modeling.kernels import fp8
from modeling.kernels.wgrad import current_store
from modeling.parallel.collectives import _comm, _gather, _scatter

__all__ = ["te_linear"]

_MODES = ("duplicated", "column", "row")


class _TELinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, mode: str, sp: int, norm_weight: Tensor | None,
                norm_bias: Tensor | None, fuse_wgrad: bool, num_biases: int,
                *tensors: Tensor) -> Tensor:
        # tensors: the weights, then num_biases biases (added in the GEMM's epilogue: no
        # tensor of their own in forward; backward allocates each bias gradient)
        weights = tensors[:len(tensors) - num_biases]
        ctx.biases = tensors[len(weights):]
        ctx.mode, ctx.sp, ctx.fuse_wgrad = mode, sp, fuse_wgrad
        ctx.has_norm = norm_weight is not None
        ctx.norm_bias = norm_bias  # a parameter (LayerNorm's beta), or None (RMSNorm)
        out_features = sum(w.shape[0] for w in weights)
        if norm_weight is not None:  # LayerNormLinear: the norm, then the GEMM on ln_out
            x = x.contiguous()
            ln_out = torch.empty_like(x)
            stats = [torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
                     for _ in range(1 if norm_bias is None else 2)]  # [mu,] rsigma
            gemm_in = ln_out
            ctx.num_stats = len(stats)
            ctx.save_for_backward(x, ln_out, *stats, norm_weight, *weights)
        else:
            gemm_in = x
            ctx.save_for_backward(x, *weights)
        gathered = mode == "column" and sp > 1
        total = _gather(gemm_in, sp, 1) if gathered else gemm_in  # (b, s, in)
        out = total.new_empty((*total.shape[:-1], out_features))
        del total  # the gathered input is freed after the GEMM
        if mode == "row" and sp > 1:
            out = _scatter(out, sp, 1)  # (b, s / sp, out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.has_norm:
            x, ln_out, *rest = ctx.saved_tensors
            norm_weight, *weights = rest[ctx.num_stats:]
            gemm_in = ln_out
        else:
            x, *weights = ctx.saved_tensors
            gemm_in = x
        mode, sp = ctx.mode, ctx.sp
        grad_total = _gather(grad, sp, 1) if mode == "row" and sp > 1 else grad
        in_total = _gather(gemm_in, sp, 1) if mode == "column" and sp > 1 else gemm_in
        dgrad = grad_total.new_empty((*grad_total.shape[:-1], weights[0].shape[1]))
        if mode == "column" and sp > 1:
            dgrad = _scatter(dgrad, sp, 1)  # reduce-scatter; the GEMM output is freed
        store = current_store()
        if store is not None:  # delay_wgrad_compute: keep [inputmat_total, grad_output]
            store.append(((in_total, grad_total), weights, ctx.fuse_wgrad))
            wgrads = [None] * len(weights)
        else:
            wgrads = [None if ctx.fuse_wgrad else torch.empty_like(w) for w in weights]
        del in_total, grad_total  # after the wgrad GEMM
        bgrads = [torch.empty_like(b) for b in ctx.biases]  # grad_bias (bgrad of the GEMM)
        if not ctx.has_norm:
            return (dgrad, None, None, None, None, None, None, *wgrads, *bgrads)
        # rmsnorm_bwd(dgrad, inputmat, rsigma, ln_weight) -> dx, dgamma; layernorm_bwd(dgrad,
        # inputmat, mu, rsigma, ln_weight) -> dx, dgamma, dbeta
        dx = torch.empty_like(x)
        del dgrad
        dgamma = torch.empty_like(norm_weight)
        dbeta = None if ctx.norm_bias is None else torch.empty_like(ctx.norm_bias)
        return (dx, None, None, dgamma, dbeta, None, None, *wgrads, *bgrads)


class _TEFp8Linear(torch.autograd.Function):
    """``_TELinear`` under an FP8 recipe (``modeling.kernels.fp8``): TE d0067d0
    ``module/linear.py`` ``_linear_forward_impl`` / ``_linear_backward`` and
    ``module/layernorm_linear.py`` ``_LayerNormLinear`` with a quantiser on the input, the
    weight (its FP8 copy is TE's cached weight workspace: static memory, not allocated
    here) and the output gradient. See ``te_linear``."""

    @staticmethod
    def forward(ctx, x: Tensor, mode: str, sp: int, norm_weight: Tensor | None,
                norm_bias: Tensor | None, fuse_wgrad: bool, num_biases: int, recipe: str,
                arch: str, save_original: bool | str, *tensors: Tensor) -> Tensor:
        weights = tensors[:len(tensors) - num_biases]
        ctx.biases = tensors[len(weights):]
        ctx.mode, ctx.sp, ctx.fuse_wgrad = mode, sp, fuse_wgrad
        ctx.recipe, ctx.arch = recipe, arch
        ctx.has_norm = norm_weight is not None
        ctx.norm_bias = norm_bias
        out_features = sum(w.shape[0] for w in weights)
        fp8.check_gemm_dims(tuple(x.shape), (out_features, weights[0].shape[1]))
        gathered = mode == "column" and sp > 1  # with_input_all_gather_nccl
        row_only = fp8.supports_only_rowwise_all_gather(recipe)
        stats: list[Tensor] = []
        if norm_weight is not None:
            # LayerNormLinear: the norm kernel writes ln_out quantised (rmsnorm_fwd /
            # layernorm_fwd, csrc/extensions/normalization.cpp): delayed fully fused; the
            # other recipes "compute norm in high precision, then quantize" through a bf16
            # ln_out of the input's shape (freed after). save_original_input does not apply.
            save_original = False
            x = x.contiguous()
            stats = [torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
                     for _ in range(1 if norm_bias is None else 2)]  # [mu,] rsigma
            columnwise = not (gathered and row_only)
            local = fp8.quantize(x, recipe, arch, True, columnwise)
            if recipe != "delayed":
                hp = torch.empty_like(x)  # the unquantised ln_out, quantised into local
                del hp
        else:
            # Linear: input_quantizer.set_usage(rowwise=True, columnwise=backward_needs_input
            # and not save_original_input); per-tensor FP8 never column-wise before a gather
            columnwise = not save_original and not (gathered and row_only)
            local = fp8.quantize(x, recipe, arch, True, columnwise)
        total = _fp8_gather(local, sp, rowwise=True, columnwise=False) if gathered else local
        out = x.new_empty((*x.shape[:-2], x.shape[-2] * (sp if gathered else 1),
                           out_features))
        del total  # clear_tensor_data(inputmat_total) after the GEMM
        if mode == "row" and sp > 1:
            out = _scatter(out, sp, 1)  # (b, s / sp, out)
        ctx.save_original = save_original
        if save_original:  # the bf16 input itself is saved; its FP8 copy dies here
            saved = [x]
            if save_original == "e5m6":  # DeepSeek-V3's E5M6 cache: its 1x128 scales too
                saved.append(torch.empty((*x.shape[:-1], -(-x.shape[-1] // fp8.BLOCK_LEN)),
                                         dtype=torch.float32, device=x.device))
            ctx.input_parts = None
        else:
            usage = fp8.saved_input_usage(recipe, arch, gathered)
            local.update_usage(**usage)
            ctx.input_parts = list(local.parts)
            saved = local.tensors
        ctx.input_shape = local.shape
        del local
        ctx.num_saved = len(saved)
        ctx.num_stats = len(stats)
        if norm_weight is not None:
            ctx.save_for_backward(x, *saved, *stats, norm_weight, *weights)
        else:
            ctx.save_for_backward(*saved, *weights)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        tensors = list(ctx.saved_tensors)
        x = tensors.pop(0) if ctx.has_norm else None
        saved = tensors[:ctx.num_saved]
        rest = tensors[ctx.num_saved:]
        if ctx.has_norm:
            norm_weight, *weights = rest[ctx.num_stats:]
        else:
            weights = rest
        del tensors, rest
        mode, sp, recipe, arch = ctx.mode, ctx.sp, ctx.recipe, ctx.arch
        # grad_output_preprocess (module/base.py): quantised with both usages (dgrad and
        # wgrad GEMMs); row-parallel with SP gathers it, quantised, first
        if mode == "row" and sp > 1:
            local_g = fp8.quantize(grad, recipe, arch, True, not fp8.per_tensor(recipe),
                                   role="grad")
            grad_q = _fp8_gather(local_g, sp, rowwise=True, columnwise=True)
            del local_g
        else:
            grad_q = fp8.quantize(grad, recipe, arch, True, True, role="grad")
        gathered = mode == "column" and sp > 1  # backward_input_needs_gather
        if ctx.save_original:  # requantised for the wgrad GEMM
            row_only = fp8.supports_only_rowwise_all_gather(recipe)
            inp = fp8.quantize(saved[0], recipe, arch, row_only, not (row_only and gathered))
        else:
            inp = fp8.Quantized(recipe, ctx.input_shape, arch, "input",
                                dict(zip(ctx.input_parts, saved)))
        del saved
        if gathered:  # set_quantizer_usage_for_wgrad_all_gather
            per = fp8.supports_only_rowwise_all_gather(recipe)
            in_total = _fp8_gather(inp, sp, rowwise=per, columnwise=not per)
            in_total.update_usage(columnwise=True)  # Hopper per-tensor: the transpose
        else:
            in_total = inp
            in_total.update_usage(columnwise=True)
        del inp
        # dgrad GEMM (b, s, in) in the activations' dtype; column + SP reduce-scattered
        rows = ctx.input_shape[-2] * (sp if gathered else 1)
        dgrad = grad.new_empty((*grad.shape[:-2], rows, weights[0].shape[1]))
        if gathered:
            dgrad = _scatter(dgrad, sp, 1)
        store = current_store()
        if store is not None:  # delay_wgrad_compute: [inputmat_total, grad_output] kept
            store.append(((*in_total.tensors, *grad_q.tensors), weights, ctx.fuse_wgrad))
            wgrads = [None] * len(weights)
        else:
            wgrads = [None if ctx.fuse_wgrad else torch.empty_like(w) for w in weights]
        del in_total, grad_q  # clear_tensor_data after the wgrad GEMM
        bgrads = [torch.empty_like(b) for b in ctx.biases]
        none = (None,) * 9  # mode, sp, norm weight / bias, fuse, num_biases, recipe, arch, orig
        if not ctx.has_norm:
            return (dgrad, *none, *wgrads, *bgrads)
        dx = torch.empty_like(x)
        del dgrad
        dgamma = torch.empty_like(norm_weight)
        dbeta = None if ctx.norm_bias is None else torch.empty_like(ctx.norm_bias)
        return (dx, None, None, dgamma, dbeta, None, None, None, None, None, *wgrads, *bgrads)


def _fp8_gather(q: "fp8.Quantized", sp: int, rowwise: bool, columnwise: bool) -> "fp8.Quantized":
    """TE's ``gather_along_first_dim`` of a quantised tensor over ``sp`` ranks
    (``distributed.py``): per-tensor FP8 (``_all_gather_fp8``) gathers ``_data`` into a new
    ``(b, s, in)`` uint8 and shares the local ``_scale_inv``, making the gathered transpose
    only when column-wise usage is asked on Hopper (``make_empty`` with the usage);
    MXFP8 / blockwise (``_all_gather_mxfp8``, ``_start_all_gather_fp8_blockwise``) gather the
    usages asked, data and scales, into buffers of the gathered shape."""
    shape = (*q.shape[:-2], q.shape[-2] * sp, q.shape[-1])
    device = q.tensors[0].device
    if fp8.per_tensor(q.recipe):
        specs = fp8.inner_specs(q.recipe, shape, True, columnwise, q.arch, q.role)
        parts = {name: torch.empty(s, dtype=d, device=device) for name, (s, d) in specs.items()
                 if name != "_scale_inv"}
        parts["_scale_inv"] = q.parts["_scale_inv"]  # "assume scaling factors are identical"
        out = fp8.Quantized(q.recipe, shape, q.arch, q.role, parts)
    else:
        out = fp8.make_empty(q.recipe, shape, rowwise, columnwise, q.arch, device, q.role)
    for name, t in out.parts.items():
        if name.endswith("data") or name == "_transpose":
            _comm(t)
    return out


def te_linear(x: Tensor, weights: list[Tensor], mode: str = "duplicated", sp: int = 1,
              norm: nn.Module | None = None, fuse_wgrad: bool = True,
              biases: list[Tensor] = (), fp8_recipe: str = "none", fp8_arch: str = "sm90",
              save_original_input: bool | str = False) -> Tensor:
    """A TE linear on this rank's ``x`` ``(b, s_local, in)``.

    Args:
        weights: ``(out_i, in)`` each; the output is ``(..., sum(out_i))``.
        mode: ``"duplicated"`` (replicated weight, no communication: MLA's down
            projections), ``"column"`` (with ``sp`` > 1 the input is all-gathered along the
            sequence: output ``(b, s, out)``) or ``"row"`` (with ``sp`` > 1 the output is
            reduce-scattered: ``(b, s / sp, out)``).
        norm: a norm fused in front (TE ``LayerNormLinear``), or None: an RMSNorm (its
            ``weight`` ``(in,)``) or a LayerNorm (``weight`` and ``bias`` ``(in,)``; TE's
            ``normalization="LayerNorm"``).
        fuse_wgrad: Megatron's ``--gradient-accumulation-fusion``.
        biases: ``(out_i,)`` each, for the weights that have one (``bias=True``: Qwen2's
            ``linear_qkv``); TE adds them in the GEMM and allocates their gradients in
            backward (``_Linear.backward``: ``grad_bias``), never under main_grad fusion.
        fp8_recipe: "none" (bf16) or an FP8 recipe (``modeling.kernels.fp8.FP8_RECIPES``):
            the input, its gathers and the output gradient become quantised tensors
            (``_TEFp8Linear``); ``fp8_arch`` "sm90" (Hopper) or "sm100" (Blackwell).
        save_original_input: under FP8, keep the bf16 input for backward instead of its FP8
            copy (Megatron's ``set_save_original_input``; ignored by ``LayerNormLinear``);
            "e5m6": DeepSeek-V3's E5M6 cache of the attention output (arXiv 2412.19437 3.3.3,
            the megatron-te option ``e5m6_attention_output``): the input kept as the 16-bit
            container of its 12-bit values (the bf16 input's storage, which attention saves
            too: one cache serves both backwards) and one fp32 scale per 1x128 tile beside
            it, ``(..., ceil(in / 128))``, freed with the input after this backward.

    Raises:
        ValueError: unknown mode (an internal error: modules pass constants).
        TracememError: under mxfp8, dimensions that are not multiples of 32 (TE's check).
    """
    if mode not in _MODES:
        raise ValueError(f"mode {mode!r} not in {_MODES}")
    if norm is None and not x.is_contiguous():
        # TE d0067d0 module/base.py TransformerEngineBaseModule.prepare_forward: a strided
        # input (not a QuantizedTensor) is made contiguous before the GEMM, and that copy is
        # what _Linear saves (MLA's kv latent, a split of linear_kv_down_proj's output, when
        # no norm is fused in front: Megatron without --qk-layernorm)
        x = x.contiguous()
    if fp8_recipe != "none":
        return _TEFp8Linear.apply(x, mode, sp, None if norm is None else norm.weight,
                                  getattr(norm, "bias", None), fuse_wgrad, len(biases),
                                  fp8_recipe, fp8_arch, save_original_input, *weights,
                                  *biases)
    return _TELinear.apply(x, mode, sp, None if norm is None else norm.weight,
                           getattr(norm, "bias", None), fuse_wgrad, len(biases), *weights,
                           *biases)
