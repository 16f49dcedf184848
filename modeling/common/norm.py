"""``RMSNorm``: ``nn.RMSNorm`` whose forward runs the kernel profile's RMSNorm
(``modeling.kernels.norm``: eager composite, torch's fused kernel, or TE's)."""

from __future__ import annotations

from torch import Tensor, nn

from modeling.parallel.groups import ParamGroup, declare_module, replicated

__all__ = ["RMSNorm"]


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm(dim, eps)`` (weight ``(dim,)``); ``kernels`` a ``modeling.kernels`` profile
    or None for ``nn.RMSNorm``'s own forward. Input and output ``(..., dim)``. The weight is
    declared ``group`` (default replicated over TP, a dense parameter counted under "norms",
    as Megatron-Core's norms are: no ``tensor_model_parallel``)."""

    def __init__(self, dim: int, eps: float | None = None, kernels=None,
                 group: ParamGroup | None = None):
        super().__init__(dim, eps=eps)
        self.kernels = kernels
        declare_module(self, group or replicated("norms"))

    def forward(self, x: Tensor) -> Tensor:
        if self.kernels is None:
            return super().forward(x)
        return self.kernels.rms_norm(self, x)
