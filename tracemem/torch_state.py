"""``preserved_torch_state``: torch's process-wide state as it was, after a call that builds or
traces a model, however that call ends.

Tracing changes global state for its duration: grad mode (``torch.no_grad`` inside
``nn.init``), the default device (``with torch.device("meta")`` is a function mode on torch's
mode stack), dispatch modes (``MemoryTracer`` is a ``TorchDispatchMode``), saved-tensor hooks
(``torch.autograd.graph.saved_tensors_hooks``), and global module and optimizer hooks
(``register_module_forward_hook``, ``register_optimizer_step_pre_hook``). Their context
managers restore it on the way out, except when a ``KeyboardInterrupt`` (or any
``BaseException``) lands inside an ``__enter__`` or ``__exit__`` itself: then a ``with``
statement never gets to undo it, and every later estimate in the same process (a notebook)
runs, for example, with grad mode off. This context manager records the state on entry and,
in ``finally``, pops what was pushed since and sets back what was changed.

Example::

    with preserved_torch_state():
        tracer = trace_toy(cfg)   # Ctrl-C here leaves grad mode, modes and hooks as they were

Known limitations: it restores state kept in torch's Python-visible globals and mode stacks
(the list above, plus the default dtype); state a C++ extension keeps elsewhere is not seen.
The saved-tensor hooks are popped until the top is the one seen on entry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.modules.module as _module
import torch.optim.optimizer as _optimizer

__all__ = ["preserved_torch_state"]

# the global hook dicts of torch.nn.modules.module and torch.optim.optimizer (handle id -> hook)
_HOOK_DICTS = (
    (_module, "_global_forward_pre_hooks"), (_module, "_global_forward_hooks"),
    (_module, "_global_forward_hooks_always_called"),
    (_module, "_global_forward_hooks_with_kwargs"), (_module, "_global_backward_pre_hooks"),
    (_module, "_global_backward_hooks"), (_module, "_global_module_registration_hooks"),
    (_module, "_global_parameter_registration_hooks"),
    (_module, "_global_buffer_registration_hooks"),
    (_optimizer, "_global_optimizer_pre_hooks"), (_optimizer, "_global_optimizer_post_hooks"),
)


def _top_saved_hooks():
    return torch._C._autograd._top_saved_tensors_default_hooks(True)


@contextlib.contextmanager
def preserved_torch_state() -> Iterator[None]:
    """Record grad mode, the default device and dtype, the dispatch and function mode stacks'
    depths, the top saved-tensor hooks and the global hooks; restore them all in ``finally``
    (module docstring)."""
    grad = torch.is_grad_enabled()
    dtype = torch.get_default_dtype()
    dispatch_depth = torch._C._len_torch_dispatch_stack()
    function_depth = torch._C._len_torch_function_stack()
    device = torch.get_default_device()
    saved_hooks = _top_saved_hooks()
    hooks = {(owner, name): set(getattr(owner, name))
             for owner, name in _HOOK_DICTS if hasattr(owner, name)}
    try:
        yield
    finally:
        while torch._C._len_torch_dispatch_stack() > dispatch_depth:
            torch._C._pop_torch_dispatch_stack(None)  # None: a user mode, not an infra one
        while torch._C._len_torch_function_stack() > function_depth:
            torch._C._pop_torch_function_stack()
        for _ in range(64):  # a bound: each pop removes one pushed pair
            top = _top_saved_hooks()
            if top is None or top == saved_hooks:
                break
            torch._C._autograd._pop_saved_tensors_default_hooks()
        for (owner, name), keys in hooks.items():
            table = getattr(owner, name)
            for key in [k for k in table if k not in keys]:
                del table[key]
        torch.set_grad_enabled(grad)
        torch.set_default_dtype(dtype)
        if torch.get_default_device() != device:
            torch.set_default_device(device)
