"""``KernelProfile``: the kernels one training stack runs, as one object the model holds.

A profile has an ``orchestration``, the op order its framework runs around the kernels:
``"eager"`` (tracemem's own modules: ``modeling.common.attention``, ``mlp``, ``moe``)
or ``"megatron"`` (Megatron-Core's ``MLASelfAttention`` / ``SelfAttention``, ``MLP`` /
``SharedExpertMLP``, ``MoELayer`` with the alltoall dispatcher, at Megatron-LM d98e8a6), and
the kernels themselves (``norm``, ``core_attention``, ``loss``, and for Megatron the TE
linears, RoPE, SwiGLU and MoE token kernels in this package).
"""

from __future__ import annotations

from torch import Tensor, nn

from modeling.kernels import activations, attention, linear, loss, moe, norm, rope, router, swiglu
from modeling.kernels import dropout as dropouts
from tracemem.errors import TracememError

__all__ = ["KERNEL_PROFILES", "MEGATRON_TE_OPTIONS", "KernelProfile", "EagerKernels",
           "TorchKernels", "MegatronTEKernels", "get_profile"]

KERNEL_PROFILES = ("megatron-te", "torch", "eager")

# megatron-te options: name -> (allowed values, default, what selects it)
MEGATRON_TE_OPTIONS = {
    "te_version": (loss.TE_CROSS_ENTROPY_VERSIONS, "2.18",
                   "TE release: >= 2.18 keeps an fp32 cross-entropy gradient, <= 2.17 writes "
                   "it into the bf16 logits"),
    "gradient_accumulation_fusion": ((True, False), True,
                                     "Megatron --gradient-accumulation-fusion (default on with "
                                     "TE): weight gradients go straight into main_grad"),
    "moe_shared_expert_overlap": ((True, False), True,
                                  "Megatron --moe-shared-expert-overlap: the shared experts "
                                  "save their gathered input"),
    "cross_entropy_fusion": (loss.CROSS_ENTROPY_FUSIONS, "te",
                             "Megatron --cross-entropy-loss-fusion with --cross-entropy-fusion-"
                             "impl te (TE's parallel cross entropy) or native (Megatron's "
                             "compiled one), or none: no --cross-entropy-loss-fusion "
                             "(tensor_parallel.vocab_parallel_cross_entropy)"),
    "masked_softmax_fusion": ((True, False), True,
                              "--attention unfused / local: the fused causal softmax kernel "
                              "where its shapes allow (Megatron --no-masked-softmax-fusion, "
                              "TE NVTE_MASKED_SOFTMAX_FUSION=0 turn it off: torch's fp32 "
                              "softmax)"),
}


class KernelProfile:
    """Base: the eager kernels. Subclasses override what their stack runs differently."""

    name = "eager"
    orchestration = "eager"

    def __init__(self, **options):
        self.options = options

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {self.options})"

    def rms_norm(self, module: nn.RMSNorm, x: Tensor) -> Tensor:
        """RMSNorm of ``x`` ``(..., h)`` with ``module``'s weight and eps (``modeling.common.norm``
        calls it from its forward)."""
        return nn.RMSNorm.forward(module, x)

    def layer_norm(self, module: nn.LayerNorm, x: Tensor) -> Tensor:
        """LayerNorm of ``x`` ``(..., h)`` with ``module``'s weight, bias and eps
        (``modeling.common.norm.LayerNorm`` calls it): ``nn.LayerNorm``'s own forward, which
        is already aten's fused ``native_layer_norm`` (eager and torch)."""
        return nn.LayerNorm.forward(module, x)

    def core_attention(self, q: Tensor, k: Tensor, v: Tensor, scale: float,
                       kind: str, dropout: float = 0.0) -> Tensor:
        """``kind`` "eager" or "flash" on ``(b, n, s, d)`` tensors, attention dropout with
        probability ``dropout``."""
        if kind == "eager":
            return attention.eager_attention(q, k, v, scale, dropout, self.dropout)
        return attention.sdpa_attention(q, k, v, scale, dropout)

    def dropout(self, x: Tensor, p: float, training: bool = True) -> Tensor:
        """Dropout of ``x`` with probability ``p`` (``x`` itself when p is 0 or not training):
        ``F.dropout`` on ``x``'s device (``modeling.kernels.dropout``: CPU and meta keep a
        noise tensor of ``x``'s dtype), byte-exact against a real CPU step."""
        return dropouts.torch_dropout(x, p, training)

    def loss(self, logits: Tensor, labels: Tensor, tp: int) -> Tensor:
        """Mean token loss of this rank's ``(b, s, V / TP)`` logits."""
        return loss.eager_cross_entropy(logits, labels)


class EagerKernels(KernelProfile):
    """tracemem's eager PyTorch modules (byte-exact against real CPU execution)."""


