"""Megatron-Core's fine-grained activation offloading, as torch code that runs on meta under the
tracer: ``--fine-grained-activation-offloading`` with ``--offload-modules`` and
``--min-offloaded-tensor-size`` (Megatron-LM 4e85d74ae9, megatron/core/pipeline_parallel/
fine_grained_activation_offload.py, read in full; the Megatron-LM CI case that measures it is
paired with that commit).

The mechanism, as Megatron runs it (each name is Megatron's):

- **Groups.** Each call site (``FineGrainedActivationOffloadingInterface(offload, tensor,
  name)``) starts a group: ``FineGrainedOffloadingGroupStartFunction`` (an identity autograd
  function) on ``tensor``, then ``saved_tensors_hooks`` (``PipelineOffloadManager.
  on_save_for_backward`` / ``on_get_saved_tensor``) while the ``with`` block runs, so what
  autograd saves inside it joins the group, each saved tensor under its own tag (a tensor saved
  twice is two entries). ``group_commit(tensor, name, forced_released_tensors)``
  (``FineGrainedOffloadingGroupCommitFunction``, an identity too) ends it, later than the
  block where the input is still needed (after the bias-dropout-add for the norms, after fc2
  for ``moe_act``). Call sites: ``attn_norm`` and ``mlp_norm`` (transformer_layer.py),
  ``qkv_linear``, ``core_attn`` (training and without ``core_attn`` recompute), ``attn_proj``
  (attention.py, multi_latent_attention.py), ``expert_fc1`` and ``moe_act``
  (moe/experts.py ``TEGroupedMLP``): ``Block.offload_groups`` lists them.
- **Offload at the commit** (``ChunkOffloadHandler.bulk_offload`` / ``bulk_offload_group``):
  each saved tensor of at least ``min_offloaded_tensor_size`` elements not marked
  ``offloading_activation = False`` (``GPTModel.preprocess_for_fine_grained_offloading`` marks
  every decoder and output-layer parameter) is copied to a pinned host buffer (a non-contiguous
  one through a ``.contiguous()`` device copy first) and the group keeps the host copy instead,
  so its device storage dies with its last other reference (``record_stream`` delays reuse of
  the block, not the allocator's ``allocated_bytes``); then each ``forced_released_tensors``
  entry passing the same size check has its storage ``resize_(0)``-ed. Host buffers: a pool
  keyed by (shape, dtype) (``GPUTensorPool``, pinned), except for ``expert_fc1`` and
  ``moe_act`` (plain pinned ``torch.empty``: "shapes ... are not known in advance").
- **Reload in backward.** The commit's backward waits for its group's reload; the start's
  backward (``on_group_start_backward`` -> ``bulk_reload``) reloads the top of the chunk's
  stack of offloaded groups (commit order: so one group ahead for the outer groups, none for
  the nested ones), or, once that stack is empty, one group of the next backward chunk whose
  forward has finished (``pre_reload_last_layer``). A tensor still on the host when autograd
  unpacks it is reloaded then (``tensor_pop``). A reload is a new device tensor
  (``torch.empty`` + copy); its host buffer goes back to the pool.
- **Chunks.** One handler per model chunk per microbatch (``init_model_chunk_offload_handler``,
  from ``GPTModel.forward``), made in the first iteration (warm-up) and reused after it; the
  backward queue is the interleaved schedule's order (``flush`` / ``push``). After the warm-up
  (``post_warmup_callback``), the last group of each name in the earliest backward chunk that
  has it stays on the device; and a group is kept when the chunk is the next to run backward
  and it is that chunk's last group of its name (``should_bulk_offload``).

What depends on the schedule (which groups are kept, how many are reloaded before a chunk's
backward) is decided per chunk and microbatch by ``offload_plan``, which walks Megatron's
bookkeeping over the rank's schedule steps; ``ChunkHandler`` then runs one chunk with its
``ChunkPlan`` under the tracer. The groups Megatron reloads during the previous backward
chunk (``pre_reload_last_layer``) are traced at the start of the chunk's own backward
(``ChunkHandler.prereloads``) and replayed where Megatron makes them: at the previous
backward chunk's group starts that find its own stack empty (``ChunkHandler.marks``;
``tracemem.estimator.replay_events``). Outside a ``chunk`` context every call here is the
identity.

Not modelled: the d2h / h2d side streams' effect on the caching allocator's block reuse
(``record_stream``); Megatron-LM d98e8a6's additions (``--activation-offload-fraction``,
``--delta-offload-bytes-across-pp-ranks``, ``--fine-grained-offloading-max-inflight-offloads``,
CUDA-graph capture, ``fused_group_mlp``): the front door refuses them by name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["OFFLOAD_MODULES", "MIN_OFFLOADED_TENSOR_SIZE", "ChunkPlan", "ChunkHandler",
           "HostBuffer", "chunk", "group", "commit", "enabled", "offload_plan"]

# TransformerConfig.__post_init__'s allowed_modules (transformer_config.py at 4e85d74ae9), in
# the order a layer's forward starts them
OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm",
                   "expert_fc1", "moe_act")
MIN_OFFLOADED_TENSOR_SIZE = 1024 * 1024  # TransformerConfig.min_offloaded_tensor_size
_UNPOOLED = ("expert_fc1", "moe_act")  # OffloadTensorGroup.__init__: use_cpu_pool = False


@dataclass(frozen=True)
class ChunkPlan:
    """What Megatron's manager decides for one chunk handler (a model chunk's microbatch):
    ``keep``, the 0-based indices (forward start order) of the groups left on the device;
    ``pre``, how many of its offloaded groups are reloaded before its backward starts (the
    top of its stack: the last committed)."""

    keep: frozenset[int] = frozenset()
    pre: int = 0


class HostBuffer(NamedTuple):
    """A host copy: the tensor's ``shape`` and ``dtype``, its bytes, and whether it comes from
    the (shape, dtype) pool (``GPUTensorPool``) or a plain pinned allocation."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    pooled: bool


