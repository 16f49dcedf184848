"""Allocations below the dispatcher that one rank of a training step keeps: buffers that C++
or library Python code takes from PyTorch's caching allocator, outside any op tracemem traces,
and holds from their first use to the end of the process. They count in
``torch.cuda.memory_stats()["allocated_bytes.all.peak"]`` (``max_memory_allocated``) from the
step that first makes them.

``workspaces(model, gpu=..., kernels=..., micro_batch_size=..., seq_length=...)`` lists them
for a rank tracemem builds (``modeling.parallel.build.build_rank`` on the meta device), each a
``Workspace`` with its exact bytes (what the source asks the allocator for; the caching
allocator's own rounding is ``tracemem.memory.allocator``'s), its source and the pass that
first makes it. It reads the model's modules; it never runs them.

Sources: torch 2.13 (``aten/src/ATen/cuda/CublasHandlePool.cpp``), TransformerEngine d0067d0
(2.20.0.dev0; the same code at 2.17.1, 4329ff84, which Megatron-LM d98e8a6's ``pyproject.toml``
pins for its CI image), Megatron-LM d98e8a6.

1. PyTorch's cuBLAS workspace, one per (cuBLAS handle, CUDA stream) that runs a torch GEMM
   (``CublasHandlePool.cpp`` ``getCurrentCUDABlasHandle`` -> ``setWorkspaceForHandle``: a map
   keyed by (handle, stream), filled by ``getNewWorkspace``, which is
   ``c10::cuda::CUDACachingAllocator::get()->allocate(getChosenWorkspaceSize())``). Size:
   ``parseChosenWorkspaceSize``, ``CUBLAS_WORKSPACE_CONFIG`` unset: 4096 * 8 KiB = 32 MiB on
   compute capability major 9, 10 and 12 (Hopper, Blackwell), else ``:4096:2:16:8`` =
   8,519,680 B (A100). Before pytorch/pytorch#175344 (merged 2026-02-19) the 32 MiB default
   was sm90's alone (``major == 9 && minor == 0``), so Blackwell took 8,519,680 B: the job's
   ``torch_cublas_default`` "sm90" (NGC PyTorch containers up to 26.02 run such a torch:
   ``tracemem.validation.megatron_ci.torch_cublas_default``). Handles are per thread
   (``DeviceThreadHandlePool``, a thread-local ``PoolWindow``): forward GEMMs run on the main
   thread, backward ones on autograd's device thread, on the stream of their forward op, so a
   rank makes one workspace per (thread, stream) pair that runs a torch GEMM. cuBLASLt shares it: ``getCUDABlasLtWorkspace`` with
   ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` unset (``unified_cublas_and_lt_workspaces``: true
   outside fbcode) returns the same (handle, stream) entry; set to 0 it would add a 1 MiB Lt
   workspace per pair (``parseCUDABlasLtWorkspaceSize``), not modelled.
   Which torch GEMMs a Megatron-TE rank runs (the TE linears, the router and TE's fused
   attention use TE's own cuBLASLt handle or cuDNN, not PyTorch's): the output layer
   (Megatron's ``ColumnParallelLinear``: ``tensor_parallel/layers.py`` ``_linear_forward``
   ``torch.matmul``, and in backward ``grad_output.matmul(weight)`` and Apex's
   ``wgrad_gemm_accum_fp32``, which takes ``at::cuda::getCurrentCUDABlasHandle()``); the
   unfused attentions (``--attention unfused``: TE ``UnfusedDotProductAttention`` and
   ``local``: Megatron ``DotProductAttention``, ``torch.baddbmm`` / ``torch.bmm``); the shared-
   expert gate (``transformer/moe/shared_experts.py``: ``F.linear``, on
   ``SharedExpertMLP.stream`` under ``--moe-shared-expert-overlap``, a second stream); a user
   layer's plain ``nn.Linear``. A pipeline stage without the output layer and with fused
   attention runs none: it makes no PyTorch workspace. Under the eager and torch profiles every
   GEMM is a torch op: a forward and a backward workspace.
2. TE's cuBLAS workspaces (``transformer_engine/pytorch/cpp_extensions/gemm.py``
   ``get_cublas_workspace``, ``functools.lru_cache`` keyed by (device, ub, grouped_gemm),
   ``torch.empty`` of ``get_cublas_workspace_size_bytes()``: 32 MiB + 1 KiB (NVFP4 GEMM plus
   alignment) on major >= 9, else 4 MiB): one for ``general_gemm`` (every TE linear, the
   router's ``te_general_gemm``), first made in forward; and, where ``GroupedLinear`` runs
   (routed experts: ``general_grouped_gemm``), ``tex.get_num_cublas_streams()`` more, 4
   (``common/util/multi_stream.cpp`` ``get_num_compute_streams``). Before TE 2.8 (commit
   3f5b475, the NVFP4 recipe) the Hopper size was 33,554,432 B.
3. TE's dummy weight gradients under gradient-accumulation fusion
   (``module/base.py`` ``get_dummy_wgrad``: one ``torch.empty`` per key ``(*shape, dtype)`` in
   the module-global ``_dummy_wgrads``, kept): with Megatron's DDP every trainable parameter has
   ``grad_added_to_main_grad`` (``distributed/distributed_data_parallel.py``
   ``DistributedDataParallel.__init__``), so each fused backward returns one. Callers and keys:
   ``module/linear.py`` (``_Linear`` backward: the weight's shape and dtype),
   ``module/layernorm_linear.py`` and ``module/grouped_linear.py`` (``main_grad.shape``, the
   weight's dtype; per expert weight), Megatron's output layer (``tensor_parallel/layers.py``
   ``LinearWithGradAccumulationAndAsyncCommunication.backward``: ``main_grad.shape``, the
   input's dtype, the activations' = the weights' in bf16 training). ``main_grad`` is a view of
   the grad buffer with the parameter's local shape, so the key is the local weight shape, and
   Megatron's fused weights count as one: ``linear_qkv`` ``[(n + 2 n_kv) d / TP, h]``,
   ``linear_fc1`` ``[2 f / TP, h]`` (gated). Shapes shared by several modules (the output layer
   and a dense fc1 of the same shape, say) share one tensor. First made in backward.
4. Megatron's global memory buffer (``megatron/core/utils.py`` ``GlobalMemoryBuffer.
   get_tensor``: one flat tensor per (name, dtype), replaced only by a larger request, never
   freed). Key ("mpu", bf16) in a GPT / MoE step with the TE spec: the output layer's sequence-
   parallel gather of its input, ``[s / CP, b, h]``, forward and backward
   (``LinearWithGradAccumulationAndAsyncCommunication``); the score buffer
   ``[b n / TP, s, s]`` of ``--attention local`` (``transformer/dot_product_attention.py``
   ``DotProductAttention.forward``). TE's linears gather into their own ``torch.empty``
   buffers, and the alltoall dispatcher does not use it, so those add nothing;
   ``MoEAllGatherTokenDispatcher.token_dispatch`` (``--moe-token-dispatcher-type allgather``)
   gathers the tokens into it over ETP x EP, ``[b s / (CP TP) x ETP x EP, h]`` (``token_
   dispatcher.py``). Its size is the largest request.
5. RoPE's frequencies, ``[s / CP, 1, 1, d_rope]`` fp32 (``models/common/embeddings/
   rotary_pos_embedding.py`` ``RotaryEmbedding.forward``: ``@lru_cache(maxsize=32)``, its
   return ``get_emb``'s ``cat((freqs, freqs))``, sliced per CP rank by
   ``get_pos_emb_on_this_cp_rank``): keyed by the module, so one per ``RotaryEmbedding``: per
   model chunk for grouped-query attention (``models/gpt/gpt_model.py``
   ``GPTModel.__init__`` / ``_preprocess``, position embedding "rope"), per MLA layer for
   MLA (``transformer/multi_latent_attention.py``: each ``MLASelfAttention`` builds its own;
   ``YarnRotaryEmbedding.forward`` caches the same tensor), at most 32 (the cache is the
   decorated function's, shared by all instances).

Not here, and why:
- cuDNN's fused-attention workspace (TE ``csrc/extensions/attention.cpp`` ``fused_attn_fwd`` /
  ``fused_attn_bwd``: ``allocateSpace``, an ``at::empty`` per call, freed on return) and TE's
  norm backward workspaces are transient, and their sizes come from cuDNN / TE heuristics at
  run time, not from a source; a peak inside attention would see them.
- NCCL's own buffers (channels, proxies, ``NCCL_BUFFSIZE``) are ``cudaMalloc`` / cuMem
  allocations outside PyTorch's allocator: not in ``allocated_bytes``. That stops holding for
  memory NCCL takes from a ``torch.cuda.MemPool``: Megatron's ``--use-nccl-ub`` builds its
  DDP / FSDP buffers in one whose allocator is ``ncclMemAlloc`` (``megatron/core/
  nccl_allocator.py``; ``distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py``):
  those are counted, but they are the buffers tracemem's static memory already holds (their
  rounding to NCCL's granularity is not modelled).
- TE's ``--tp-comm-overlap`` userbuffers workspace (``get_cublas_workspace(ub=True)``: 3 x the
  size), the grouped-tensor GEMM path (``moe_use_grouped_tensor``: ``_get_grouped_cublas_
  workspace`` per layout and ``_get_grouped_gemm_setup_workspace``), FP8 state: not run by the
  megatron-te profile.
- The MoE dispatchers' references to ``probs``, ``routing_map`` and the row-id map kept
  until the layer's next forward (``token_dispatcher.py``): tensors the trace already makes,
  whose lifetime the schedule replay extends (``MemoryTracer.retain``); not an allocation
  below the dispatcher.
- Yarn RoPE (Megatron's default ``--rope-type`` for MLA): ``YarnRotaryEmbedding.__init__``
  (``models/common/embeddings/yarn_rotary_pos_embedding.py``) also registers ``cos_cached`` /
  ``sin_cached`` buffers ``[original_max_position_embeddings / CP, 1, 1, d_rope]`` per MLA layer,
  cast to bf16 by ``Float16Module`` (``transformer/module.py``
  ``convert_module_to_dtype_except_fp32_marked``), and under ``--apply-rope-fusion``
  ``get_cached_cos_sin`` replaces them by ``[s / CP, 1, 1, d_rope]`` ones in the activations'
  dtype: module buffers of a RoPE tracemem's MLA does not run (it runs plain frequencies and
  the unfused RoPE); the lru-cached frequencies above are the same for both.

Overlap with the trace: the output layer's SP gather is traced as a transient ``[s / CP, b, h]``
(forward and backward), the allgather dispatcher's token gather as a transient until the
permutation, and ``--attention local``'s scores as alive through each attention; in
Megatron all three are this global buffer, so an estimate adding item 4 should not count those
transients on top of it.

Example::

    model = build_rank(cfg, par, rank, kernels="megatron-te", dtype=torch.bfloat16)
    items = workspaces(model, gpu="H100", kernels="megatron-te", micro_batch_size=1,
                       seq_length=4096)
    sum(w.nbytes for w in items)

Known limitations: ``CUBLASLT_WORKSPACE_SIZE``, ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` and
``setChosenWorkspaceSize`` are taken at their defaults (``CUBLAS_WORKSPACE_CONFIG`` is the
job's: ``torch_cublas_workspace_bytes``). The torch 2.13 function bodies were read from a copy of ``CublasHandlePool.cpp`` whose
API matches 2.13's installed ``ATen/cuda/CUDAContextLight.h``, not from the v2.13 tag (not
reachable here). Recompute does not change the count: a recomputed forward runs in autograd's
device thread, whose backward GEMMs of the same modules make that workspace anyway.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from modeling.common.attention.gqa import GQA
from modeling.common.attention.mla import MLA
from modeling.common.linear import Linear
from modeling.common.mlp import MLP
from modeling.common.moe import GroupedExperts, MoE
from modeling.common.router import Gate
from modeling.kernels import get_profile
from modeling.kernels.attention import UNFUSED_IMPLS
from tracemem.errors import TracememError
from tracemem.job import GPUS, TORCH_CUBLAS_DEFAULTS

__all__ = ["Workspace", "workspaces", "FIRST_USES", "RECOMPUTE_CHOICES",
           "torch_cublas_workspace_bytes", "te_cublas_workspace_bytes", "TE_NUM_CUBLAS_STREAMS",
           "ROPE_CACHE_SIZE", "TORCH_CUBLAS_DEFAULTS"]

FIRST_USES = ("forward", "backward")
RECOMPUTE_CHOICES = ("none", "selective", "full")

_TORCH = "torch 2.13 aten/src/ATen/cuda/CublasHandlePool.cpp"
_TE = "TransformerEngine d0067d0 transformer_engine/pytorch"
_MCORE = "Megatron-LM d98e8a6 megatron/core"

# TE common/util/multi_stream.cpp get_num_compute_streams (the same at 2.17.1 and back to 2.2's
# gemm.h num_streams): the grouped GEMM's cuBLAS streams, one workspace each
TE_NUM_CUBLAS_STREAMS = 4
# functools.lru_cache(maxsize=32) on RotaryEmbedding.forward / YarnRotaryEmbedding.forward
ROPE_CACHE_SIZE = 32


@dataclass(frozen=True)
class Workspace:
    """One allocation below the dispatcher, kept from its first use on.

    Fields: ``name`` what it is (e.g. "PyTorch cuBLAS workspace (autograd device thread,
    current stream)"); ``nbytes`` the bytes the source asks the caching allocator for;
    ``source`` the file and function at the pinned version; ``first_use`` "forward" or
    "backward", the pass of a step that first makes it."""

    name: str
    nbytes: int
    source: str
    first_use: str


def torch_cublas_workspace_bytes(capability: tuple[int, int],
                                 config: str | None = None,
                                 default_rule: str = "2.13") -> int:
    """PyTorch's cuBLAS workspace per (handle, stream) on a GPU of compute ``capability``:
    torch 2.13 ``CublasHandlePool.cpp`` ``parseChosenWorkspaceSize``. With
    ``CUBLAS_WORKSPACE_CONFIG`` (``config``) set, the sum over its ``:SIZE:COUNT`` matches
    (regex ``:([0-9]+):([0-9]+)``) of SIZE KiB x COUNT, whatever the GPU (Megatron's
    deterministic runs set ``:4096:8``: 32 MiB, also on A100); a value with no match warns
    and takes the default. Unset (None), the default, by ``default_rule``
    (``TORCH_CUBLAS_DEFAULTS``): "2.13", "32MiB for Hopper and Blackwell" (major 9, 10 or
    12; pytorch/pytorch#175344, merged 2026-02-19); "sm90", the code before it, "32MiB for
    Hopper" (``const bool sm90 = properties->major == 9 && properties->minor == 0``);
    otherwise ``:4096:2:16:8``, two 4 MiB and eight 16 KiB chunks.

    Raises:
        TracememError: an unknown ``default_rule``."""
    if default_rule not in TORCH_CUBLAS_DEFAULTS:
        raise TracememError(f"torch_cublas_default {default_rule!r} is invalid; choose one "
                            f"of {', '.join(TORCH_CUBLAS_DEFAULTS)}")
    large = (capability[0] in (9, 10, 12) if default_rule == "2.13"
             else tuple(capability) == (9, 0))
    default = 4096 * 8 * 1024 if large else 4096 * 1024 * 2 + 16 * 1024 * 8
    if config is None:
        return default
    matches = re.findall(r":([0-9]+):([0-9]+)", config)
    if not matches:
        return default
    return sum(int(size) * 1024 * int(count) for size, count in matches)


def te_cublas_workspace_bytes(capability: tuple[int, int]) -> int:
    """One TE cuBLAS workspace: TE ``cpp_extensions/gemm.py``
    ``get_cublas_workspace_size_bytes`` (since TE 2.8: 32 MiB for the NVFP4 GEMM plus 1024 B
    for alignment and scales on major >= 9; 4 MiB otherwise)."""
    if capability[0] >= 9:
        return 32 * 1024 * 1024 + 1024
    return 4_194_304


def workspaces(model: nn.Module, *, gpu: str | None, kernels, recompute: str = "none",
               micro_batch_size: int | None = None,
               seq_length: int | None = None,
               cublas_workspace_config: str | None = None,
               torch_cublas_default: str = "2.13") -> list[Workspace]:
    """The allocations below the dispatcher that ``model`` (one rank, as
    ``modeling.parallel.build.build_rank`` builds it) keeps on a ``gpu``
    (``tracemem.job.GPUS``; None: the GPU is not known, nothing is counted) running the
    ``kernels`` profile (a ``modeling.kernels.KernelProfile`` or its name): under megatron-te
    items 1-5 of the module docstring, under eager and torch PyTorch's cuBLAS workspaces only
    (every GEMM there is a torch op). ``micro_batch_size`` (b) and ``seq_length`` (s, tokens per
    sequence before context parallelism) size the items that depend on the sequence (RoPE's
    cache, Megatron's global memory buffer). ``recompute`` ("none", "selective", "full") is
    checked and changes nothing (module docstring). ``cublas_workspace_config``: the job's
    ``CUBLAS_WORKSPACE_CONFIG`` (``torch_cublas_workspace_bytes``), None when unset;
    ``torch_cublas_default``: which PyTorch default applies when it is unset
    (``TORCH_CUBLAS_DEFAULTS``).

    Returns the items in a fixed order (PyTorch cuBLAS, TE cuBLAS, Megatron's global buffer,
    RoPE, dummy weight gradients), each a separate allocation.

    Raises:
        TracememError: an unknown ``gpu``, ``recompute`` or ``torch_cublas_default``;
            ``micro_batch_size`` or
            ``seq_length`` missing or below 1 where an item depends on them.
    """
    if recompute not in RECOMPUTE_CHOICES:
        raise TracememError(f"recompute {recompute!r} is invalid; choose one of "
                            f"{', '.join(RECOMPUTE_CHOICES)}")
    if gpu is None:
        return []
    if gpu not in GPUS:
        raise TracememError(f"--gpu {gpu!r} is invalid; choose one of {', '.join(GPUS)}")
    capability = GPUS[gpu]
    profile = get_profile(kernels)
    megatron = profile.orchestration == "megatron"
    modules = _Modules(model, megatron)
    out = _torch_cublas(modules, capability, cublas_workspace_config, torch_cublas_default)
    if not megatron:
        return out
    out += _te_cublas(modules, capability)
    sized = (_global_buffer(modules, model, micro_batch_size, seq_length)
             + _rope(modules, model, seq_length))
    if None in sized:  # an item applies, and its size needs the sequence
        raise TracememError("workspaces(): Megatron's global memory buffer and RoPE's cached "
                            "frequencies depend on the sequence; pass micro_batch_size= and "
                            "seq_length= (the job's)")
    out += sized
    if profile.fuse_wgrad:
        out += _dummy_wgrads(modules)
    return out


class _Modules:
    """What a rank's modules run, read once: the TE weights and their Megatron shapes, the
    torch GEMM sites, the routed experts, the attentions."""

    def __init__(self, model: nn.Module, megatron: bool):
        self.te_weights: list[tuple[str, tuple[int, ...], torch.dtype, str]] = []
        self.grouped: list[str] = []  # routed-expert modules (TE GroupedLinear)
        self.routers = 0  # MoE routers (TE general_gemm in fp32)
        self.torch_gemm_streams: set[str] = set()  # streams running a torch GEMM
        self.head: Linear | None = getattr(model, "head", None)
        self.attentions: list[tuple[str, nn.Module]] = []
        self.allgather_moes: list[tuple[str, MoE]] = []  # MoEAllGatherTokenDispatcher, > 1 rank
        skip: set[int] = set()
        for path, mod in model.named_modules():
            if id(mod) in skip:
                continue
            if isinstance(mod, (GQA, MLA)):
                self.attentions.append((path, mod))
            if not megatron:  # F.linear everywhere (the router's too)
                if isinstance(mod, (nn.Linear, Gate)):
                    self.torch_gemm_streams.add("current")
                continue
            if isinstance(mod, MoE):
                self.routers += 1  # router_gating_linear: TE's general_gemm
                if (mod.kernels.options.get("moe_token_dispatcher") == "allgather"
                        and mod.ep * mod.etp > 1):
                    self.allgather_moes.append((path, mod))
                skip.update(id(m) for m in mod.experts.modules())
                experts = _expert_weights(f"{path}.experts", mod.experts)
                if experts:  # TE GroupedLinear (TEGroupedMLP), or one TE linear pair per
                    # local expert (SequentialMLP: general_gemm, no grouped-GEMM streams)
                    if isinstance(mod.experts, GroupedExperts):
                        self.grouped.append(f"{path}.experts")
                    self.te_weights += experts
                gate = mod.shared_expert_gate
                if gate is not None:  # F.linear; SharedExpertMLP.stream under the overlap
                    skip.add(id(gate))
                    shared = mod.shared_experts
                    overlap = shared is not None and shared.shared_overlap
                    self.torch_gemm_streams.add("shared-expert" if overlap else "current")
            elif isinstance(mod, GQA):  # one linear_qkv over [wq; wk; wv]
                skip.update((id(mod.wq), id(mod.wk), id(mod.wv)))
                self.te_weights.append(_fused(f"{path}.wq", mod.wq, mod.wk, mod.wv))
            elif isinstance(mod, MLP) and hasattr(mod, "w3"):  # one linear_fc1 over [w1; w3]
                skip.update((id(mod.w1), id(mod.w3)))
                self.te_weights.append(_fused(f"{path}.w1", mod.w1, mod.w3))
            elif isinstance(mod, Linear) and _is_te(mod):
                which = "output layer" if mod is self.head else "TE linear"
                self.te_weights.append((path, tuple(mod.weight.shape), mod.weight.dtype,
                                        which))
            elif isinstance(mod, nn.Linear):  # a plain nn.Linear: F.linear, a torch GEMM
                self.torch_gemm_streams.add("current")
            if isinstance(mod, (GQA, MLA)) and mod.attention in UNFUSED_IMPLS:
                self.torch_gemm_streams.add("current")  # baddbmm / bmm
        if megatron and self.head is not None:  # the output layer's torch.matmul
            self.torch_gemm_streams.add("current")

    @property
    def runs_te_general_gemm(self) -> bool:
        return self.routers > 0 or any(which == "TE linear" for *_, which in self.te_weights)


def _is_te(mod: Linear) -> bool:
    return mod.kernels is not None and mod.kernels.orchestration == "megatron"


def _fused(path: str, *linears: Linear) -> tuple[str, tuple[int, ...], torch.dtype, str]:
    """Megatron's one weight for several tracemem ``Linear`` s: their rows stacked."""
    first = linears[0].weight
    rows = sum(m.weight.shape[0] for m in linears)
    return path, (rows, first.shape[1]), first.dtype, "TE linear"


def _expert_weights(path: str, experts: nn.Module) -> list:
    """The per-expert weights of Megatron's ``TEGroupedMLP`` (``linear_fc1`` ``weight{i}``
    ``[2 f, h]`` gated, ``[f, h]`` not, ``linear_fc2`` ``[h, f]``) for tracemem's grouped or
    sequential experts."""
    if isinstance(experts, GroupedExperts):
        if experts.w1.shape[0] == 0:
            return []
        fc1 = (experts.w1.shape[1] + (experts.w3.shape[1] if experts.gated else 0),
               experts.w1.shape[2])
        fc2 = tuple(experts.w2.shape[1:])
        dtype = experts.w1.dtype
    else:
        if len(experts) == 0:
            return []
        first = experts[0]
        fc1 = (first.w1.weight.shape[0] + (first.w3.weight.shape[0]
                                           if hasattr(first, "w3") else 0),
               first.w1.weight.shape[1])
        fc2 = tuple(first.w2.weight.shape)
        dtype = first.w1.weight.dtype
    which = "TE GroupedLinear" if isinstance(experts, GroupedExperts) else "TE linear"
    return [(f"{path}.linear_fc1", fc1, dtype, which), (f"{path}.linear_fc2", fc2, dtype, which)]


def _torch_cublas(modules: _Modules, capability, config: str | None = None,
                  default_rule: str = "2.13") -> list[Workspace]:
    """One per (thread, stream) running a torch GEMM: the main thread's in forward, autograd's
    device thread's in backward, on each stream that runs one."""
    nbytes = torch_cublas_workspace_bytes(capability, config, default_rule)
    source = (f"{_TORCH} getCurrentCUDABlasHandle, setWorkspaceForHandle, getNewWorkspace, "
              f"parseChosenWorkspaceSize")
    if config is None and default_rule != "2.13":
        source += " (its default before pytorch/pytorch#175344: 32 MiB on sm90 only)"
    out = []
    for stream in sorted(modules.torch_gemm_streams):  # "current" before "shared-expert"
        where, src = ("current stream", source) if stream == "current" else (
            "SharedExpertMLP.stream",
            f"{source}; {_MCORE}/transformer/moe/shared_experts.py "
            f"SharedExpertMLP.pre_forward_comm")
        for thread, first_use in (("main thread", "forward"),
                                  ("autograd device thread", "backward")):
            out.append(Workspace(f"PyTorch cuBLAS workspace ({thread}, {where})", nbytes,
                                 src, first_use))
    return out


def _te_cublas(modules: _Modules, capability) -> list[Workspace]:
    nbytes = te_cublas_workspace_bytes(capability)
    src = f"{_TE}/cpp_extensions/gemm.py get_cublas_workspace, get_cublas_workspace_size_bytes"
    out = []
    if modules.runs_te_general_gemm:
        out.append(Workspace("TE cuBLAS workspace (general_gemm)", nbytes,
                             f"{src} (general_gemm)", "forward"))
    if modules.grouped:
        for i in range(TE_NUM_CUBLAS_STREAMS):
            out.append(Workspace(
                f"TE cuBLAS workspace (general_grouped_gemm, stream {i})", nbytes,
                f"{src} (grouped_gemm=True); common/util/multi_stream.cpp "
                f"get_num_compute_streams", "forward"))
    return out


def _global_buffer(modules: _Modules, model, b, s) -> list[Workspace | None]:
    """Megatron's ("mpu", dtype) buffers: the largest request of each dtype, or [] when
    nothing requests one; [None] when a request exists but the sequence is not given."""
    sizes, head = model.sizes, modules.head
    gathers = head is not None and sizes.sp > 1  # the output layer's SP gather
    local = [(path, attn) for path, attn in modules.attentions if attn.attention == "local"]
    if not gathers and not local and not modules.allgather_moes:
        return []
    if b is None or s is None:
        return [None]
    _check_positive(b, s)
    requests = []  # (elements, dtype, what)
    if gathers:  # [s / CP, b, h] in the activations' dtype
        requests.append((b * (s // sizes.cp) * head.weight.shape[1], head.weight.dtype,
                         "output layer's sequence-parallel gather"))
    for path, moe in modules.allgather_moes:  # the dispatcher's token gather over ETP x EP:
        # [b s / (CP TP) x ETP x EP, h] in the activations' dtype
        h = moe.cfg.hidden_size
        requests.append((b * (s // (sizes.cp * sizes.sp)) * moe.ep * moe.etp * h,
                         moe.gate.weight.dtype, f"{path} allgather dispatcher's token gather"))
    for path, attn in local:  # [b * n / TP, s, s] in the query's dtype (no CP with local)
        requests.append((b * attn.num_heads * s * s, attn.wo.weight.dtype,
                         f"{path} scores"))
    largest: dict[torch.dtype, tuple[int, str]] = {}  # one buffer per (name, dtype)
    for numel, dtype, what in requests:
        if numel > largest.get(dtype, (0, ""))[0]:
            largest[dtype] = (numel, what)
    return [Workspace(
        f"Megatron global memory buffer ('mpu', {_dtype(dtype)}: largest request, {what})",
        numel * dtype.itemsize,
        f"{_MCORE}/utils.py GlobalMemoryBuffer.get_tensor; tensor_parallel/layers.py "
        f"LinearWithGradAccumulationAndAsyncCommunication.forward (sequence-parallel gather); "
        f"transformer/dot_product_attention.py DotProductAttention.forward (local scores); "
        f"transformer/moe/token_dispatcher.py MoEAllGatherTokenDispatcher.token_dispatch",
        "forward") for dtype, (numel, what) in largest.items()]


def _rope(modules: _Modules, model, s) -> list[Workspace | None]:
    """RoPE's lru-cached frequencies: one per RotaryEmbedding, at most ROPE_CACHE_SIZE."""
    cfg, sizes = model.cfg, model.sizes
    mla = [(path, attn) for path, attn in modules.attentions if isinstance(attn, MLA)]
    if mla:  # one RotaryEmbedding per MLASelfAttention
        owners = [path for path, _ in mla]
        dim = mla[0][1].rope_dim
        src = (f"{_MCORE}/models/common/embeddings/rotary_pos_embedding.py "
               f"RotaryEmbedding.forward (lru_cache); transformer/multi_latent_attention.py "
               f"MLASelfAttention.__init__")
    elif cfg.has_rope and any(isinstance(a, GQA) for _, a in modules.attentions):
        owners = [f"model chunk {i}" for i in range(len(model.chunks))]  # one GPTModel each
        dim = cfg.rotary_dim
        src = (f"{_MCORE}/models/common/embeddings/rotary_pos_embedding.py "
               f"RotaryEmbedding.forward (lru_cache); models/gpt/gpt_model.py "
               f"GPTModel._preprocess")
    else:
        return []
    if s is None:
        return [None]
    _check_positive(1, s)
    nbytes = (s // sizes.cp) * dim * 4  # [s / CP, 1, 1, d_rope] fp32
    return [Workspace(f"RoPE frequencies [{s // sizes.cp}, 1, 1, {dim}] fp32 ({owner})",
                      nbytes, src, "forward")
            for owner in owners[:ROPE_CACHE_SIZE]]


def _dummy_wgrads(modules: _Modules) -> list[Workspace]:
    """One per distinct (shape, dtype) of the fused weights (module docstring, item 3)."""
    users: dict[tuple, list[str]] = {}
    for path, shape, dtype, _ in modules.te_weights:
        users.setdefault((shape, dtype), []).append(path)
    out = []
    for (shape, dtype), paths in users.items():
        numel = 1
        for d in shape:
            numel *= d
        more = f" and {len(paths) - 1} more" if len(paths) > 1 else ""
        out.append(Workspace(
            f"TE dummy wgrad {list(shape)} {_dtype(dtype)} ({paths[0]}{more})",
            numel * dtype.itemsize,
            f"{_TE}/module/base.py get_dummy_wgrad (module/linear.py, layernorm_linear.py, "
            f"grouped_linear.py backward; {_MCORE}/tensor_parallel/layers.py "
            f"LinearWithGradAccumulationAndAsyncCommunication.backward)",
            "backward"))
    return out


def _dtype(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype).removeprefix("torch."))


def _check_positive(b: int, s: int) -> None:
    if b < 1 or s < 1:
        raise TracememError(f"workspaces(): micro_batch_size ({b}) and seq_length ({s}) "
                            f"must be at least 1")
