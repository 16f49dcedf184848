"""``Linear``: ``nn.Linear`` without its value initialisation, whose forward runs the kernel
profile's linear.

Model ``__init__`` sets shapes only (tracemem's STYLE: values, when needed, come from a separate
initialisation); skipping ``reset_parameters`` also makes building DeepSeek-V3 with one Linear per
expert (44,544 expert Linears) several times faster on the meta device.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from modeling.parallel.groups import ParamGroup, declare_module, replicated

__all__ = ["Linear"]


class Linear(nn.Linear):
    """``nn.Linear(in_features, out_features, bias)`` whose weight (and bias) are left
    uninitialised (``torch.empty``). Input ``(..., in_features)``, output ``(..., out_features)``.

    ``kernels`` (a ``modeling.kernels`` profile, or None for ``F.linear``): under a Megatron
    profile ``forward(x, mode, sp, norm, fused, skip_bias_add)`` is a TE linear
    (``modeling.kernels.linear``): ``mode`` "duplicated" / "column" / "row" with
    sequence-parallel degree ``sp``, ``norm`` an RMSNorm or LayerNorm fused in front (TE
    ``LayerNormLinear``), ``fused`` further ``Linear`` s whose weights are concatenated to this
    one's output (Megatron's one ``linear_fc1`` for w1 and w3), ``skip_bias_add`` leaves the
    bias out of the GEMM for the caller to add (Megatron's ``skip_bias_add=True``: TE returns
    the bias apart; the non-gated MLP's fused bias-GELU adds it). Other profiles run
    ``F.linear`` on ``x`` (bias included) and take no extra arguments.

    ``group`` (``modeling.parallel.groups.ParamGroup``) is the weight's declared group, set
    here where the weight is made (a column-parallel weight ``(out / TP, in)`` has ``tp_dim``
    0, a row-parallel one 1, a duplicated one None); a bias follows a column-parallel weight
    and is replicated otherwise (Megatron-Core's ``RowParallelLinear`` bias).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 kernels=None, group: ParamGroup | None = None):
        super().__init__(in_features, out_features, bias=bias)
        self.kernels = kernels
        if group is not None:
            declare_module(self, group, bias=group if group.tp_dim == 0 else replicated(
                group.component, group.kind))

    # Megatron-Core's set_save_original_input (extensions/transformer_engine.py): set on
    # attention's linear_proj and the shared experts' linear_fc1 (True: recipes other than
    # delayed), and on the linears after a recomputed norm ("recompute": any FP8 recipe) by
    # modeling.common.block; the profile honours it under FP8 only
    save_original_input: bool | str = False

    def reset_parameters(self) -> None:
        """Values are not set here; see the module docstring."""

    def forward(self, x: Tensor, mode: str = "duplicated", sp: int = 1,
                norm: nn.Module | None = None, fused: tuple[Linear, ...] = (),
                skip_bias_add: bool = False) -> Tensor:
        if self.kernels is not None and self.kernels.orchestration == "megatron":
            weights = [self.weight, *(f.weight for f in fused)]
            biases = [] if skip_bias_add else [m.bias for m in (self, *fused)
                                               if m.bias is not None]
            # Megatron's set_save_original_input (FP8: keep the bf16 input, not its FP8 copy)
            extra = ({"save_original_input": self.save_original_input}
                     if self.save_original_input else {})
            if biases:
                return self.kernels.linear(x, weights, mode, sp, norm, biases, **extra)
            return self.kernels.linear(x, weights, mode, sp, norm, **extra)
        return F.linear(x, self.weight, self.bias)