class _Group:
    """``OffloadTensorGroup``: the saved tensors of one call, by tag; a ``HostBuffer`` in
    place of each offloaded one."""

    __slots__ = ("name", "index", "tensors", "offload")

    def __init__(self, name: str, index: int, offload: bool):
        self.name, self.index, self.offload = name, index, offload
        self.tensors: dict[tuple[int, int], Any] = {}


def _tracer():
    from tracemem.tracer import MemoryTracer

    mode = _get_current_dispatch_mode()
    return mode if isinstance(mode, MemoryTracer) else None


class ChunkHandler:
    """``ChunkOffloadHandler`` for one model chunk's microbatch, driven by its ``plan``.

    ``modules``: the ``--offload-modules`` names; ``min_size``: ``--min-offloaded-tensor-size``
    (elements). ``expected``: the group names ``Block.offload_groups`` predicts, in order (a
    call site that disagrees raises, so plan and trace cannot drift apart). After the
    forward: ``names`` (the groups started), ``host`` (the ``HostBuffer`` of every offloaded
    tensor, in offload order).

    Raises:
        RuntimeError: a group started out of the predicted order, or a saved tensor unpacked
            twice (Megatron's ``tensor_pop`` would fail too).
    """

    def __init__(self, modules: Iterable[str], min_size: int = MIN_OFFLOADED_TENSOR_SIZE,
                 plan: ChunkPlan = ChunkPlan(), expected: Sequence[str] | None = None):
        self.modules = frozenset(modules)
        self.min_size, self.plan = min_size, plan
        self.expected = tuple(expected) if expected is not None else None
        self.groups: list[_Group] = []
        self._to_offload: list[_Group] = []  # started, not committed
        self._to_reload: list[_Group] = []  # offloaded, commit order (a stack)
        self._count = 0
        self.host: list[HostBuffer] = []
        self._began_backward = False
        # the tracer's event positions: where each spare group start of the backward would
        # reload a group of the next backward chunk (``marks``), and the events of each group
        # reloaded by ``begin_backward`` (``prereloads``, (start, end)); the replay moves the
        # latter to the previous backward chunk's marks (tracemem.estimator.replay_events)
        self.marks: list[int] = []
        self.prereloads: list[tuple[int, int]] = []

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(g.name for g in self.groups)

    # ---------------------------------------------------------------- forward
    def start_forward(self, name: str) -> None:
        """``on_group_start_forward``."""
        index = len(self.groups)
        if self.expected is not None and (index >= len(self.expected)
                                          or self.expected[index] != name):
            raise RuntimeError(f"fine-grained offloading: group {index} is {name!r}, "
                               f"Block.offload_groups predicted "
                               f"{self.expected[index] if index < len(self.expected) else None!r}")
        g = _Group(name, index, index not in self.plan.keep)
        self.groups.append(g)
        self._to_offload.append(g)
        self._count = 0

    def pack(self, t: Tensor):
        """``on_save_for_backward`` / ``tensor_push``: the tensor joins the open group; the
        tracer still sees it saved (its storage becomes an activation)."""
        tracer = _tracer()
        offloadable = getattr(t, "offloading_activation", True) is not False \
            and not isinstance(t, torch.nn.Parameter)
        if tracer is not None:
            offloadable = offloadable and tracer.born_in_trace(t)
            kept = tracer.saved_for_backward(t)
        else:
            kept = t.detach()
        kept._tracemem_offloadable = offloadable
        g = self.groups[-1]
        tag = (g.index, self._count)
        self._count += 1
        g.tensors[tag] = kept
        return (self, tag)

    def _needs_offloading(self, t: Tensor) -> bool:
        """``tensor_need_offloading_checker``: at least ``min_size`` elements and not marked
        ``offloading_activation = False`` (parameters, and storages made before the step)."""
        return t.numel() >= self.min_size and getattr(t, "_tracemem_offloadable", True) \
            and getattr(t, "offloading_activation", True) is not False

    def commit_forward(self, forced_released: Sequence[Tensor]) -> None:
        """``on_group_commit_forward`` -> ``bulk_offload``: offload the innermost open group
        (unless the plan keeps it), then release ``forced_released``."""
        g = self._to_offload.pop()
        if not g.offload:
            return
        self._to_reload.append(g)
        pooled = g.name not in _UNPOOLED
        t = None
        for tag, t in list(g.tensors.items()):
            if isinstance(t, Tensor) and self._needs_offloading(t):
                if not t.is_contiguous():
                    t.contiguous()  # ChunkOffloadHandler.offload: a device copy, then D2H
                buf = HostBuffer(tuple(t.shape), t.dtype, t.numel() * t.element_size(), pooled)
                self.host.append(buf)
                g.tensors[tag] = buf
        del t
        tracer = _tracer()
        for r in forced_released:  # the same tensor_need_offloading_checker
            if r is not None and self._needs_offloading(r):
                r.untyped_storage().resize_(0)
                if tracer is not None:
                    tracer.storage_resized(r)

    # ---------------------------------------------------------------- backward
    def _reload(self, buf: HostBuffer) -> Tensor:
        """``ChunkOffloadHandler.reload``: a new device tensor, filled from the host."""
        out = torch.empty(buf.shape, dtype=buf.dtype, device="meta")
        tracer = _tracer()
        if tracer is not None:
            from tracemem.categories import Category

            tracer.tag(out, Category.ACTIVATION)
        return out

    def _bulk_reload_group(self) -> None:
        """``bulk_reload_group``: reload every offloaded tensor of the stack's top group."""
        g = self._to_reload.pop()
        for tag, t in list(g.tensors.items()):
            if isinstance(t, HostBuffer):
                g.tensors[tag] = self._reload(t)

    def begin_backward(self) -> None:
        """The plan's ``pre`` groups, reloaded before the backward (Megatron:
        ``pre_reload_last_layer``, during the previous backward chunk's tail; module
        docstring)."""
        if self._began_backward:
            return
        self._began_backward = True
        tracer = _tracer()
        for _ in range(min(self.plan.pre, len(self._to_reload))):
            start = len(tracer.events) if tracer is not None else 0
            self._bulk_reload_group()
            if tracer is not None:
                self.prereloads.append((start, len(tracer.events)))

    def start_backward(self) -> None:
        """``on_group_start_backward`` -> ``bulk_reload``: the stack's top group; with the
        stack empty Megatron reloads one group of the next backward chunk (``marks``: the
        replay puts that chunk's ``prereloads`` here)."""
        self.begin_backward()
        if self._to_reload:
            self._bulk_reload_group()
        else:
            tracer = _tracer()
            if tracer is not None:
                self.marks.append(len(tracer.events))

    def unpack(self, tag: tuple[int, int]) -> Tensor:
        """``on_get_saved_tensor`` / ``tensor_pop``: the tensor, reloaded now if it is still
        on the host."""
        self.begin_backward()
        g = self.groups[tag[0]]
        if tag not in g.tensors:
            raise RuntimeError(f"fine-grained offloading: saved tensor {tag} of group "
                               f"{g.name!r} unpacked twice")
        t = g.tensors.pop(tag)
        return self._reload(t) if isinstance(t, HostBuffer) else t


