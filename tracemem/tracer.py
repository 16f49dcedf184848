"""The storage-lifetime tracer: a ``TorchDispatchMode`` that knows, at every aten op of a
training step, which storages are alive, how many bytes each holds, what kind of memory it is
and which module made it.

Modelled on PyTorch's ``torch/distributed/_tools/mem_tracker.py`` (per-storage accounting
with weakref finalizers, categories as a ``str`` enum), but built for what that tool refuses:
several microbatches and steps in one timeline, an ordered event log that a pipeline simulator
can replay, and the meta device as the main target.

On the meta device an op that makes fresh tensors is run once per distinct call (the op and
its arguments' shapes, strides, dtypes and values); later calls get outputs of the same
metadata from ``torch.empty_strided`` (``_MetaOutputs``), which the tracer sees born exactly
as it sees the kernel's.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from tracemem.categories import Category, Phase
from tracemem.errors import (
    DataDependentOpError,
    FusedOptimizerError,
    MissingMetaKernelError,
    TracememError,
)

__all__ = ["MemoryTracer", "MemoryEvent", "StorageInfo"]


# ---------------------------------------------------------------- meta outputs, remembered
# On the meta device an op's outputs are its output metadata and nothing else, and that is a
# function of the op and its arguments' metadata. torch computes it with Python reference /
# fake implementations (torch/_prims_common/wrappers.py, torch/_refs, torch/_meta_registrations)
# at tens of microseconds an op; a training step repeats the same ops on the same shapes (each
# microbatch, each layer of a kind, each rank class). ``_MetaOutputs`` remembers, for the ops
# that make fresh tensors, what the first call returned (shape, strides, dtype, storage
# bytes) and makes the same outputs again with ``torch.empty_strided``: one new storage per
# output, of the same bytes, as the op's own meta kernel makes. The events are the same by
# construction (the tracer sees the same storages born) and by test
# (tests/tracemem/test_meta_outputs.py traces every family with and without it). Not used:
# off the meta device, under another dispatch mode below the tracer, for an op that mutates,
# aliases (its schema), or returns anything but tensors, for ops outside aten / prims (a
# custom op's fake implementation may do more than return shapes), for tensor subclasses,
# and for any call whose arguments are not plain values (numbers, dtypes, devices, lists of
# them) or whose outputs share a storage with each other or an input.
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format,
            torch.layout)
_NAMESPACES = ("aten", "prims")
_MAX_REMEMBERED = 1 << 18  # entries, then forgotten all at once (a bound on memory)


class _Uncacheable(Exception):
    pass


def _arg_key(value, inputs: list):
    kind = type(value)
    if kind is Tensor:
        if not value.is_meta or value.layout is not torch.strided or value.is_conj() \
                or value.is_neg():
            raise _Uncacheable
        inputs.append(value)
        return (value.shape, value.stride(), value.storage_offset(), value.dtype)
    if kind is list or kind is tuple:
        if all(type(v) is int for v in value):  # sizes, dims: as they are (no bool among them)
            return (kind, int, tuple(value))
        return (kind, tuple([_arg_key(v, inputs) for v in value]))
    if kind in _SCALARS:
        return (kind, value)
    raise _Uncacheable


class _MetaOutputs:
    """Per op: whether its outputs may be remembered; per (op, arguments' metadata): the
    outputs to make again (None: this call's outputs may not be)."""

    def __init__(self) -> None:
        self.ops: dict = {}
        self.outputs: dict = {}
        self.hits = self.misses = 0

    def cacheable(self, func) -> bool:
        ok = self.ops.get(func)
        if ok is None:
            schema = func._schema
            ok = self.ops[func] = (
                func.namespace in _NAMESPACES and not schema.is_mutable
                and bool(schema.returns)
                and all(r.alias_info is None and str(r.type) in ("Tensor", "Tensor[]")
                        for r in schema.returns)
                and torch.Tag.dynamic_output_shape not in func.tags
                and torch.Tag.data_dependent_output not in func.tags)
        return ok

    def key(self, func, types, args, kwargs):
        """The call's key, or None (not remembered); ``inputs``: its tensor arguments."""
        if any(t is not Tensor for t in types):
            return None, ()
        inputs: list = []
        try:
            key = (func, _arg_key(args, inputs),
                   tuple((k, _arg_key(v, inputs)) for k, v in kwargs.items()))
        except _Uncacheable:
            return None, ()
        return key, inputs

    def make(self, entry):
        one, specs = entry
        outs = [torch.empty_strided(shape, stride, dtype=dtype, device="meta")
                for shape, stride, dtype in specs]
        self.hits += 1
        return outs[0] if one else (outs if one is None else tuple(outs))

    def remember(self, key, inputs, out) -> None:
        """Keep ``out``'s metadata under ``key`` when it is fresh plain meta tensors, each
        its own storage of exactly the bytes ``empty_strided`` makes."""
        self.misses += 1
        if len(self.outputs) >= _MAX_REMEMBERED:
            self.outputs.clear()
        one = type(out) is Tensor
        outs = [out] if one else out
        if not one and type(out) not in (tuple, list):
            self.outputs[key] = None
            return
        seen = {t.untyped_storage()._cdata for t in inputs}
        specs = []
        for t in outs:
            if type(t) is not Tensor or t.device.type != "meta" or t.layout is not torch.strided \
                    or t.storage_offset() != 0 or t.is_conj() or t.is_neg():
                self.outputs[key] = None
                return
            storage = t.untyped_storage()
            if storage._cdata in seen or storage.nbytes() != _strided_nbytes(t):
                self.outputs[key] = None
                return
            seen.add(storage._cdata)
            specs.append((tuple(t.shape), t.stride(), t.dtype))
        self.outputs[key] = (True if one else (None if type(out) is list else False), specs)


def _strided_nbytes(t: Tensor) -> int:
    """The bytes ``torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)`` allocates."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


META_OUTPUTS = _MetaOutputs()

# CUDA's caching allocator rounds every request up to a multiple of kMinBlockSize = 512 bytes
# (c10/cuda/CUDACachingAllocator.cpp, ``round_size``). A request of 0 bytes allocates nothing.
CUDA_MIN_BLOCK_SIZE = 512

# Key under which an autograd Node's ``metadata`` dict records the module that created it, so
# that ops run by that Node in backward are attributed to the same module.
_NODE_MODULE_KEY = "tracemem.module"

# Substrings of the errors PyTorch raises when an operator cannot run on the meta device:
# "Could not run 'ns::op' with arguments from the 'Meta' backend" (no kernel at all),
# "attempted to run this operator with Meta tensors, but there was no fake impl or Meta kernel"
# (torch.library.Library without a fake impl), "There was no fake impl registered"
# (torch.library.custom_op without register_fake).
_MISSING_META_MARKERS = ("'Meta' backend", "Meta tensors", "no fake impl", "Meta kernel")

_AT_CHOICES = "'peak', 'now' or an event index (int)"

# Keys under which a Node's metadata records that the Node has finished (the graph task id), so
# that the ops run with it as the current Node afterwards are the autograd engine's own.
_NODE_DONE_KEY = "tracemem.done"

# The autograd engine sums two gradients for one input in place, ``old.add_(new)``, when it
# holds the only reference to ``old`` and to its storage (``can_accumulate_inplace`` in
# torch/csrc/autograd/input_buffer.cpp: use_count() == 1 and storage().use_count() == 1);
# otherwise it allocates ``old + new``. Under any Python dispatch mode every tensor has a
# Python object, which the check counts, so the engine always takes the out-of-place path.
# The tracer undoes that: inside its mode a tensor held only by the engine's buffer has
# use_count 4 (buffer, Python object, two dispatcher stack copies) and its storage use_count 2
# (the tensor and the tracer's Python storage object); measured with torch 2.13.
_SOLE_OWNER_TENSOR_REFS = 4
_SOLE_OWNER_STORAGE_REFS = 2


class _Storage:
    """What the tracer knows of one storage. The category may be refined while the storage
    lives (a temporary that autograd saves becomes an activation); it applies to its whole life."""

    __slots__ = ("sid", "key", "nbytes", "raw_nbytes", "category", "module", "phase", "op",
                 "device", "dtype", "shape", "ref", "retain")

    def __init__(self, sid, key, raw_nbytes, nbytes, category, module, phase, op, tensor):
        self.sid = sid
        self.key = key  # StorageImpl address: the key in MemoryTracer._live
        self.raw_nbytes = raw_nbytes
        self.nbytes = nbytes
        self.category = category
        self.module = module
        self.phase = phase
        self.op = op
        self.device = tensor.device.type
        self.dtype = tensor.dtype
        self.shape = tuple(tensor.shape)
        self.ref = None
        # a slot (MemoryTracer.retain): the storage is also held past its traced free, by
        # its module or (a "pp." slot) by Megatron's 1F1B loop; None: not
        self.retain = None


class MemoryEvent:
    """One allocation or free, in the order it happened.

    Attributes:
        index: position in ``MemoryTracer.events``.
        action: ``"alloc"`` or ``"free"``. A storage that grows (``resize_``) appears as an
            ``alloc`` of the new size followed by a ``free`` of the old one, as CPU and CUDA
            allocators do it (new block first, copy, then release the old block).
        nbytes: bytes of this event (after rounding), always >= 0.
        total_bytes: bytes alive right after this event, externals included.
        storage_id: tracer-local id of the storage (stable across its alloc and free).
        phase, op: when it happened and the aten op running (``None`` outside any op).
        category, module, device, dtype, shape: of the storage (see ``StorageInfo``).
    """

    __slots__ = ("index", "action", "nbytes", "total_bytes", "phase", "op", "_storage")

    def __init__(self, index, action, nbytes, total_bytes, phase, op, storage):
        self.index = index
        self.action = action
        self.nbytes = nbytes
        self.total_bytes = total_bytes
        self.phase = phase
        self.op = op
        self._storage = storage

    storage_id = property(lambda self: self._storage.sid)
    category = property(lambda self: self._storage.category)
    module = property(lambda self: self._storage.module)
    device = property(lambda self: self._storage.device)
    dtype = property(lambda self: self._storage.dtype)
    shape = property(lambda self: self._storage.shape)
    retain = property(lambda self: self._storage.retain)

    def __repr__(self) -> str:
        return (f"MemoryEvent({self.index}, {self.action} {self.nbytes} B, total={self.total_bytes},"
                f" {self.category.value}, {self.module!r}, {self.phase.value}, {self.op})")


@dataclass(frozen=True)
class StorageInfo:
    """A storage alive at some point of the trace.

    Attributes:
        storage_id: tracer-local id.
        nbytes: bytes counted (after rounding).
        category: what it holds (``Category``).
        module: fully qualified name of the module that made it ("" = the root module or code
            outside any module); for externals, the module owning the parameter or buffer.
        phase: when it was born.
        op: the aten op that first produced or used it (``None`` for externals).
        device, dtype, shape: of the first tensor it was seen through.
    """

    storage_id: int
    nbytes: int
    category: Category
    module: str
    phase: Phase
    op: str | None
    device: str
    dtype: torch.dtype
    shape: tuple[int, ...]


def _iter_tensors(values: Iterable[Any]) -> Iterator[Tensor]:
    # aten ops take tensors directly or in one level of list (cat, foreach, index).
    for v in values:
        if isinstance(v, Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            for w in v:
                if isinstance(w, Tensor):
                    yield w


class MemoryTracer(TorchDispatchMode):
    """Records every storage's bytes and lifetime through a training step, on the meta device
    (to estimate) or on real CPU tensors (to validate against the allocator).

    A storage is born the first time the tracer sees it, as the output or the input of an aten
    op (a tensor made outside the region is first seen as an input), and dies when its last
    reference goes (a weakref finalizer on the untyped storage). Views share their base's
    storage and cost nothing. ``resize_`` that grows a storage counts the new block while the
    old one is still held, then frees the old one.

    Categories (``Category``): tracked externals are parameters, buffers, gradients, optimizer
    states or inputs; storages born in the region are temporaries, except those that autograd
    saves for backward (``torch.autograd.graph.saved_tensors_hooks``: activations), those that
    end up as a tracked leaf's ``.grad`` (gradients) and those that end up in a traced
    optimizer's ``state`` (optimizer states). Phases (``Phase``): forward, backward,
    recompute (forward ops re-run by ``torch.utils.checkpoint`` inside backward), optimizer.

    Args:
        rounding: ``None`` counts exact storage bytes (what the CPU allocator reports);
            ``512`` rounds each storage up to a multiple of 512 bytes, as the CUDA caching
            allocator does (``round_size`` in c10/cuda/CUDACachingAllocator.cpp).
        devices: device type or types whose storages are counted (e.g. ``"meta"`` for the
            accelerator being estimated); ``None`` counts every device.
        remember_meta_outputs: make a meta op's outputs again from what the same op made
            for the same arguments' metadata before (``_MetaOutputs``, process-wide), instead
            of running torch's meta kernel each time; the same storages, shapes and events
            either way (False: every op runs its kernel).

    Raises:
        TracememError: ``rounding`` is not ``None`` or a positive int, ``devices`` names an
            unknown device type, or ``at`` is invalid.
        MissingMetaKernelError: an operator has no meta kernel (raised from the traced op).
        DataDependentOpError: an operator needs tensor values that meta tensors do not have
            (``.item()``, ``if t.any():``, ``nonzero``, ``masked_select``, boolean-mask
            indexing, ``.tolist()``); the message names the op, the module and the way out.
        FusedOptimizerError: a fused optimizer (``Adam(fused=True)``) steps meta parameters.

    Example::

        model = nn.Linear(1024, 1024, device="meta")
        opt = torch.optim.Adam(model.parameters())
        x = torch.empty(8, 1024, device="meta")
        tracer = MemoryTracer()
        tracer.track_external(model, opt, x)
        with tracer:
            model(x).sum().backward()
            opt.step()
        tracer.peak_bytes - tracer.baseline_bytes   # bytes the step adds at its peak
        tracer.by_category(at="peak")               # {"parameter": ..., "gradient": ..., ...}

    Known limitations:
        - Allocations below the dispatcher are invisible: kernel workspaces (cuBLAS, oneDNN
          scratchpads, cuDNN), the CPU tensors that wrap Python scalars passed as tensor
          arguments (8 B each, and TensorIterator's cast copies of them), NCCL buffers.
        - Module attribution in backward uses the autograd Node running the op; ops that the
          autograd engine runs between Nodes (accumulating a gradient that two branches
          produced) are attributed to the Node that produced the second one.
        - A backward with ``create_graph=True`` is reported as phase ``recompute``, because
          grad mode is on inside it, as it is in checkpoint recomputation.
        - Storages that ``torch.utils.checkpoint`` recomputes and holds for backward are
          ``temporary`` (checkpoint's own saved-tensor hooks replace ours in that region).
    """

    def __init__(self, *, rounding: int | None = None, devices: Iterable[str] | None = None,
                 remember_meta_outputs: bool = True):
        super().__init__()
        self._remember = bool(remember_meta_outputs)
        if rounding is not None and (isinstance(rounding, bool) or not isinstance(rounding, int)
                                     or rounding <= 0):
            raise TracememError(
                f"rounding={rounding!r} is invalid; use None (exact bytes) or a positive int "
                f"such as {CUDA_MIN_BLOCK_SIZE} (CUDA caching allocator block size)")
        self.rounding = rounding
        self.devices = None if devices is None else _device_types(devices)
        self.events: list[MemoryEvent] = []
        self.current_bytes = 0
        self.peak_bytes = 0
        self.peak_event_index: int | None = None
        self.baseline_bytes = 0  # set on the first entry
        self._entered = False
        self._live: dict[int, _Storage] = {}  # StorageImpl address -> record
        self._next_sid = 0
        self._inside = False
        self._op: str | None = None
        self._module_stack: list[str] = []
        self._module_names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        self._leaves = WeakIdKeyDictionary()  # tracked leaf tensors (a weak set by identity)
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._optimizer_depth = 0
        self._handles: list[Any] = []
        self._saved_hooks = None

    # ------------------------------------------------------------------ externals
    def track_external(self, *objects: Any) -> None:
        """Register what is alive before the step, so it is counted in the baseline instead of
        being born mid-step.

        Accepts, also nested in lists, tuples and dicts: ``nn.Module`` (its parameters,
        buffers and existing ``.grad``), ``torch.optim.Optimizer`` (its parameters and state
        tensors) and tensors (category ``input``). Module paths are the state_dict names of the
        first module passed that owns them. Storages already known are left as they are.
        """
        for obj in objects:
            if isinstance(obj, nn.Module):
                self._track_module(obj)
            elif isinstance(obj, torch.optim.Optimizer):
                self._track_optimizer(obj)
            elif isinstance(obj, Tensor):
                self._register(obj, Category.INPUT, "", Phase.EXTERNAL, None)
                if obj.requires_grad and obj.is_leaf:
                    self._leaves[obj] = None
                if obj.grad is not None:
                    self._register(obj.grad, Category.GRADIENT, "", Phase.EXTERNAL, None)
            elif isinstance(obj, dict):
                self.track_external(*obj.values())
            elif isinstance(obj, (list, tuple)):
                self.track_external(*obj)
            elif obj is not None:
                raise TracememError(
                    f"track_external got an object of type {type(obj).__name__}; it takes "
                    f"nn.Module, "
                    f"torch.optim.Optimizer, Tensor, or lists/tuples/dicts of them (None is "
                    f"skipped)")

    def _track_module(self, module: nn.Module) -> None:
        for name, mod in module.named_modules(remove_duplicate=False):
            self._module_names.setdefault(mod, name)
        for mod_name, mod in module.named_modules():
            for p in mod.parameters(recurse=False):
                self._track_parameter(p, mod_name)
            for b in mod.buffers(recurse=False):
                self._register(b, Category.BUFFER, mod_name, Phase.EXTERNAL, None)

    def _track_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizers.add(optimizer)
        for group in optimizer.param_groups:
            for p in group["params"]:
                self._track_parameter(p, "")
        self._retag_optimizer_states(optimizer, register=True)

    def _track_parameter(self, p: Tensor, module: str) -> None:
        self._register(p, Category.PARAMETER, module, Phase.EXTERNAL, None)
        self._leaves[p] = None
        if p.grad is not None:
            self._register(p.grad, Category.GRADIENT, module, Phase.EXTERNAL, None)

    # ------------------------------------------------------------------ storage accounting
    def _counted(self, t: Tensor) -> bool:
        return self.devices is None or t.device.type in self.devices

    def _register(self, t: Tensor, category: Category, module: str, phase: Phase,
                  op: str | None) -> _Storage | None:
        """Record ``t``'s storage as born now if it is new; return its record."""
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested or storage-less tensors
            return None
        key = st._cdata
        rec = self._live.get(key)
        if rec is not None:
            return rec
        if not self._counted(t):
            return None
        raw = st.nbytes()
        rec = _Storage(self._next_sid, key, raw, self._round(raw), category, module, phase, op,
                       t)
        self._next_sid += 1
        self._watch(st, rec)
        self._emit("alloc", rec.nbytes, rec, phase)
        return rec

    def _watch(self, st: torch.UntypedStorage, rec: _Storage) -> None:
        """Make ``rec`` the live record of ``st``, freed by a finalizer when ``st`` dies."""
        key = rec.key = st._cdata
        rec.ref = weakref.ref(st, lambda _ref: self._on_storage_freed(key))
        self._live[key] = rec

    def _round(self, nbytes: int) -> int:
        if self.rounding is None or nbytes == 0:
            return nbytes
        return -(-nbytes // self.rounding) * self.rounding

    def _emit(self, action: str, nbytes: int, rec: _Storage, phase: Phase) -> None:
        if nbytes == 0:
            return
        self.current_bytes += nbytes if action == "alloc" else -nbytes
        index = len(self.events)
        self.events.append(MemoryEvent(index, action, nbytes, self.current_bytes, phase,
                                       self._op, rec))
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self.peak_event_index = index

    def _on_storage_freed(self, key: int) -> None:
        rec = self._live.pop(key, None)
        if rec is not None:
            self._emit("free", rec.nbytes, rec, self._phase() if self._inside else Phase.OUTSIDE)

    def _check_resize(self, t: Tensor, rec: _Storage, phase: Phase) -> None:
        """Record a change of ``rec``'s size, if ``t`` still uses that storage (``set_`` may
        have pointed it at another one)."""
        st = t.untyped_storage()
        if st._cdata != rec.key:
            return
        raw = st.nbytes()
        if raw != rec.raw_nbytes:
            new, old = self._round(raw), rec.nbytes
            rec.raw_nbytes, rec.nbytes = raw, new
            self._emit("alloc", new, rec, phase)  # the new block exists before the old is freed
            self._emit("free", old, rec, phase)

    # ------------------------------------------------------------------ phase and module
    def _phase(self) -> Phase:
        if self._optimizer_depth:
            return Phase.OPTIMIZER
        if torch._C._current_graph_task_id() != -1:
            # Non-reentrant checkpoint recomputes forward under enable_grad inside backward.
            if self._module_stack or torch.is_grad_enabled():
                return Phase.RECOMPUTE
            return Phase.BACKWARD
        return Phase.FORWARD

    def _module_path(self, phase: Phase) -> str:
        if self._module_stack:
            return self._module_stack[-1]
        if phase is Phase.BACKWARD or phase is Phase.RECOMPUTE:
            node = torch._C._current_autograd_node()
            if node is not None:
                return node.metadata.get(_NODE_MODULE_KEY, "")
        return ""

    def _module_name(self, module: nn.Module) -> str:
        name = self._module_names.get(module)
        if name is None:  # a module not passed to track_external: name it by its class
            name = type(module).__name__
            for sub_name, sub in module.named_modules(prefix=name, remove_duplicate=False):
                self._module_names.setdefault(sub, sub_name)
        return name

    @staticmethod
    def _label_autograd_nodes(values: Any, path: str) -> None:
        """Tag the not-yet-tagged autograd Nodes reachable from ``values`` with ``path``, so
        the ops each Node runs in backward are attributed to the module that created it, and
        hook each Node's end so the engine's gradient sums after it can be recognised."""
        stack = [t.grad_fn for t in _iter_tensors(values if isinstance(values, (list, tuple))
                                                  else (values,)) if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            metadata = node.metadata
            if _NODE_MODULE_KEY in metadata:
                continue
            metadata[_NODE_MODULE_KEY] = path
            next_nodes = [n for n, _ in node.next_functions if n is not None]
            if next_nodes:  # a Node with no inputs to feed (AccumulateGrad) needs no hook
                node.register_hook(_mark_node_done)
            stack.extend(next_nodes)

    def _forward_pre_hook(self, module: nn.Module, args: Any) -> None:
        # Nodes made between modules belong to the enclosing module (or the top level).
        self._label_autograd_nodes(args, self._module_stack[-1] if self._module_stack else "")
        self._module_stack.append(self._module_name(module))

    def _forward_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._module_stack:
            self._label_autograd_nodes(output, self._module_stack[-1])
            self._module_stack.pop()

    # ------------------------------------------------------------------ retagging
    def _pack_hook(self, t: Tensor) -> Tensor:
        """Mark a storage saved for backward as an activation; keep what autograd keeps.

        Returns ``t.detach()``, never ``t``: a saved *output* packed as itself holds its
        ``grad_fn``, the Node that holds the packed value, a reference cycle through C++ that
        Python's collector cannot break; the storage then outlives the graph whenever the Node
        never runs (e.g. ``amax`` whose output feeds only ``topk``'s indices). Without hooks,
        autograd saves an output without its ``grad_fn`` for this reason
        (``SavedVariable::SavedVariable`` in torch/csrc/autograd/saved_variable.cpp, torch
        2.13); with hooks, ``SavedVariable::unpack`` rebuilds the autograd metadata from its
        own fields (an output's Node is passed in by the Node), so the detached tensor (same
        storage, same version counter) unpacks to the same value."""
        try:
            rec = self._live.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            return t.detach()
        if rec is not None and rec.category in (Category.TEMPORARY, Category.COMM_BUFFER):
            rec.category = Category.ACTIVATION  # a received buffer kept for backward is one
        return t.detach()

    def saved_for_backward(self, t: Tensor) -> Tensor:
        """What the tracer's own saved-tensor pack hook does (``_pack_hook``), for a hook
        pushed inside the tracer's that replaces it (fine-grained activation offloading,
        ``modeling.common.offload``): the storage becomes an activation; returns
        ``t.detach()``."""
        return self._pack_hook(t)

    def born_in_trace(self, t: Tensor) -> bool:
        """Whether ``t``'s storage was made in the traced region (not a parameter, buffer or
        other storage made before it)."""
        try:
            rec = self._live.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            return False
        return rec is not None and rec.phase is not Phase.EXTERNAL

    def storage_resized(self, tensor: Tensor) -> None:
        """Record that ``tensor``'s storage changed size outside any op
        (``tensor.untyped_storage().resize_(n)`` runs below the dispatcher, so no op reports
        it): how Megatron-Core's ``CheckpointWithoutOutput`` frees an output's memory and
        restores it (tensor_parallel/random.py). A storage the tracer does not know is
        ignored."""
        rec = self._live.get(tensor.untyped_storage()._cdata)
        if rec is not None:
            self._check_resize(tensor, rec, self._phase())

    def tag(self, tensor: Tensor, category: Category, module: str | None = None) -> None:
        """Give the storage of ``tensor`` (born in the traced region) ``category``: how
        collective wrappers mark their buffers ``comm_buffer``. A storage saved for backward
        stays an ``activation``. ``module``: the module path to attribute it to, where the
        tracer found none running (a hook's buffer made in backward); None keeps the one
        found."""
        rec = self._live.get(tensor.untyped_storage()._cdata)
        if rec is not None and rec.phase is not Phase.EXTERNAL \
                and rec.category is not Category.ACTIVATION:
            rec.category = category
            if module is not None:
                rec.module = module

    def retain(self, tensor: Tensor | None, slot: str) -> None:
        """Mark the storage of ``tensor`` (born in the traced region) as held in ``slot``
        beyond the trace's own lifetime. Module state: a name unique to the module (the MoE
        dispatchers' ``"moe3.dispatcher.probs"``, ``modeling.common.moe``: Megatron-Core's
        token dispatchers keep the routing probabilities, maps and permutation map as
        attributes until the layer's next forward), held until the slot's next storage is
        allocated, or to the end of the replay. ``"pp.input"``, ``"pp.output"``,
        ``"pp.input_grad"``, ``"pp.output_grad"`` (``tracemem.estimator._trace_fb``): the
        pipeline tensors Megatron's 1F1B loop keeps, held only where the job runs that loop
        (``Segments.megatron_1f1b``). The trace is unchanged (the storage is freed where the
        traced code drops it); the schedule replay (``tracemem.estimator.replay_events``)
        applies the slot."""
        if tensor is None:
            return
        rec = self._live.get(tensor.untyped_storage()._cdata)
        if rec is not None and rec.phase is not Phase.EXTERNAL:
            rec.retain = slot

    def _retag(self, t: Tensor | None, category: Category, module: str | None = None) -> None:
        """Give a storage born in the region its final category (and module)."""
        if t is None:
            return
        rec = self._live.get(t.untyped_storage()._cdata)
        if rec is not None and rec.phase is not Phase.EXTERNAL and (
                rec.category is Category.TEMPORARY or rec.category is Category.INPUT):
            rec.category = category
            if module is not None:
                rec.module = module

    def _on_grad_accumulated(self, leaf: Tensor) -> None:
        self._retag_grad(leaf)

    def _retag_grad(self, leaf: Tensor) -> None:
        if leaf.grad is not None:
            leaf_rec = self._live.get(leaf.untyped_storage()._cdata)
            self._retag(leaf.grad, Category.GRADIENT, leaf_rec.module if leaf_rec else None)

    def _retag_optimizer_states(self, optimizer: torch.optim.Optimizer, register: bool) -> None:
        # An optimizer state belongs to the module of the parameter it is kept for.
        for param, state in optimizer.state.items():
            param_rec = self._live.get(param.untyped_storage()._cdata)
            module = param_rec.module if param_rec is not None else ""
            for value in state.values():
                if isinstance(value, Tensor):
                    if register:
                        self._register(value, Category.OPTIMIZER_STATE, module, Phase.EXTERNAL,
                                       None)
                    self._retag(value, Category.OPTIMIZER_STATE, module)

    def _optimizer_pre_hook(self, optimizer, args, kwargs) -> None:
        meta = [p for group in optimizer.param_groups for p in group["params"]
                if p.device.type == "meta"]
        if optimizer.defaults.get("fused") and meta:
            name = type(optimizer).__name__
            rec = self._live.get(meta[0].untyped_storage()._cdata)
            owner = f" (first of module {rec.module!r})" if rec is not None and rec.module else ""
            raise FusedOptimizerError(
                f"torch.optim.{name}(fused=True) cannot step parameters{owner} on the meta device "
                f"(its fused kernels take only real devices: "
                f"_device_dtype_check_for_fused in torch/optim/optimizer.py); trace it with "
                f"torch.optim.{name}(..., foreach=True), which keeps the same states")
        self._optimizers.add(optimizer)
        self._optimizer_depth += 1

    def _optimizer_post_hook(self, optimizer, args, kwargs) -> None:
        self._optimizer_depth -= 1
        self._retag_optimizer_states(optimizer, register=False)

    # ------------------------------------------------------------------ the mode
    def __enter__(self) -> MemoryTracer:
        if not self._entered:
            self.baseline_bytes = self.current_bytes
            self._entered = True
        self._inside = True
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._forward_pre_hook),
            nn.modules.module.register_module_forward_hook(self._forward_hook, always_call=True),
            register_optimizer_step_pre_hook(self._optimizer_pre_hook),
            register_optimizer_step_post_hook(self._optimizer_post_hook),
        ]
        self._handles += [leaf.register_post_accumulate_grad_hook(self._on_grad_accumulated)
                          for leaf in self._leaves.keys() if leaf.requires_grad]
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack_hook, _unpack)
        self._saved_hooks.__enter__()
        return super().__enter__()

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            super().__exit__(exc_type, exc, tb)
        finally:
            self._saved_hooks.__exit__(exc_type, exc, tb)
            for handle in self._handles:
                handle.remove()
            self._handles = []
            self._module_stack.clear()
            self._optimizer_depth = 0
            for leaf in self._leaves.keys():
                self._retag_grad(leaf)
            for optimizer in self._optimizers:
                self._retag_optimizer_states(optimizer, register=False)
            self._inside = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        phase = self._phase()
        module = self._module_path(phase)
        op = self._op = func._name  # e.g. "aten::mm"
        mutable = func._schema.is_mutable
        inputs = []  # (tensor, record) of the inputs a mutating op may resize
        for t in _iter_tensors((*args, *kwargs.values())):
            rec = self._register(t, Category.INPUT, module, phase, op)
            if mutable and rec is not None:
                inputs.append((t, rec))
        key = None
        # no other mode below the tracer (the stack without it, while it runs): its own
        # length, not _get_current_dispatch_mode_stack's list, on this per-op path
        if self._remember and META_OUTPUTS.cacheable(func) \
                and not torch._C._len_torch_dispatch_stack():
            key, tensors = META_OUTPUTS.key(func, types, args, kwargs)
        entry = None if key is None else META_OUTPUTS.outputs.get(key, False)
        try:
            out = META_OUTPUTS.make(entry) if entry else func(*args, **kwargs)
        except Exception as error:
            where = (f"in module {module!r}" if module else
                     "in the root module" if self._module_stack else
                     "at the top level (outside any module)")
            clear = (_data_dependent(func, args, kwargs, error, where)
                     or _missing_meta_kernel(func, args, kwargs, error))
            if clear is None:
                raise
            raise clear from error
        if key is not None and entry is False:
            META_OUTPUTS.remember(key, tensors, out)
        if func is _ADD and phase is Phase.BACKWARD and _is_engine_inplace_sum(args, out):
            self._take_over(args[0], out)
        for t in _iter_tensors(out if isinstance(out, (list, tuple)) else (out,)):
            rec = self._register(t, Category.TEMPORARY, module, phase, op)
            if mutable and rec is not None:
                self._check_resize(t, rec, phase)
        for t, rec in inputs:
            self._check_resize(t, rec, phase)
        self._op = None
        return out

    def _take_over(self, old: Tensor, new: Tensor) -> None:
        """``new`` is the storage the engine would not have allocated: give it ``old``'s
        record (same id, bytes and category), and let ``old``'s death pass unrecorded."""
        rec = self._live.pop(old.untyped_storage()._cdata, None)
        if rec is not None:
            self._watch(new.untyped_storage(), rec)

    # ------------------------------------------------------------------ queries
    def _index(self, at: str | int) -> int:
        if at == "peak":
            return -1 if self.peak_event_index is None else self.peak_event_index
        if at == "now":
            return len(self.events) - 1
        if isinstance(at, int) and not isinstance(at, bool) and -1 <= at < len(self.events):
            return at
        raise TracememError(f"at={at!r} is invalid; use {_AT_CHOICES} in "
                            f"[-1, {len(self.events) - 1}]")

    def live_at(self, at: str | int = "peak") -> list[StorageInfo]:
        """Storages alive right after event ``at`` ("peak", "now", or an index into
        ``events``; -1 = before any event), largest first."""
        end = self._index(at)
        live: dict[int, list] = {}
        for event in self.events[:end + 1]:
            entry = live.setdefault(event.storage_id, [event._storage, 0])
            entry[1] += event.nbytes if event.action == "alloc" else -event.nbytes
            if entry[1] == 0:
                del live[event.storage_id]
        out = [StorageInfo(s.sid, nbytes, s.category, s.module, s.phase, s.op, s.device,
                           s.dtype, s.shape) for s, nbytes in live.values()]
        out.sort(key=lambda info: (-info.nbytes, info.storage_id))
        return out

    def by_category(self, at: str | int = "peak") -> dict[str, int]:
        """Bytes alive at ``at`` per category value, largest first (zero categories omitted)."""
        return _group(self.live_at(at), lambda info: info.category.value)

    def by_module(self, at: str | int = "peak") -> dict[str, int]:
        """Bytes alive at ``at`` per module path, largest first ("" = root/top level)."""
        return _group(self.live_at(at), lambda info: info.module)

    def by_phase(self, at: str | int = "peak") -> dict[str, int]:
        """Bytes alive at ``at`` per phase in which the storage was born."""
        return _group(self.live_at(at), lambda info: info.phase.value)


def _device_types(devices: str | Iterable[str]) -> frozenset[str]:
    """Device types from a name or names ("meta", "cuda:0" -> "cuda").

    Raises:
        TracememError: a name torch does not know.
    """
    names = [devices] if isinstance(devices, str) else list(devices)
    types = set()
    for name in names:
        try:
            types.add(torch.device(name).type)
        except (RuntimeError, TypeError):
            raise TracememError(f"devices: {name!r} is not a device type; use names such as "
                                f"'meta', 'cuda', 'cpu'") from None
    return frozenset(types)


def _group(infos: list[StorageInfo], key) -> dict[str, int]:
    totals: dict[str, int] = {}
    for info in infos:
        totals[key(info)] = totals.get(key(info), 0) + info.nbytes
    return dict(sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])))


