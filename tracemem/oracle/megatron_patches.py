"""Every patch that lets Megatron-Core run on the meta device, on a CPU, under a fake process
group: the one place where tracemem touches Megatron-Core's code.

Pinned: **megatron-core 0.16.1** (the ``megatron`` extra). Each entry of ``PATCHES`` names the
attribute it replaces (module and name at 0.16.1) and why; ``tests/tracemem/
test_oracle_megatron.py`` fails if one of them is no longer where the entry says.

What the patches do, in four groups:

- **no CUDA**: ``torch.cuda.current_device`` answers ``meta``, CUDA streams and events are
  no-ops (the alltoall dispatcher's device-to-host stream, the shared experts' overlap
  stream), a ``TorchFunctionMode`` (``CudaToMeta``) moves any tensor a factory puts on
  ``cuda`` to ``meta`` (hard-coded ``device="cuda"`` buffers) and answers ``Tensor.type()``
  of a meta tensor with its CUDA name (the distributed optimizer's dtype check), and apex's
  ``fused_weight_gradient_mlp_cuda`` (``--gradient-accumulation-fusion`` of Megatron-Core's
  own linear layers) accumulates into ``main_grad`` as a no-op.
- **TE leaves that Megatron-Core reaches through module names**: the fused permute / unpermute
  / chunk sort and the router GEMM (``te_general_gemm``) are tracemem's ``megatron-te``
  kernels (``modeling.kernels``), because Transformer Engine does not install without CUDA
  (its names are ``MagicMock`` placeholders or absent at 0.16.1). MLA's down projections are
  recognised by the class name ``TELinear``, so that name points at the oracle's leaf.
- **fused pointwise kernels**: the ``torch.compile``-fused SwiGLU bodies allocate their
  outputs only, as the compiled kernel does (eager would materialise every pointwise
  intermediate).
- **data-dependent sizes**: ``MoEAlltoAllTokenDispatcher.preprocess`` takes the per-expert
  token counts from tracemem's routing model (``modeling.common.routing``) instead of reading the
  routing map's values (``.tolist()`` / ``.cpu()`` on meta cannot give them); the device-to-
  host synchronisation becomes a no-op.

Nothing here changes what Megatron-Core allocates on a GPU except where the entry says.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy
import torch
from torch.overrides import TorchFunctionMode

from tracemem.errors import TracememError

__all__ = ["MEGATRON_CORE_VERSION", "Patch", "PATCHES", "CudaToMeta", "applied",
           "fake_process_groups", "require_megatron", "set_routing"]

MEGATRON_CORE_VERSION = "0.16.1"


def require_megatron() -> None:
    """Import-check megatron-core at the pinned version.

    Raises:
        TracememError: megatron-core is not installed (``pip install 'tracemem[megatron]'``)
            or is another version.
    """
    try:
        import megatron.core  # noqa: F401
        from megatron.core.package_info import __version__
    except ImportError as error:
        raise TracememError(f"--against megatron-core needs megatron-core "
                            f"{MEGATRON_CORE_VERSION}: pip install 'tracemem[megatron]' (in "
                            f"a clone, `make test` installs it, or .venv/bin/python -m pip "
                            f"install -c constraints.txt -e '.[megatron]') ({error})") from None
    if __version__ != MEGATRON_CORE_VERSION:
        raise TracememError(f"--against megatron-core is pinned to megatron-core "
                            f"{MEGATRON_CORE_VERSION}; {__version__} is installed")


# ---------------------------------------------------------------------------- no CUDA
class _NoStream:
    """A CUDA stream / event stand-in: every method is a no-op, ``with`` does nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: _NoStream()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _is_cuda(device: Any) -> bool:
    if isinstance(device, int):
        return True  # an int device is a CUDA ordinal (torch.cuda.current_device())
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class CudaToMeta(TorchFunctionMode):
    """Moves tensors that code asks for on ``cuda`` to ``meta``: a ``device=`` keyword naming
    CUDA, ``.cuda()``, ``.to("cuda")``; and ``Tensor.type()`` of a meta tensor answers the
    CUDA type name (``torch.cuda.BFloat16Tensor``). Replaces every hard-coded CUDA placement in
    Megatron-Core 0.16.1 (e.g. ``permute_idx_device`` in ``transformer/moe/
    token_dispatcher.py`` ``MoEAlltoAllTokenDispatcher.__init__``)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.type and len(args) == 1 and not kwargs \
                and args[0].device.type == "meta":
            # Tensor.type() names a meta tensor "torch.meta.BFloat16Tensor"; optimizer/
            # distrib_optimizer.py DistributedOptimizer._build_model_and_main_param_groups
            # (and optimizer.py Float16OptimizerWithFloat16Params) accept "torch.cuda.*" only
            return func(*args).replace("torch.meta.", "torch.cuda.")
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = torch.device("meta")
        if func is torch.Tensor.cuda:
            return args[0].to("meta")
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], torch.device("meta"), *args[2:])
        return func(*args, **kwargs)


# ---------------------------------------------------------------------------- TE leaves
def _te_general_gemm(A, B, out_dtype, layout="TN", bias=None, grad=False, **kwargs):
    """TE ``general_gemm`` (``transformer_engine/pytorch/cpp_extensions/gemm.py``) as Megatron-
    Core's router calls it: ``op(B) @ op(A)`` in ``out_dtype``, returned as a 1-tuple (the rest
    of TE's tuple is unused). Allocates the output only."""
    rows = B.shape[1] if layout[1] == "T" else B.shape[0]
    cols = A.shape[1] if layout[0] == "N" else A.shape[0]
    return (torch.empty((rows, cols), dtype=out_dtype, device=B.device),)


