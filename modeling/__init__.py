"""modeling: the model families' module graphs on the meta device, with Megatron-style sharding.

Package-level API (imported on first use, so ``import modeling.kernels`` stays light and no
import cycle with ``tracemem`` forms): ``load_config``, ``ModelConfig``, ``PRESETS``,
``build_model``; ``modeling.parallel.build_rank`` shards one rank.

Layout: ``common/`` (shared blocks), ``families/<name>/`` (config, key table, presets),
``registry.py`` (model_type -> family), ``kernels/`` (kernel profiles), ``parallel/`` (plans,
``build_rank``, collectives, pipeline p2p), ``params.py`` (parameter counts).
"""

from __future__ import annotations

import importlib

__all__ = ["load_config", "ModelConfig", "PRESETS", "build_model"]

_LAZY = {"load_config": "modeling.registry", "PRESETS": "modeling.registry",
         "ModelConfig": "modeling.common.config",
         "build_model": "modeling.common.model"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'modeling' has no attribute {name!r}")
