"""A backward split into I (input gradients) and W (weight gradients of every Linear and
grouped linear), on any autograd graph, for the zero-bubble and DualPipe schedules.

DeepSeek's DualPipe (deepseek-ai/DualPipe 3da1bbe, dualpipe/utils.py ``WeightGradStore``) and
the zero-bubble Megatron fork defer the weight gradient inside their Linear's backward: the
backward computes the input gradient, stores a closure over the layer input and the output
gradient, and runs it later. ``split_backward`` does the same without touching the modules:

- ``WeightGradients.find(output, params)`` walks the autograd graph built by the forward and
  finds every matrix multiply whose second operand comes from a parameter through views or
  transposes only (``MmBackward0`` and ``AddmmBackward0``: ``nn.Linear`` / ``F.linear``;
  ``GroupedMmBackward0``: ``torch._grouped_mm``); it keeps the multiply's first operand (the
  layer input, which the node has saved anyway) and hooks the node to keep its output
  gradient.
- ``backward_input`` runs the autograd engine as a normal backward (each node's saved tensors
  are freed as it runs) but only towards the stage inputs and the other parameters (norms,
  embedding, biases), so the engine skips those multiplies' weight gradients
  (``task_should_compute_output``).
- ``WeightGradients.run()`` (W) computes each weight gradient from the layer input and the
  output gradient with the formula of aten's ``mm_mat2_backward`` /
  ``_grouped_mm_mat2_backward`` (torch 2.13 tools/autograd/derivatives.yaml; column-major
  ``mat2``, as ``F.linear``'s ``weight.t()``, gets ``grad.t().mm(mat1).t()``), and feeds it into
  the node's weight edge, so the parameter's ``AccumulateGrad`` (and its hooks) run as in a
  full backward; then it drops the layer inputs and output gradients.

So between I and W a microbatch keeps exactly, per Linear, its input and its output gradient.

Under recompute, as DualPipe and the zero-bubble fork do it (docs/schedules.md, "What W
keeps under recompute": DualPipe ``examples/example_dualpipe.py`` ``LinearFunc.backward``;
sail-sg/zero-bubble-pipeline-parallelism 39f2c18 ``TrainingIteration.schedule_r`` ->
``RecomputeStore.pop`` -> ``CheckpointFunction.recompute_forward``, then
``LinearWithGradAccumulationAndAsyncCommunication.backward`` -> ``WeightGradStore.put``):
the recomputation re-materialises the region's saved tensors during I; the backward of the
recomputed graph frees each as its node runs, except each Linear's input, which the W
closure holds with the output gradient until W; nothing else of the recomputation is kept
from I to W. Per mechanism:

- Megatron's reentrant ``CheckpointFunction`` and ``CheckpointWithoutOutput``
  (``modeling.common.checkpoint``): the recomputed graph exists only inside the checkpoint's
  backward, which runs its own ``torch.autograd.backward``. Both call
  ``modeling.kernels.wgrad.inner_backward``; inside an I step (``split_inner``, entered by
  ``backward_input``) it is the same split: ``find`` on the recomputed graph, a backward
  towards the checkpoint's detached inputs and the non-deferred parameters, the recomputed
  Linears' inputs and output gradients joining this microbatch's W.
- ``torch.utils.checkpoint`` (non-reentrant, torch 2.13 ``_checkpoint_hook``): the nodes are
  in the forward's graph, but each saved tensor is a ``_Holder`` that the first unpack in a
  graph task recomputes (the whole region, once) and that unpacks once per graph task
  (``unpack_hook``: "already unpacked once"). ``find`` reads no such tensor at forward time;
  the node's pre-hook, right before the node itself unpacks it in I, unpacks it (recomputing
  the region then, as the node's unpack would have) and hands the same tensor back to the
  holder for the node's own unpack (``_peek``), then keeps it until W.
- A ``CheckpointWithoutOutput`` output that a Linear saved was discarded (0 bytes) and, at
  d98e8a6, made to point at the recomputed data (``share_storage``); the tracer counts those
  bytes on the recomputed tensor, which the checkpoint's backward drops. A deferred weight
  gradient whose layer input is such an output keeps that recomputed tensor until W
  (``modeling.kernels.wgrad.recomputed_twin``), the TE kernels' store the same
  (``KernelStore``).

TE kernels' deferred weight gradients (``modeling.kernels.wgrad.delayed_wgrad``) need
nothing more: the checkpoint's backward runs inside the I step's ``delayed_wgrad`` block.

Output gradients are kept as detached aliases (same storage): the tracer emulates the
engine's in-place gradient sums by reference counts (``tracemem.tracer``
``_is_engine_inplace_sum``), which a second Python name for the same tensor object does not
raise, so holding the engine's own object let a later sum take over a storage W still held.

Known limitations: a Linear whose weight reaches the multiply through anything but views
(a cast, an FP8 quantisation) is not deferred; ``--zero 3`` with W steps is refused
(``tracemem.job``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node
from torch.utils.checkpoint import GraphExecGroup, _CheckpointFrame, _Handle, _Holder

from modeling.kernels.wgrad import (KernelStore, delayed_wgrad, recomputed_twin,
                                    run_delayed_wgrad, split_inner)

__all__ = ["WeightGradients", "backward_input"]

# node type -> (attribute of the saved first operand, index of the weight edge)
_MATMULS = {"MmBackward0": ("_saved_self", 1), "AddmmBackward0": ("_saved_mat1", 2),
            "GroupedMmBackward0": ("_saved_self", 1)}
# nodes between a multiply and the parameter that only view it
_VIEWS = {"TBackward0", "TransposeBackward0", "ViewBackward0", "PermuteBackward0",
          "ExpandBackward0"}


def _parameter_behind(edge: tuple[Node | None, int], params: set[int]) -> Tensor | None:
    node = edge[0]
    while node is not None and type(node).__name__ in _VIEWS and len(node.next_functions) == 1:
        node = node.next_functions[0][0]
    if node is not None and type(node).__name__ == "AccumulateGrad" \
            and id(node.variable) in params:
        return node.variable
    return None


@dataclass
class _Deferred:
    # the multiply's weight edge (the view towards the parameter's AccumulateGrad), not the
    # multiply's own Node, whose edges hold the graph behind it. A kept layer input with a
    # grad_fn still holds that graph (down to the stage input's AccumulateGrad and tensor),
    # as a tensor in DualPipe's closure does
    weight_edge: tuple[Node, int]
    kind: str
    param: Tensor
    layer_input: Tensor | None
    offs: Tensor | None = None
    output_grad: Tensor | None = None
    twin: Tensor | None = None  # the recomputed data a discarded layer input now holds


@dataclass
class WeightGradients:
    """The deferred weight gradients of one microbatch's backward (its W step)."""

    deferred: list[_Deferred] = field(default_factory=list)
    handles: list = field(default_factory=list)
    kernels: KernelStore = field(default_factory=KernelStore)  # TE kernels' (kernels.wgrad)

    @classmethod
    def find(cls, outputs: list[Tensor], params: list[Tensor]) -> WeightGradients:
        """Every Linear / grouped-linear weight gradient reachable from ``outputs`` whose
        parameter is in ``params``."""
        ids = {id(p) for p in params}
        store = cls()
        seen: set[Node] = set()
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            stack += [n for n, _ in node.next_functions if n is not None]
            kind = type(node).__name__
            if kind not in _MATMULS:
                continue
            attribute, edge = _MATMULS[kind]
            param = _parameter_behind(node.next_functions[edge], ids)
            if param is None:
                continue
            entry = _Deferred(node.next_functions[edge], kind, param, None)
            later = []  # (field, saved tensor) of a torch.utils.checkpoint region: read in I
            names = [("layer_input", attribute)] + \
                ([("offs", "_saved_offs")] if kind == "GroupedMmBackward0" else [])
            for name, saved in names:
                raw = getattr(node, "_raw" + saved)
                if isinstance(raw.data, _Holder):
                    later.append((name, raw))
                else:
                    setattr(entry, name, getattr(node, saved))
            store.handles.append(node.register_prehook(_keep_output_grad(entry, later)))
            store.deferred.append(entry)
        return store

    @property
    def params(self) -> list[Tensor]:
        return [entry.param for entry in self.deferred]

    def run(self) -> None:
        """W: compute and accumulate every deferred weight gradient, then drop the layer
        inputs and output gradients."""
        for handle in self.handles:
            handle.remove()
        run_delayed_wgrad(self.kernels)
        while self.deferred:
            entry = self.deferred.pop(0)
            x, dy = entry.layer_input, entry.output_grad
            if dy is None:  # the multiply got no gradient (unused output)
                continue
            if entry.kind == "GroupedMmBackward0":
                # (E, out, in) per group, transposed to mat2's (E, in, out)
                grad = torch._grouped_mm(dy.t(), x, offs=entry.offs).transpose(-2, -1)
            else:
                grad = dy.t().mm(x).t()  # mat2 (in, out) is weight.t(): column-major
            node, index = entry.weight_edge
            del entry, x, dy
            torch.autograd.backward([GradientEdge(node, index)], [grad])
            del grad