def _fused_permute_with_probs(tokens, probs, routing_map, num_out_tokens=None):
    """TE ``moe_permute_with_probs`` via ``modeling.kernels.moe.te_permute``: permuted tokens
    ``(num_out_tokens, h)``, their probabilities and the row-id map."""
    from modeling.kernels.moe import te_permute
    return te_permute(tokens, probs, int(num_out_tokens))


def _fused_permute(tokens, routing_map, num_out_tokens=None, **kwargs):
    """TE ``moe_permute`` without probabilities: the alltoall dispatcher always permutes with
    them; present because ``TransformerConfig.__post_init__`` imports the name."""
    raise TracememError("the oracle's permute needs the probabilities (alltoall dispatcher)")


def _fused_unpermute(permuted, row_id_map, merging_probs=None, restore_shape=None, **kwargs):
    """TE ``moe_unpermute`` without merging probabilities (they were applied in the weighted
    SwiGLU) via ``modeling.kernels.moe.te_unpermute``."""
    from modeling.kernels.moe import te_unpermute
    if merging_probs is not None:
        raise TracememError("the oracle's unpermute does not merge probabilities "
                            "(moe_apply_probs_on_input / merged probs are not modelled)")
    return te_unpermute(permuted, row_id_map, int(restore_shape[0]))


def _fused_sort_chunks_by_index(inp, split_sizes, sorted_idxs):
    from modeling.kernels.moe import te_sort_chunks
    return te_sort_chunks(inp)[0]


def _fused_sort_chunks_by_index_with_probs(inp, probs, split_sizes, sorted_idxs):
    from modeling.kernels.moe import te_sort_chunks
    return te_sort_chunks(inp, probs)


