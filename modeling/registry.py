"""The model families tracemem knows, by Hugging Face ``model_type``, and ``load_config``.

One line per ``model_type``: the family module whose config loader reads it (its key table and
presets live in ``modeling/families/<name>/``).
"""

from __future__ import annotations

from pathlib import Path

from modeling.families.deepseek import config as deepseek

__all__ = ["FAMILIES", "PRESETS", "load_config"]

# Hugging Face model_type -> the family that reads it.
FAMILIES = {
    "deepseek_v2": deepseek,
    "deepseek_v3": deepseek,
}

PRESETS = deepseek.PRESETS


def load_config(model: str | Path):
    """A preset name (``PRESETS``), the path of a Hugging Face ``config.json``, or a folder
    holding one, as a ``ModelConfig`` (see the family's ``load_config``).

    Raises:
        TracememError: see ``modeling.families.deepseek.config.load_config``.
    """
    return deepseek.load_config(model)
