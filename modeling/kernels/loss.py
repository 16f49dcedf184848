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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["eager_cross_entropy", "te_cross_entropy", "TE_CROSS_ENTROPY_VERSIONS"]

TE_CROSS_ENTROPY_VERSIONS = ("2.18", "2.17")


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
                     te_version: str = "2.18") -> Tensor:
    """Mean token loss (the per-token fp32 loss averaged, as Megatron's loss mask does for a
    full mask). ``logits`` ``(b, s, V / TP)`` bf16.

    Raises:
        ValueError: unknown ``te_version`` (validated by ``get_profile`` first).
    """
    if te_version not in TE_CROSS_ENTROPY_VERSIONS:
        raise ValueError(f"te_version {te_version!r} not in {TE_CROSS_ENTROPY_VERSIONS}")
    return _TECrossEntropy.apply(logits, tp, te_version != "2.17").mean()
