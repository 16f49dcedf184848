"""Named training setups as ``Job`` fields: ``tracemem estimate --recipe NAME`` /
``recipe_job(NAME, **overrides)``.

A recipe is a published job written down once, each field with the section of the source that
states it. The user's own flags (or keywords) override the recipe's values; the output says
which values came from the recipe (``Job.recipe_fields``).

Why ``recipe_job(name, **overrides)`` and not ``Job(recipe=name)``: a frozen dataclass cannot
tell a field left at its default from one given with the default's value, so ``Job(recipe=...,
recompute="none")`` could not be told from ``Job(recipe=...)``; the recipe's fields are merged
before the ``Job`` is built, and the ``Job`` records the recipe's name and the fields it set.

``deepseek-v3``: DeepSeek-V3 as trained (arXiv 2412.19437, "DeepSeek-V3 Technical Report",
sections 3.2-3.4), with deepseek-ai/DualPipe (3da1bbe) for the schedule. Where the paper is
silent the value is an assumption, named as one in ``RECIPES[...].assumptions`` (or, for a
kernel option's element, ``option_assumptions``, listed while the option is on).

Errors: an unknown recipe name is a ``TracememError`` naming the choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tracemem.errors import TracememError

__all__ = ["Recipe", "RECIPES", "recipe_fields", "recipe_job"]


@dataclass(frozen=True)
class Recipe:
    """A named job: ``fields`` are ``Job`` keywords; ``sources`` the citation of each;
    ``assumptions`` what the source leaves open and the value chosen (``option_assumptions``:
    those of a kernel option's element, which apply while the option is on); ``approximations``
    what the recipe's source does that tracemem does not trace (printed with the estimate)."""

    name: str
    title: str
    fields: dict[str, Any]
    sources: dict[str, str]
    assumptions: tuple[str, ...] = ()
    approximations: tuple[str, ...] = field(default=())
    # kernel option -> the assumption of its element, listed while the option is on
    option_assumptions: dict[str, str] = field(default_factory=dict)


_V3 = "arXiv 2412.19437"
# (field, value, source): DeepSeek-V3's published training setup
_DEEPSEEK_V3 = (
    ("model", "deepseek-v3", f"{_V3} 4.2 (61 layers, h 7168, 256 routed experts, MTP depth 1): "
                             f"the preset (modeling/families/deepseek/presets/deepseek-v3.json)"),
    ("world_size", 2048, f"{_V3} 3.1: a cluster of 2048 NVIDIA H800 GPUs"),
    ("gpu", "H800", f"{_V3} 3.1: H800 GPUs (Hopper, sm90)"),
    ("hbm", "80GB", "NVIDIA H800 SXM5 data sheet: 80 GB (decimal, as the issue asks: --hbm 80GB)"),
    ("tp", 1, f"{_V3} 3.4 / 3.2.3: no costly tensor parallelism"),
    ("pp", 16, f"{_V3} 3.2: 16-way pipeline parallelism"),
    ("schedule", "dualpipe", f"{_V3} 3.2.1: DualPipe; deepseek-ai/DualPipe DualPipe.step; "
                             f"3.2.3: the embedding and the output head on the same PP rank, so "
                             f"MTP shares them physically (the rank builds one of each, "
                             f"modeling/common/model.py; tests/modeling/test_mtp_sharing.py)"),
    ("ep", 64, f"{_V3} 3.2: 64-way expert parallelism spanning 8 nodes"),
    ("etp", 1, f"{_V3} 3.2: experts not tensor-split"),
    ("zero", 1, f"{_V3} 3.2: ZeRO-1 data parallelism"),
    ("precision", "deepseek-v3", f"{_V3} 3.3.3: BF16 AdamW moments, FP32 master weights and "
                                 f"gradients (tracemem/precision.py PRECISION_RECIPES)"),
    ("recompute", "selective", f"{_V3} 3.2.3: recomputation of RMSNorm and MLA up-projection"),
    ("recompute_modules", ("layernorm", "mla_up_proj", "moe_act"),
     f"{_V3} 3.2.3: all RMSNorm operations and MLA up-projections recomputed in backward; "
     f"3.3.3: the SwiGLU's output recomputed in backward (moe_act, the routed experts')"),
    ("kernels", "megatron-te", "the profile that runs FP8 (modeling/kernels/fp8.py)"),
    ("kernel_options", {"fp8_recipe": "blockwise", "fp8_format": "e4m3",
                        "fp8_moe_act_cache": True, "fp8_dispatch": True,
                        "e5m6_attention_output": True},
     f"{_V3} 3.3.1-3.3.2: FP8 GEMMs with 1x128 activation tiles and 128x128 weight blocks "
     f"(TE Float8BlockScaling), E4M3 on all tensors; 3.3.3: the SwiGLU's input cached in "
     f"FP8 (fp8_moe_act_cache); the activation before the MoE up-projections and the "
     f"gradient before the down-projections dispatched in FP8, the combine in BF16 "
     f"(fp8_dispatch: modeling/kernels/fp8_dispatch.py, DeepEP's FP8 dispatch tuple); "
     f"the input of the linear after attention cached in E5M6 with 1x128 scales "
     f"(e5m6_attention_output)"),
    ("seq_length", 4096, f"{_V3} 4.2: maximum sequence length 4K in pre-training"),
    ("global_batch_size", 15360, f"{_V3} 4.2: batch size ramped to 15360 (the value it holds)"),
    ("micro_batch_size", 1, "assumption: the paper gives no micro-batch size"),
    ("pp_layout", (4,) * 15 + (1,), "assumption: the paper gives no layer split"),
    ("ema", "host", f"{_V3} 3.2.3: Exponential Moving Average in CPU"),
)

RECIPES = {
    "deepseek-v3": Recipe(
        "deepseek-v3", "DeepSeek-V3 as trained (arXiv 2412.19437 sections 3.2-3.4)",
        {name: value for name, value, _ in _DEEPSEEK_V3},
        {name: source for name, _, source in _DEEPSEEK_V3},
        assumptions=(
            "micro-batch size 1: the paper gives none; 1 is the least activation memory, and "
            "M = 15360 / (1 x DP 128) = 120 microbatches is even and >= 2 x PP, as "
            "DualPipe.step asserts (num_chunks >= num_ranks * 2, even)",
            "layers per stage 4*15,1 (61 layers): the paper gives none; arXiv 2502.07846's "
            "split of the same model on PP 16, the last stage 1 layer + head + MTP",
            "EMA: fp32, one value per parameter element the rank holds (TP / EP / PP local, "
            "not DP-sharded), pageable host memory; section 3.2.3 says only 'stored in CPU "
            "memory and updated asynchronously after each training step'",
            "routing balanced: the auxiliary-loss-free balancing of section 2.1.2",
        ),
        approximations=(),
        option_assumptions={
            "fp8_moe_act_cache":
            "SwiGLU inputs cached in FP8 (3.3.3 names those 'in MoE'): the routed and the "
            "shared experts' (fp8_moe_act_cache); the three dense layers' SwiGLU, outside the "
            "MoE, keep Megatron's bf16 input",
            "e5m6_attention_output":
            "E5M6 (3.3.3: the input of the linear after attention, also read by "
            "attention's backward): each 12-bit value in a 16-bit container, 2 B, the bf16 "
            "storage Megatron's linear_proj and attention already share (one cache for both "
            "backwards; packing two values in 3 B would keep a quarter less), and one fp32 "
            "scale per 1x128 tile (3.3.2's scales are fp32; these are powers of two and "
            "would fit in 1 B), kept until linear_proj's backward",
            "fp8_dispatch":
            "FP8 dispatch (3.3.3): the payload is DeepEP's (deepseek-ai/DeepEP ebfe47e "
            "Buffer.dispatch: float8_e4m3fn values and one fp32 scale per 1x128 tile) on "
            "Megatron's alltoall dispatcher, one row per (token, expert) slot (DeepEP sends "
            "one per token and destination rank); fc1 keeps the received row-wise payload "
            "for its weight gradient and converts it to 128x1 tiles in backward, as 3.3.3 "
            "says of the attention output's cached input",
        }),
}


def _recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise TracememError(f"--recipe {name!r} is unknown; choose one of {', '.join(RECIPES)}")
    return RECIPES[name]


def recipe_fields(name: str) -> dict[str, Any]:
    """The ``Job`` keywords of recipe ``name`` (a copy).

    Raises:
        TracememError: ``name`` is not a ``RECIPES`` key.
    """
    fields_ = dict(_recipe(name).fields)
    fields_["kernel_options"] = dict(fields_.get("kernel_options", {}))
    return fields_


def _deepseek_deltas_off(fields: dict, given: dict) -> dict[str, str]:
    """The DeepSeek-V3 kernel options a recipe set (not given by the user) that the user's
    other values leave without what they need -> why; ``recipe_job`` turns them off rather
    than refuse the user's override (they have no flags of their own). ``fields``: the merged
    Job keywords; ``given``: the user's kernel options."""
    options = fields.get("kernel_options", {})
    blockwise = options.get("fp8_recipe") == "blockwise"
    needs = {
        "fp8_dispatch": (blockwise and fields.get("ep", 1) > 1,
                         "it needs --fp8-recipe blockwise" if not blockwise
                         else "it needs EP > 1"),
        "e5m6_attention_output": (blockwise, "it needs --fp8-recipe blockwise"),
        "fp8_moe_act_cache": (options.get("fp8_recipe", "none") != "none"
                              and fields.get("recompute") == "selective"
                              and "moe_act" in fields.get("recompute_modules", ()),
                              "it needs FP8 and --recompute selective with moe_act"),
    }
    return {option: why for option, (ok, why) in needs.items()
            if options.get(option) and option not in given and not ok}


def recipe_job(name: str, **overrides):
    """The ``Job`` of recipe ``name`` with ``overrides`` (``Job`` keywords) winning;
    ``kernel_options`` given are merged over the recipe's. ``Job.recipe`` is ``name`` and
    ``Job.recipe_fields`` the recipe's fields that were kept. A DeepSeek-V3 kernel option the
    recipe sets (``fp8_dispatch``, ``e5m6_attention_output``, ``fp8_moe_act_cache``: no flags
    of their own) is turned off where the overrides leave it without what it needs (another
    FP8 recipe, EP 1, no ``moe_act`` recompute); ``Job.recipe_off`` says which and why.

    Raises:
        TracememError: an unknown recipe, ``recipe`` or ``recipe_fields`` among the
            overrides; anything ``Job`` raises.
    """
    from tracemem.job import Job

    kwargs = recipe_fields(name)
    for own in ("recipe", "recipe_fields"):
        if own in overrides:
            raise TracememError(f"recipe_job({name!r}, {own}=...): the recipe is the first "
                                f"argument; {own} is not an override")
    given = dict(overrides.get("kernel_options") or {})
    if "kernel_options" in overrides:
        overrides = dict(overrides)
        overrides["kernel_options"] = kwargs["kernel_options"] | dict(overrides["kernel_options"])
    if {"num_microbatches", "global_batch_size"} & set(overrides):  # a batch replaces whole
        kwargs.pop("global_batch_size", None)
    if {"pp", "pp_first_stage_layers", "pp_last_stage_layers"} & set(overrides) \
            and "pp_layout" not in overrides:
        kwargs.pop("pp_layout", None)  # a layer split of the user's replaces the recipe's
    kept = tuple(sorted(k for k in kwargs if k not in overrides))
    fields = kwargs | overrides
    off = _deepseek_deltas_off(fields, given)
    if off:
        fields["kernel_options"] = {k: v for k, v in fields["kernel_options"].items()
                                    if k not in off}
    return Job(**fields, recipe=name, recipe_fields=kept,
               recipe_off=tuple(f"{option}: {why}" for option, why in off.items()))