def _unpack(t: Tensor) -> Tensor:
    return t


_ADD = torch.ops.aten.add.Tensor


def _mark_node_done(grad_inputs, grad_outputs) -> None:
    node = torch._C._current_autograd_node()
    if node is not None:
        node.metadata[_NODE_DONE_KEY] = torch._C._current_graph_task_id()


def _is_engine_inplace_sum(args, out) -> bool:
    """Whether this ``add`` is the autograd engine summing two gradients after a Node ran, in
    a case where the engine, outside any dispatch mode, would have added in place."""
    node = torch._C._current_autograd_node()
    if node is None or node.metadata.get(_NODE_DONE_KEY) != torch._C._current_graph_task_id():
        return False
    old = args[0]
    return (isinstance(old, Tensor) and isinstance(out, Tensor)
            and old.untyped_storage().nbytes() == out.untyped_storage().nbytes()
            and is_non_overlapping_and_dense_or_false(old)
            and old._use_count() == _SOLE_OWNER_TENSOR_REFS
            and torch._C._storage_Use_Count(old.untyped_storage()._cdata)
            == _SOLE_OWNER_STORAGE_REFS)


# The way out of each kind of data-dependent op (see _DATA_DEPENDENT_OPS).
_STATIC_BRANCH = ("make the step shape-static: decide the branch from the config or a routing "
                  "model (modeling.common.routing, e.g. tokens per expert) instead of tensor values, "
                  "or compute both branches and pick with torch.where")