# ---------------------------------------------------------------------------- fused SwiGLU
def _swiglu(y):
    return y.new_empty((*y.shape[:-1], y.shape[-1] // 2))


def _weighted_swiglu(y, weights):
    return y.new_empty((*y.shape[:-1], y.shape[-1] // 2))


def _swiglu_back(g, y):
    return torch.empty_like(y)


def _weighted_swiglu_back(g, y, weights):
    return torch.empty_like(y), torch.empty_like(weights)


def _bias_dropout_add_train():
    from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_unfused
    return bias_dropout_add_unfused(True)


# ---------------------------------------------------------------------------- wgrad fusion
class _FusedWgrad:
    """apex's ``fused_weight_gradient_mlp_cuda`` (CUDA only): ``wgrad_gemm_accum_fp32`` /
    ``_fp16`` accumulate ``input^T @ grad`` into ``main_grad`` in place, allocating nothing;
    here they do nothing (meta tensors have no values)."""

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad):
        return None

    wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32


# ---------------------------------------------------------------------------- resize_
def _storage_resized(tensors) -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from tracemem.tracer import MemoryTracer
    mode = _get_current_dispatch_mode()
    if isinstance(mode, MemoryTracer):
        for t in tensors:
            if isinstance(t, torch.Tensor):
                mode.storage_resized(t)


def _discard_output(original):
    def discard_output_and_register_recompute(self, hook_tensor):
        outputs = self.outputs
        original(self, hook_tensor)
        _storage_resized(outputs or ())
    return discard_output_and_register_recompute


def _recompute(original):
    def recompute(self, grad):
        outputs = self.outputs
        original(self, grad)
        _storage_resized(outputs or ())
    return recompute


# ---------------------------------------------------------------------------- routing
_ROUTING: dict[str, Any] = {"model": None}


def set_routing(routing) -> None:
    """The routing model (``modeling.common.routing.RoutingModel``) the patched dispatcher asks."""
    _ROUTING["model"] = routing


def _dispatcher_preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
    """``MoEAlltoAllTokenDispatcher.preprocess`` (dropless, no padding) with the counts of the
    routing model: this rank's tokens send ``counts[e]`` slots to expert ``e``; every EP and
    expert-TP peer is assumed to route as this rank does (tracemem's convention,
    ``modeling.common.moe.MoE``), so this rank's local expert ``e`` receives ``counts[e]`` from each
    of the ``tp_size * ep_size`` peers. Sets the split sizes as Python ints (what the real
    dispatcher copies to the host at ``cuda_dtoh_point``) and returns the tokens per local
    expert as a CPU tensor."""
    routing = _ROUTING["model"]
    if routing is None:
        raise TracememError("the oracle's dispatcher has no routing model (set_routing)")
    tokens, num_experts = routing_map.shape
    top_k = self.config.moe_router_topk
    layer = getattr(self, "tracemem_layer", 0)  # 0-based; set by the oracle's builder
    counts = routing.counts(tokens, top_k, num_experts, layer)
    local = [counts[e] for e in self.local_expert_indices]
    self.num_out_tokens = tokens * top_k
    n_local = self.num_local_experts
    peers = self.tp_size * self.ep_size
    if self.ep_size > 1 or self.tp_size > 1:  # numpy arrays, as the host copies are
        self.input_splits = numpy.array([sum(counts[r * n_local:(r + 1) * n_local])
                                         for r in range(self.ep_size)])
        self.output_splits = numpy.array([sum(local)] * self.ep_size)
        self.output_splits_tp = numpy.array([sum(local) * self.ep_size] * self.tp_size)
    self.num_global_tokens_per_local_expert = torch.tensor(
        [local] * peers, dtype=torch.long, device="cpu")
    self.cuda_sync_point = "no_sync"
    return torch.tensor([c * peers for c in local], dtype=torch.long, device="cpu")


def _dtoh_and_synchronize(self, point, tokens_per_expert=None):
    """``_maybe_dtoh_and_synchronize``: the split sizes are host values already."""
    return tokens_per_expert


# ---------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Patch:
    """One attribute replaced while ``applied()`` is active.

    Attributes:
        module: the dotted module path; name: the attribute (``Class.method`` for a method);
        make: returns the replacement (called once per ``applied()``); replaces: what the
            original is at megatron-core 0.16.1 (file and function) and why it is replaced;
        read_by: qualified names of the functions in ``module`` that read the global
            ``name`` (the test checks they still do: a name that TE would define is absent
            without it, so its presence cannot be checked).
    """

    module: str
    name: str
    make: Callable[[], Any]
    replaces: str
    read_by: tuple[str, ...] = ()  # functions of ``module`` that read ``name`` (a global)

    def owner(self):
        obj = importlib.import_module(self.module)
        parts = self.name.split(".")
        for part in parts[:-1]:
            obj = getattr(obj, part)
        return obj, parts[-1]


def _original(module: str, cls: str, name: str):
    """The unpatched ``module.cls.name`` (read when ``applied()`` installs the wrapper)."""
    return getattr(getattr(importlib.import_module(module), cls), name)


def _no_fp8(init):
    def no_fp8(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.fp8 = False
    return no_fp8


def _leaf(name: str):
    def make():
        from tracemem.oracle import megatron_spec
        return getattr(megatron_spec, name)
    return make


_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
_SWIGLU = "megatron.core.fusions.fused_bias_swiglu"
_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"

PATCHES: tuple[Patch, ...] = (
    Patch("torch.cuda", "current_device", lambda: (lambda: torch.device("meta")),
          "torch.cuda.current_device: Megatron-Core places buffers on it (transformer/moe/"
          "router.py TopKRouter.__init__ expert-bias buffers, tensor_parallel/layers.py); "
          "no CUDA here, so it answers the meta device"),
    Patch("torch.cuda", "Stream", lambda: _NoStream,
          "torch.cuda.Stream: transformer/moe/token_dispatcher.py MoEAlltoAllTokenDispatcher."
          "__init__ (cuda_dtoh_stream) and transformer/moe/shared_experts.py SharedExpertMLP."
          "__init__ (the overlap stream); a no-op stream"),
    Patch("torch.cuda", "stream", lambda: (lambda stream=None: contextlib.nullcontext()),
          "torch.cuda.stream: the `with torch.cuda.stream(...)` blocks of shared_experts.py "
          "and token_dispatcher.py; one stream here"),
    Patch("torch.cuda", "current_stream", lambda: (lambda device=None: _NoStream()),
          "torch.cuda.current_stream: shared_experts.py SharedExpertMLP.pre_forward_comm / "
          "get_output wait_stream; a no-op stream"),
    Patch("megatron.core.tensor_parallel.random", "CudaRNGStatesTracker.fork",
          lambda: (lambda self, name=None: contextlib.nullcontext()),
          "tensor_parallel/random.py CudaRNGStatesTracker.fork: transformer/transformer_block.py "
          "TransformerBlock.forward forks the model-parallel CUDA RNG under SP (a CUDA RNG "
          "state, never seeded here); dropout is 0 and meta has no values, so nothing to fork"),
    Patch("megatron.core.tensor_parallel.random", "_get_all_rng_states",
          lambda: (lambda: (None, None, None)),
          "tensor_parallel/random.py _get_all_rng_states: CheckpointFunction (full recompute) "
          "and CheckpointWithoutOutput (mla_up_proj, moe_act) stash the CPU and CUDA RNG "
          "states (torch.cuda.get_rng_state needs CUDA); both are host tensors, not GPU "
          "memory, and meta draws no random numbers"),
    Patch("megatron.core.tensor_parallel.random", "_set_all_rng_states",
          lambda: (lambda *states: None),
          "tensor_parallel/random.py _set_all_rng_states: restores the stash above; nothing "
          "to restore"),
    Patch("megatron.core.tensor_parallel.random",
          "CheckpointWithoutOutput.discard_output_and_register_recompute",
          lambda: _discard_output(_original("megatron.core.tensor_parallel.random",
                                            "CheckpointWithoutOutput",
                                            "discard_output_and_register_recompute")),
          "tensor_parallel/random.py CheckpointWithoutOutput.discard_output_and_register_"
          "recompute (mla_up_proj, moe_act recompute) frees its outputs with "
          "untyped_storage().resize_(0), below the dispatcher; the original, then the tracer "
          "is told (MemoryTracer.storage_resized)"),
    Patch("megatron.core.tensor_parallel.random", "CheckpointWithoutOutput.__init__",
          lambda: _no_fp8(_original("megatron.core.tensor_parallel.random",
                                    "CheckpointWithoutOutput", "__init__")),
          "tensor_parallel/random.py CheckpointWithoutOutput.__init__ sets self.fp8 = fp8 is "
          "not None (True for the default fp8=False) and later asks TE's "
          "FP8GlobalStateManager, a NameError without TE (layernorm and moe_act recompute); "
          "the original, then fp8 False: the oracle runs bf16"),
    Patch("megatron.core.tensor_parallel.random", "CheckpointWithoutOutput._recompute",
          lambda: _recompute(_original("megatron.core.tensor_parallel.random",
                                       "CheckpointWithoutOutput", "_recompute")),
          "tensor_parallel/random.py CheckpointWithoutOutput._recompute resizes the outputs' "
          "storages back (resize_ and a storage copy_, below the dispatcher); the original, "
          "then the tracer is told"),
    Patch(_MOE_UTILS, "HAVE_TE", lambda: True,
          "transformer/moe/moe_utils.py HAVE_TE (False without Transformer Engine): permute / "
          "unpermute / sort_chunks_by_idxs with fused=True check it before the TE kernels",
          read_by=('permute', 'unpermute', 'sort_chunks_by_idxs')),
    Patch(_MOE_UTILS, "te_general_gemm", lambda: _te_general_gemm,
          "moe_utils.py te_general_gemm (undefined without TE: NameError in "
          "RouterGatingLinearFunction.forward): TE general_gemm, output only",
          read_by=("RouterGatingLinearFunction.forward",
                   "RouterGatingLinearFunction.backward")),
    Patch(_MOE_UTILS, "fused_permute", lambda: _fused_permute,
          "moe_utils.py fused_permute (TE moe_permute; undefined without TE, imported by "
          "transformer_config.py TransformerConfig.__post_init__ when moe_permute_fusion)",
          read_by=('permute',)),
    Patch(_MOE_UTILS, "fused_permute_with_probs", lambda: _fused_permute_with_probs,
          "moe_utils.py fused_permute_with_probs (TE moe_permute_with_probs; undefined without "
          "TE): modeling.kernels.moe.te_permute",
          read_by=('permute',)),
    Patch(_MOE_UTILS, "fused_unpermute", lambda: _fused_unpermute,
          "moe_utils.py fused_unpermute (TE moe_unpermute): modeling.kernels.moe.te_unpermute",
          read_by=('unpermute',)),
    Patch(_MOE_UTILS, "fused_sort_chunks_by_index", lambda: _fused_sort_chunks_by_index,
          "moe_utils.py fused_sort_chunks_by_index (TE moe_sort_chunks_by_index): "
          "modeling.kernels.moe.te_sort_chunks",
          read_by=('sort_chunks_by_idxs',)),
    Patch(_MOE_UTILS, "fused_sort_chunks_by_index_with_probs",
          lambda: _fused_sort_chunks_by_index_with_probs,
          "moe_utils.py fused_sort_chunks_by_index_with_probs (TE "
          "moe_sort_chunks_by_index_with_probs): modeling.kernels.moe.te_sort_chunks",
          read_by=('sort_chunks_by_idxs',)),
    Patch("megatron.core.fusions.fused_bias_dropout", "bias_dropout_add_fused_train",
          lambda: _bias_dropout_add_train(),
          "fusions/fused_bias_dropout.py bias_dropout_add_fused_train (torch.compile of "
          "_bias_dropout_add_func, which dynamo cannot trace on meta tensors): the same body "
          "run eagerly; without bias and with dropout 0 it is `residual + x`, one output, "
          "nothing saved, as the compiled kernel"),
    Patch(_SWIGLU, "swiglu", lambda: _swiglu,
          "fusions/fused_bias_swiglu.py swiglu (torch.compile-fused: one kernel, output only)"),
    Patch(_SWIGLU, "weighted_swiglu", lambda: _weighted_swiglu,
          "fused_bias_swiglu.py weighted_swiglu (torch.compile-fused: output only)"),
    Patch(_SWIGLU, "swiglu_back", lambda: _swiglu_back,
          "fused_bias_swiglu.py swiglu_back (torch.compile-fused: the input gradient only)"),
    Patch(_SWIGLU, "weighted_swiglu_back", lambda: _weighted_swiglu_back,
          "fused_bias_swiglu.py weighted_swiglu_back (torch.compile-fused: the input and "
          "probability gradients only)"),
    Patch(_DISPATCHER, "MoEAlltoAllTokenDispatcher.preprocess", lambda: _dispatcher_preprocess,
          "token_dispatcher.py MoEAlltoAllTokenDispatcher.preprocess: the split sizes come "
          "from the routing map's values (routing_map.sum, then .tolist() / a host copy), "
          "which meta tensors do not have; here from tracemem's routing model"),
    Patch(_DISPATCHER, "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
          lambda: _dtoh_and_synchronize,
          "token_dispatcher.py MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize: the "
          "device-to-host copy of the split sizes on cuda_dtoh_stream; they are host ints"),
    Patch("megatron.core.tensor_parallel.layers", "_grad_accum_fusion_available",
          lambda: True,
          "tensor_parallel/layers.py _grad_accum_fusion_available (False without apex's "
          "fused_weight_gradient_mlp_cuda): ColumnParallelLinear.__init__ refuses "
          "gradient_accumulation_fusion without it; the whole-model oracle's output layer "
          "fuses its weight gradient as --gradient-accumulation-fusion does",
          read_by=("ColumnParallelLinear.__init__",)),
    Patch("megatron.core.tensor_parallel.layers", "fused_weight_gradient_mlp_cuda",
          lambda: _FusedWgrad,
          "tensor_parallel/layers.py fused_weight_gradient_mlp_cuda (apex, CUDA only; "
          "undefined without it): LinearWithGradAccumulationAndAsyncCommunication.backward "
          "accumulates the weight gradient into main_grad in place; a no-op here",
          read_by=("LinearWithGradAccumulationAndAsyncCommunication.backward",)),
    Patch("megatron.core.transformer.multi_latent_attention", "TELinear", _leaf("TELinear"),
          "transformer/multi_latent_attention.py TELinear (None without TE): "
          "MLASelfAttention.__init__ makes the down projections duplicated only when their "
          "class `in [TELinear]`; the oracle's leaf TELinear",
          read_by=("MLASelfAttention.__init__",)),
)


@contextlib.contextmanager
def applied() -> Iterator[None]:
    """Every patch of ``PATCHES`` and ``CudaToMeta``, undone on exit (also on error).

    Raises:
        TracememError: megatron-core missing or not the pinned version; a patched attribute
            not found (megatron-core moved it).
    """
    require_megatron()
    saved = []
    try:
        for patch in PATCHES:
            owner, attr = patch.owner()
            if not hasattr(owner, attr) and not patch.read_by:
                raise TracememError(f"megatron patch target {patch.module}.{patch.name} "
                                    f"is missing")
            saved.append((owner, attr, owner.__dict__.get(attr, _MISSING)))
            setattr(owner, attr, patch.make())
        with CudaToMeta():
            yield
    finally:
        for owner, attr, old in reversed(saved):
            if old is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)


_MISSING = object()


@contextlib.contextmanager
def fake_process_groups(*, world_size: int, rank: int = 0, tp: int = 1, ep: int = 1,
                        etp: int = 1, pp: int = 1, sp: bool = False, cp: int = 1,
                        vpp: int = 1, instances: int = 1) -> Iterator[None]:
    """A fake ``torch.distributed`` world (``torch.testing._internal.distributed.fake_pg``
    ``FakeStore``, backend ``"fake"``: collectives return without moving data) and
    Megatron-Core's model-parallel groups on it (``parallel_state.initialize_model_parallel``
    with ``create_gloo_process_groups=False``: gloo groups on a fake store fail;
    ``instances``: its ``num_distributed_optimizer_instances``). Torn down on exit.

    Raises:
        TracememError: a process group is already initialised in this process.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise TracememError("the Megatron-Core oracle needs its own fake process group; "
                            "torch.distributed is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
            context_parallel_size=cp,
            expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
            num_distributed_optimizer_instances=instances,
            create_gloo_process_groups=False)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
