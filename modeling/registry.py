"""The model families tracemem knows, by Hugging Face ``model_type`` (and "gpt", Megatron-LM's
GPTModel, whose config files are tracemem's own field names), and ``load_config``.

One line per ``model_type``: the family module that reads it (``modeling/families/<name>/
config.py``: its key table ``HF_KEYS``, the keys it checks ``CHECKED`` or tolerates
``TOLERATED``, ``config_from_dict``, its ``PRESETS``). A config whose ``model_type`` has no
family, or that carries a key another family reads and this one does not (``q_lora_rank`` in a
Llama config), is refused: one line naming the key, the value and the families known.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from modeling.common.config import ModelConfig, parse_json, require_object, show
from modeling.families.deepseek import config as deepseek
from modeling.families.gpt import config as gpt
from modeling.families.llama import config as llama
from modeling.families.mixtral import config as mixtral
from modeling.families.qwen import config as qwen
from modeling.families.qwen2_moe import config as qwen2_moe
from modeling.families.qwen3_moe import config as qwen3_moe
from tracemem.errors import TracememError

__all__ = ["FAMILIES", "PRESETS", "load_config", "config_from_dict", "family_of"]

# Hugging Face model_type (or "gpt": Megatron's GPTModel) -> the family module that reads it.
FAMILIES = {
    "deepseek_v2": deepseek,
    "deepseek_v3": deepseek,
    "llama": llama,
    "qwen2": qwen,
    "qwen3": qwen,
    "qwen3_moe": qwen3_moe,
    "qwen2_moe": qwen2_moe,
    "mixtral": mixtral,
    "gpt": gpt,
}

PRESETS = tuple(p for family in dict.fromkeys(FAMILIES.values()) for p in family.PRESETS)


def _known() -> str:
    return ", ".join(FAMILIES)


def _keys(family) -> set[str]:
    return set(family.HF_KEYS) | set(family.CHECKED) | set(family.TOLERATED)


def family_of(data: dict[str, Any], source: str):
    """The family module of config dict ``data``.

    Raises:
        TracememError: ``model_type`` missing or with no family; a key of another family.
    """
    require_object(data, source)
    model_type = data.get("model_type")
    if model_type not in FAMILIES:
        what = ("has no model_type" if "model_type" not in data else
                f"model_type={show(model_type)} has no family in tracemem")
        raise TracememError(f"{source}: {what}; families known: {_known()}")
    family = FAMILIES[model_type]
    mine = _keys(family)
    for key, value in data.items():
        if key in mine or value is None:
            continue
        owners = [t for t, f in FAMILIES.items() if f is not family and key in f.HF_KEYS]
        if owners:
            raise TracememError(
                f"{source}: {key}={show(value)} contradicts model_type {model_type!r} (it is "
                f"a key of {', '.join(owners)}); families known: {_known()}")
    return family


def config_from_dict(data: dict[str, Any], source: str) -> ModelConfig:
    """The ``ModelConfig`` of Hugging Face config dict ``data`` (from file ``source``), read
    by its family.

    Raises:
        TracememError: see ``family_of`` and the family's ``config_from_dict``.
    """
    return family_of(data, source).config_from_dict(data, source)


def load_config(model: str | Path) -> ModelConfig:
    """A preset name (``PRESETS``), the path of a Hugging Face ``config.json``, or a folder
    holding one.

    Raises:
        TracememError: unknown preset and no such file, unreadable or malformed JSON, or any
            error of ``config_from_dict``.
    """
    name = str(model)
    for family in dict.fromkeys(FAMILIES.values()):
        if name in family.PRESETS:
            text = resources.files(family.PRESET_PACKAGE).joinpath(f"{name}.json").read_text()
            return config_from_dict(json.loads(text), name)
    path = Path(name)
    if path.is_dir() and (path / "config.json").is_file():  # a Hugging Face model folder
        path = path / "config.json"
    if not path.is_file():
        raise TracememError(f"--model {name!r} is neither a preset ({', '.join(PRESETS)}) nor "
                            f"a config.json file (or a folder holding one)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise TracememError(f"{path}: cannot read: {error}") from None
    return config_from_dict(parse_json(text, str(path)), str(path))
