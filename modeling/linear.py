"""``Linear``: ``nn.Linear`` without its value initialisation.

Model ``__init__`` sets shapes only (tracemem's STYLE: values, when needed, come from a separate
initialisation); skipping ``reset_parameters`` also makes building DeepSeek-V3 with one Linear per
expert (44,544 expert Linears) several times faster on the meta device.
"""

from __future__ import annotations

from torch import nn

__all__ = ["Linear"]


class Linear(nn.Linear):
    """``nn.Linear(in_features, out_features, bias=False)`` whose weight is left uninitialised
    (``torch.empty``). Input ``(..., in_features)``, output ``(..., out_features)``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        """Values are not set here; see the module docstring."""
