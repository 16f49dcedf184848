"""Issue 26: an interrupt (any ``BaseException``) that lands while a model is built or traced
leaves torch's global state as it was (``tracemem.torch_state.preserved_torch_state``).

Reference: what a ``with`` statement cut inside its ``__enter__`` leaves behind (grad mode off,
a device or dispatch mode pushed, hooks registered), made here by hand at the point a
``KeyboardInterrupt`` would land, and torch's own getters for the state afterwards.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.modules.module as module_hooks
from torch.utils._python_dispatch import TorchDispatchMode

import tracemem.examples as examples
from tracemem.examples import ToyConfig, trace_toy
from tracemem.torch_state import preserved_torch_state

SMALL = ToyConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=16,
                  vocab_size=64, dtype="float32")


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _leave_everything_changed():
    """What an interrupt inside ``__enter__``s leaves: each change made, none undone."""
    torch.set_grad_enabled(False)
    torch.device("meta").__enter__()  # the default device, a function mode
    _Mode().__enter__()  # a dispatch mode (MemoryTracer is one)
    torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t).__enter__()
    module_hooks.register_module_forward_hook(lambda *a: None)
    torch.set_default_dtype(torch.float64)
    raise KeyboardInterrupt


def _state():
    return (torch.is_grad_enabled(), str(torch.get_default_device()),
            torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack(),
            torch._C._autograd._top_saved_tensors_default_hooks(True),
            len(module_hooks._global_forward_hooks), torch.get_default_dtype())


def test_state_is_restored_after_an_interrupt():
    before = _state()
    assert before[:2] == (True, "cpu")
    with pytest.raises(KeyboardInterrupt):
        with preserved_torch_state():
            _leave_everything_changed()
    assert _state() == before


def test_an_interrupt_while_the_toy_builds_leaves_later_traces_working(monkeypatch):
    reference = trace_toy(SMALL).peak_bytes
    before = _state()

    def interrupted(cfg):
        _leave_everything_changed()

    monkeypatch.setattr(examples, "ToyTransformer", interrupted)
    with pytest.raises(KeyboardInterrupt):
        trace_toy(SMALL)
    monkeypatch.undo()
    assert _state() == before
    assert trace_toy(SMALL).peak_bytes == reference  # the next call in the process (a notebook)
