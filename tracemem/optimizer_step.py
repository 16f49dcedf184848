"""The optimizer step of one rank as traced events: what a training iteration allocates after
the pipeline schedule's last backward, on top of static memory (``tracemem.static``).

What Megatron-Core's distributed optimizer holds and allocates (NVIDIA/Megatron-LM d98e8a6):

- Gradient and parameter buffers (megatron/core/distributed/param_and_grad_buffer.py
  ``_ParamAndGradBuffer.__init__``): one flat ``grad_data`` of every parameter (dense and
  expert buffers apart, each bucketed), in the main-grad dtype, allocated once at setup; with
  the distributed optimizer also one flat bf16 ``param_data``, and each parameter's ``.data``
  is re-pointed into it (``param.data = new_param_data``): the buffer *replaces* the
  parameters, so it costs nothing beyond them. Both are static memory (``param_bytes``,
  ``grad_bytes``); their alignment padding (64 elements per parameter start, bucket ends
  padded to a multiple of the DP size) is not counted.
- Gradient reduce-scatter (distributed_data_parallel.py ``start_grad_sync`` through the
  buckets) and parameter all-gather (``start_param_sync``) run in place on those buffers:
  their outputs are views of the same storage, so they allocate nothing here.
- The step (distrib_optimizer.py ``DistributedOptimizer``): ``_copy_model_grads_to_main_grads``
  gives each fp32 master shard its gradient as ``shard_model_grad.float()``, which is the grad
  buffer itself when it is fp32 and a new fp32 copy of the shard when the buffer is bf16
  (``--grad-reduce-in-bf16``); under the precision-aware optimizer it is a view
  (``decoupled_grad``). The copies live until ``zero_grad`` at the start of the next
  iteration (megatron/training/training.py ``train_step``): here, until the step ends.
- The Adam kernel: Megatron uses TE's ``FusedAdam`` (or apex's), one ``multi_tensor_adam``
  launch that updates parameters and moments in place and allocates nothing
  (transformer_engine/pytorch/optimizers/fused_adam.py ``FusedAdam.step``); its state (the
  moments, and under the precision-aware optimizer the master weights) is created lazily at the
  first step, with ``zeros_like`` per parameter (``FusedAdam.initialize_state``). Static memory
  holds that state from the start, as every iteration after the first does, so the first step's
  creation (the same bytes, with the same gradients alive) is covered.
- ``optimizer="torch"``: a real ``torch.optim.Adam(foreach=True)`` step traced on the meta
  device over this rank's fp32 master shards (torch/optim/adam.py ``_multi_tensor_adam``:
  ``torch._foreach_sqrt`` of the second moments makes a full temporary copy of them).

- ``--optimizer-cpu-offload`` (``offload``: ``tracemem.offload``): Megatron's
  ``HybridDeviceOptimizer``. With bf16 main grads each device parameter's new fp32 gradient
  copy (``fp32_param.grad = grad.to(fp32)``) is made while the previous step's, static memory
  (``tracemem.offload.offload_static``), is still held, one parameter at a time; then, one host
  parameter at a time, the bf16 gradient's fp32 conversion on the device before its copy to
  the host
  (``copy_(grad, non_blocking=True)``); TE's FusedAdam over the device part allocates nothing;
  after the host step, one host parameter at a time, the fp32 device temporary through which
  ``gpu_param.data.copy_(param.data, non_blocking=True)`` converts the host master into the bf16
  parameter (PyTorch's Copy.cu ``copy_kernel_cuda``).

Not counted: NCCL's own buffers, gradient-norm and clipping scalars.
"""

from __future__ import annotations

import torch
from torch import nn

from modeling.parallel.groups import numel_by_kind
from tracemem.errors import TracememError

__all__ = ["OPTIMIZERS", "trace_optimizer_step"]

OPTIMIZERS = ("fused", "torch")


