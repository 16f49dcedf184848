"""Megatron's full-recompute methods on a built rank: ``--recompute-method uniform|block``
with ``--recompute-num-layers N``.

Megatron-LM, megatron/core/transformer/transformer_block.py,
``TransformerBlock._checkpointed_forward`` (one ``TransformerBlock`` per model chunk):

- ``uniform``: the chunk's layers in groups of N, each group one checkpoint (only the group's
  input is kept; the group is recomputed in backward). N = 1 is every layer on its own,
  ``Block.set_recompute("full")``.
- ``block``: the first N layers of the chunk each checkpointed, the rest not recomputed.

Both as megatron/core/recompute.py ``checkpointed_forward`` (``chunk_runner``) does them at
Megatron-LM d98e8a6. Applied from outside the modules: ``block`` sets each layer's own
recompute; ``uniform`` with N > 1 makes the group's first layer run the whole group under one
checkpoint and the others pass their input through when called outside it (the layers, their
parameters and module paths stay as built). The checkpoint is Megatron-Core's reentrant
``tensor_parallel.checkpoint`` under a Megatron kernel profile (``modeling.common.checkpoint.
megatron_checkpoint``, with ``--distribute-saved-activations`` as the layers were set: the
group's input kept as 1/TP), else ``torch.utils.checkpoint`` non-reentrant.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from modeling.common.checkpoint import megatron_checkpoint
from tracemem.errors import TracememError

__all__ = ["RECOMPUTE_METHODS", "apply_recompute_method", "check_recompute_method"]

RECOMPUTE_METHODS = ("uniform", "block")


def check_recompute_method(recompute: str, method: str, num_layers: int) -> None:
    """Raises:
        TracememError: an unknown method, a non-positive N, or a method other than the
            default (uniform, 1) without --recompute full (Megatron: recompute_method applies
            to recompute_granularity full only).
    """
    if method not in RECOMPUTE_METHODS:
        raise TracememError(f"--recompute-method {method!r} is invalid; choose one of "
                            f"{', '.join(RECOMPUTE_METHODS)}")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0 \
            or (method == "uniform" and num_layers == 0):
        raise TracememError(f"--recompute-num-layers {num_layers!r} must be a positive "
                            f"integer (or 0 with --recompute-method block)")
    if recompute != "full" and (method, num_layers) != ("uniform", 1):
        raise TracememError(f"--recompute-method {method} --recompute-num-layers {num_layers} "
                            f"applies to --recompute full, not --recompute {recompute}")


def apply_recompute_method(model: torch.nn.Module, method: str, num_layers: int) -> None:
    """Set up ``model`` (a ``modeling.common.model.Transformer`` whose layers were set to full
    recompute) for ``method`` with N = ``num_layers``, chunk by chunk."""
    for chunk in model.chunks:
        layers = [model.layers[str(i)] for i in chunk]
        if method == "block":
            for j, layer in enumerate(layers):
                if j >= num_layers:
                    layer.set_recompute("none")
            continue
        if num_layers == 1:
            continue
        for start in range(0, len(layers), num_layers):
            _group(layers[start:start + num_layers])


def _group(layers: list) -> None:
    distribute = layers[0].distribute  # as Block.set_recompute("full", ...) left it
    for layer in layers:
        layer.set_recompute("none")
    if len(layers) == 1:
        layers[0].set_recompute("full", distribute_saved_activations=distribute is not None)
        return
    inside = [False]
    real = [type(layer).forward for layer in layers]

    def run(h, routing):
        inside[0] = True
        try:
            for layer in layers:
                h = layer(h, routing)
        finally:
            inside[0] = False
        return h

    def forward_of(index: int):
        layer = layers[index]

        def forward(h, routing):
            if inside[0]:
                return real[index](layer, h, routing)
            if index == 0:
                if layer.kernels.orchestration == "megatron":  # CheckpointFunction
                    return megatron_checkpoint(run, distribute, h, routing)
                return checkpoint(run, h, routing, use_reentrant=False)
            return h  # ran inside the group's checkpoint
        return forward

    for index, layer in enumerate(layers):
        layer.forward = forward_of(index)
