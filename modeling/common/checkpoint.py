"""Megatron-Core's two activation-checkpoint mechanisms, as torch code that runs on meta under
the tracer (Megatron-LM d98e8a6, megatron/core/tensor_parallel/random.py):

- ``megatron_checkpoint(function, distribute_saved_activations, *args)``: ``tensor_parallel.
  checkpoint`` (``CheckpointFunction``), reentrant. The forward runs under ``no_grad``, so it
  saves nothing and frees its temporaries as it goes; only the tensor arguments are kept
  (``ctx.save_for_backward``). Backward detaches them, runs ``function`` again under
  ``enable_grad`` and backpropagates through that graph inside the checkpoint's own backward
  (``torch.autograd.backward(outputs, grads)``). With ``distribute_saved_activations`` the
  first argument is kept as this TP rank's 1/TP of its elements in a new buffer
  (``split_tensor_into_1d_equal_chunks(new_buffer=True)``, tensor_parallel/utils.py) and the
  full tensor's storage is released (``safely_set_viewless_tensor_data``); backward gathers it
  back into a new full buffer (``gather_split_1d_tensor``) before recomputing. Megatron uses
  it for full recompute (megatron/core/recompute.py ``checkpointed_forward``) and for the
  selective modules ``core_attn`` (transformer/attention.py ``_checkpointed_attention_forward``),
  ``mlp`` (transformer/transformer_layer.py ``_run_mlp``), ``moe`` (transformer/moe/moe_layer.py
  ``MoELayer.forward``) and ``shared_experts`` (moe_layer.py ``shared_experts_compute``).
- ``CheckpointWithoutOutput``: runs a function under ``no_grad`` keeping its inputs; the caller
  hands its outputs to their consumer (which saves them for its own backward), then calls
  ``discard_output_and_register_recompute(hook_tensor)``: the outputs' storages are resized to
  0 bytes (the consumer's saved tensors keep their shape, not their memory) and a gradient hook
  on ``hook_tensor`` recomputes them when backward reaches it. Megatron uses it for
  ``layernorm`` (transformer_layer.py ``_run_input_layernorm`` / ``_forward_pre_mlp_layernorm``),
  ``moe_act`` (transformer/moe/experts.py ``TEGroupedMLP.forward``) and ``mla_up_proj``
  (transformer/multi_latent_attention.py ``get_query_key_value_tensors``). At d98e8a6
  ``_recompute`` makes each discarded output's storage point at the recomputed data
  (``share_storage``, a C++ extension: zero copy), so the recomputed output is the only copy;
  megatron-core 0.16.1 (the oracle) resizes the storage back and copies into it while the
  recomputed output is still held, one output more during that backward.

The tracer cannot see ``untyped_storage().resize_`` (it runs below the dispatcher): it is told
(``MemoryTracer.storage_resized``) when a storage is discarded. Under a split backward
(zero-bubble and DualPipe I steps) both backwards go through
``modeling.kernels.wgrad.inner_backward``, so the recomputed graph's Linear weight gradients
are deferred to W like the rest (``tracemem.split_backward``). Known limitation: the RNG
states both mechanisms stash (``_get_all_rng_states``: CPU and CUDA generator states, a few
bytes of host memory) are not modelled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from modeling.kernels.wgrad import inner_backward, share_storage
from tracemem.tracer import MemoryTracer

__all__ = ["megatron_checkpoint", "CheckpointWithoutOutput"]


_SLOT = object()  # where a tensor argument was: it is kept by ctx.save_for_backward


def _tensors(args) -> list[Tensor]:
    return [a for a in args if isinstance(a, Tensor)]


def _others(args) -> tuple:
    """``args`` with each tensor replaced by ``_SLOT`` (kept on ``ctx``)."""
    return tuple(_SLOT if isinstance(a, Tensor) else a for a in args)


def _rebuild(others, tensors) -> tuple:
    """The arguments again: ``others`` with each ``_SLOT`` replaced, in order, by
    ``tensors``."""
    it = iter(tensors)
    return tuple(next(it) if a is _SLOT else a for a in others)


def _detach(t: Tensor) -> Tensor:
    out = t.detach()
    out.requires_grad_(t.requires_grad)
    return out


def _split_1d(t: Tensor, tp: int, rank: int) -> Tensor:
    """``split_tensor_into_1d_equal_chunks(t, new_buffer=True)``: this rank's numel / TP
    elements, copied into a new 1-D buffer."""
    part = t.numel() // tp
    data = torch.empty(part, dtype=t.dtype, device=t.device)
    data.copy_(t.reshape(-1).narrow(0, part * rank, part))
    return data


def _gather_1d(t: Tensor, tp: int) -> Tensor:
    """``gather_split_1d_tensor``: a new buffer of numel * TP elements that
    ``all_gather_into_tensor`` fills (on meta: nothing to fill)."""
    return torch.empty(t.numel() * tp, dtype=t.dtype, device=t.device)


class _CheckpointFunction(torch.autograd.Function):
    """tensor_parallel/random.py ``CheckpointFunction`` (forward, backward), with the
    non-tensor arguments (tracemem's routing model) kept on ``ctx`` beside the saved
    tensors."""

    @staticmethod
    def forward(ctx, run_function: Callable, distribute: tuple[int, int] | None, *args):
        ctx.run_function = run_function
        ctx.args = _others(args)
        with torch.no_grad():
            outputs = run_function(*args)
        if distribute is not None:  # keep 1/TP of the first argument, release the rest
            first = args[0]
            ctx.input_0_shape, ctx.tp = first.shape, distribute[0]
            first.data = _split_1d(first.data, *distribute)
            # the caller's tensor itself: saved-tensor hooks (the tracer's) may save another
            # tensor object on the same storage, and backward must restore the caller's one,
            # as Megatron's (hook-free) ctx.saved_tensors[0] is
            ctx.first = first
        ctx.save_for_backward(*_tensors(args))
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        inputs = ctx.saved_tensors
        if hasattr(ctx, "input_0_shape"):
            full = _gather_1d(inputs[0].data, ctx.tp).view(ctx.input_0_shape)
            inputs[0].data = ctx.first.data = full  # the 1/TP buffer is released
            ctx.first = None
        detached = [_detach(t) for t in inputs]
        with torch.enable_grad():
            outputs = ctx.run_function(*_rebuild(ctx.args, detached))
        if isinstance(outputs, Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads)
                 if isinstance(o, Tensor) and o.requires_grad]
        # torch.autograd.backward(outputs, grads), or an I step's split of it
        inner_backward([o for o, _ in pairs], [g for _, g in pairs], detached)
        it = iter(detached)
        return (None, None) + tuple(next(it).grad if a is _SLOT else None for a in ctx.args)


def megatron_checkpoint(function: Callable, distribute_saved_activations: tuple[int, int] | None,
                        *args: Any):
    """``tensor_parallel.checkpoint(function, distribute_saved_activations, *args)``
    (tensor_parallel/random.py): ``function(*args)`` recomputed in backward (reentrant).
    ``distribute_saved_activations``: None, or (TP, this rank's TP index) to keep 1/TP of the
    first argument (Megatron's ``--distribute-saved-activations``)."""
    return _CheckpointFunction.apply(function, distribute_saved_activations, *args)


def _tell_tracer(tensors) -> None:
    mode = _get_current_dispatch_mode()
    if isinstance(mode, MemoryTracer):
        for t in tensors:
            mode.storage_resized(t)


class _CheckpointWithoutOutputFunction(torch.autograd.Function):
    """tensor_parallel/random.py ``CheckpointWithoutOutputFunction``: forward under
    ``no_grad`` keeping the inputs; backward backpropagates through the graph that
    ``CheckpointWithoutOutput._recompute`` built (``ctx.outputs``) into the detached inputs."""

    @staticmethod
    def forward(ctx, run_function: Callable, owner: CheckpointWithoutOutput, *args):
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.args = _others(args)
        ctx.save_for_backward(*_tensors(args))
        owner.ctx = ctx
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        inputs, outputs = ctx.inputs, ctx.outputs
        inner_backward(outputs, grads, inputs)  # torch.autograd.backward, or an I step
        ctx.outputs = ctx.inputs = None
        it = iter(inputs)
        return (None, None) + tuple(next(it).grad if a is _SLOT else None for a in ctx.args)


class CheckpointWithoutOutput:
    """tensor_parallel/random.py ``CheckpointWithoutOutput`` at Megatron-LM d98e8a6 (module
    docstring). Example (Megatron's ``moe_act``)::

        ckpt = CheckpointWithoutOutput()
        act = ckpt.checkpoint(swiglu, fc1_output, probs)  # no graph, inputs kept
        out = fc2(act)                                    # fc2 saves act
        ckpt.discard_output_and_register_recompute(out)   # act's storage -> 0 bytes
    """

    def __init__(self):
        self.run_function: Callable | None = None
        self.ctx = None
        self.outputs: tuple[Tensor, ...] | None = None

    def checkpoint(self, run_function: Callable, *args: Any):
        self.run_function = run_function
        outputs = _CheckpointWithoutOutputFunction.apply(run_function, self, *args)
        self.outputs = (outputs,) if isinstance(outputs, Tensor) else tuple(outputs)
        return outputs

    def discard_output_and_register_recompute(self, hook_tensor: Tensor) -> None:
        """``_discard_outputs`` (each output's storage ``resize_(0)``), then ``hook_tensor``'s
        gradient hook recomputes them."""
        for out in self.outputs:
            out.untyped_storage().resize_(0)
        _tell_tracer(self.outputs)
        if hook_tensor.requires_grad:
            hook_tensor.register_hook(self._recompute)

    def _recompute(self, _grad) -> None:
        if self.ctx is None:  # already recomputed
            return
        ctx = self.ctx
        inputs = [_detach(t) for t in ctx.saved_tensors]
        with torch.enable_grad():
            outputs = self.run_function(*_rebuild(ctx.args, inputs))
        if isinstance(outputs, Tensor):
            outputs = (outputs,)
        # d98e8a6 share_storage: each discarded output now aliases its recomputed twin (no
        # bytes allocated for it); the twin lives while ctx.outputs holds it, until this
        # checkpoint's backward has run, which is after every consumer of the output
        for output, twin in zip(self.outputs, outputs):
            share_storage(output, twin)  # recorded for deferred weight gradients (W)
        ctx.outputs, ctx.inputs = outputs, inputs
        self.run_function = self.outputs = self.ctx = None
