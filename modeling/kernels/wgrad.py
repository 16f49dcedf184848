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
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["delayed_wgrad", "current_store", "run_delayed_wgrad"]

_STORES: list[list] = []


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
