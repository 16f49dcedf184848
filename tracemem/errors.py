"""Error types raised by tracemem for problems in the user's input or model."""

from __future__ import annotations

__all__ = ["TracememError", "MissingMetaKernelError", "DataDependentOpError",
           "FusedOptimizerError", "divisors_hint"]


class TracememError(ValueError):
    """A user error: bad configuration, flag or argument. The message names the parameter, the
    value given and what would be valid. The CLI prints it on one line and exits with code 2."""


class MissingMetaKernelError(TracememError):
    """An operator has no meta (fake) kernel, so it cannot run on the meta device.

    The message names the operator and shows how to register a fake kernel with
    ``torch.library.register_fake``, which is all tracemem needs to trace a layer whose real
    kernel is not written yet.
    """


class DataDependentOpError(TracememError):
    """An operator needs tensor values, which the meta device does not have: it reads a value
    (``Tensor.item()``, ``bool(t)`` as in ``if (mask == 0).any():``, ``int(t)``), makes an
    output whose shape depends on values (``nonzero``, ``masked_select``, boolean-mask
    indexing, ``unique``, ``bincount``) or copies values to the host (``.tolist()``,
    ``.cpu()``).

    The one-line message names the operator, the module path that ran it and how to make the
    step shape-static (a routing model for token counts, a static output size, or a
    ``torch.library`` custom op with ``register_fake``).
    """


class FusedOptimizerError(TracememError):
    """A fused optimizer (``torch.optim.Adam(fused=True)`` and the like) steps parameters on
    the meta device, which its fused kernels do not support. The message names the optimizer
    and the way out (``foreach=True``)."""


def divisors_hint(n: int, limit: int = 8, also: int | None = None) -> str:
    """The first ``limit`` divisors of ``n``, for "try ..." in an error message; with
    ``also`` (a positive int, such as the world size), only those that divide it too, where
    there are any. The search stops at 2^20, so a huge ``n`` cannot stall the message."""
    if isinstance(also, int) and not isinstance(also, bool) and also > 0 and n > 0:
        both = [d for d in range(1, min(n, also, 2**20) + 1) if n % d == 0 and also % d == 0]
        if both:
            shown = both[:limit]
            return ", ".join(map(str, shown)) + (", ..." if len(both) > limit else "")
    found = []
    for d in range(1, min(n, 2**20) + 1):
        if n % d == 0:
            found.append(d)
            if len(found) == limit:
                return ", ".join(map(str, found)) + ", ..."
    return ", ".join(map(str, found))
