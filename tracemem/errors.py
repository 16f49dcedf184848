"""Error types raised by tracemem for problems in the user's input or model."""

from __future__ import annotations

__all__ = ["TracememError", "MissingMetaKernelError", "divisors_hint"]


class TracememError(ValueError):
    """A user error: bad configuration, flag or argument. The message names the parameter, the
    value given and what would be valid. The CLI prints it on one line and exits with code 2."""


class MissingMetaKernelError(TracememError):
    """An operator has no meta (fake) kernel, so it cannot run on the meta device.

    The message names the operator and shows how to register a fake kernel with
    ``torch.library.register_fake``, which is all tracemem needs to trace a layer whose real
    kernel is not written yet.
    """


def divisors_hint(n: int, limit: int = 8) -> str:
    """The first ``limit`` divisors of ``n``, for "try ..." in an error message. The search
    stops at 2^20, so a huge ``n`` cannot stall the message."""
    found = []
    for d in range(1, min(n, 2**20) + 1):
        if n % d == 0:
            found.append(d)
            if len(found) == limit:
                return ", ".join(map(str, found)) + ", ..."
    return ", ".join(map(str, found))
