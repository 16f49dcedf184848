"""Pipeline point-to-point buffers of one stage, and Megatron's output deallocation.

A stage receives its input activation (and, in backward, the gradient of its output) into
freshly allocated buffers, and sends its output (and the gradient of its input). Megatron-LM
frees the data of a sent output at once and keeps only its autograd graph
(megatron/core/pipeline_parallel/schedules.py: ``deallocate_output_tensor``, on by default),
then runs backward on it with ``custom_backward`` (which skips the shape check). Receive
buffers are marked ``comm_buffer`` in the active ``MemoryTracer``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from modeling.parallel.collectives import _comm

__all__ = ["recv_forward", "send_forward", "recv_backward", "backward_from"]


def recv_forward(shape: tuple[int, ...], dtype: torch.dtype,
                 device: str | torch.device = "meta") -> Tensor:
    """The input activation received from the previous stage, e.g. ``(b, s / (cp * sp), h)``;
    it requires grad, so its gradient is what this stage sends back."""
    return _comm(torch.empty(shape, dtype=dtype, device=device)).requires_grad_()


def send_forward(output: Tensor, deallocate: bool = True) -> None:
    """Send ``output`` to the next stage; with ``deallocate`` (Megatron's default) its data is
    replaced by a 1-element tensor right away, keeping its autograd graph."""
    if deallocate:
        output.data = torch.empty((1,), dtype=output.dtype, device=output.device)


def recv_backward(shape: tuple[int, ...], dtype: torch.dtype,
                  device: str | torch.device = "meta") -> Tensor:
    """The gradient of this stage's output, received from the next stage."""
    return _comm(torch.empty(shape, dtype=dtype, device=device))


def backward_from(output: Tensor, grad: Tensor | None = None) -> None:
    """Backward from ``output`` (a loss when ``grad`` is None), even if its data was
    deallocated: like Megatron's ``custom_backward``, call the autograd engine directly."""
    if grad is None:
        grad = torch.ones_like(output)
    torch.autograd.Variable._execution_engine.run_backward(
        (output,), (grad,), keep_graph=False, create_graph=False, inputs=(),
        allow_unreachable=True, accumulate_grad=True)