def _shard_numels(model: nn.Module, par, quantity: str) -> list[int]:
    """Elements of this rank's shard of the dense and of the expert parameters, as
    ``SHARDING``'s ``quantity`` rows split them: ceil(total / group), one contiguous range of
    each buffer (Megatron's per-parameter pieces of that range are taken together)."""
    totals = numel_by_kind(model)  # by each parameter's declared group
    return [-(-n // par.shards(quantity, kind)) for kind, n in totals.items() if n]


def check_optimizer(optimizer: str, par) -> None:
    """Raises TracememError: an unknown optimizer, or "torch" under the precision-aware
    optimizer (which is TE's FusedAdam)."""
    if not isinstance(optimizer, str) or optimizer not in OPTIMIZERS:
        raise TracememError(f"--optimizer {optimizer!r} is invalid; choose one of "
                            f"{', '.join(OPTIMIZERS)}")
    if optimizer == "torch" and par.precision_spec.use_precision_aware_optimizer:
        raise TracememError("--optimizer torch cannot run --use-precision-aware-optimizer "
                            "(that is TE's FusedAdam); use --optimizer fused")


def trace_optimizer_step(model: nn.Module, par, tracer, optimizer: str = "fused",
                         offload=None) -> None:
    """Run, under ``tracer`` (a ``MemoryTracer``), the allocations of this rank's optimizer
    step for ``model`` (the rank's ``build_rank`` modules) under ``par`` (its ZeRO stage and
    precision), as the module docstring describes; ``offload`` (a
    ``tracemem.offload.OptimizerOffload``, or None) its optimizer CPU offload. Every tensor
    made here is freed by the end; what the step's peak holds is in the tracer's events.

    Raises:
        TracememError: see ``check_optimizer``.
    """
    check_optimizer(optimizer, par)
    spec = par.precision_spec
    meta = torch.device("meta")
    if offload is not None:
        _offload_step(model, par, tracer, offload)
        return
    adam = None
    if optimizer == "torch":
        masters = [nn.Parameter(torch.empty(n, dtype=torch.float32, device=meta))
                   for n in _shard_numels(model, par, "optimizer_states")]
        for master in masters:
            master.grad = torch.empty_like(master)  # stands for the buffer's shard (static)
        adam = torch.optim.Adam(masters, foreach=True)
        adam.step()  # the state, created lazily at the first step: static memory's
        tracer.track_external(adam)
    with tracer:
        copies = []
        if not spec.use_precision_aware_optimizer and spec.grad_bytes == 2 \
                and par.zero < 3:  # Megatron-FSDP returns before the copy
            copies = [torch.empty(n, dtype=torch.float32, device=meta)
                      for n in _shard_numels(model, par, "step_grad_copies")]
        if adam is not None:
            adam.step()
        del copies


def _offload_step(model: nn.Module, par, tracer, offload) -> None:
    """The device allocations of ``HybridDeviceOptimizer.step`` (module docstring)."""
    from tracemem.offload import hdo_parameters, offload_split

    split = offload_split(hdo_parameters(model, par), offload.fraction)
    meta = torch.device("meta")
    bf16_grads = par.precision_spec.grad_bytes == 2
    with tracer:
        if bf16_grads:
            # _set_sub_optimizer_grads: fp32_param.grad = grad.to(fp32), the new copy made
            # before the assignment frees the previous step's (held in static memory)
            for n in split.device:
                replaced = torch.empty(n, dtype=torch.float32, device=meta)
                del replaced
            # the D2H copies: each bf16 grad converted on the device first
            for n in split.host:
                converted = torch.empty(n, dtype=torch.float32, device=meta)
                del converted
        # gpu_optimizer.step (TE FusedAdam: in place), then the host steps, each followed by
        # param_copy_back_gpu_hook: the fp32 host master through an fp32 device temporary
        for n in split.host:
            staged = torch.empty(n, dtype=torch.float32, device=meta)
            del staged
