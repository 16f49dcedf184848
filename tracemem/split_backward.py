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

Not supported: saved tensors of ``torch.utils.checkpoint`` regions (they can be unpacked once);
``estimate`` rejects recompute with a schedule that has W steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

from modeling.kernels.wgrad import delayed_wgrad, run_delayed_wgrad

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
    node: Node
    kind: str
    param: Tensor
    layer_input: Tensor | None
    offs: Tensor | None = None
    output_grad: Tensor | None = None


@dataclass
class WeightGradients:
    """The deferred weight gradients of one microbatch's backward (its W step)."""

    deferred: list[_Deferred] = field(default_factory=list)
    handles: list = field(default_factory=list)
    kernels: list = field(default_factory=list)  # TE kernels' delayed wgrads (kernels.wgrad)

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
            entry = _Deferred(node, kind, param, getattr(node, attribute),
                              node._saved_offs if kind == "GroupedMmBackward0" else None)
            store.handles.append(node.register_prehook(_keep_output_grad(entry)))
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
            node, index = entry.node.next_functions[_MATMULS[entry.kind][1]]
            del entry, x, dy
            torch.autograd.backward([GradientEdge(node, index)], [grad])
            del grad


def _keep_output_grad(entry: _Deferred):
    def hook(grad_outputs):
        entry.output_grad = grad_outputs[0]
    return hook


def backward_input(outputs: list[Tensor], grads: list[Tensor | None], inputs: list[Tensor],
                   params: list[Tensor]) -> WeightGradients:
    """I: the backward of ``outputs`` (with ``grads``; None for a loss) towards ``inputs``
    (stage inputs that require grad) and every parameter in ``params`` except the deferred
    ones; returns the deferred weight gradients (call ``run()`` for W)."""
    store = WeightGradients.find(outputs, params)
    deferred = {id(p) for p in store.params}
    targets = [t for t in inputs if t.requires_grad] + \
        [p for p in params if p.requires_grad and id(p) not in deferred]
    grads = [torch.ones_like(o) if g is None else g for o, g in zip(outputs, grads)]
    if targets:
        with delayed_wgrad(store.kernels):  # TE kernels defer theirs (delay_wgrad_compute)
            torch.autograd.Variable._execution_engine.run_backward(
                tuple(outputs), tuple(grads), keep_graph=False, create_graph=False,
                inputs=tuple(targets), allow_unreachable=True, accumulate_grad=True)
    return store