_STATIC_SHAPE = ("make the shape static: take the counts from a routing model "
                 "(modeling.common.routing, as modeling.common.moe does for tokens per expert), give the size "
                 "(torch.nonzero_static, repeat_interleave(output_size=)), or wrap the block in a "
                 "torch.library custom op with register_fake returning the shapes to assume")
_NO_HOST_COPY = ("keep the values that decide shapes in Python (the config, a routing model "
                 "from modeling.common.routing) or wrap the block in a torch.library custom op with "
                 "register_fake")

# Operators whose result depends on tensor values: what they need, and the way out. Keyed by
# schema name (no overload). The kernels' meta behaviour: torch/_meta_registrations.py and
# aten/src/ATen/native (torch 2.13).
_DATA_DEPENDENT_OPS = {
    "aten::_local_scalar_dense": (
        "reads a tensor's value (Tensor.item(), bool(t) as in `if (mask == 0).any():`, int(t), "
        "float(t))", _STATIC_BRANCH),
    "aten::is_nonzero": ("reads a tensor's value (bool(t))", _STATIC_BRANCH),
    "aten::equal": ("reads tensor values (torch.equal)", _STATIC_BRANCH),
    "aten::nonzero": ("makes an output whose shape depends on tensor values (nonzero, argwhere, "
                      "torch.where(cond))", _STATIC_SHAPE),
    "aten::masked_select": ("makes an output whose shape depends on the mask's values",
                            _STATIC_SHAPE),
    "aten::index": ("indexes with a boolean mask (t[mask]), whose output shape depends on the "
                    "mask's values", _STATIC_SHAPE),
    "aten::_unique": ("makes an output whose shape depends on tensor values (unique)",
                      _STATIC_SHAPE),
    "aten::_unique2": ("makes an output whose shape depends on tensor values (unique)",
                       _STATIC_SHAPE),
    "aten::unique_dim": ("makes an output whose shape depends on tensor values (unique)",
                         _STATIC_SHAPE),
    "aten::unique_consecutive": ("makes an output whose shape depends on tensor values",
                                 _STATIC_SHAPE),
    "aten::bincount": ("makes an output whose shape depends on tensor values (bincount)",
                       _STATIC_SHAPE),
    "aten::repeat_interleave": ("makes an output whose shape depends on the repeats' values",
                                _STATIC_SHAPE),
    "aten::_to_copy": ("copies tensor values to the host (.tolist(), .cpu(), .to('cpu'))",
                       _NO_HOST_COPY),
    "aten::copy_": ("copies tensor values to a real device", _NO_HOST_COPY),
}

