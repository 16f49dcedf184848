"""Collectives of one rank, as autograd Functions that allocate the buffers a real run
allocates, marked ``comm_buffer`` in the active ``MemoryTracer`` (Megatron's scatter to the
sequence-parallel region allocates nothing: a view of this rank's slice).

One process stands for one rank, so the data is not exchanged: an all-gather concatenates
``world`` copies of the local tensor, a reduce-scatter keeps a copy of this rank's slice, an
all-to-all returns an uninitialised buffer of the received size. Shapes, dtypes and lifetimes
are those of the real collective (Megatron-Core ``tensor_parallel/mappings.py``:
``gather_from_sequence_parallel_region`` backward is a reduce-scatter and vice versa;
``moe/token_dispatcher.py``: the all-to-all's backward is the reverse all-to-all). NCCL's own
internal buffers are below the dispatcher and not counted.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from tracemem.categories import Category
from tracemem.tracer import MemoryTracer

__all__ = ["all_gather", "reduce_scatter", "scatter_to_sequence_parallel", "all_to_all"]


# the collective whose stand-in ops run now: modeling.common.sac's op policy saves the
# outputs of a forward reduce-scatter's and all-to-all's, as torchtitan's SelectiveAC saves
# reduce_scatter_tensor and all_to_all_single
RUNNING: list[str] = []


@contextmanager
def _running(name: str):
    RUNNING.append(name)
    try:
        yield
    finally:
        RUNNING.pop()


def active_tracer() -> MemoryTracer | None:
    """The ``MemoryTracer`` tracing now, if any (it may sit below another mode: selective
    checkpointing's caching mode)."""
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, MemoryTracer):
            return mode
    return None


def _comm(t: Tensor) -> Tensor:
    tracer = active_tracer()
    if tracer is not None:
        tracer.tag(t, Category.COMM_BUFFER)
    return t


def _gather(x: Tensor, world: int, dim: int) -> Tensor:
    return _comm(torch.cat([x] * world, dim=dim))


def _scatter(x: Tensor, world: int, dim: int) -> Tensor:
    return _comm(x.narrow(dim, 0, x.shape[dim] // world).clone())


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, world: int, dim: int) -> Tensor:
        ctx.world, ctx.dim = world, dim
        return _gather(x, world, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _scatter(grad, ctx.world, ctx.dim), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, world: int, dim: int) -> Tensor:
        ctx.world, ctx.dim = world, dim
        with _running("reduce_scatter"):
            return _scatter(x, world, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _gather(grad, ctx.world, ctx.dim), None, None


class _ScatterToSequenceParallel(torch.autograd.Function):
    """Megatron-Core ``tensor_parallel/mappings.py`` ``_ScatterToSequenceParallelRegion``:
    ``_split_along_first_dim`` returns ``input_[offset:offset + n].contiguous()``, a slice of
    the first dimension of ``[s, b, h]``, contiguous already, so the same storage: the whole
    input stays alive while the slice does. Backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, world: int, dim: int) -> Tensor:
        ctx.world, ctx.dim = world, dim
        part = x.narrow(dim, 0, x.shape[dim] // world)
        # tracemem's (b, s, h) slices s contiguously only at b = 1; else a copy stands in
        return part if part.is_contiguous() else _comm(part.clone())

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _gather(grad, ctx.world, ctx.dim), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, rows_out: int) -> Tensor:
        ctx.rows_in = x.shape[0]
        with _running("all_to_all"):
            return _comm(x.new_empty((rows_out, *x.shape[1:])))

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _comm(grad.new_empty((ctx.rows_in, *grad.shape[1:]))), None


def all_gather(x: Tensor, world: int, dim: int) -> Tensor:
    """All-gather along ``dim`` over ``world`` ranks: output ``world`` times longer in ``dim``;
    its backward reduce-scatters. Identity when ``world`` is 1."""
    return x if world == 1 else _AllGather.apply(x, world, dim)


def reduce_scatter(x: Tensor, world: int, dim: int) -> Tensor:
    """Reduce-scatter along ``dim`` over ``world`` ranks: output ``world`` times shorter in
    ``dim``; its backward all-gathers. Identity when ``world`` is 1."""
    return x if world == 1 else _ReduceScatter.apply(x, world, dim)


def scatter_to_sequence_parallel(x: Tensor, world: int, dim: int) -> Tensor:
    """Megatron's ``scatter_to_sequence_parallel_region`` of ``x`` along ``dim``: this rank's
    slice as a view of ``x`` (``_ScatterToSequenceParallel``: nothing allocated, ``x`` kept
    alive by it; a copy where the slice is not contiguous, b > 1 in tracemem's (b, s, h)
    layout); its backward all-gathers. Identity when ``world`` is 1."""
    return x if world == 1 else _ScatterToSequenceParallel.apply(x, world, dim)


def all_to_all(x: Tensor, rows_out: int) -> Tensor:
    """All-to-all of ``x`` ``(rows_in, ...)``: this rank receives ``rows_out`` rows; the
    backward sends ``rows_out`` gradient rows and receives ``rows_in``."""
    return _AllToAll.apply(x, rows_out)
