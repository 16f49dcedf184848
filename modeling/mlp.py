"""SwiGLU MLP: w2(silu(w1(x)) * w3(x)), the dense FFN of the first layers and the body of
every routed and shared expert (DeepSeek-V3 ``MLP`` / ``Expert``)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from modeling.linear import Linear

__all__ = ["MLP"]


class MLP(nn.Module):
    """Args: ``dim`` (h), ``inter_dim`` (hidden width). Input and output ``(..., h)``."""

    def __init__(self, dim: int, inter_dim: int):
        super().__init__()
        self.w1 = Linear(dim, inter_dim, bias=False)  # gate projection
        self.w2 = Linear(inter_dim, dim, bias=False)  # down projection
        self.w3 = Linear(dim, inter_dim, bias=False)  # up projection

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