# What PyTorch says when an op needs values of a meta tensor.
_DATA_DEPENDENT_MARKERS = ("cannot be called on meta tensors", "data-independent",
                           "Cannot copy out of meta tensor", "without output_size")


def _data_dependent(func, args, kwargs, error: Exception, where: str
                    ) -> DataDependentOpError | None:
    """Turn the errors of ops that need values of meta tensors into one line naming the op,
    the module that ran it and how to make the step shape-static."""
    if not any(t.device.type == "meta" for t in _iter_tensors(list(args) + list(kwargs.values()))):
        return None
    message = str(error)
    name = func._schema.name
    known = _DATA_DEPENDENT_OPS.get(name)
    if not any(marker in message for marker in _DATA_DEPENDENT_MARKERS):
        if known is None or not any(marker in message for marker in _MISSING_META_MARKERS):
            return None
    what, way_out = known or ("needs tensor values", _STATIC_SHAPE)
    return DataDependentOpError(
        f"operator {name} {where} {what}; meta tensors have no values, so {way_out}")


def _missing_meta_kernel(func, args, kwargs, error: Exception) -> MissingMetaKernelError | None:
    """Turn PyTorch's 'no Meta kernel' errors into one that says how to register a fake."""
    message = str(error)
    if not any(marker in message for marker in _MISSING_META_MARKERS):
        return None
    if not any(t.device.type == "meta" for t in _iter_tensors(list(args) + list(kwargs.values()))):
        return None
    name = func._schema.name
    params = ", ".join(a.name for a in func._schema.arguments)
    return MissingMetaKernelError(
        f"operator {name} has no meta kernel, so it cannot run on the meta device. Register a "
        f"fake kernel that returns empty tensors of the output shapes, e.g.\n"
        f"    @torch.library.register_fake(\"{name}\")\n"
        f"    def _({params}):\n"
        f"        return torch.empty_like({func._schema.arguments[0].name})\n"
        f"(schema: {func._schema})")