_ACTIVE: list[ChunkHandler] = []


@contextmanager
def chunk(handler: ChunkHandler | None):
    """Run a chunk's forward with ``handler`` as the current forward chunk (None: offloading
    off, every call the identity)."""
    if handler is None:
        yield None
        return
    _ACTIVE.append(handler)
    try:
        yield handler
    finally:
        _ACTIVE.pop()


def enabled(name: str) -> bool:
    """Whether group ``name`` offloads in the forward now running (Megatron's
    ``self.offload_*`` flags: ``fine_grained_activation_offloading`` and ``name`` in
    ``offload_modules``)."""
    return bool(_ACTIVE) and name in _ACTIVE[-1].modules


def _unpack(state) -> Tensor:
    handler, tag = state
    return handler.unpack(tag)


class _Start(torch.autograd.Function):
    """``FineGrainedOffloadingGroupStartFunction``."""

    @staticmethod
    def forward(ctx, tensor: Tensor, handler: ChunkHandler, name: str) -> Tensor:
        ctx.handler = handler
        handler.start_forward(name)
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.handler.start_backward()
        return grad, None, None


class _Commit(torch.autograd.Function):
    """``FineGrainedOffloadingGroupCommitFunction``."""

    @staticmethod
    def forward(ctx, tensor: Tensor, handler: ChunkHandler, forced: tuple) -> Tensor:
        handler.commit_forward(forced)
        ctx.handler = handler
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.handler.begin_backward()  # on_group_commit_backward: the chunk's backward begins
        return grad, None, None