def _keep_output_grad(entry: _Deferred, later: list):
    def hook(grad_outputs):
        # a detached alias: the engine may still sum another gradient into this one in place
        # (the tracer decides by reference counts, which another Python name does not raise)
        entry.output_grad = None if grad_outputs[0] is None else grad_outputs[0].detach()
        for name, raw in later:
            setattr(entry, name, _peek(raw))
        if entry.layer_input is not None:  # a CheckpointWithoutOutput output, recomputed
            entry.twin = recomputed_twin(entry.layer_input)
    return hook


def _frame(unpack_hook) -> _CheckpointFrame:
    """The ``_CheckpointFrame`` a ``torch.utils.checkpoint`` unpack hook closes over (torch
    2.13 ``_checkpoint_hook.__init__``: ``unpack_hook``, or ``unpack_hook_with_error_cb``
    around it)."""
    for cell in unpack_hook.__closure__ or ():
        value = cell.cell_contents
        if isinstance(value, _CheckpointFrame):
            return value
        if callable(value) and getattr(value, "__closure__", None):
            return _frame(value)
    raise RuntimeError("torch.utils.checkpoint's unpack hook no longer closes over its "
                       "_CheckpointFrame (written for torch 2.13): tracemem.split_backward "
                       "cannot keep a checkpointed Linear input until W")


