"""Deferred weight gradients of the TE kernels (TE's ``delay_wgrad_compute``), for the
zero-bubble and DualPipe schedules' W steps.

TransformerEngine d0067d0 ``module/linear.py`` ``_Linear.backward``: when the module's
``wgrad_store`` delays the weight gradient, the backward stores ``[inputmat_total,
grad_output]`` (the gathered input under sequence parallelism, and the output gradient) with
the wgrad GEMM and returns no weight gradient; ``backward_dw()`` runs it later
(``module/base.py``). ``module/grouped_linear.py`` does the same with its inputs and output
gradient. Here: while a ``delayed_wgrad(store)`` block is active, the TE kernels put the
tensors the wgrad needs into ``store`` instead of freeing them; ``run_delayed_wgrad(store)`` is
the W step: it allocates each weight gradient (none with gradient-accumulation fusion: it goes
into ``main_grad``) and drops the stored tensors.

Checkpoints whose backward runs its own backward (Megatron's reentrant ``CheckpointFunction``
and ``CheckpointWithoutOutput``, ``modeling.common.checkpoint``) call ``inner_backward``
instead of ``torch.autograd.backward``: outside an I step it is that call; inside one
(``split_inner(run)``, which ``tracemem.split_backward.backward_input`` enters) ``run`` does
the recomputed graph's backward as an I step too, its Linear weight gradients deferred into
the same W step. The modeling package names no tracemem module: the split hands itself in.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["delayed_wgrad", "current_store", "run_delayed_wgrad", "split_inner",
           "inner_backward", "KernelStore", "share_storage", "recomputed_twin"]

_STORES: list[list] = []
_SPLITS: list[Callable] = []


def share_storage(output: Tensor, recomputed: Tensor) -> None:
    """Megatron-LM d98e8a6 tensor_parallel/random.py ``CheckpointWithoutOutput._recompute``:
    ``share_storage(output, recomputation_output)`` makes the discarded output's storage
    point at the recomputed data, so whoever holds the output (its consumer's saved tensor, a
    deferred weight gradient) holds those bytes. The tracer counts them on ``recomputed``'s
    storage: this records, weakly (it keeps nothing alive), which tensor that is."""
    output.untyped_storage()._tracemem_recomputed = weakref.ref(recomputed)


def recomputed_twin(t: Tensor) -> Tensor | None:
    """The recomputed tensor whose data ``t``'s storage now holds (``share_storage``), if it
    is still alive, detached (the same storage; not its graph, which holds the checkpoint's
    inputs: the real ``share_storage`` keeps the data only); else None."""
    ref = getattr(t.untyped_storage(), "_tracemem_recomputed", None)
    twin = None if ref is None else ref()
    return None if twin is None else twin.detach()


class KernelStore(list):
    """The TE kernels' deferred weight gradients of one W step: ``(tensors, weights,
    fuse_wgrad)`` each. A kept tensor whose storage holds a recomputed output's data
    (``share_storage``) is kept with that output, as its bytes are."""

    def append(self, item) -> None:
        tensors, weights, fuse_wgrad = item
        twins = [twin for twin in map(recomputed_twin, tensors) if twin is not None]
        # detached aliases (same storages): holding the kernel's own tensor objects would
        # hide the hold from the tracer's emulation of the engine's in-place gradient sums
        # (tracemem.tracer _is_engine_inplace_sum counts TensorImpl and storage references;
        # a second Python reference to the same object adds neither), which then gave a
        # later sum the record of a storage W still holds (counted freed in I). The real
        # engine sums out of place here: TE's store holds the tensor (use_count > 1)
        super().append((tuple(t.detach() for t in tensors) + tuple(twins), weights,
                        fuse_wgrad))


@contextmanager
def delayed_wgrad(store: list) -> Iterator[list]:
    """TE kernels' weight gradients run inside this block go into ``store``."""
    _STORES.append(store)
    try:
        yield store
    finally:
        _STORES.pop()


def current_store() -> list | None:
    """The active store, or None (weight gradients are computed in the backward)."""
    return _STORES[-1] if _STORES else None


def run_delayed_wgrad(store: list) -> None:
    """W: each stored weight gradient (``(tensors, weights, fuse_wgrad)``), then free the
    stored tensors."""
    while store:
        tensors, weights, fuse_wgrad = store.pop(0)
        grads = [] if fuse_wgrad else [torch.empty_like(w) for w in weights]
        del tensors, grads


@contextmanager
def split_inner(run: Callable) -> Iterator[None]:
    """Inside this block ``inner_backward(outputs, grads, inputs)`` calls ``run`` with the
    same arguments (an I step's backward of a recomputed graph)."""
    _SPLITS.append(run)
    try:
        yield
    finally:
        _SPLITS.pop()


def inner_backward(outputs: Sequence[Tensor], grads: Sequence[Tensor | None],
                   inputs: Sequence[Tensor]) -> None:
    """The backward a reentrant checkpoint runs on the graph its recomputation built:
    ``torch.autograd.backward(outputs, grads)`` (tensor_parallel/random.py
    ``CheckpointFunction.backward`` / ``CheckpointWithoutOutputFunction.backward``), or, in
    an I step, the split's ``run``, which must leave each of ``inputs`` (the detached
    checkpoint inputs) with its ``.grad`` as that call would."""
    if _SPLITS:
        # a checkpoint nested in this one comes back here, into the same I step
        _SPLITS[-1](list(outputs), list(grads), list(inputs))
        return
    torch.autograd.backward(list(outputs), list(grads))