@dataclass
class group:
    """``with group(name, tensor) as tensor:`` Megatron's ``FineGrainedActivationOffloading
    Interface(offload, tensor, name)``: the group starts on ``tensor`` (returned, an alias
    carrying the start node) and what autograd saves in the block joins it."""

    name: str
    tensor: Tensor
    when: bool = True  # False: no group here (Megatron: the norm is an IdentityOp, fused)
    _hooks: Any = field(default=None, repr=False)

    def __enter__(self) -> Tensor:
        if not self.when or not enabled(self.name):
            return self.tensor
        handler = _ACTIVE[-1]
        out = _Start.apply(self.tensor, handler, self.name)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(handler.pack, _unpack)
        self._hooks.__enter__()
        return out

    def __exit__(self, *exc) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None


def commit(tensor, name: str, forced_released: Sequence[Tensor | None] = (),
           when: bool = True):
    """``group_commit(tensor, name, forced_released_tensors)``: ends the innermost open group
    (offloading it) on ``tensor`` (a tuple or list: on its first element), returned as an
    alias carrying the commit node; the identity when ``name`` does not offload or not
    ``when``."""
    if not when or not enabled(name):
        return tensor
    if isinstance(tensor, (tuple, list)):
        first = commit(tensor[0], name, forced_released)
        return type(tensor)([first, *tensor[1:]])
    return _Commit.apply(tensor, _ACTIVE[-1], tuple(forced_released))


