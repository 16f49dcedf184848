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
from modeling.kernels import context_parallel, fp8, fp8_dispatch
from modeling.kernels import dropout as dropouts
from modeling.common.rope import apply_rope
from tracemem.errors import TracememError

__all__ = ["KERNEL_PROFILES", "MEGATRON_TE_OPTIONS", "TORCH_OPTIONS", "KernelProfile",
           "EagerKernels", "TorchKernels", "MegatronTEKernels", "get_profile"]

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
    # FP8 (modeling.kernels.fp8): "none" stays the default, so every bf16 figure stays
    "fp8_recipe": (fp8.FP8_RECIPES, "none",
                   "Megatron --fp8-recipe with --fp8-format: delayed (DelayedScaling), "
                   "tensorwise (Float8CurrentScaling), mxfp8 (MXFP8BlockScaling, Blackwell "
                   "only), blockwise (Float8BlockScaling); none: bf16"),
    "fp8_format": (fp8.FP8_FORMATS, "hybrid",
                   "Megatron --fp8-format e4m3 or hybrid (E5M2 gradients): one byte a value "
                   "either way, no byte changes"),
    "fp8_param_gather": ((False, True), False,
                         "Megatron --fp8-param-gather: parameters kept in FP8 (primary FP8 "
                         "weights: no separate FP8 weight copy; tracemem.static)"),
    "fp8_arch": (fp8.FP8_ARCHS, "auto",
                 "the GPU's FP8 class: sm90 (Hopper: per-tensor FP8 keeps a transposed "
                 "copy for the gradient GEMMs) or sm100 (Blackwell: one copy); auto: from "
                 "--gpu (get_profile), sm90 when no GPU is given"),
    "fp8_amax_history_len": (range(1, 1 << 20), 1,
                             "Megatron --fp8-amax-history-len (default 1): delayed scaling's "
                             "fp32 amax history per quantised tensor (tracemem.static)"),
    "fp8_layers_at_start_in_bf16": (range(0, 1 << 20), 0,
                                    "Megatron --first-last-layers-bf16 with "
                                    "--num-layers-at-start-in-bf16: the first layers run "
                                    "without FP8 (fp8_utils.is_first_last_bf16_layer)"),
    "fp8_layers_at_end_in_bf16": (range(0, 1 << 20), 0,
                                  "with --num-layers-at-end-in-bf16: the last layers run "
                                  "without FP8"),
    # DeepSeek-V3's own scheme (not a Megatron-LM flag): --recipe deepseek-v3
    "e5m6_attention_output": ((False, True), False,
                              "DeepSeek-V3 (arXiv 2412.19437 3.3.3, 'Low-Precision "
                              "Storage'): under blockwise FP8 the input of the linear after "
                              "attention, also read by attention's backward, is cached in "
                              "E5M6 with 1x128 scales: kept as the 16-bit container of its "
                              "12-bit values (the bf16 storage Megatron's linear_proj and "
                              "attention already share) plus one fp32 scale per tile "
                              "(modeling.kernels.linear.te_linear)"),
    "fp8_dispatch": ((False, True), False,
                     "DeepSeek-V3 (arXiv 2412.19437 3.3.3, 'Low-Precision Communication'): "
                     "under blockwise FP8 the alltoall dispatcher's tokens travel to the "
                     "experts as FP8 with fp32 1x128 scales (DeepEP's dispatch tuple), fc1 "
                     "consuming them unquantised, and the output gradient travels back to "
                     "the experts the same way; the combine and the tokens' gradient stay "
                     "bf16 (modeling.kernels.fp8_dispatch)"),
    "fp8_moe_act_cache": ((False, True), False,
                          "DeepSeek-V3 (arXiv 2412.19437 3.3.3, 'Low-Precision Storage'): with "
                          "--recompute-modules moe_act under FP8, the routed and the shared "
                          "experts' SwiGLU input (fc1's output) is cached in FP8, 1x128 tiles "
                          "with fp32 scales, instead of bf16, and dequantised to recompute the "
                          "SwiGLU in backward (modeling.common.moe._megatron_experts, "
                          "fp8_cached_swiglu)"),
}