def _peek(raw) -> Tensor:
    """A saved tensor of a ``torch.utils.checkpoint`` region, unpacked in I and still there
    for its node's own unpack. torch 2.13 ``_checkpoint_hook.__init__`` ``unpack_hook``: the
    first unpack in a graph task (``gid``) recomputes the region and files each recomputed
    tensor under a ``_Handle`` in ``frame.recomputed[gid]``; an unpack hands out the tensor and
    clears ``holder.handles[gid]``. The tensor is filed again under a new handle: the node's
    unpack then gets this same tensor (no second recomputation, no copy)."""
    holder = raw.data
    gid = GraphExecGroup._get_current_group()
    if gid is None:
        gid = torch._C._current_graph_task_id()
    value = raw.unpack()
    handle = _Handle()
    holder.handles[gid] = handle
    _frame(raw.unpack_hook).recomputed[gid][handle] = value
    return value


def backward_input(outputs: list[Tensor], grads: list[Tensor | None], inputs: list[Tensor],
                   params: list[Tensor]) -> WeightGradients:
    """I: the backward of ``outputs`` (with ``grads``; None for a loss) towards ``inputs``
    (stage inputs that require grad) and every parameter in ``params`` except the deferred
    ones; returns the deferred weight gradients (call ``run()`` for W)."""
    store = WeightGradients()
    with delayed_wgrad(store.kernels):  # TE kernels defer theirs (delay_wgrad_compute)
        # reentrant checkpoints' own backwards (kernels.wgrad.inner_backward) split the same way
        with split_inner(lambda o, g, i: _split(store, o, g, i, params)):
            _split(store, outputs, grads, inputs, params)
    return store


def _split(store: WeightGradients, outputs: list[Tensor], grads: list[Tensor | None],
           inputs: list[Tensor], params: list[Tensor]) -> None:
    """The backward of ``outputs`` towards ``inputs`` and the parameters not deferred, the
    multiplies it reaches deferred into ``store``."""
    found = WeightGradients.find(outputs, params)
    store.deferred += found.deferred
    store.handles += found.handles
    deferred = {id(p) for p in store.params}
    targets = [t for t in inputs if t.requires_grad] + \
        [p for p in params if p.requires_grad and id(p) not in deferred]
    pairs = [(o, torch.ones_like(o) if g is None else g) for o, g in zip(outputs, grads)
             if o.requires_grad]
    if targets and pairs:
        torch.autograd.Variable._execution_engine.run_backward(
            tuple(o for o, _ in pairs), tuple(g for _, g in pairs), keep_graph=False,
            create_graph=False, inputs=tuple(targets), allow_unreachable=True,
            accumulate_grad=True)
