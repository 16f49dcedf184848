"""``RMSNorm`` and ``LayerNorm``: ``nn.RMSNorm`` / ``nn.LayerNorm`` whose forward runs the kernel
profile's norm (``modeling.kernels.norm``: eager composite, torch's fused kernel, or TE's), and
``make_norm``, the one place a norm site turns ``cfg.normalization`` into a module."""

from __future__ import annotations

from torch import Tensor, nn

from modeling.parallel.groups import ParamGroup, declare_module, replicated

__all__ = ["RMSNorm", "LayerNorm", "make_norm"]


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


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm(dim, eps)`` (weight and bias ``(dim,)``), Megatron's
    ``--normalization LayerNorm``; ``kernels`` a ``modeling.kernels`` profile or None for
    ``nn.LayerNorm``'s own forward. Input and output ``(..., dim)``. The weight and the bias
    are declared the same ``group`` (default replicated over TP, "norms": TE's ``LayerNorm``
    weight and bias carry no ``tensor_model_parallel``)."""

    def __init__(self, dim: int, eps: float = 1e-5, kernels=None,
                 group: ParamGroup | None = None):
        super().__init__(dim, eps=eps)
        self.kernels = kernels
        declare_module(self, group or replicated("norms"))  # weight and bias alike

    def forward(self, x: Tensor) -> Tensor:
        if self.kernels is None:
            return super().forward(x)
        return self.kernels.layer_norm(self, x)


def make_norm(cfg, dim: int, kernels=None, group: ParamGroup | None = None
              ) -> RMSNorm | LayerNorm:
    """The norm ``cfg.normalization`` names (``modeling.common.config.NORMALIZATIONS``) over
    the last ``dim`` channels, eps ``cfg.rms_norm_eps``, as Megatron-Core's ``TENorm`` picks TE's
    ``LayerNorm`` or ``RMSNorm`` from ``config.normalization`` at every norm site
    (megatron/core/extensions/transformer_engine.py ``TENorm.__new__``)."""
    cls = LayerNorm if cfg.normalization == "layernorm" else RMSNorm
    return cls(dim, eps=cfg.rms_norm_eps, kernels=kernels, group=group)
