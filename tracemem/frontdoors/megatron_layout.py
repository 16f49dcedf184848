"""Megatron-LM's pipeline layouts in tracemem's terms: decoder layers per virtual stage.

- ``--pipeline-model-parallel-layout``: Megatron-Core's layout string
  (megatron/core/transformer/pipeline_parallel_layer_layout.py at d98e8a6,
  ``PipelineParallelLayerLayout.parse_str_to_list`` and ``validate_layer_layout``): virtual
  stages separated by ``|`` in virtual-stage order (stage ``v = vpp_rank * pp + pp_rank``),
  ``E`` embedding, ``t`` decoder layer, ``m`` MTP layer, ``L`` loss; commas are cosmetic;
  ``(...)*n`` and ``x*n`` repeat. "Et*3|(tt|)*29,m|L" is [E t t t], [t t] x 29, [m], [L].
- ``--decoder-first/last-pipeline-num-layers`` with virtual stages: Megatron's
  ``get_num_layers_to_build`` (megatron/core/transformer/transformer_block.py): the first
  (last) pipeline rank holds the given layers, the others share the rest, and each rank's
  layers split evenly over its virtual stages.

tracemem builds the embedding on the first virtual stage and the loss, head and MTP layers on
the last; a layout that puts them elsewhere is refused by name.
"""

from __future__ import annotations

import re

from tracemem.errors import TracememError

__all__ = ["parse_layout_string", "format_layout_string", "uneven_virtual_layout",
           "moe_layer_fields", "moe_pattern_text"]

_FLAG = "--pipeline-model-parallel-layout"
# Megatron-Core's two unrolling patterns (parse_str_to_list), applied in this order
_REPEATS = (re.compile(r"\(([^)]+)\)\*(\d+)"), re.compile(r"(.)\*(\d+)"))
_MAX_STAGES = 4096


def _unroll(text: str) -> str:
    text = text.replace(",", "")
    for pattern in _REPEATS:
        def repeat(match):
            count = int(match.group(2))
            if count > _MAX_STAGES:
                raise TracememError(f"{_FLAG} {text!r} repeats {count} times; too many")
            return match.group(1) * count
        text = pattern.sub(repeat, text)
    return text


def parse_layout_string(text: str, pp: int, num_layers: int,
                        mtp_num_layers: int) -> tuple[tuple[int, ...], int]:
    """``(decoder layers per virtual stage, vpp)`` of a layout string on ``pp`` pipeline ranks,
    with Megatron-Core's checks (``validate_layer_layout``: embedding first and loss last,
    each once; ``num_layers`` decoder layers; ``mtp_num_layers`` MTP layers after every
    decoder layer) and tracemem's (the embedding in the first virtual stage, the loss and the
    MTP layers in the last).

    Raises:
        TracememError: an unknown character, a stage count that PP does not divide, or a
            check above, naming the flag and the layout.
    """
    where = f"{_FLAG} {text!r}"
    stages = [list(stage) for stage in _unroll(text).split("|")]
    for stage in stages:
        for char in stage:
            if char not in "ELtm":
                raise TracememError(f"{where}: invalid layer character {char!r}; known: E "
                                    f"(embedding), t (decoder layer), m (MTP layer), L (loss)")
    if len(stages) > _MAX_STAGES:
        raise TracememError(f"{where}: {len(stages)} stages; at most {_MAX_STAGES}")
    if len(stages) % pp:
        raise TracememError(f"{where}: {len(stages)} virtual stages do not divide by "
                            f"--pipeline-model-parallel-size {pp} (Megatron's validate_args)")
    flat = [char for stage in stages for char in stage]
    if not flat or flat[0] != "E" or flat.count("E") != 1:
        raise TracememError(f"{where}: the embedding E must come first, once "
                            f"(Megatron-Core validate_layer_layout)")
    if flat[-1] != "L" or flat.count("L") != 1:
        raise TracememError(f"{where}: the loss L must come last, once "
                            f"(Megatron-Core validate_layer_layout)")
    decoders = flat.count("t")
    if decoders != num_layers:
        raise TracememError(f"{where} holds {decoders} decoder layers (t); --num-layers is "
                            f"{num_layers} (Megatron-Core validate_layer_layout)")
    mtps = flat.count("m")
    if mtps != mtp_num_layers:
        raise TracememError(f"{where} holds {mtps} MTP layers (m); --mtp-num-layers is "
                            f"{mtp_num_layers} (Megatron-Core validate_layer_layout)")
    if mtps and "t" in flat[flat.index("m"):]:
        raise TracememError(f"{where}: decoder layers must come before the MTP layers "
                            f"(Megatron-Core validate_layer_layout)")
    if "E" not in stages[0]:
        raise TracememError(f"{where}: the embedding is in virtual stage "
                            f"{_stage_of(stages, 'E')}; not modelled yet: tracemem builds it "
                            f"on the first virtual stage")
    if "L" not in stages[-1]:
        raise TracememError(f"{where}: the loss is in virtual stage {_stage_of(stages, 'L')} "
                            f"of {len(stages)}; not modelled yet: tracemem builds the head and "
                            f"loss on the last virtual stage")
    if mtps and stages[-1].count("m") != mtps:
        raise TracememError(f"{where}: MTP layers outside the last virtual stage (a standalone "
                            f"MTP stage); not modelled yet: tracemem builds them with the loss")
    return tuple(stage.count("t") for stage in stages), len(stages) // pp


