"""Error types raised by tracemem for problems in the user's input or model."""

from __future__ import annotations

__all__ = ["TracememError", "MissingMetaKernelError"]


class TracememError(ValueError):
    """A user error: bad configuration, flag or argument. The message names the parameter, the
    value given and what would be valid. The CLI prints it on one line and exits with code 2."""


class MissingMetaKernelError(TracememError):
    """An operator has no meta (fake) kernel, so it cannot run on the meta device.

    The message names the operator and shows how to register a fake kernel with
    ``torch.library.register_fake``, which is all tracemem needs to trace a layer whose real
    kernel is not written yet.
    """
