"""Loss kernels on this rank's vocabulary shard of the logits ``(b, s, V / TP)``.

- eager / torch: ``F.cross_entropy(logits.float(), labels)`` (torchtitan's loss upcasts too):
  the fp32 copy of the logits and its log-softmax are kept for backward.
- megatron-te: Transformer Engine's parallel cross entropy (Megatron's
  ``--cross-entropy-loss-fusion --cross-entropy-fusion-impl te``), whose gradient handling
  changed between versions (``te_version`` option):
  - ``"2.18"`` and later (TE commit 01bbe3e, PR #3193, first in v2.18; d0067d0 reads the
    same): ``transformer_engine/common/triton/cross_entropy.py`` ``cross_entropy_forward``
    allocates an fp32 gradient ``(b, s, V / TP)`` in forward (``grad_input =
    torch.empty_like(_input, dtype=torch.float32)``) and ``CrossEntropyFunction`` saves only
    it; backward scales it in place and returns it, and autograd casts it to the logits'
    bf16 (a second ``(b, s, V / TP)`` buffer) while the fp32 one is alive.
  - ``"2.17"`` and earlier (v2.17 ``cross_entropy.py``: ``ctx.save_for_backward(inp.detach())``):
    the gradient is written in place into the bf16 logits, which are therefore kept.
  Both allocate the fp32 per-token loss ``(b * s,)``, ``m_d_X_y`` ``(3 * b * s,)`` and, with
  TP > 1, its all-gathered copy ``(3 * b * s * TP,)``.
- megatron-te, ``cross_entropy_fusion`` "native" and "none": Megatron-Core's own vocab-parallel
  cross entropy (``megatron_cross_entropy``), fused by ``torch.compile`` or not.
- torch, ``loss_chunks`` N > 0: torchtitan's ``ChunkedLossWrapper`` (``chunked_cross_entropy``):
  the head and the loss per sequence chunk, each chunk's backward run at once, inside the
  forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["eager_cross_entropy", "te_cross_entropy", "megatron_cross_entropy",
           "chunked_cross_entropy",
           "TE_CROSS_ENTROPY_VERSIONS", "CROSS_ENTROPY_FUSIONS"]

TE_CROSS_ENTROPY_VERSIONS = ("2.18", "2.17")
# Megatron's --cross-entropy-loss-fusion --cross-entropy-fusion-impl te | native, and no fusion
CROSS_ENTROPY_FUSIONS = ("te", "native", "none")


def eager_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean token loss of ``logits`` ``(b, s, V)`` against ``labels`` ``(b, s)``."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class _TECrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, tp: int, fp32_grad: bool) -> Tensor:
        rows = logits.shape[0] * logits.shape[1]
        loss = torch.empty((rows,), dtype=torch.float32, device=logits.device)
        m_d_x_y = torch.empty((rows * 3,), dtype=torch.float32, device=logits.device)
        gathered = (torch.empty((rows * 3 * tp,), dtype=torch.float32, device=logits.device)
                    if tp > 1 else None)
        grad = torch.empty_like(logits, dtype=torch.float32) if fp32_grad else logits
        del m_d_x_y, gathered
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        (grad,) = ctx.saved_tensors
        return grad, None, None


def te_cross_entropy(logits: Tensor, labels: Tensor, tp: int = 1,
                     te_version: str = "2.18", reduce: bool = True) -> Tensor:
    """Mean token loss (the per-token fp32 loss averaged, as Megatron's loss mask does for a
    full mask), or with ``reduce=False`` the per-token fp32 loss ``(b * s,)``. ``logits`` ``(b,
    s, V / TP)`` bf16.

    Raises:
        ValueError: unknown ``te_version`` (validated by ``get_profile`` first).
    """
    if te_version not in TE_CROSS_ENTROPY_VERSIONS:
        raise ValueError(f"te_version {te_version!r} not in {TE_CROSS_ENTROPY_VERSIONS}")
    loss = _TECrossEntropy.apply(logits, tp, te_version != "2.17")
    return loss.mean() if reduce else loss


# ------------------------------------------------------------------------------------------------
# Megatron-Core's vocab-parallel cross entropy (Megatron-LM d98e8a6). Shapes in Megatron's order:
# logits [s, b, V / TP], target [s, b]; N = s * b rows, Vp = V / TP. The all-reduces (max, and
# the predicted logits with the exp sums) are in place (NCCL): they allocate nothing.


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """No ``--cross-entropy-loss-fusion``: ``megatron/core/tensor_parallel/cross_entropy.py``
    ``_VocabParallelCrossEntropy`` with ``VocabParallelCrossEntropy``'s static methods, run as
    their torch ops (eager: nothing in it is compiled), label smoothing 0.

    Forward: ``calculate_logits_max``: the fp32 copy of the logits ``[s, b, Vp]`` (the softmax
    to be) and ``torch.max`` (values fp32 and indices int64 ``[s, b]``, the indices dropped);
    ``calculate_predicted_logits``: the max subtracted in place, ``target_mask`` bool ``[s,
    b]`` (two comparisons, or'ed), ``masked_target`` int64 (a clone, minus the vocabulary
    start, masked in place), ``arange`` int64 ``[N]``, the gathered predicted logits fp32
    ``[N]`` and their clone, exp in place, the exp sums fp32 ``[s, b]``;
    ``calculate_cross_entropy_loss``: the loss fp32 ``[s, b]`` (log, minus), the exps divided
    in place into the softmax. Saved: the softmax fp32 ``[s, b, Vp]``, ``target_mask`` and
    ``masked_target_1d`` int64 ``[N]``.

    Backward: ``prepare_gradient_calculation_operands`` / ``calculate_gradients``: ``arange``
    ``[N]``, ``1.0 - target_mask.float()`` fp32 ``[N]`` (two), the target entries gathered,
    lowered and scattered back into the softmax in place, then multiplied in place by the loss
    gradient: the softmax *is* the fp32 gradient; autograd casts it to the bf16 logits' dtype
    (a second ``[s, b, Vp]`` buffer while the fp32 one is alive)."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor) -> Tensor:
        logits = logits.float()  # calculate_logits_max
        logits_max = torch.max(logits, dim=-1)[0]
        vocab = logits.shape[-1]
        start, end = 0, vocab  # rank 0's VocabUtility range (no value is ever read)
        logits -= logits_max.unsqueeze(dim=-1)  # calculate_predicted_logits
        target_mask = (target < start) | (target >= end)
        masked_target = target.clone() - start
        masked_target[target_mask] = 0
        logits_2d = logits.view(-1, vocab)
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
        predicted_logits_1d = logits_2d[arange_1d, masked_target_1d]
        predicted_logits_1d = predicted_logits_1d.clone().contiguous()
        predicted_logits = predicted_logits_1d.view_as(target)
        predicted_logits[target_mask] = 0.0
        torch.exp(logits, out=logits)
        sum_exp_logits = logits.sum(dim=-1)
        loss = torch.log(sum_exp_logits) - predicted_logits  # calculate_cross_entropy_loss
        logits.div_(sum_exp_logits.unsqueeze(dim=-1))
        ctx.save_for_backward(logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_2d = softmax.view(-1, softmax.size()[-1])
        arange_1d = torch.arange(start=0, end=grad_2d.size()[0], device=grad_2d.device)
        softmax_update = 1.0 - target_mask.view(-1).float()
        grad_2d[arange_1d, masked_target_1d] -= softmax_update
        softmax.mul_(grad_output.unsqueeze(dim=-1))
        return softmax, None


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """``--cross-entropy-loss-fusion --cross-entropy-fusion-impl native``:
    ``megatron/core/fusions/fused_cross_entropy.py`` ``_VocabParallelCrossEntropy``, whose four
    steps are ``@jit_fuser`` functions, ``torch.compile`` at torch >= 2.2 (``megatron/core/
    jit.py``). Its buffers are the ones inductor's generated code allocates for those four
    graphs (torch 2.13, read from ``TORCH_LOGS=output_code`` on CPU; the buffer decisions come
    from functionalization and the device-independent post-grad passes, not checked on a GPU):

    - ``calculate_logits_max``: the fp32 copy ``[s, b, Vp]`` and the max fp32 ``[s, b]`` (no
      indices);
    - ``calculate_predicted_logits``: ``target_mask`` bool ``[s, b]``, ``masked_target``
      int64 ``[s, b]`` (returned as ``masked_target_1d``), two fp32 intermediates ``[N]`` and
      ``[s, b]`` freed when it returns, and the concatenated predicted logits and exp sums
      fp32 ``[2s, b]`` (one all-reduce); the exps are written into the fp32 copy in place;
    - ``calculate_cross_entropy_loss``: the loss fp32 ``[s, b]``; the softmax divided in place.

    Saved: the softmax fp32 ``[s, b, Vp]``, ``target_mask``, ``masked_target_1d``. Backward,
    ``calculate_gradients``: the target update is functionalised into an fp32 copy ``[N, Vp]``
    of the softmax (``index_put`` is not re-inplaced on a view of a graph input), the result
    cast to bf16 ``[s, b, Vp]`` inside the graph (``grad_input.to(torch.bfloat16)``) and written
    back into the softmax; the fp32 copy is freed when it returns."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor) -> Tensor:
        f32, dev = torch.float32, logits.device
        softmax = torch.empty(logits.shape, dtype=f32, device=dev)  # calculate_logits_max
        logits_max = torch.empty(logits.shape[:-1], dtype=f32, device=dev)  # noqa: F841
        target_mask = torch.empty(target.shape, dtype=torch.bool, device=dev)
        masked_target = torch.empty(target.shape, dtype=torch.int64, device=dev)
        predicted = torch.empty((target.numel(),), dtype=f32, device=dev)  # intermediates
        sums = torch.empty(target.shape, dtype=f32, device=dev)
        predicted_sum_exp = torch.empty((2 * target.shape[0], *target.shape[1:]), dtype=f32,
                                        device=dev)  # noqa: F841 (held to the end)
        del predicted, sums
        loss = torch.empty(target.shape, dtype=f32, device=dev)  # calculate_cross_entropy_loss
        ctx.save_for_backward(softmax, target_mask, masked_target.view(-1))
        return loss

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        softmax, _, _ = ctx.saved_tensors
        scattered = torch.empty((softmax.shape[:-1].numel(), softmax.shape[-1]),
                                dtype=softmax.dtype, device=softmax.device)
        grad = torch.empty(softmax.shape, dtype=torch.bfloat16, device=softmax.device)
        del scattered
        return grad, None


def megatron_cross_entropy(logits: Tensor, labels: Tensor, tp: int = 1, fusion: str = "te",
                           te_version: str = "2.18") -> Tensor:
    """Mean token loss of this rank's logits ``(b, s, V / TP)`` bf16 against ``labels`` ``(b,
    s)`` int64, as Megatron-Core computes it: ``megatron/core/models/common/language_module/
    language_module.py`` ``LanguageModule.compute_language_model_loss`` transposes the labels
    to ``[s, b]`` (``.contiguous()``: an int64 copy when b > 1), runs the cross entropy
    ``fusion`` selects (``CROSS_ENTROPY_FUSIONS``: "te" ``te_cross_entropy``; "native"
    ``fused_vocab_parallel_cross_entropy``; "none" ``tensor_parallel.
    vocab_parallel_cross_entropy``) and transposes the fp32 per-token loss back to ``[b, s]``
    (a copy when b > 1). The ``(b, s, ...)`` logits here are Megatron's ``[s, b, ...]``
    relabelled by a ``view`` (the same bytes).

    Raises:
        ValueError: unknown ``fusion`` or ``te_version`` (validated by ``get_profile`` first).
    """
    if fusion not in CROSS_ENTROPY_FUSIONS:
        raise ValueError(f"fusion {fusion!r} not in {CROSS_ENTROPY_FUSIONS}")
    b, s = logits.shape[:2]
    target = labels.transpose(0, 1).contiguous()  # [s, b]
    if fusion == "te":
        loss = te_cross_entropy(logits, target, tp, te_version, reduce=False).view(s, b)
    else:
        logits = logits.view(s, b, -1)  # Megatron's [s, b, V / TP]
        function = _FusedVocabParallelCrossEntropy if fusion == "native" \
            else _VocabParallelCrossEntropy
        loss = function.apply(logits, target)  # [s, b] fp32
    return loss.transpose(0, 1).contiguous().mean()  # [b, s]


class _DecoderOutputGradientBackProp(torch.autograd.Function):
    """torchtitan 0.3.0 ``torchtitan/components/loss.py`` ``_DecoderOutputGradientBackProp``:
    keeps the accumulated hidden-state gradient (``ctx.save_for_backward``) and returns it
    as the hidden states' gradient in backward."""

    @staticmethod
    def forward(ctx, hidden: Tensor, grad: Tensor, loss: Tensor) -> Tensor:
        ctx.save_for_backward(grad)
        return loss.detach()

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        (grad,) = ctx.saved_tensors
        return grad, None, None