def _stage_of(stages: list[list[str]], char: str) -> int:
    return next(i for i, stage in enumerate(stages) if char in stage)


def format_layout_string(layout: tuple[int, ...], mtp_num_layers: int = 0) -> str:
    """Decoder layers per virtual stage -> a layout string (runs of equal stages as
    ``(t*n|)*k``), the inverse of ``parse_layout_string``: ``(3, 2, 2, 1)`` with one MTP
    layer -> ``"Et*3|(t*2|)*2t,mL"``."""
    parts = []
    for v, n in enumerate(layout):
        body = ("E" if v == 0 else "") + ("t" * n if n < 3 else f"t*{n}")
        if v == len(layout) - 1:
            body += ("," if n else "") + "m" * mtp_num_layers + "L"
        parts.append(body)
    # runs of equal middle stages as (tt|)*k
    out: list[str] = []
    i = 0
    while i < len(parts):
        if 0 < i < len(parts) - 1:
            j = i
            while j + 1 < len(parts) - 1 and parts[j + 1] == parts[i]:
                j += 1
            if j > i:
                out.append(f"({parts[i]}|)*{j - i + 1}")
                i = j + 1
                continue
        out.append(parts[i] + ("|" if i < len(parts) - 1 else ""))
        i += 1
    return "".join(out)


def uneven_virtual_layout(num_layers: int, pp: int, vpp: int, first: int | None,
                          last: int | None) -> tuple[int, ...]:
    """Decoder layers per virtual stage for Megatron's uneven first / last pipeline ranks
    with ``vpp`` virtual stages per rank (``get_num_layers_to_build``).

    Raises:
        TracememError: Megatron's assertions: the rest not divisible by the middle ranks, or a
            rank's layers not divisible by ``vpp``.
    """
    rest, others = num_layers, pp
    for value in (first, last):
        if value is not None:
            rest -= value
            others -= 1
    if rest < 0 or (others > 0 and rest % others):
        raise TracememError(
            f"--decoder-first-pipeline-num-layers {first} / --decoder-last-pipeline-num-layers "
            f"{last} leave {rest} of {num_layers} layers for {others} middle pipeline ranks; "
            f"Megatron asserts the left over layers divide by the left over stages "
            f"(get_num_layers_to_build)")
    per = rest // others if others > 0 else 0
    per_rank = [per] * pp
    if first is not None:
        per_rank[0] = first
    if last is not None:
        per_rank[-1] = last
    for p, n in enumerate(per_rank):
        if n % vpp:
            raise TracememError(f"pipeline rank {p} holds {n} layers, which do not divide into "
                                f"{vpp} virtual stages (Megatron's get_num_layers_to_build "
                                f"asserts it)")
    return tuple(per_rank[v % pp] // vpp for v in range(pp * vpp))


def moe_layer_fields(freq, num_layers: int, mtp_num_layers: int) -> dict:
    """``ModelConfig`` fields for Megatron's ``--moe-layer-freq`` (megatron/core/models/gpt/
    gpt_layer_specs.py: an int N makes layer i MoE when i % N == 0; a list gives each layer,
    1 MoE, 0 dense, and must have ``num_layers`` entries), with the MTP layers (global ids
    ``num_layers + k``) built like the last decoder layer (``get_gpt_mtp_block_spec``: the
    block spec's last layer): ``first_k_dense_replace`` (the leading dense layers),
    ``moe_layer_freq`` and ``mlp_only_layers`` (every other dense layer).

    Raises:
        TracememError: a list of the wrong length or with values other than 0 and 1.
    """
    if isinstance(freq, int):
        if freq < 1:
            raise TracememError(f"--moe-layer-freq {freq} must be a positive integer or a "
                                f"pattern such as ([0]*3+[1]*58)")
        pattern = [1 if i % freq == 0 else 0 for i in range(num_layers)]
    else:
        pattern = list(freq)
        if len(pattern) != num_layers:
            raise TracememError(f"--moe-layer-freq has {len(pattern)} entries; --num-layers is "
                                f"{num_layers} (Megatron asserts one per layer: "
                                f"gpt_layer_specs.py)")
        if set(pattern) - {0, 1}:
            raise TracememError(f"--moe-layer-freq entries must be 0 (dense) or 1 (MoE); got "
                                f"{sorted(set(pattern) - {0, 1})}")
    mtp = [pattern[-1] if pattern else 1] * mtp_num_layers
    full = pattern + mtp
    if isinstance(freq, int) and all(
            full[i] == (1 if i % freq == 0 else 0) for i in range(len(full))):
        return {"first_k_dense_replace": 0, "moe_layer_freq": freq, "mlp_only_layers": ()}
    leading = next((i for i, v in enumerate(full) if v == 1), len(full))
    return {"first_k_dense_replace": leading, "moe_layer_freq": 1,
            "mlp_only_layers": tuple(i for i in range(leading, len(full)) if full[i] == 0)}


def moe_pattern_text(pattern: list[int]) -> str:
    """A per-layer 0 / 1 list as Megatron's expression: runs as ``[v]*n`` joined by ``+``
    (``[0, 0, 0, 1, 1]`` -> ``"([0]*3+[1]*2)"``)."""
    runs: list[list[int]] = []
    for value in pattern:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([value, 1])
    return "(" + "+".join(f"[{v}]*{n}" if n > 1 else f"[{v}]" for v, n in runs) + ")"