# torch options: name -> (allowed values, default, what selects it)
TORCH_OPTIONS = {
    "zero_grad_set_to_none": ((False, True), False,
                              "torchtitan's optimizers.zero_grad(set_to_none=training."
                              "disable_cuda_graphs) (torchtitan 0.3.0 trainer.py): False (its "
                              "default, CUDA graphs on) keeps FSDP2's fp32 sharded gradients, "
                              "zeroed, from one step to the next; True frees them, so each "
                              "step's first backward makes them again (tracemem.zero3)"),
    "fused_qkv": ((True, False), True,
                  "torchtitan's qkv_linear: FusedQKVLinear (one wqkv GEMM, its output split "
                  "and copied: the fuse_qkv=True of torchtitan 0.3.0's llama3 and qwen3 "
                  "configs) or QKVLinear (wq, wk, wv apart)"),
    "loss_chunks": (range(0, 1 << 20), 0,
                    "torchtitan's loss: 0 CrossEntropyLoss (the whole fp32 logits), N > 0 "
                    "ChunkedLossWrapper num_chunks N (loss.chunked_cross_entropy)"),
}


class KernelProfile:
    """Base: the eager kernels. Subclasses override what their stack runs differently."""

    name = "eager"
    orchestration = "eager"
    fused_qkv = False  # GQA's q, k, v as three GEMMs (wq, wk, wv); the torch profile fuses
    zero_grad_set_to_none = False  # FSDP2's sharded gradients kept between steps (torch option)

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

    def rope_cache(self, inv_freq: Tensor, max_seq_len: int) -> Tensor | None:
        """The RoPE cache an attention module holds as a buffer, or None: the eager
        rotate-half form (``modeling.common.rope.apply_rope``) makes cos and sin per call."""
        return None

    def rope_qk(self, q: Tensor, k: Tensor, inv_freq: Tensor,
                cache: Tensor | None) -> tuple[Tensor, Tensor]:
        """RoPE of the eager orchestration's ``q`` ``(b, s, n, d)`` and ``k`` ``(b, s, n_kv,
        d)``; ``cache``: what ``rope_cache`` made (None here)."""
        return apply_rope(q, inv_freq), apply_rope(k, inv_freq)

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

    @property
    def fused_qkv(self) -> bool:
        """``TORCH_OPTIONS`` ``fused_qkv``: GQA's q, k, v in one GEMM (torchtitan's
        ``FusedQKVLinear``, ``modeling.common.attention.gqa``)."""
        return self.options.get("fused_qkv", True)

    @property
    def zero_grad_set_to_none(self) -> bool:
        """``TORCH_OPTIONS`` ``zero_grad_set_to_none``: FSDP2's sharded gradients freed
        between steps (made by each step's first backward) rather than zeroed and kept."""
        return self.options.get("zero_grad_set_to_none", False)

    @property
    def loss_chunks(self) -> int:
        """``TORCH_OPTIONS`` ``loss_chunks``: 0, or ChunkedLossWrapper's num_chunks."""
        return self.options.get("loss_chunks", 0)

    def rms_norm(self, module, x):
        return norm.fused_rms_norm(module, x)

    def rope_cache(self, inv_freq, max_seq_len):
        """torchtitan's ``ComplexRoPE`` cache (``modeling.kernels.rope.complex_rope_cache``)."""
        return rope.complex_rope_cache(inv_freq, max_seq_len)

    def rope_qk(self, q, k, inv_freq, cache):
        """torchtitan's ``ComplexRoPE`` (``modeling.kernels.rope.complex_rope``): nothing
        kept for backward but the cache."""
        if cache is None:
            return super().rope_qk(q, k, inv_freq, cache)
        return rope.complex_rope(q, k, cache)

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

    @property
    def fp8_recipe(self) -> str:
        """The FP8 recipe the TE linears run (option ``fp8_recipe``), "none" in bf16."""
        return self.options["fp8_recipe"]

    @property
    def fp8_arch(self) -> str:
        """"sm90" or "sm100" (option ``fp8_arch``; "auto" resolved by ``get_profile``, and
        here as Hopper)."""
        arch = self.options["fp8_arch"]
        return "sm90" if arch == "auto" else arch

    @property
    def fp8_save_original_input(self) -> bool:
        """Whether Megatron sets ``save_original_input`` on attention's ``linear_proj`` and
        the shared experts' ``linear_fc1`` (``attention.py`` ``Attention.__init__``,
        ``shared_experts.py`` ``SharedExpertMLP.__init__``: FP8 with a recipe other than
        delayed): they keep their bf16 input, not its FP8 copy."""
        return self.fp8_recipe not in ("none", "delayed")

    def without_fp8(self) -> "MegatronTEKernels":
        """This profile in bf16 (itself when it has no FP8 recipe)."""
        if self.fp8_recipe == "none":
            return self
        return type(self)(**{**self.options, "fp8_recipe": "none"})

    def bf16_layer(self, layer_id: int, num_layers: int) -> "MegatronTEKernels":
        """The profile of decoder layer ``layer_id`` (global, 0-based): this one, or this one
        without FP8 when ``--first-last-layers-bf16`` keeps the layer in bf16 (options
        ``fp8_layers_at_start_in_bf16`` / ``_end_``; Megatron ``fp8_utils.py``
        ``is_first_last_bf16_layer``). An MTP module's layer (``layer_id`` >= ``num_layers``)
        keeps this one: Megatron's MTP runs under the global FP8 context
        (``multi_token_prediction.py``: ``get_fp8_context(self.config)``, layer_no -1)."""
        o = self.options
        if self.fp8_recipe == "none" or layer_id >= num_layers or not (
                layer_id < o["fp8_layers_at_start_in_bf16"]
                or layer_id >= num_layers - o["fp8_layers_at_end_in_bf16"]):
            return self
        return self.without_fp8()

    def linear(self, x, weights, mode="duplicated", sp=1, norm_module=None, biases=(),
               save_original_input=False):
        """A TE Linear / LayerNormLinear (``linear.te_linear``), under the option
        ``fp8_recipe``'s FP8 when one is set. ``save_original_input`` (Megatron's
        ``set_save_original_input``, honoured under FP8 only, as TE): True where Megatron
        sets it for recipes other than delayed (``fp8_save_original_input``); "recompute"
        where it sets it under any FP8 recipe (``--recompute-modules layernorm``:
        ``set_for_recompute_input_layernorm`` / ``_pre_mlp_layernorm``); "e5m6" on
        attention's ``linear_proj`` under the option ``e5m6_attention_output``
        (``linear.te_linear``).

        Raises:
            TracememError: "recompute" under delayed scaling (TE's ``_linear_forward_impl``
                raises "DelayedScaling recipe is not supported with save_original_input").
        """
        recipe = self.fp8_recipe
        if save_original_input == "recompute" and recipe == "delayed":
            raise TracememError("--recompute-modules layernorm with --fp8-recipe delayed: "
                                "Megatron sets save_original_input on the linears after the "
                                "recomputed norm and TE refuses it (\"DelayedScaling recipe "
                                "is not supported with save_original_input\"); use another "
                                "--fp8-recipe")
        keep = recipe != "none" and (save_original_input == "recompute" or (
            bool(save_original_input) and self.fp8_save_original_input))
        if keep and save_original_input == "e5m6":  # e5m6_attention_output: linear_proj
            keep = "e5m6"
        return linear.te_linear(x, weights, mode, sp, norm_module, self.fuse_wgrad, biases,
                                recipe, self.fp8_arch, keep)

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

    def grouped_linear(self, x, weights, out_features, counts=None,
                       save_original_input=False, wire_in=None, wire_grad=None):
        """TE GroupedLinear (``moe.te_grouped_linear``) on ``x`` sorted by expert,
        ``counts`` rows per local expert (each quantised apart under FP8);
        ``save_original_input``: Megatron's ``moe_act`` recompute keeps fc2's bf16 input;
        ``wire_in`` / ``wire_grad``: the option ``fp8_dispatch``'s payloads
        (``modeling.kernels.fp8_dispatch``).

        Raises:
            TracememError: ``save_original_input`` under delayed scaling (TE's
                ``_GroupedLinear.forward`` raises "DelayedScaling recipe is not supported
                with save_original_input").
        """
        if save_original_input and self.fp8_recipe == "delayed":
            raise TracememError("--recompute-modules moe_act with --fp8-recipe delayed: "
                                "Megatron sets save_original_input on the experts' fc2 and "
                                "TE refuses it (\"DelayedScaling recipe is not supported "
                                "with save_original_input\"); use another --fp8-recipe")
        return moe.te_grouped_linear(x, weights, out_features, self.fuse_wgrad,
                                     self.fp8_recipe, self.fp8_arch, counts,
                                     save_original_input, wire_in, wire_grad)

    @property
    def fp8_align(self) -> int:
        """Rows per expert are padded to this under FP8 (Megatron ``fp8_utils.py``
        ``get_fp8_align_size``: 32 for mxfp8, else 16)."""
        return 32 if self.fp8_recipe == "mxfp8" else 16

    def fp8_pad(self, x, probs, counts, wire=None):
        """Megatron's ``quantization_padding`` (TE ``Fp8Padding``) of the expert input ``x``
        ``(rows, h)`` and ``probs`` ``(rows, 1)``: returns them padded and the padded counts
        (``moe.te_fp8_pad``; unchanged when every count is aligned). ``wire``: the option
        ``fp8_dispatch``'s payload carrying ``x``, padded in its place
        (``fp8_dispatch.hop``)."""
        padded = [-(-c // self.fp8_align) * self.fp8_align for c in counts]
        if padded == list(counts):
            return x, probs, list(counts)
        x = (moe.te_fp8_pad(x, sum(padded)) if wire is None
             else fp8_dispatch.hop(x, sum(padded), "pad", wire)[0])
        return x, None if probs is None else moe.te_fp8_pad(probs, sum(padded)), padded

    def fp8_unpad(self, out, counts, wire_grad=None):
        """TE ``Fp8Unpadding`` of the experts' output back to ``sum(counts)`` rows; with
        ``wire_grad`` (``fp8_dispatch``) its backward pads the gradient's payload."""
        if wire_grad is not None:
            return fp8_dispatch.hop(out, sum(counts), "pad", bwd=wire_grad)[0]
        return moe.te_fp8_pad(out, sum(counts))

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
    and the profile keeps what it resolved to, so profiles that trace alike compare alike;
    ``fp8_arch`` "auto" likewise (``fp8.fp8_arch``).

    Raises:
        TracememError: unknown profile, option or option value; an FP8 recipe the GPU
            cannot run (``fp8.check_fp8``: mxfp8 on Hopper, FP8 on an A100).
    """
    if isinstance(name, KernelProfile):
        return name
    if name not in _CLASSES:
        raise TracememError(f"--kernels {name!r} is invalid; choose one of "
                            f"{', '.join(KERNEL_PROFILES)}")
    known = {"megatron-te": MEGATRON_TE_OPTIONS, "torch": TORCH_OPTIONS}.get(name, {})
    fp8_keys = [k for k in options if k.startswith("fp8_")]
    if fp8_keys and name != "megatron-te":  # the format first: the flag that turns FP8 on
        key = "fp8_format" if "fp8_format" in fp8_keys else fp8_keys[0]
        flag = {"fp8_layers_at_start_in_bf16": "--num-layers-at-start-in-bf16",
                "fp8_layers_at_end_in_bf16": "--num-layers-at-end-in-bf16",
                "fp8_arch": "--gpu"}.get(key, "--" + key.replace("_", "-"))  # Megatron's
        if key in ("fp8_dispatch", "fp8_moe_act_cache"):  # DeepSeek-V3's: no flag
            raise TracememError(f"kernel option {key} (DeepSeek-V3's FP8 scheme) needs "
                                f"--kernels megatron-te; --kernels {name} runs bf16")
        raise TracememError(f"FP8 ({flag} {options[key]}) needs --kernels megatron-te "
                            f"(Transformer Engine's FP8 modules); --kernels {name} runs bf16")
    for key, value in options.items():
        if key not in known:
            raise TracememError(f"kernel option {key!r} does not apply to --kernels {name}"
                                + (f"; options: {', '.join(known)}" if known else ""))
        allowed = known[key][0]
        if isinstance(allowed, range):  # a count
            if type(value) is not int or value not in allowed:
                raise TracememError(f"kernel option {key}={value!r} is invalid; give a whole "
                                    f"number >= {allowed.start}")
            continue
        if value not in allowed or type(value) is not type(allowed[0]):
            raise TracememError(f"kernel option {key}={value!r} is invalid; choose one of "
                                f"{', '.join(map(str, allowed))}")
    full = {key: options.get(key, spec[1]) for key, spec in known.items()}
    if name == "torch":  # only what differs from the defaults: existing torch jobs unchanged
        full = {key: value for key, value in full.items() if value != known[key][1]}
    if full.get("attention_backend") == "auto":
        full["attention_backend"] = attention.te_auto_attention_backend(gpu_arch)
    if full.get("fp8_arch") == "auto":
        full["fp8_arch"] = fp8.fp8_arch(gpu_arch)
    if name == "megatron-te":
        fp8.check_fp8(full["fp8_recipe"], full["fp8_arch"], gpu_arch)
    return _CLASSES[name](**full)
