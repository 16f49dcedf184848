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

Several weights give one output of their summed widths, as Megatron's fused ``linear_fc1``
(gate and up projections in one ``(2f, h)`` weight) does. All shapes here are this rank's.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from modeling.kernels.wgrad import current_store
from modeling.parallel.collectives import _gather, _scatter

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


def te_linear(x: Tensor, weights: list[Tensor], mode: str = "duplicated", sp: int = 1,
              norm: nn.Module | None = None, fuse_wgrad: bool = True,
              biases: list[Tensor] = ()) -> Tensor:
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

    Raises:
        ValueError: unknown mode (an internal error: modules pass constants).
    """
    if mode not in _MODES:
        raise ValueError(f"mode {mode!r} not in {_MODES}")
    return _TELinear.apply(x, mode, sp, None if norm is None else norm.weight,
                           getattr(norm, "bias", None), fuse_wgrad, len(biases), *weights,
                           *biases)