# ------------------------------------------------------------------ the schedule's decisions
def offload_plan(steps: Sequence, groups_of_chunk: Sequence[Sequence[str]], chunk_of_stage,
                 *, warmup: bool = False) -> dict[tuple[int, int], ChunkPlan]:
    """Megatron's manager decisions for each (model chunk, microbatch) of one rank, from its
    schedule ``steps`` (each with ``kind`` "F" / "B", ``stage`` the virtual stage,
    ``microbatch``), the group names of each model chunk (``Block.offload_groups``, forward
    order) and ``chunk_of_stage(v)`` (the rank's model chunk of virtual stage v, Megatron's
    ``vp_stage``). ``warmup``: the first iteration (everything offloaded); otherwise any
    later one.

    Walks, without tensors, what the manager does at 4e85d74ae9: the backward queue built from
    the forward order (``init_model_chunk_offload_handler``, ``flush``, ``push``); after the
    warm-up, ``post_warmup_callback``'s kept groups (the last group of each name in the
    earliest backward chunk having it, one per name up to ``_offload_margin``) and
    ``should_bulk_offload``'s (the next chunk to run backward keeps its last group of each
    name); in backward, each group start reloads one group of the chunk's own stack, then of
    the next non-empty backward chunk whose forward has finished (``bulk_reload``,
    ``pre_reload_last_layer``), which gives each chunk's ``pre``.

    Raises:
        ValueError: a schedule whose backward order is not the queue's (Megatron's manager
            assumes its interleaved 1F1B order).
    """
    vpp = len(groups_of_chunk)
    forwards = [s for s in steps if s.kind == "F"]
    # the backward queue (PipelineOffloadManager.init_model_chunk_offload_handler)
    stages: list[list[tuple[int, int]]] = [[] for _ in range(vpp)]
    queue: list[tuple[int, int]] = []

    def flush():
        if len(stages[0]) == len(stages[-1]):
            stages[-1] = []
            for chunks in reversed(stages):
                queue.extend(chunks)
            for i in range(vpp):
                stages[i] = []

    for s in forwards:
        c = chunk_of_stage(s.stage)
        if c == vpp - 1:
            flush()
        stages[c].append((c, s.microbatch))
        if c == vpp - 1:
            queue.append((c, s.microbatch))
            flush()
    queued = set(queue)
    queue.extend(key for key in [(chunk_of_stage(s.stage), s.microbatch) for s in forwards]
                 if key not in queued)  # never flushed: Megatron would not run them back
    names = {key: tuple(groups_of_chunk[key[0]]) for key in queue}
    nonempty = [key for key in queue if names[key]]
    order = [(chunk_of_stage(s.stage), s.microbatch) for s in steps if s.kind == "B"]
    if [k for k in order if names[k]] != nonempty:
        raise ValueError("the schedule's backward order is not the order Megatron's offload "
                         "manager queues chunks in (its interleaved 1F1B order)")
    position = {key: i for i, key in enumerate(queue)}

    def last_of(key, name):
        return max(i for i, n in enumerate(names[key]) if n == name)

    keep: dict[tuple[int, int], set[int]] = {key: set() for key in queue}
    if not warmup:
        margin = max((len(set(names[k])) for k in queue), default=0)
        earliest: dict[str, tuple[int, int]] = {}
        for key in queue:
            for name in names[key]:
                earliest.setdefault(name, key)
        for name, key in earliest.items():  # post_warmup_callback
            if margin <= 0:
                break
            keep[key].add(last_of(key, name))
            margin -= 1
    # walk the steps: forwards (should_bulk_offload), backwards (the reload stacks)
    index = 0  # _cached_chunks_index_backward: past the last chunk popped
    done_forward: set[tuple[int, int]] = set()
    pre: dict[tuple[int, int], int] = {key: 0 for key in queue}
    stack: dict[tuple[int, int], int] = {}
    for s in steps:
        key = (chunk_of_stage(s.stage), s.microbatch)
        if s.kind == "F":
            if not warmup:
                for name in set(names[key]):
                    front = next((k for k in queue[index:] if name in names[k]), None)
                    if front == key:
                        keep[key].add(last_of(key, name))
            done_forward.add(key)
            stack[key] = len(names[key]) - len(keep[key])
        elif s.kind == "B" and names[key]:
            index = position[key] + 1
            own = stack[key] - pre[key]
            spare = len(names[key]) - max(own, 0)
            nxt = next((k for k in queue[index:] if names[k]), None)
            if nxt is not None and nxt in done_forward and spare > 0:
                pre[nxt] = min(spare, stack[nxt])
    return {key: ChunkPlan(frozenset(keep[key]), pre[key]) for key in queue}
