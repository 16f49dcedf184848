"""``KernelProfile``: the kernels one training stack runs, as one object the model holds.

A profile has an ``orchestration``, the op order its framework runs around the kernels:
``"eager"`` (tracemem's own modules: ``modeling.common.attention``, ``mlp``, ``moe``)
or ``"megatron"`` (Megatron-Core's ``MLASelfAttention`` / ``SelfAttention``, ``MLP`` /
``SharedExpertMLP``, ``MoELayer`` with the alltoall dispatcher, at Megatron-LM d98e8a6), and
the kernels themselves (``norm``, ``core_attention``, ``loss``, and for Megatron the TE
linears, RoPE, SwiGLU and MoE token kernels in this package).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from modeling.kernels import activations, attention, linear, loss, moe, norm, rope, router, swiglu
from modeling.kernels import context_parallel
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
    "moe_permute_fusion": ((True, False), True,
                           "Megatron --moe-permute-fusion: TE's fused token permutation (off: "
                           "moe_utils.permute / unpermute as torch ops, which keep int64 "
                           "indices)"),
    "moe_token_dispatcher": (("alltoall", "allgather"), "alltoall",
                             "Megatron --moe-token-dispatcher-type: alltoall, or allgather "
                             "(Megatron's default: every token gathered over ETP x EP)"),
    "moe_router_dtype": (("fp32", "input"), "fp32",
                         "Megatron --moe-router-dtype fp32 (fp32 router logits and "
                         "probabilities), or input: no flag, the logits in the activations' "
                         "dtype"),
    "masked_softmax_fusion": ((True, False), True,
                              "--attention unfused / local: the fused causal softmax kernel "
                              "where its shapes allow (Megatron --no-masked-softmax-fusion, "
                              "TE NVTE_MASKED_SOFTMAX_FUSION=0 turn it off: torch's fp32 "
                              "softmax)"),
    # fused stays the default: what tracemem modelled before this option; "auto" is resolved
    # by get_profile from the GPU's architecture (attention.te_auto_attention_backend)
    "attention_backend": (attention.TE_ATTENTION_BACKENDS, "fused",
                          "Megatron --attention-backend for TE's DotProductAttention: fused "
                          "(cuDNN), flash (TE's FlashAttention over flash-attn 2: "
                          "attention.te_flash_attention, and the flash ring under CP p2p), or "
                          "auto (TE's choice for the GPU: fused on sm90+, and on sm80 or an "
                          "unknown GPU while flash-attn's presence is not known)"),
    # allgather stays the default: it is what tracemem modelled before this option, so a job
    # that does not set it keeps its figures; the Megatron-LM front door passes Megatron's
    # own default (p2p) when CP > 1
    "cp_comm_type": (context_parallel.CP_COMM_TYPES, "allgather",
                     "Megatron --cp-comm-type with CP > 1: allgather (K and V all-gathered "
                     "over the CP group before TE's fused attention) or p2p (TE's ring "
                     "attention, AttnFuncWithCPAndKVP2P: modeling.kernels.context_parallel); "
                     "a2a and a2a+p2p are not modelled"),
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

    @property
    def attention_backend(self) -> str:
        """TE's backend for ``kind`` "flash": "fused" or "flash" (option ``attention_backend``;
        "auto" is resolved by ``get_profile``, and here as for a GPU not known)."""
        backend = self.options["attention_backend"]
        return attention.te_auto_attention_backend(None) if backend == "auto" else backend

    def core_attention(self, q, k, v, scale, kind, dropout=0.0):
        """``kind`` "flash": TE's DotProductAttention on ``(b, s, n, d)`` tensors with the
        backend of option ``attention_backend``, fused (``attention.te_fused_attention``) or
        flash (``attention.te_flash_attention``); attention dropout keeps nothing more in
        either (the rng state is kept already). "unfused" / "local": Megatron's unfused
        attention (``attention.megatron_unfused_attention``) with attention dropout
        ``dropout``. Returns ``(b, s, n * d_v)``."""
        if kind in attention.UNFUSED_IMPLS:
            return attention.megatron_unfused_attention(
                q, k, v, scale, kind, dropout, self.dropout,
                self.options["masked_softmax_fusion"])
        if self.attention_backend == "flash":
            return attention.te_flash_attention(q, k, v)
        return attention.te_fused_attention(q, k, v)

    @property
    def cp_ring(self) -> bool:
        """Whether CP attention is TE's ring attention (option ``cp_comm_type`` "p2p")."""
        return self.options["cp_comm_type"] == "p2p"

    def ring_attention(self, q, k, v, cp, cp_rank=None):
        """CP > 1 under ``cp_comm_type`` "p2p": TE's ring attention on this rank's ``(b, s /
        CP, ., d)`` q, k, v (``context_parallel.te_ring_attention``), at ring rank
        ``cp_rank``, default the last (CP - 1: the rank Megatron logs), with the backend of
        option ``attention_backend`` (fused or flash). Returns ``(b, s / CP, n * d_v)``.
        Attention dropout keeps nothing more (each step's rng state is kept)."""
        return context_parallel.te_ring_attention(q, k, v, cp,
                                                  cp - 1 if cp_rank is None else cp_rank,
                                                  self.attention_backend)

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
        """The router GEMM: fp32 logits (``--moe-router-dtype fp32``) or, with the option
        ``moe_router_dtype`` "input" (Megatron's default: no flag), in ``x``'s dtype."""
        fp32 = self.options["moe_router_dtype"] == "fp32"
        return router.router_gating_linear(x, weight, torch.float32 if fp32 else x.dtype)

    def permute(self, x, probs, slots, routing_map):
        """Tokens ``(T, h)`` to ``(slots, h)`` by expert: TE's fused permute with the
        probabilities (``--moe-permute-fusion``) or Megatron's unfused torch ops; returns
        the tokens, the permuted probabilities and the map ``unpermute`` takes back."""
        if self.options["moe_permute_fusion"]:
            return moe.te_permute(x, probs, slots, routing_map.shape[1])
        return moe.megatron_permute(x, routing_map, slots, probs)

    def sort_chunks(self, x, probs=None):
        if self.options["moe_permute_fusion"]:
            return moe.te_sort_chunks(x, probs)
        return moe.megatron_sort_chunks(x, probs)

    def unpermute(self, x, row_id_map, tokens):
        if self.options["moe_permute_fusion"]:
            return moe.te_unpermute(x, row_id_map, tokens)
        return moe.megatron_unpermute(x, row_id_map, tokens)

    def grouped_linear(self, x, weights, out_features):
        return moe.te_grouped_linear(x, weights, out_features, self.fuse_wgrad)

    def loss(self, logits, labels, tp):
        return loss.megatron_cross_entropy(logits, labels, tp,
                                           self.options["cross_entropy_fusion"],
                                           self.options["te_version"])


_CLASSES = {"eager": EagerKernels, "torch": TorchKernels, "megatron-te": MegatronTEKernels}


def get_profile(name: str | KernelProfile = "megatron-te",
                gpu_arch: tuple[int, int] | None = None, **options) -> KernelProfile:
    """The profile ``name`` (``KERNEL_PROFILES``) with ``options`` (megatron-te only:
    ``MEGATRON_TE_OPTIONS``; unset ones take their defaults). A profile passes through.
    ``gpu_arch``: the GPU's compute capability (``tracemem.job.GPUS``), or None: megatron-te's
    ``attention_backend`` "auto" is resolved from it (``attention.te_auto_attention_backend``)
    and the profile keeps what it resolved to, so profiles that trace alike compare alike.

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
    if full.get("attention_backend") == "auto":
        full["attention_backend"] = attention.te_auto_attention_backend(gpu_arch)
    return _CLASSES[name](**full)
