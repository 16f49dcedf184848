"""Memory categories and training-step phases, as ``str`` enums.

Modelled on ``torch.distributed._tools.mem_tracker._MemRefType`` and ``_ModState``: the enum
values are plain strings so they serialise to JSON unchanged.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Category", "Phase"]


class Category(str, Enum):
    """What a storage holds.

    A storage has one category for its whole life, decided by the end of the trace: a tensor
    that forward creates and autograd then saves is an ``ACTIVATION`` from its birth, a tensor
    that backward creates and that ends in a leaf's ``.grad`` is a ``GRADIENT``.
    """

    PARAMETER = "parameter"  # an nn.Module parameter
    BUFFER = "buffer"  # an nn.Module buffer (e.g. batch-norm running stats)
    INPUT = "input"  # a tracked tensor, or a storage first seen as an op input
    GRADIENT = "gradient"  # the .grad of a tracked parameter or input
    OPTIMIZER_STATE = "optimizer_state"  # a tensor held in optimizer.state
    ACTIVATION = "activation"  # saved for backward (saved_tensors_hooks pack hook)
    TEMPORARY = "temporary"  # anything else made inside the traced region
    COMM_BUFFER = "comm_buffer"  # communication buffer (set by collective wrappers)

    def __str__(self) -> str:
        return self.value


class Phase(str, Enum):
    """When an event happened."""

    EXTERNAL = "external"  # registered by track_external, before the step
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"  # forward ops re-run by torch.utils.checkpoint during backward
    OPTIMIZER = "optimizer"  # inside optimizer.step()
    OUTSIDE = "outside"  # a free that happened while the tracer was not entered

    def __str__(self) -> str:
        return self.value
