"""Transformer Engine's CPU offloading of N decoder layers' activations, as torch code that runs
on meta under the tracer: Megatron's ``--cpu-offloading-num-layers N`` (which sets
``--cpu-offloading``).

Megatron-LM d98e8a6: ``TransformerBlock.__init__`` (megatron/core/transformer/
transformer_block.py) calls ``get_cpu_offload_context(cpu_offloading, cpu_offloading_num_layers,
num_layers, ...)`` (the wrapper in megatron/core/extensions/transformer_engine.py; TE >= 2.10
passes ``retain_pinned_cpu_buffers``) and ``TransformerBlock.forward`` runs each of its layers
``with self.offload_context`` and then ``hidden_states = group_prefetch_offload_commit_async(
hidden_states)``. ``TransformerConfig.__post_init__`` refuses N >= num_layers, pipeline
parallelism and activation recompute with it; the MTP layers are outside the block's loop.

What TE does (transformer_engine/pytorch/cpu_offload.py, identical at v2.17.1, v2.18 and d0067d0;
the default path, ``NVTE_CPU_OFFLOAD_V1`` unset; each name is TE's):

- ``DefaultOffloadSynchronizer`` over the block's L layers, offloading layers 0..N-1: layer j's
  device tensors are released before layer L-N+j's forward (``finish_offload_map``), its reload
  starts before layer L-1-N+j's backward (``start_reload_map``), so that "peak memory usage of
  saving activations is (num_layers - num_offloaded_layers) * T" (its docstring).
- ``saved_tensors_hooks(push_tensor, pop_tensor)`` inside the context: a tensor saved in an
  offloaded layer joins the layer's group when ``OffloadableLayerState._check_if_offload``
  passes: at least 256 * 1024 elements, not a ``Parameter``, not marked ``_TE_do_not_offload``
  (TE's modules mark their weights and FP8 weight workspaces: ``mark_not_offload``), on the
  GPU, contiguous (a non-contiguous one stays, with a warning, unless marked
  ``offload_base_tensor``); the group holds it (the saved value is its index), anything else
  is saved as usual.
- ``fwd_step`` (each layer's ``__enter__``): layer i-1's group is offloaded (``start_offload``:
  a view of its base's size, or marked ``offload_base_tensor`` by TE's attention for q, k, v,
  becomes its base; duplicates by ``id`` once; a pinned ``torch.empty_like`` host copy each),
  and the groups due are released (``release_activation_forward_gpu_memory``: the group drops
  its device tensors, which die with their last other reference).
- Backward (a pre-hook on the layer output's ``grad_fn``, registered by the synchronization
  function): ``bwd_step`` releases the previous backward layer (``release_all_memory``: its
  reloaded tensors and host copies) and starts the reloads due (``start_reload``: a device
  ``torch.empty_like`` per host copy, then views restored); ``finish_part_of_bwd`` (queued as
  the engine's final callback) releases the last one. A host copy is freed with its layer's
  reload (not with ``retain_pinned_cpu_buffers``, which keeps it for the next iteration: the
  same bytes).

``enabled()`` is TE's ``is_cpu_offload_enabled()``: True inside the context of any layer
(offloaded or not); TE's modules then change what they allocate (``GroupedLinear``: FP8 inputs
quantised without bulk allocation; bf16 inputs saved as the per-expert ``torch.split`` views,
``modeling.kernels.moe``). Outside a ``synchronizer`` context every call here is the identity.

Not modelled: the offload stream's effect on the caching allocator's block reuse (copies
finish on a side stream before a release waits for them: ``allocated_bytes`` is what is
modelled); the v1 path (``NVTE_CPU_OFFLOAD_V1=1``: the Megatron front door refuses it with
``--cpu-offloading-num-layers``).
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from modeling.common.offload import HostBuffer
from tracemem.errors import TracememError

__all__ = ["MIN_OFFLOAD_NUMEL", "Synchronizer", "synchronizer", "layer", "synchronize",
           "enabled", "mark_base"]

MIN_OFFLOAD_NUMEL = 256 * 1024  # OffloadableLayerState._check_if_offload


def _tracer():
    from tracemem.tracer import MemoryTracer

    mode = _get_current_dispatch_mode()
    return mode if isinstance(mode, MemoryTracer) else None


class _LayerState:
    """``OffloadableLayerState``: one layer's group (``fwd``: the device tensors by index, as
    pushed), its host copies (``cpu``) and reloaded tensors (``bwd``), and the view of each
    pushed index (``aux``)."""

    __slots__ = ("state", "fwd", "cpu", "bwd", "aux")

    def __init__(self):
        self.state = "not_offloaded"
        self.fwd: list[Tensor] = []
        self.cpu: list[HostBuffer] = []
        self.bwd: list[Tensor] = []
        self.aux: dict[str, list] = {}

    def release_all_memory(self) -> None:
        self.fwd, self.cpu, self.bwd, self.aux = [], [], [], {}
        self.state = "not_offloaded"


class Synchronizer:
    """TE's ``DefaultOffloadSynchronizer`` for a block of ``num_layers`` layers offloading
    the first ``num_offloaded`` (Megatron's ``--cpu-offloading-num-layers``). After a
    microbatch's forward, ``host`` holds the ``HostBuffer`` of every host copy made, in
    offload order (plain pinned ``torch.empty_like``: unpooled).

    Raises:
        TracememError: ``num_offloaded`` > ``num_layers - 1`` (``get_cpu_offload_context``:
            "Cannot offload all layers without manual synchronization"), or below 1; an
            offloaded base tensor that is not contiguous (``start_offload`` raises).
        RuntimeError: a tensor of an offloaded layer unpacked before its reload (TE's
            ``pop_tensor`` would fail too).
    """

    def __init__(self, num_layers: int, num_offloaded: int):
        if not 1 <= num_offloaded <= num_layers - 1:
            raise TracememError(f"--cpu-offloading-num-layers {num_offloaded}: TE cannot "
                                f"offload all layers without manual synchronization (the "
                                f"last layer is not offloaded); give 1 to {num_layers - 1} "
                                f"for a block of {num_layers} layers")
        self.num_layers, self.num_offloaded = num_layers, num_offloaded
        self.layers = [_LayerState() for _ in range(num_layers)]
        self.offload = {j: j < num_offloaded for j in range(num_layers)}
        self.finish: defaultdict[int, list[int]] = defaultdict(list)
        self.reload: defaultdict[int, list[int]] = defaultdict(list)
        for j in range(num_offloaded):  # _init_offload_synchronization_dicts
            self.finish[num_layers - num_offloaded + j].append(j)
            self.reload[num_layers - 1 - num_offloaded + j].append(j)
        self.num_of_fwds: int | None = None
        self.previous_bwd: int | None = None
        self.current: int | None = None
        self.inside = False
        self.host: list[HostBuffer] = []

    # ---------------------------------------------------------------- forward
    def fwd_step(self) -> int:
        """``DefaultOffloadSynchronizer.fwd_step``, before each layer's forward."""
        if self.num_of_fwds in (None, self.num_layers - 1):
            for state in self.layers:
                state.release_all_memory()
            self.num_of_fwds = 0
        else:
            self.num_of_fwds += 1
        self.current = self.num_of_fwds
        if self.offload.get(self.current - 1, False):
            self._start_offload(self.current - 1)
        for j in self.finish[self.current]:
            self._release_forward(j)
        return self.current

    def push(self, t: Tensor):
        """``push_tensor``: the index of ``t`` in the current layer's group, or the tensor
        as the tracer saves it (``MemoryTracer.saved_for_backward``)."""
        tracer = _tracer()
        if self.offload.get(self.num_of_fwds, False) and self._check_if_offload(t, tracer):
            state = self.layers[self.num_of_fwds]
            if tracer is not None:
                tracer.saved_for_backward(t)  # the storage is an activation until released
            state.fwd.append(t)
            return (self, self.num_of_fwds, len(state.fwd) - 1)
        return tracer.saved_for_backward(t) if tracer is not None else t.detach()

    @staticmethod
    def _check_if_offload(t: Tensor, tracer) -> bool:
        """``_check_if_offload``: 256 Ki elements or more, not a parameter nor marked
        ``_TE_do_not_offload``, on the device (here: a storage made in the traced step; TE's
        weight workspaces are static memory), contiguous unless ``offload_base_tensor``."""
        if t.numel() < MIN_OFFLOAD_NUMEL or isinstance(t, torch.nn.Parameter) \
                or getattr(t, "_TE_do_not_offload", False):
            return False
        if tracer is not None and not tracer.born_in_trace(t):
            return False
        return t.is_contiguous() or getattr(t, "offload_base_tensor", False)

    def _start_offload(self, j: int) -> None:
        """``start_offload``: base tensors for views (``_switch_to_base_tensors``),
        duplicates by ``id`` once (``_deduplicate_tensors``), a pinned host copy each."""
        state = self.layers[j]
        state.state = "offload_started"
        views, originals, unique, index = [], [], [], {}
        for t in state.fwd:
            if t._base is not None and (getattr(t, "offload_base_tensor", False)
                                        or t._base.numel() == t.numel()):
                views.append((tuple(t.shape), t.stride(), t.storage_offset()))
                t = t._base
            else:
                views.append(None)
            if id(t) not in index:
                index[id(t)] = len(unique)
                unique.append(t)
            originals.append(index[id(t)])
        state.fwd = unique
        state.aux = {"views": views, "original": originals}
        for t in unique:
            if not t.is_contiguous():
                raise TracememError(f"TE CPU offloading: a tensor of shape {tuple(t.shape)} "
                                    f"must be contiguous for CPU offloading "
                                    f"(OffloadableLayerState.start_offload raises)")
            buf = HostBuffer(tuple(t.shape), t.dtype, t.numel() * t.element_size(), False)
            state.cpu.append(buf)
            self.host.append(buf)

    def _release_forward(self, j: int) -> None:
        """``release_activation_forward_gpu_memory``: the group drops its device tensors."""
        state = self.layers[j]
        if state.state != "offload_started":
            raise RuntimeError(f"TE CPU offloading: layer {j} released in state {state.state}")
        state.state = "offload_finished"
        state.fwd = []

    # ---------------------------------------------------------------- backward
    def bwd_step(self, layer_num: int) -> None:
        """``bwd_step``, before layer ``layer_num``'s backward."""
        if self.previous_bwd is not None:
            self.layers[self.previous_bwd].release_all_memory()
        self.previous_bwd = self.current = layer_num
        for j in self.reload[layer_num]:
            self._start_reload(j)

    def _start_reload(self, j: int) -> None:
        """``start_reload``: a device ``torch.empty_like`` per host copy."""
        state = self.layers[j]
        if state.state != "offload_finished":
            raise RuntimeError(f"TE CPU offloading: layer {j} reloaded in state {state.state}")
        state.state = "reload_started"
        tracer = _tracer()
        state.bwd = []
        for buf in state.cpu:
            out = torch.empty(buf.shape, dtype=buf.dtype, device="meta")
            if tracer is not None:
                from tracemem.categories import Category

                tracer.tag(out, Category.ACTIVATION)
            state.bwd.append(out)

    def pop(self, packed) -> Tensor:
        """``pop_tensor``: the saved tensor, the reloaded one (its view restored) for an
        offloaded index."""
        if isinstance(packed, Tensor):
            return packed
        _, j, i = packed
        state = self.layers[j]
        if state.state == "not_offloaded":
            return state.fwd[i]
        if state.state != "reload_started":
            raise RuntimeError(f"TE CPU offloading: a tensor of layer {j} unpacked in state "
                               f"{state.state} (TE's pop_tensor expects reload_started)")
        t = state.bwd[state.aux["original"][i]]
        view = state.aux["views"][i]
        return t if view is None else t.as_strided(*view)

    def finish_part_of_bwd(self) -> None:
        """``finish_part_of_bwd``: the last backward layer's memory released."""
        if self.previous_bwd is not None:
            self.layers[self.previous_bwd].release_all_memory()
        self.previous_bwd = None


_ACTIVE: list[Synchronizer] = []


@contextmanager
def synchronizer(sync: Synchronizer | None):
    """Run a model chunk's forward with ``sync`` as the block's offload synchronizer (None:
    offloading off, every call here the identity)."""
    if sync is None:
        yield None
        return
    _ACTIVE.append(sync)
    try:
        yield sync
    finally:
        _ACTIVE.pop()


def _pop(packed) -> Tensor:
    return packed if isinstance(packed, Tensor) else packed[0].pop(packed)


@contextmanager
def layer():
    """``with self.offload_context:`` around one decoder layer's forward (TE's
    ``_CpuOffloadContext``): ``fwd_step``, then the saved-tensor hooks while the layer runs.
    Yields the layer's number in the block, or None when offloading is off."""
    if not _ACTIVE:
        yield None
        return
    sync = _ACTIVE[-1]
    if sync.inside:
        raise RuntimeError("Offloading context was entered without synchronization function "
                           "being called.")
    sync.inside = True
    hooks = torch.autograd.graph.saved_tensors_hooks(sync.push, _pop)
    hooks.__enter__()
    try:
        yield sync.fwd_step()
    finally:
        hooks.__exit__(None, None, None)
        sync.inside = False


def synchronize(tensor: Tensor) -> Tensor:
    """``group_prefetch_offload_commit_async(hidden_states)`` after a layer (TE's
    ``synchronization_function``): a pre-hook on ``tensor.grad_fn`` that runs ``bwd_step``
    for the layer just run and queues ``finish_part_of_bwd`` as the engine's final
    callback. The identity when offloading is off or grad is disabled."""
    if not _ACTIVE or not torch.is_grad_enabled():
        return tensor
    sync = _ACTIVE[-1]
    if tensor.grad_fn is None:
        raise ValueError("Tensor passed to synchronization_function must require grad to "
                         "register backward hooks")
    number = sync.current

    def hook(_grad_outputs: Any) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(sync.finish_part_of_bwd)
        sync.bwd_step(number)

    tensor.grad_fn.register_prehook(hook)
    return tensor


def enabled() -> bool:
    """TE's ``is_cpu_offload_enabled()``: inside a layer's offload context."""
    return bool(_ACTIVE) and _ACTIVE[-1].inside


def mark_base(*tensors: Tensor | None) -> None:
    """TE's ``start_offload(*tensors, offload_base_tensor=True)`` where offloading is on
    (``FusedAttnFunc`` and ``FlashAttention`` forwards for q, k and v, backends.py; called
    from ``te_fused_attention`` / ``te_flash_attention``): a view among them is offloaded as
    its base."""
    if not enabled():
        return
    for t in tensors:
        if t is not None and t._base is not None:
            t.offload_base_tensor = True
