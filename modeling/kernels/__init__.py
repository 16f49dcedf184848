"""Kernel profiles: which tensors a real training stack's kernels allocate, keep for backward and
free, for every kernel family the model runs (RMSNorm and LayerNorm, linear with TP / SP
communication, RoPE, core attention, SwiGLU, bias-GELU and squared ReLU, router, MoE permute /
dispatch / combine, grouped linear, loss).

The model modules (``modeling.common.attention.mla``, ``mlp``, ``moe``, ``block``, ``model``) hold a
``KernelProfile`` and call its methods; they never pick a kernel themselves. Three profiles:

- ``eager``: tracemem's own PyTorch modules, the ones proven byte-exact against real CPU
  execution (``tracemem validate``). Real ops, real autograd.
- ``torch``: the eager orchestration with the torch-native fused kernels torchtitan runs:
  ``aten::_fused_rms_norm`` (saves the input and an fp32 rstd), SDPA's fused attention.
- ``megatron-te``: Megatron-Core + Transformer Engine 2.x in bf16 as a DeepSeek recipe runs it
  (TE spec, grouped GEMM, alltoall dispatcher with permute fusion, fused weighted SwiGLU,
  unfused RoPE, TE cross-entropy fusion, shared-expert overlap). Its kernels are
  ``torch.autograd.Function`` s whose forward allocates exactly the real kernel's outputs and
  saves exactly what it saves, and whose backward allocates its gradients and transients; the
  values are never computed (they run on the meta device). Sources: Megatron-LM at commit
  d98e8a6 (2026-08-22) and TransformerEngine at d0067d0 (2.20.0.dev0); each kernel's docstring
  names the file and function it mirrors. ``docs/kernels.md`` has the table. Under its option
  ``fp8_recipe`` (Megatron's ``--fp8-recipe``) the TE linears run FP8 (``modeling.kernels.fp8``:
  the quantised tensors TE allocates per recipe and GPU architecture).

``get_profile(name, **options)`` returns a profile; ``KERNEL_PROFILES`` names them.
"""

from modeling.kernels.profile import (
    KERNEL_PROFILES,
    MEGATRON_TE_OPTIONS,
    EagerKernels,
    KernelProfile,
    MegatronTEKernels,
    TorchKernels,
    get_profile,
)

__all__ = ["KERNEL_PROFILES", "MEGATRON_TE_OPTIONS", "KernelProfile", "EagerKernels",
           "TorchKernels", "MegatronTEKernels", "get_profile"]
