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

__all__ = ["FAMILIES", "PRESETS", "HF_REPOS", "MAX_EXPERT_MODULES", "load_config",
           "config_from_dict", "family_of", "preset_name", "check_model_size"]

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

# Hugging Face repository -> the preset holding its config.json (each preset's "_comment" names
# its source); --model takes either, and the repository's own name alone ("DeepSeek-V3"),
# without regard to case. DeepSeek-V3-Base, -0324 and DeepSeek-R1 publish the same config.json
# as DeepSeek-V3 (the same architecture and sizes).
HF_REPOS = {
    "deepseek-ai/DeepSeek-V3": "deepseek-v3",
    "deepseek-ai/DeepSeek-V3-Base": "deepseek-v3",
    "deepseek-ai/DeepSeek-V3-0324": "deepseek-v3",
    "deepseek-ai/DeepSeek-R1": "deepseek-v3",
    "deepseek-ai/DeepSeek-V2": "deepseek-v2",
    "deepseek-ai/DeepSeek-V2-Lite": "deepseek-v2-lite",
    "moonshotai/Moonlight-16B-A3B": "moonlight-16b-a3b",
    "meta-llama/Meta-Llama-3-8B": "llama-3-8b",
    "meta-llama/Meta-Llama-3-70B": "llama-3-70b",
    "meta-llama/Llama-3.1-405B": "llama-3.1-405b",
    "mistralai/Mixtral-8x7B-v0.1": "mixtral-8x7b",
    "Qwen/Qwen2.5-14B": "qwen2.5-14b",
    "Qwen/Qwen1.5-MoE-A2.7B": "qwen1.5-moe-a2.7b",
    "Qwen/Qwen3-30B-A3B": "qwen3-30b-a3b",
}

# Routed experts summed over the MoE layers (and MTP modules) above this are refused: each is
# a module to build on meta (about 1 ms each here), and 2^16 is four times DeepSeek-V3's 256 x
# 59 = 15,104.
MAX_EXPERT_MODULES = 2**16


def preset_name(name: str) -> str | None:
    """The preset ``name`` means: a preset, a Hugging Face repository of ``HF_REPOS`` or its
    name alone, in any case ("DeepSeek-V3", "deepseek-ai/DeepSeek-V3" -> "deepseek-v3"); or
    None."""
    if name in PRESETS:
        return name
    lower = name.strip().lower()
    for preset in PRESETS:
        if preset.lower() == lower:
            return preset
    for repo, preset in HF_REPOS.items():
        if lower in (repo.lower(), repo.split("/")[1].lower()):
            return preset
    return None


def check_model_size(cfg: ModelConfig) -> None:
    """What bounds the time to build a model beyond its config's own checks
    (``modeling.common.config``): the routed experts over all MoE layers and MTP modules at
    most ``MAX_EXPERT_MODULES``.

    Raises:
        TracememError: too many expert modules, naming the counts.
    """
    if not cfg.num_routed_experts:
        return
    layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers)) + cfg.num_mtp_modules
    total = cfg.num_routed_experts * layers
    if total > MAX_EXPERT_MODULES:
        raise TracememError(
            f"{cfg.name}: {cfg.num_routed_experts:,} routed experts x {layers} MoE layers = "
            f"{total:,} expert modules is more than {MAX_EXPERT_MODULES:,} (DeepSeek-V3 has "
            f"15,104); each is a module to build")


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
    cfg = family_of(data, source).config_from_dict(data, source)
    check_model_size(cfg)
    return cfg


def load_config(model: str | Path) -> ModelConfig:
    """A preset name (``PRESETS``; also in any case, or as its Hugging Face repository:
    ``preset_name``), the path of a Hugging Face ``config.json``, or a folder holding one.

    Raises:
        TracememError: unknown preset and no such file, unreadable or malformed JSON, or any
            error of ``config_from_dict``.
    """
    name = str(model)
    path = Path(name)
    if path.is_dir() and (path / "config.json").is_file():  # a Hugging Face model folder
        path = path / "config.json"
    preset = preset_name(name) if name in PRESETS or not path.is_file() else None
    if preset is not None:  # a file of that name is read only when it is no preset's
        family = next(f for f in dict.fromkeys(FAMILIES.values()) if preset in f.PRESETS)
        text = resources.files(family.PRESET_PACKAGE).joinpath(f"{preset}.json").read_text()
        return config_from_dict(json.loads(text), preset)
    if not path.is_file():
        import difflib

        names = {p.lower(): p for p in PRESETS}
        close = difflib.get_close_matches(name.lower(), names, n=1, cutoff=0.75)
        hint = (f"; did you mean {names[close[0]]!r}?" if close else
                "; tracemem reads no model hub: download the repository's config.json and "
                "give its path" if "/" in name and not name.startswith((".", "/")) else "")
        raise TracememError(f"--model {name!r} is neither a preset ({', '.join(PRESETS)}, or "
                            f"its Hugging Face repository) nor a config.json file (or a "
                            f"folder holding one){hint}")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise TracememError(f"{path}: cannot read: {error}") from None
    return config_from_dict(parse_json(text, str(path)), str(path))
