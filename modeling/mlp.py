"""SwiGLU MLP: w2(silu(w1(x)) * w3(x)), the dense FFN of the first layers and the body of
every routed and shared expert (DeepSeek-V3 ``MLP`` / ``Expert``)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from modeling.linear import Linear
from modeling.parallel.collectives import all_gather, reduce_scatter

__all__ = ["MLP"]


class MLP(nn.Module):
    """Args: ``dim`` (h), ``inter_dim`` (hidden width held), ``sp`` (sequence-parallel degree:
    with ``sp`` > 1 the input ``(b, s / sp, h)`` is all-gathered along the sequence before w1 /
    w3 and the output reduce-scattered after w2, as Megatron's column- / row-parallel linears
    do). Input and output ``(b, s_local, h)`` or ``(tokens, h)`` (``sp`` 1)."""

    def __init__(self, dim: int, inter_dim: int, sp: int = 1):
        super().__init__()
        self.sp = sp
        self.w1 = Linear(dim, inter_dim, bias=False)  # gate projection
        self.w2 = Linear(inter_dim, dim, bias=False)  # down projection
        self.w3 = Linear(dim, inter_dim, bias=False)  # up projection

    def forward(self, x: Tensor) -> Tensor:
        x = all_gather(x, self.sp, dim=1)
        return reduce_scatter(self.w2(F.silu(self.w1(x)) * self.w3(x)), self.sp, dim=1)