class TorchKernels(KernelProfile):
    """torchtitan's torch-native fused kernels in the eager orchestration: fused RMSNorm,
    SDPA's fused attention, ``torch._grouped_mm``, ``F.cross_entropy`` on fp32 logits."""

    name = "torch"

    def rms_norm(self, module, x):
        return norm.fused_rms_norm(module, x)

    def dropout(self, x, p, training=True):
        """CUDA's dropout, ``aten::native_dropout``: a bool mask kept."""
        return dropouts.native_dropout(x, p, training)


class MegatronTEKernels(KernelProfile):
    """Megatron-Core + Transformer Engine 2.x in bf16 (options: ``MEGATRON_TE_OPTIONS``)."""

    name = "megatron-te"
    orchestration = "megatron"

    @property
    def fuse_wgrad(self) -> bool:
        return self.options["gradient_accumulation_fusion"]

    def rms_norm(self, module, x):
        return norm.te_rms_norm(module, x)

    def layer_norm(self, module, x):
        return norm.te_layer_norm(module, x)

    def core_attention(self, q, k, v, scale, kind, dropout=0.0):
        """``kind`` "flash": TE fused attention on ``(b, s, n, d)`` tensors (attention dropout
        keeps nothing more: the rng state is kept already); "unfused" / "local": Megatron's
        unfused attention (``attention.megatron_unfused_attention``) with attention dropout
        ``dropout``. Returns ``(b, s, n * d_v)``."""
        if kind in attention.UNFUSED_IMPLS:
            return attention.megatron_unfused_attention(
                q, k, v, scale, kind, dropout, self.dropout,
                self.options["masked_softmax_fusion"])
        return attention.te_fused_attention(q, k, v)

    def dropout(self, x, p, training=True):
        """``torch.nn.Dropout`` / ``F.dropout`` on CUDA: ``aten::native_dropout``, a bool mask
        kept. Megatron's ``bias_dropout_add`` under ``--bias-dropout-fusion`` (the default) is compiled
        (``torch.compile``) and keeps the same bool mask; it does not materialise the dropped
        tensor before the residual add, which this eager op does, transiently."""
        return dropouts.native_dropout(x, p, training)

    def linear(self, x, weights, mode="duplicated", sp=1, norm_module=None, biases=()):
        return linear.te_linear(x, weights, mode, sp, norm_module, self.fuse_wgrad, biases)

    def rope(self, t, inv_freq):
        return rope.megatron_rope(t, inv_freq)

    def rope_bshd(self, t, inv_freq):
        return rope.megatron_rope_bshd(t, inv_freq)

    def swiglu(self, y):
        return swiglu.fused_swiglu(y)

    def weighted_swiglu(self, y, probs):
        return swiglu.fused_weighted_swiglu(y, probs)

    def bias_gelu(self, y, bias):
        return activations.fused_bias_gelu(y, bias)

    def squared_relu(self, y):
        return activations.compiled_squared_relu(y)

    def router_logits(self, x, weight):
        return router.router_gating_linear(x, weight)

    def permute(self, x, probs, slots):
        return moe.te_permute(x, probs, slots)

    def sort_chunks(self, x, probs=None):
        return moe.te_sort_chunks(x, probs)

    def unpermute(self, x, row_id_map, tokens):
        return moe.te_unpermute(x, row_id_map, tokens)

    def grouped_linear(self, x, weights, out_features):
        return moe.te_grouped_linear(x, weights, out_features, self.fuse_wgrad)

    def loss(self, logits, labels, tp):
        return loss.megatron_cross_entropy(logits, labels, tp,
                                           self.options["cross_entropy_fusion"],
                                           self.options["te_version"])


_CLASSES = {"eager": EagerKernels, "torch": TorchKernels, "megatron-te": MegatronTEKernels}


def get_profile(name: str | KernelProfile = "megatron-te", **options) -> KernelProfile:
    """The profile ``name`` (``KERNEL_PROFILES``) with ``options`` (megatron-te only:
    ``MEGATRON_TE_OPTIONS``; unset ones take their defaults). A profile passes through.

    Raises:
        TracememError: unknown profile, option or option value.
    """
    if isinstance(name, KernelProfile):
        return name
    if name not in _CLASSES:
        raise TracememError(f"--kernels {name!r} is invalid; choose one of "
                            f"{', '.join(KERNEL_PROFILES)}")
    known = MEGATRON_TE_OPTIONS if name == "megatron-te" else {}
    for key, value in options.items():
        if key not in known:
            raise TracememError(f"kernel option {key!r} does not apply to --kernels {name}"
                                + (f"; options: {', '.join(known)}" if known else ""))
        allowed = known[key][0]
        if value not in allowed or type(value) is not type(allowed[0]):
            raise TracememError(f"kernel option {key}={value!r} is invalid; choose one of "
                                f"{', '.join(map(str, allowed))}")
    full = {key: options.get(key, spec[1]) for key, spec in known.items()}
    return _CLASSES[name](**full)