def chunked_cross_entropy(hidden: Tensor, labels: Tensor, head, loss, num_chunks: int
                          ) -> Tensor:
    """torchtitan 0.3.0's ``ChunkedLossWrapper.__call__`` (``torchtitan/components/loss.py``)
    on the final norm's output ``hidden`` ``(b, s, h)`` and ``labels`` ``(b, s)``: ``head``
    (a callable, ``(b, s / N, h)`` -> ``(b, s / N, V / TP)``) and ``loss`` (logits, labels
    -> scalar) per sequence chunk, op for op:

    - ``_chunk_local``: ``torch.split`` along the sequence into N equal chunks, each
      ``.contiguous()`` (a copy when b > 1; with b = 1 a chunk is already contiguous, a view),
      the hidden ones ``detach().requires_grad_()``; the labels likewise. All chunks live
      until the call returns.
    - ``GradAccumulator``: ``torch.zeros_like(hidden, dtype=float32)``, the fp32 gradient
      accumulator ``(b, s, h)``; ``add`` casts each chunk's gradient to fp32 (a temporary
      ``(b, s / N, h)``) and writes it into its slice.
    - per chunk: ``logits = head(chunk)``, ``chunk_loss = loss(logits, labels)``, at once
      ``chunk_loss.backward()`` (the head's weight gradient accumulates; the chunk's graph is
      freed), ``chunk.grad`` into the accumulator, then ``chunk.grad = None``. The names
      ``logits`` and ``chunk_loss`` hold chunk i's tensors until chunk i + 1 rebinds them, so
      chunk i's bf16 logits are alive while chunk i + 1's head runs, as in torchtitan.
    - ``accumulated_grad = result().to(hidden.dtype)``: a bf16 copy, kept by
      ``_DecoderOutputGradientBackProp`` until backward; the fp32 accumulator goes with the
      call.

    Returns the summed chunk losses (fp32 scalar) whose backward hands the accumulated
    gradient to ``hidden``. Without grad (``hidden.requires_grad`` False) no backward, no
    accumulator.

    Raises:
        TracememError: s not divisible by N (torchtitan's ``torch._check``).
    """
    from tracemem.errors import TracememError

    seq = hidden.shape[1]
    if seq % num_chunks:
        raise TracememError(f"--loss.num_chunks {num_chunks} must divide the sequence length "
                            f"{seq} the loss sees (torchtitan's ChunkedLossWrapper: "
                            f"\"sequence length must be divisible by num_chunks\")")
    n = seq // num_chunks
    requires_grad = hidden.requires_grad
    h_chunks = [c.contiguous().detach().requires_grad_(requires_grad)
                for c in torch.split(hidden, [n] * num_chunks, dim=1)]
    label_chunks = [c.contiguous() for c in torch.split(labels, [n] * num_chunks, dim=1)]
    accumulator = torch.zeros_like(hidden, dtype=torch.float32) if requires_grad else None
    total = hidden.new_zeros((), dtype=torch.float32)
    for i, (h_chunk, label_chunk) in enumerate(zip(h_chunks, label_chunks)):
        logits = head(h_chunk)
        chunk_loss = loss(logits, label_chunk)
        total = total + chunk_loss.detach()
        if requires_grad:
            chunk_loss.backward()
            accumulator[:, i * n:(i + 1) * n] = h_chunk.grad.to(torch.float32)
            h_chunk.grad = None
    if not requires_grad:
        return total
    accumulated = accumulator.to(hidden.dtype)
    del accumulator, logits, chunk_loss, h_chunks, label_chunks
    return _DecoderOutputGradientBackProp.apply(hidden, accumulated, total)
