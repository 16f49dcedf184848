"""The MLP: SwiGLU ``w2(silu(w1(x)) * w3(x))`` (the dense FFN of every family, the body of
every routed and shared expert: DeepSeek-V3 ``MLP`` / ``Expert``, transformers' ``LlamaMLP``),
the same gated form with GELU (GeGLU), or the plain MLP ``w2(act(w1(x)))`` with GELU (GPT-2's
and Megatron's GPT default) or squared ReLU (Megatron's ``--squared-relu``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from modeling.kernels import KernelProfile, get_profile
from modeling.common.linear import Linear
from modeling.parallel.collectives import all_gather, reduce_scatter
from modeling.parallel.groups import ParamGroup

__all__ = ["MLP", "ACTIVATIONS"]

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu,
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                # megatron/core/activations.py squared_relu, as torch ops
                "squared_relu": lambda x: torch.pow(F.relu(x), 2)}
ACTIVATIONS = tuple(_ACTIVATIONS)


class MLP(nn.Module):
    """Args: ``dim`` (h), ``inter_dim`` (hidden width held), ``sp`` (sequence-parallel degree:
    with ``sp`` > 1 the input ``(b, s / sp, h)`` is all-gathered along the sequence before w1 /
    w3 and the output reduce-scattered after w2, as Megatron's column- / row-parallel linears
    do), ``kernels`` (a ``modeling.kernels`` profile), ``shared_overlap`` (Megatron's shared
    experts with ``--moe-shared-expert-overlap``: the sequence is gathered outside the
    linears, which then save the gathered input; megatron/core/transformer/moe/
    shared_experts.py ``SharedExpertMLP.__init__`` sets ``parallel_mode = None``). Input and
    output ``(b, s_local, h)`` or ``(tokens, h)`` (``sp`` 1).

    Under ``megatron-te`` the forward is Megatron-Core's ``MLP`` (megatron/core/transformer/
    mlp.py): one fused ``linear_fc1`` over [w1; w3] (output ``(..., 2 * inter)``), the fused
    SwiGLU, ``linear_fc2``; ``norm`` fuses the pre-MLP RMSNorm into fc1 (the dense layers'
    ``TELayerNormColumnParallelLinear``).

    Groups (``modeling.parallel.groups``), declared here: ``component`` (default "dense_mlp";
    "shared_experts", "routed_experts"), ``kind`` "dense" or "expert", ``ep`` (a routed expert,
    one of the rank's E / EP), ``split``: w1 / w3 column-parallel and w2 row-parallel over TP
    (ETP for a routed expert), or, False, replicated (arXiv 2502.07846's shared expert).

    ``activation`` (``ACTIVATIONS``: transformers' ``ACT2FN`` names and "squared_relu"),
    ``gated`` (False: no ``w3``, ``w2(act(w1(x)))``) and ``bias`` (biases on every linear:
    Llama's ``mlp_bias``, Megatron's ``add_bias_linear``) select the other forms. Under
    ``megatron-te`` (megatron/core/transformer/mlp.py ``MLP.forward``): SwiGLU runs the fused
    kernel; a non-gated MLP takes fc1's bias apart (``skip_bias_add=True``) and runs, with a
    bias, GELU as the fused bias-GELU (``--bias-gelu-fusion``, Megatron's default) and squared
    ReLU as ``fc1 + bias`` then the compiled squared ReLU, without one ``F.gelu`` or the
    compiled squared ReLU on fc1's output (``modeling.kernels.activations``); other gated forms
    run Megatron's unfused ``glu`` (fc1's output chunked in two). fc2's bias stays in its GEMM:
    Megatron returns it apart to the fused bias-dropout-add (megatron/core/fusions/
    fused_bias_dropout.py ``bias_dropout_add_fused_train``), which allocates nothing for it in
    forward and its ``(h,)`` gradient in backward, as the GEMM's bias does here."""

    def __init__(self, dim: int, inter_dim: int, sp: int = 1,
                 kernels: KernelProfile | None = None, shared_overlap: bool = False, *,
                 component: str = "dense_mlp", kind: str = "dense", ep: bool = False,
                 split: bool = True, activation: str = "silu", gated: bool = True,
                 bias: bool = False):
        super().__init__()
        self.sp = sp
        self.kernels = kernels or get_profile("eager")
        self.shared_overlap = shared_overlap
        self.act = _ACTIVATIONS[activation]
        self.activation = activation
        self.swiglu = gated and activation == "silu"
        kern = self.kernels
        fc1 = ParamGroup(component, kind, 0 if split else None, ep)
        fc2 = ParamGroup(component, kind, 1 if split else None, ep)
        # DeepSeek-V3's FP8 cache of the SwiGLU input, for a shared expert (set by
        # modeling.common.moe.MoE.set_recompute; see _fp8_cached_swiglu)
        self.fp8_act_cache = False
        self.w1 = Linear(dim, inter_dim, bias=bias, kernels=kern, group=fc1)  # gate projection
        self.w2 = Linear(inter_dim, dim, bias=bias, kernels=kern, group=fc2)  # down projection
        if gated:
            self.w3 = Linear(dim, inter_dim, bias=bias, kernels=kern, group=fc1)  # up projection

    def forward(self, x: Tensor, norm: nn.Module | None = None) -> Tensor:
        if self.kernels.orchestration == "megatron":
            return self._forward_megatron(x, norm)
        if norm is not None:
            x = norm(x)
        x = all_gather(x, self.sp, dim=1)
        hidden = self.act(self.w1(x))
        if hasattr(self, "w3"):
            hidden = hidden * self.w3(x)
        return reduce_scatter(self.w2(hidden), self.sp, dim=1)

    def _forward_megatron(self, x: Tensor, norm: nn.Module | None) -> Tensor:
        swiglu = self.kernels.swiglu
        if self.shared_overlap:  # pre_forward_comm gathers; the linears do no TP comm
            x = all_gather(x, self.sp, dim=1)
            out = self.w2(swiglu(self.w1(x, fused=(self.w3,))))  # fc1 = [w1; w3], fc2
            return reduce_scatter(out, self.sp, dim=1)  # post_forward_comm
        if not hasattr(self, "w3"):
            return self.w2(self._activate_plain(x, norm), "row", self.sp)
        if self.fp8_act_cache and getattr(self.kernels, "fp8_recipe", "none") != "none":
            return self._fp8_cached_swiglu(x, norm)
        fc1 = self.w1(x, "column", self.sp, norm, fused=(self.w3,))  # (b, s, 2 * inter)
        # MLP.forward rebinds intermediate_parallel to the activation's output: fc1's output
        # is gone before fc2 runs unless the activation saved it (it does not under no_grad:
        # the forward of Megatron's reentrant recompute)
        hidden = swiglu(fc1) if self.swiglu else self._activate(fc1)
        del fc1
        return self.w2(hidden, "row", self.sp)

    def _fp8_cached_swiglu(self, x: Tensor, norm: nn.Module | None) -> Tensor:
        """A shared expert with DeepSeek-V3's FP8 cache of the SwiGLU input
        (``modeling.common.moe.fp8_cached_swiglu``; ``fp8_act_cache``, set by
        ``MoE.set_recompute``): fc1, the cached SwiGLU, fc2 keeping its recomputed input."""
        from modeling.common.moe import fp8_cached_swiglu

        fc1 = self.w1(x, "column", self.sp, norm, fused=(self.w3,))  # (b, s, 2 * inter)
        ckpt, hidden = fp8_cached_swiglu(self.kernels, fc1)
        del fc1
        out = self.w2(hidden, "row", self.sp)
        ckpt.discard_output_and_register_recompute(out)
        return out

    def _activate_plain(self, x: Tensor, norm: nn.Module | None) -> Tensor:
        """Megatron's non-gated ``MLP.forward``: fc1 (its bias returned apart), then the
        activation with the bias; ``(b, s, inter)``."""
        fc1 = self.w1(x, "column", self.sp, norm, skip_bias_add=True)  # (b, s, inter)
        bias = self.w1.bias
        if bias is not None and self.activation in ("gelu", "gelu_pytorch_tanh"):
            return self.kernels.bias_gelu(fc1, bias)  # bias_gelu_impl (--bias-gelu-fusion)
        if bias is not None:
            fc1 = fc1 + bias  # intermediate_parallel + bias_parallel (no fusion)
        if self.activation == "squared_relu":
            return self.kernels.squared_relu(fc1)
        return self.act(fc1)

    def _activate(self, fc1: Tensor) -> Tensor:
        gate, up = torch.chunk(fc1, 2, dim=-1)  # Megatron's glu
        return self.act(gate) * up
