"""torchtitan jobs in: a torchtitan 0.3.0 ``Trainer.Config`` -> ``tracemem.Job`` keywords.

torchtitan 0.3.0 (the package registry's wheel; ``PIN``) describes a run as a ``Trainer.Config``
(``torchtitan/trainer.py`` ``Trainer.Config``) returned by a config-registry function
(``torchtitan/models/<module>/config_registry.py``, e.g. ``llama3_debugmodel``), chosen with
``--module`` / ``--config`` and overridden with ``--section.option VALUE`` flags parsed by tyro
(``torchtitan/config/manager.py`` ``ConfigManager.parse_args``; 0.3.0 reads no TOML files).
``torchtitan_config`` runs that same parser; ``torchtitan_job_kwargs`` maps the config to the
keywords of ``tracemem.job.Job``; ``torchtitan_job`` builds the ``Job``. torchtitan is an
optional dependency, imported only here, on first use (module docstring of the test file
names the pinned packages that make it importable).

Every field of every section is honoured (``HONOURED``), memory-neutral (``NEUTRAL``, a
section's ``"section.*"`` for a whole section) or refused by name (``REFUSED``: refused when it
is not at its default, or when ``REFUSED_WHEN`` says so); a field in none of them (a newer
torchtitan) is refused by name too. The model (``model_spec.model``, a tree of module configs)
is read from its shapes into a Hugging Face-style dict of its family (llama3 -> ``llama``,
qwen3 -> ``qwen3`` / ``qwen3_moe``, deepseek_v3 -> ``deepseek_v3``) and read by that family's
key table (``modeling.registry.config_from_dict``); a module config of any other class (a
float8 / MX / NVFP4 converter's linears, LoRA, varlen attention, other dispatchers) is refused
by its class name (``MODULE_CLASSES``).

What torchtitan 0.3.0 does that the mapping relies on, each read in the 0.3.0 wheel:

- FSDP2 on every run: ``torchtitan/models/llama3/parallelize.py`` (and qwen3, deepseek_v3)
  "Always run apply_fsdp_to_decoder -- with shard_degree=1 it is a no-op for the all-gather
  but still installs the MixedPrecisionPolicy"; ``torchtitan/distributed/fsdp.py``
  ``apply_fsdp_to_decoder``: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``,
  one ``fully_shard`` per transformer block, the embedding, ``[norm, lm_head]`` and the root.
  Hence ``zero`` 3 and ``precision`` ``fsdp2`` (``tracemem.precision``: 16 B per sharded
  parameter; the bf16 copies traced while gathered, ``tracemem.zero3``).
- ``fsdp_reshard_after_forward`` (``get_fsdp_reshard_after_forward_policy``): "default" is
  ``not pp_enabled``; ``[norm, lm_head]`` reshards after forward only under "always" (tracemem's
  head unit keeps its gather, ``modeling``'s declaration, as torchtitan's default). "never"
  would keep every block gathered from its forward to its backward: refused.
- PP with FSDP2 (``pipeline_parallel_degree`` > 1, "default" policy): no resharding after
  forward, and torch's pipelining keeps every unit gathered and its gradient unsharded (fp32)
  until the last microbatch (``tracemem.zero3.pp_keeps_gathered``, ``pp_resident_bytes``).
  The split is torchtitan's own (``_pipeline``); schedules 1F1B, GPipe, Interleaved1F1B; the
  pipeline microbatch is ``micro_batch_size``, M = local_batch_size / it; gradient
  accumulation under PP is refused.
- Degrees (``torchtitan/distributed/parallel_dims.py`` ``ParallelDims``): world = dp_replicate
  x dp_shard x cp x tp x pp, dp_shard -1 takes the rest; EP borrows ranks from dp_shard x cp x
  tp ("efsdp = dp_shard * cp * tp / ep"), so routed experts are not TP-sharded (tracemem
  ``etp`` 1) and shard over EDP = world / (EP x PP).
- Batch: ``training.local_batch_size`` sequences per data-parallel rank per accumulation step
  (``micro_batch_size``); ``training.global_batch_size`` -1 is local x DP, otherwise its
  quotient by local x DP is the gradient-accumulation steps (``global_batch_size`` here, M =
  G / (b x DP) as ``Job`` derives it).
- ``activation_checkpoint``: ``None`` (tyro ``activation-checkpoint:none``) -> ``recompute``
  none; ``FullAC`` (``ptd_checkpoint_wrapper`` around each transformer block,
  ``torchtitan/distributed/activation_checkpoint.py``) -> full, uniform, 1 layer per
  checkpoint; ``SelectiveAC`` (the registries' default: ``SelectiveAC._wrap_block``, an
  op-level save list, every other matmul recomputed, the router gate's mm always) ->
  recompute selective with ``recompute_modules`` ``("op",)`` (``modeling.common.sac``:
  torch's ``create_selective_checkpoint_contexts`` around each block, as torchtitan; only
  ``force_recompute_mm_shapes_by_fqns`` ``["moe.router.gate"]``, its default).
  ``MemoryBudgetAC`` (the compiler's partitioner) is refused.
- ``loss``: ``CrossEntropyLoss`` (fp32 logits, as the ``torch`` profile's loss) and
  ``ChunkedLossWrapper`` (the registries' default, ``torchtitan/components/loss.py``: the
  head and the loss per sequence chunk, each chunk's backward at once, an fp32 gradient
  accumulator of the hidden states) with a ``CrossEntropyLoss`` inside -> the ``torch``
  profile's ``loss_chunks`` option ``num_chunks`` (``modeling.kernels.loss.
  chunked_cross_entropy``).
- ``compile.enable``: refused: AOTAutograd's min-cut partitioner chooses what a compiled
  region saves for backward, which tracemem does not trace.
- CUDA graphs (``training.disable_cuda_graphs`` False, the default: ``wrap_with_cuda_graph``
  over forward + backward; ``optimizers.zero_grad(set_to_none=False)``): honoured with the
  approximation stated (``torchtitan_approximations``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from tracemem.errors import TracememError

__all__ = ["PIN", "HONOURED", "NEUTRAL", "REFUSED", "REFUSED_WHEN", "MODULE_CLASSES",
           "SCHEDULES", "torchtitan_config", "torchtitan_job_kwargs", "torchtitan_job",
           "torchtitan_model_config", "torchtitan_approximations", "check_importable"]

PIN = "0.3.0"  # torchtitan on the package registry
_AT = f"torchtitan {PIN}"

_LOG = "logging, metrics and profiling (host side, between steps)"
_IO = "paths, data loading and checkpoints (host side or between steps)"
_NMY = "not modelled yet: "

# section.field -> what it sets (Job keyword), torchtitan's semantics cited in the docstring
HONOURED: dict[str, str] = {
    "model_spec": "the model: model_spec.model read into a ModelConfig "
                  "(torchtitan_model_config); name, flavor: its name",
    "training.local_batch_size": "micro_batch_size (b, per data-parallel rank)",
    "training.global_batch_size": "global_batch_size (-1: local x DP); M = G / (b x DP)",
    "training.seq_len": "seq_length",
    "training.dtype": "float32 (the default): fp32 parameters under FSDP2 (precision fsdp2)",
    "training.mixed_precision_param": "bfloat16 (the default): FSDP2's gathered bf16 copies",
    "training.mixed_precision_reduce": "float32 (its only choice): fp32 sharded gradients",
    "training.disable_cuda_graphs": "False (default): forward + backward captured as a CUDA "
                                    "graph (approximation: torchtitan_approximations), "
                                    "zero_grad(set_to_none=False) keeps FSDP2's sharded "
                                    "gradients; True: the torch option zero_grad_set_to_none",
    "parallelism.data_parallel_shard_degree": "DP (with -1: the ranks left); ZeRO-3 shards "
                                              "over DP x CP",
    "parallelism.data_parallel_replicate_degree": "HSDP replicas: DP = replicate x shard; "
                                                  "FSDP2 shards within a replica "
                                                  "(num_distributed_optimizer_instances)",
    "parallelism.tensor_parallel_degree": "tp",
    "parallelism.enable_sequence_parallel": "sp (with tp > 1)",
    "parallelism.expert_parallel_degree": "ep (etp 1: EP borrows dp_shard x cp x tp)",
    "parallelism.context_parallel_degree": "1 only (REFUSED_WHEN)",
    "parallelism.pipeline_parallel_degree": "pp; with FSDP2 each stage stays gathered and "
                                            "keeps fp32 unsharded gradients through the step "
                                            "(tracemem.zero3.pp_keeps_gathered)",
    "parallelism.pipeline_parallel_schedule": "schedule under PP (SCHEDULES; others refused)",
    "parallelism.pipeline_parallel_microbatch_size": "micro_batch_size under PP; M = "
                                                     "local_batch_size / it",
    "parallelism.pipeline_parallel_first_stage_less_layers": "pp_layout (torchtitan's own "
                                                             "split, _pp_layout)",
    "parallelism.pipeline_parallel_last_stage_less_layers": "pp_layout",
    "parallelism.pipeline_parallel_layers_per_stage": "vpp and pp_layout",
    "parallelism.module_fqns_per_model_part": "pp_layout (layers per model part)",
    "parallelism.fsdp_reshard_after_forward": "default / always: every block reshards after "
                                              "forward without PP; under PP default only "
                                              "(no resharding); never: REFUSED_WHEN",
    "activation_checkpoint": "None -> recompute none; FullAC -> recompute full (uniform, 1); "
                             "SelectiveAC -> recompute selective, modules ('op',) "
                             "(modeling.common.sac)",
    "activation_checkpoint.force_recompute_mm_shapes_by_fqns": "['moe.router.gate'] only "
                                                               "(REFUSED_WHEN): the router "
                                                               "gate's mm recomputed",
    "loss": "CrossEntropyLoss: the torch profile's fp32 cross entropy; ChunkedLossWrapper: "
            "kernel option loss_chunks = num_chunks",
    "loss.num_chunks": "ChunkedLossWrapper's chunks: kernel option loss_chunks",
    "loss.loss_fn": "CrossEntropyLoss only (inside ChunkedLossWrapper; _loss)",
    "optimizer.param_groups": "AdamW / Adam: two moments (precision fsdp2)",
    "optimizer.implementation": "fused -> optimizer fused; foreach -> optimizer torch",
    "compile.enable": "False only (REFUSED_WHEN)",
}

NEUTRAL: dict[str, str] = {
    "hf_assets_path": _IO, "dump_folder": _IO,
    "profiler.*": _LOG + " (a memory snapshot records, it does not allocate on the GPU)",
    "metrics.*": _LOG, "tokenizer.*": _IO, "dataloader.*": _IO, "checkpoint.*": _IO,
    "lr_scheduler.*": "the learning rate: a scalar per step",
    "comm.*": "timeouts, flight-recorder buffers (host side) and the backend choice",
    "validator.*": "validation runs between training steps, forward only under no_grad",
    "override.*": "imports of user modules (torchtitan/overrides): a refused module config "
                  "class is what they would change",
    "training.max_norm": "gradient clipping: a foreach norm over the sharded gradients "
                         "(one fp32 scalar per tensor)",
    "training.steps": "the number of steps", "training.gc_freq": "host-side Python GC",
    "training.gc_debug": "host-side Python GC",
    "parallelism.spmd_backend": "how sharding is expressed (DTensor or spmd_types): the same "
                                "local shards",
    "parallelism.pipeline_parallel_schedule_csv": "'' or None only (REFUSED_WHEN)",
    "parallelism.context_parallel_load_balancer": "used only with CP > 1",
    "parallelism.context_parallel_ptrr_mask_key": "used only with CP > 1",
    "activation_checkpoint.preserve_rng_state": "an RNG state per checkpoint (a few bytes)",
    "activation_checkpoint.determinism_check": "a host-side check of recomputed metadata",
    "activation_checkpoint.debug": "host-side debug records",
    "loss.global_vocab_size": "the vocabulary the loss is told (the model's head sets it)",
    "optimizer.optimizer_factory_kwargs_by_name": "empty only (REFUSED_WHEN)",
    "compile.backend": "used only with compile.enable",
    "compile.components": "used only with compile.enable",
    "compile.enable_async_tensor_parallel": "used only with compile.enable (its __post_init__)",
    "debug.seed": "RNG seed", "debug.deterministic": "deterministic algorithms: the same "
                                                     "tensors (workspaces below the "
                                                     "dispatcher aside)",
    "debug.deterministic_warn_only": "a warning mode", "debug.print_config": _LOG,
    "debug.save_config_file": _IO, "debug.enable_structured_logging": _LOG,
    "debug.spmd_typechecking": "type checks of the SPMD types (host side)",
}

# refused when not at the default (or when REFUSED_WHEN says so): what is missing
REFUSED: dict[str, str] = {
    "training.enable_cpu_offload": _NMY + "FSDP2's CPUOffloadPolicy (parameters, gradients "
                                   "and optimizer states on the host)",
    "parallelism.enable_fsdp_symm_mem": _NMY + "FSDP2's symmetric-memory communication "
                                        "buffers",
    "debug.moe_force_load_balance": "use tracemem's routing model (--routing balanced is its "
                                    "default) instead",
    "debug.detect_anomaly": _NMY + "autograd anomaly mode keeps forward tracebacks",
    "debug.batch_invariant": "torchtitan refuses it in pre-training (Trainer.Config)",
}

_DEFAULT_POLICY = ("default", "always")
REFUSED_WHEN: dict[str, tuple[Callable[[Any], bool], str]] = {
    "training.dtype": (lambda v: v != "float32",
                       _NMY + "training.dtype bfloat16 (bf16 parameters, gradients and "
                       "optimizer states, no fp32 copy); use float32 (torchtitan's default)"),
    "training.mixed_precision_param": (lambda v: v != "bfloat16",
                                       _NMY + "fp32 compute (tracemem traces bf16 "
                                       "parameters); use bfloat16"),
    "training.mixed_precision_reduce": (lambda v: v != "float32",
                                        "torchtitan 0.3.0 allows only float32"),
    "parallelism.context_parallel_degree": (
        lambda v: v != 1, _NMY + "torch's context_parallel attention (its K / V rotation); "
        "use 1"),
    "parallelism.pipeline_parallel_schedule_csv": (
        lambda v: bool(v), _NMY + "a schedule read from a CSV file; name one of "
        + ", ".join(("1F1B", "GPipe", "Interleaved1F1B"))),
    "parallelism.fsdp_reshard_after_forward": (
        lambda v: v not in _DEFAULT_POLICY, _NMY + "never: every block kept gathered from "
        "its forward to its backward; use default or always"),
    "compile.enable": (lambda v: v is not False,
                       "torch.compile: AOTAutograd's min-cut partitioner chooses what each "
                       "compiled region saves for backward, which tracemem does not trace; "
                       "use --compile.no-enable"),
    "optimizer.optimizer_factory_kwargs_by_name": (
        lambda v: bool(v), _NMY + "optimizer factory options"),
    "activation_checkpoint.force_recompute_mm_shapes_by_fqns": (
        lambda v: list(v) != ["moe.router.gate"], _NMY + "other force-recompute mm shapes "
        "than the router gate's (SelectiveAC's default ['moe.router.gate'])"),
}

# torchtitan schedules (torch.distributed.pipelining names) -> tracemem's; the interleaved
# warm-up count is the same: torch 2.13 pipelining/schedules.py ScheduleInterleaved1F1B
# (n_local_stages - 1) x pp + 2 x (pp - 1 - rank), Megatron's (vpp - 1) x pp + 2 x (pp - rank - 1)
SCHEDULES = {"1F1B": "1f1b", "GPipe": "gpipe", "Interleaved1F1B": "interleaved-1f1b"}

# module config classes (qualified names, torchtitan 0.3.0 torchtitan/models/) the model reader
# knows; any other class in model_spec.model is refused by name
MODULE_CLASSES = {
    "Llama3Model.Config", "Llama3TransformerBlock.Config", "Qwen3Model.Config",
    "Qwen3TransformerBlock.Config", "DeepSeekV3Model.Config",
    "DeepSeekV3TransformerBlock.Config", "GQAttention.Config", "Attention.Config",
    "FusedQKVLinear.Config", "QKVLinear.Config", "Linear.Config", "Embedding.Config",
    "RMSNorm.Config",
    "FeedForward.Config", "ComplexRoPE.Config", "CosSinRoPE.Config", "FlexAttention.Config",
    "ScaledDotProductAttention.Config", "MoE.Config", "RoutedExperts.Config",
    "GroupedExperts.Config", "AllToAllTokenDispatcher.Config", "LocalTokenDispatcher.Config",
    "TokenChoiceTopKRouter.Config",
}
_MODEL_TYPES = {"Llama3Model.Config": "llama", "Qwen3Model.Config": "qwen3",
                "DeepSeekV3Model.Config": "deepseek_v3"}
_INSTALL = ("torchtitan 0.3.0 is not importable here; install it and what it imports: "
            "make test does, or pip install --no-deps -r requirements-torchtitan.txt in a "
            "clone of tracemem (the pinned set)")


def check_importable() -> None:
    """Raises: TracememError: torchtitan 0.3.0 does not import (what to install)."""
    try:
        import torchtitan  # noqa: F401
        from torchtitan.config.manager import ConfigManager  # noqa: F401
    except ImportError as error:
        raise TracememError(f"{_INSTALL}: {error}") from None


def torchtitan_config(module: str, config: str, overrides: Sequence[str] = ()):
    """The ``Trainer.Config`` torchtitan itself builds from ``--module module --config
    config`` and ``--section.option VALUE`` ``overrides`` (``ConfigManager.parse_args``,
    which calls the registry function and applies the overrides with tyro).

    Raises:
        TracememError: torchtitan not importable; an unknown module or function, or an
            override tyro rejects (torchtitan's message, one line).
    """
    import contextlib
    import io

    check_importable()
    from torchtitan.config.manager import ConfigManager

    argv = ["--module", module, "--config", config, *overrides]
    # tyro's usage box and torchtitan's warnings about files a memory estimate does not read
    # (its checkpoint and tokenizer paths, through the root logger) go to stderr: captured,
    # and on a rejection distilled into the one-line error
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            return ConfigManager().parse_args(argv)
    except SystemExit as exc:  # tyro prints its usage and exits on a bad flag
        own = sorted(a for a in overrides if a.startswith("--") and a.split("=")[0] in
                     _tracemem_flags())
        hint = (f"; tracemem's own flags ({', '.join(own)}) go before --torchtitan-module"
                if own else "")
        raise TracememError(f"torchtitan {PIN} rejected its arguments "
                            f"{' '.join(overrides) or '(none)'} for --module {module} "
                            f"--config {config}: {_tyro_message(captured.getvalue())}"
                            f"{hint}") from exc
    except (ValueError, ImportError, AttributeError, TypeError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error)
        first = _shorten_available(str(first), config)
        if "supported modules are" in first:  # torchtitan's whole registry, flux and RL too
            first = (first.split("For shorthands", 1)[0].strip()
                     + " tracemem reads the models of torchtitan's llama3, qwen3 and "
                       "deepseek_v3 modules (and experiments built from their parts)")
        raise TracememError(f"torchtitan {PIN} --module {module} --config {config}: "
                            f"{first}") from None


def _shorten_available(message: str, config: str) -> str:
    """torchtitan's "Config function ... not found ... Available config functions: [...]"
    (``message``) with the list (every public name of the registry module, dozens) replaced
    by the names closest to ``config`` and their count: the error stays one short line."""
    import ast
    import difflib

    head, sep, tail = message.partition("Available config functions: ")
    if not sep:
        return message
    try:
        names = [n for n in ast.literal_eval(tail.strip()) if isinstance(n, str)]
    except (ValueError, SyntaxError):
        return message
    close = difflib.get_close_matches(config, names, n=3, cutoff=0.5)
    shown = close or [n for n in names if "debugmodel" in n][:3] or names[:3]
    return (f"{head.strip().rstrip('.')}; {'closest' if close else 'e.g.'}: "
            f"{', '.join(shown)} ({len(names)} names in the registry)")


def _tyro_message(text: str) -> str:
    """What tyro printed (``text``: its usage box) as one clause: the unrecognized options or
    the parse error, tyro's "perhaps you meant" options and, for a subcommand, the available
    ones; "no message" when it printed none of these."""
    import re

    flat = " ".join(line.strip().strip("│╭╮╰╯─ ").strip() for line in text.splitlines())
    flat = re.sub(r"\s+", " ", flat)
    stop = r"(?= -{5,}|$)"
    parts = []
    for label, pattern in (("unrecognized", r"Unrecognized options: (.*?)" + stop),
                           ("", r"(Error parsing .*?)" + stop)):
        for match in re.finditer(pattern, flat):
            parts.append(f"{label} {match.group(1).strip()}".strip())
    meant = re.findall(r"(--[A-Za-z0-9_.-]+) [A-Z]+\b", flat.split("Perhaps you meant:", 1)[1]
                       ) if "Perhaps you meant:" in flat else []
    if meant:
        parts.append("perhaps you meant " + " or ".join(dict.fromkeys(meant[:3])))
    sub = re.search(r"Available subcommands: (.*?)" + stop, flat)
    if sub and any(":" in p for p in parts[:1]):
        parts.append("subcommands " + sub.group(1).strip().rstrip(","))
    return "; ".join(parts) if parts else "no message"


def _tracemem_flags() -> set[str]:
    """Every option string of ``tracemem estimate`` (a tracemem flag typed among torchtitan's
    overrides is torchtitan's there)."""
    from tracemem.cli import _options, build_parser

    return _options(build_parser(), "estimate")


def _fields(obj) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(obj) if f.init]


def _default(cls, f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _classify(config) -> None:
    """Every field of every section in one of the tables; a refused one at its default.

    Raises:
        TracememError: the first refused or unknown field, named ``section.field``.
    """
    for top in _fields(config):
        name = top.name
        value = getattr(config, name)
        if name == "model_spec" or name in NEUTRAL or f"{name}.*" in NEUTRAL:
            continue  # the model is read whole (torchtitan_model_config)
        if not dataclasses.is_dataclass(value):
            if name in HONOURED:  # activation_checkpoint None
                continue
            _unknown(name, value)
        for f in _fields(value):
            key = f"{name}.{f.name}"
            v = getattr(value, f.name)
            if key in REFUSED_WHEN:
                when, why = REFUSED_WHEN[key]
                if when(v):
                    raise TracememError(f"--{key} {v!r}: {why} ({_AT})")
                continue
            if key in HONOURED or key in NEUTRAL:
                continue
            if key in REFUSED:
                if v != _default(type(value), f):
                    raise TracememError(f"--{key} {v!r}: {REFUSED[key]} ({_AT})")
                continue
            if name in ("activation_checkpoint", "loss"):
                continue  # the class itself is honoured or refused (_recompute, _loss)
            _unknown(key, v)


def _unknown(key: str, value) -> None:
    raise TracememError(f"--{key} {value!r} is not in tracemem's tables for torchtitan {PIN} "
                        f"(a newer torchtitan?); tracemem cannot say whether it changes memory")


def _qual(obj) -> str:
    return type(obj).__qualname__


def _walk(obj, path: str = "model"):
    """(path, config) of every module config in the tree under ``obj``."""
    if dataclasses.is_dataclass(obj):
        yield path, obj
        for f in dataclasses.fields(obj):
            yield from _walk(getattr(obj, f.name), f"{path}.{f.name}")
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from _walk(item, f"{path}[{i}]")


def _attention_signature(att) -> tuple:
    return tuple((f.name, getattr(att, f.name)) for f in dataclasses.fields(att)
                 if isinstance(getattr(att, f.name), (int, float, str, type(None), bool)))


def _ffn_width(ff) -> int:
    return ff.w1.out_features


def _biases(*linears) -> bool:
    return any(getattr(lin, "bias", False) for lin in linears if lin is not None)


def _fused_qkv(model_spec) -> bool:
    """Whether the GQA layers of ``model_spec`` project q, k, v with one ``FusedQKVLinear``
    (torchtitan 0.3.0 models/common/attention.py; ``fuse_qkv=True``, the llama3 and qwen3
    configs' default) rather than ``QKVLinear`` (wq, wk, wv): the ``torch`` profile's
    ``fused_qkv`` option. False for an MLA model (no qkv_linear)."""
    layers = list(model_spec.model.layers)
    qkv = getattr(layers[0].attention, "qkv_linear", None) if layers else None
    return qkv is not None and _qual(qkv) == "FusedQKVLinear.Config"


def torchtitan_model_config(model_spec):
    """The ``modeling.ModelConfig`` of a torchtitan 0.3.0 ``ModelSpec``: the module-config
    tree ``model_spec.model`` (``Llama3Model.Config``, ``Qwen3Model.Config``,
    ``DeepSeekV3Model.Config``) read from its shapes into the family's Hugging Face keys
    (module docstring), then ``modeling.registry.config_from_dict``.

    Raises:
        TracememError: a module config class not in ``MODULE_CLASSES`` (a converter's float8 /
            MX / NVFP4 linears, LoRA, another attention or dispatcher), named with its path;
            layers whose attention differs; MTP layers; any error of the family's reader.
    """
    from modeling.registry import config_from_dict

    model = model_spec.model
    source = f"torchtitan {PIN} {model_spec.name} {model_spec.flavor}"
    for path, node in _walk(model):
        if _qual(node) not in MODULE_CLASSES:
            raise TracememError(f"{source}: {path} is a {_qual(node)}, which tracemem does not "
                                f"model (float8 / MX / NVFP4 converters, LoRA and other "
                                f"module classes are refused by name; {_AT})")
    kind = _MODEL_TYPES.get(_qual(model))
    if kind is None:
        raise TracememError(f"{source}: {_qual(model)} has no tracemem family")
    if getattr(model, "mtp_layers", None):
        raise TracememError(f"{source}: mtp_layers ({len(model.mtp_layers)}): {_NMY}"
                            f"torchtitan's multi-token prediction (torchtitan/models/"
                            f"deepseek_v3/mtp.py)")
    layers = list(model.layers)
    first = layers[0]
    att = first.attention
    if any(_attention_signature(b.attention) != _attention_signature(att) for b in layers):
        raise TracememError(f"{source}: layers with different attention settings are not "
                            f"modelled")
    moe_layers = [i for i, b in enumerate(layers) if b.moe is not None]
    dense_layers = [i for i, b in enumerate(layers) if b.moe is None]
    widths = {_ffn_width(layers[i].feed_forward) for i in dense_layers}
    if len(widths) > 1:
        raise TracememError(f"{source}: dense layers of different widths {sorted(widths)}")
    rope = att.rope
    data: dict[str, Any] = {
        "vocab_size": model.vocab_size, "hidden_size": model.dim,
        "num_hidden_layers": len(layers), "num_attention_heads": att.n_heads,
        "rms_norm_eps": model.norm.eps, "max_position_embeddings": rope.max_seq_len,
        "tie_word_embeddings": bool(model.enable_weight_tying), "torch_dtype": "bfloat16",
        "rope_theta": rope.theta,
    }
    if model.lm_head.out_features != model.vocab_size:
        raise TracememError(f"{source}: lm_head out_features {model.lm_head.out_features} != "
                            f"vocab_size {model.vocab_size}")
    moe = layers[moe_layers[0]].moe if moe_layers else None
    if widths:
        data["intermediate_size"] = widths.pop()
    elif moe is not None:  # every layer MoE: the dense width is unused
        data["intermediate_size"] = moe.routed_experts.inner_experts.hidden_dim
    if kind == "deepseek_v3":
        data.update(q_lora_rank=att.q_lora_rank or None, kv_lora_rank=att.kv_lora_rank,
                    qk_nope_head_dim=att.qk_nope_head_dim,
                    qk_rope_head_dim=att.qk_rope_head_dim, v_head_dim=att.v_head_dim,
                    model_type="deepseek_v3")
        if moe_layers and moe_layers != list(range(len(dense_layers), len(layers))):
            raise TracememError(f"{source}: MoE layers {moe_layers} are not the last ones "
                                f"after the dense ones (DeepSeek's first_k_dense_replace)")
        if moe is None:
            raise TracememError(f"{source}: a DeepSeek-V3 model with no MoE layer")
        data["first_k_dense_replace"] = len(dense_layers)
        data.update(_deepseek_moe(moe, source))
    else:
        qkv = att.qkv_linear
        if _fused_qkv(model_spec):
            data.update(num_key_value_heads=qkv.n_kv_heads, head_dim=qkv.head_dim,
                        attention_bias=_biases(qkv.wqkv, att.wo))
        else:  # QKVLinear: wq, and wk / wv both built from wkv
            data.update(num_key_value_heads=qkv.wkv.out_features // qkv.head_dim,
                        head_dim=qkv.head_dim, attention_bias=_biases(qkv.wq, qkv.wkv, att.wo))
        if kind == "qwen3" and att.qk_norm is None:
            raise TracememError(f"{source}: a Qwen3 attention without qk_norm")
        if kind == "llama" and att.qk_norm is not None:
            raise TracememError(f"{source}: a Llama 3 attention with qk_norm")
        if kind == "llama":
            data["mlp_bias"] = any(_biases(layers[i].feed_forward.w1) for i in dense_layers)
            if moe_layers:
                raise TracememError(f"{source}: MoE layers in a Llama 3 model")
        data["model_type"] = kind
        if moe is not None:
            if kind != "qwen3":
                raise TracememError(f"{source}: MoE layers in a {kind} model")
            router = moe.router
            if moe.shared_experts is not None:
                raise TracememError(f"{source}: Qwen3 MoE with shared experts")
            if router.score_func != "softmax" or router.route_scale != 1.0:
                raise TracememError(f"{source}: Qwen3 MoE router {router.score_func} x "
                                    f"{router.route_scale}: only softmax x 1.0 is Qwen3's")
            data.update(model_type="qwen3_moe",
                        moe_intermediate_size=moe.routed_experts.inner_experts.hidden_dim,
                        num_experts=moe.num_experts, num_experts_per_tok=router.top_k,
                        norm_topk_prob=bool(router.route_norm), decoder_sparse_step=1,
                        mlp_only_layers=dense_layers)
    return config_from_dict(data, source)


def _deepseek_moe(moe, source: str) -> dict[str, Any]:
    router, experts = moe.router, moe.routed_experts.inner_experts
    width = experts.hidden_dim
    shared = 0
    if moe.shared_experts is not None:
        total = _ffn_width(moe.shared_experts)
        if total % width:
            raise TracememError(f"{source}: shared experts of width {total}, not a multiple "
                                f"of the expert width {width}")
        shared = total // width
    groups = router.num_expert_groups or 1
    # torchtitan's load-balancing expert_bias (load_balance_coeff) is DeepSeek-V3's
    # e_score_correction_bias (aux-loss-free balancing): noaux_tc
    method = "noaux_tc" if moe.load_balance_coeff is not None else (
        "group_limited_greedy" if groups > 1 else "greedy")
    return {"moe_intermediate_size": width, "n_routed_experts": moe.num_experts,
            "n_shared_experts": shared, "num_experts_per_tok": router.top_k,
            "moe_layer_freq": 1, "n_group": groups, "topk_group": router.num_limited_groups or 1,
            "scoring_func": router.score_func, "topk_method": method,
            "norm_topk_prob": bool(router.route_norm),
            "routed_scaling_factor": router.route_scale}


def _recompute(ac) -> dict[str, Any]:
    if ac is None:
        return {"recompute": "none"}
    name = _qual(ac)
    if name == "FullAC.Config":
        return {"recompute": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if name == "SelectiveAC.Config":  # modeling.common.sac (module docstring)
        return {"recompute": "selective", "recompute_modules": ("op",)}
    why = {"MemoryBudgetAC.Config": "the compiler's memory-budget partitioner (needs "
                                    "compile)"}.get(name, "an activation checkpointing policy "
                                                          "tracemem does not know")
    raise TracememError(f"--activation_checkpoint {name.split('.')[0]}: {_NMY}{why} ({_AT})")


def _loss(loss) -> dict[str, Any]:
    """The ``torch`` profile's kernel options of torchtitan's loss: none for
    ``CrossEntropyLoss``; ``loss_chunks`` num_chunks for a ``ChunkedLossWrapper`` around a
    ``CrossEntropyLoss`` (torchtitan/components/loss.py).

    Raises:
        TracememError: another loss, or another loss inside the wrapper, or num_chunks < 1.
    """
    name = _qual(loss)
    if name == "CrossEntropyLoss.Config":
        return {}
    if name == "ChunkedLossWrapper.Config":
        inner = _qual(loss.loss_fn)
        if inner != "CrossEntropyLoss.Config":
            raise TracememError(f"--loss.loss_fn {inner.split('.')[0]} inside "
                                f"ChunkedLossWrapper: {_NMY}that loss ({_AT})")
        if isinstance(loss.num_chunks, bool) or not isinstance(loss.num_chunks, int) \
                or loss.num_chunks < 1:
            raise TracememError(f"--loss.num_chunks {loss.num_chunks!r} must be a positive "
                                f"integer ({_AT})")
        return {"loss_chunks": loss.num_chunks}
    raise TracememError(f"--loss {name.split('.')[0]}: {_NMY}that loss ({_AT})")


def _optimizer(opt) -> str:
    names = {g.optimizer_name for g in opt.param_groups}
    if not names <= {"AdamW", "Adam"}:
        raise TracememError(f"--optimizer {sorted(names - {'AdamW', 'Adam'})[0]}: {_NMY}"
                            f"optimizers other than Adam / AdamW (two moments) ({_AT})")
    impl = {"fused": "fused", "foreach": "torch"}.get(opt.implementation)
    if impl is None:
        raise TracememError(f"--optimizer.implementation {opt.implementation!r}: {_NMY}"
                            f"per-tensor (for-loop) Adam; use fused or foreach ({_AT})")
    return impl


def _degrees(par, world_size: int) -> dict[str, int]:
    """torchtitan's ``ParallelDims`` degrees: dp_shard -1 takes the ranks left."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise TracememError(f"--world-size {world_size!r} must be a positive integer (the "
                            f"launcher's WORLD_SIZE, which torchtitan takes from outside its "
                            f"config)")
    rep, tp, cp, pp = (par.data_parallel_replicate_degree, par.tensor_parallel_degree,
                       par.context_parallel_degree, par.pipeline_parallel_degree)
    shard = par.data_parallel_shard_degree
    # torchtitan 0.3.0 distributed/parallel_dims.py ParallelDims._validate
    for name, degree in (("data_parallel_replicate_degree", rep),
                         ("tensor_parallel_degree", tp), ("context_parallel_degree", cp),
                         ("pipeline_parallel_degree", pp)):
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
            raise TracememError(f"--parallelism.{name} {degree!r}: torchtitan requires >= 1 "
                                f"(ParallelDims: 'Parallelism degree should be >= 1, except "
                                f"for dp_shard')")
    if isinstance(shard, bool) or not isinstance(shard, int) or (shard != -1 and shard < 1):
        raise TracememError(f"--parallelism.data_parallel_shard_degree {shard!r}: torchtitan "
                            f"requires -1 or >= 1 (ParallelDims: 'dp_shard must -1 or >=1.')")
    others = rep * tp * cp * pp
    if shard == -1:
        if world_size % others:
            raise TracememError(f"dp_replicate({rep}) * tp({tp}) * cp({cp}) * pp({pp}) = "
                                f"{others} does not divide world_size({world_size}) "
                                f"(--parallelism.data_parallel_shard_degree -1 takes the rest)")
        shard = world_size // others
    if rep * shard * tp * cp * pp != world_size:
        raise TracememError(f"dp_replicate({rep}) * dp_shard({shard}) * tp({tp}) * cp({cp}) "
                            f"* pp({pp}) = {rep * shard * tp * cp * pp} != "
                            f"world_size({world_size}) (torchtitan's ParallelDims)")
    return {"dp_shard": shard, "dp_replicate": rep, "tp": tp, "cp": cp, "pp": pp}


def torchtitan_job_kwargs(config, *, world_size: int) -> dict[str, Any]:
    """The ``Job`` keywords of a torchtitan 0.3.0 ``Trainer.Config`` on ``world_size`` GPUs
    (the launcher's, as torchtitan takes it): model, degrees, batch, recompute, precision
    (``fsdp2``, ZeRO-3), the ``torch`` kernel profile with flash-style attention (torchtitan's
    FlexAttention / SDPA keep the output and the log-sum-exp, no s x s scores), the optimizer.

    Raises:
        TracememError: a refused or unknown field (``HONOURED`` / ``NEUTRAL`` / ``REFUSED``),
            a refused module class, inconsistent degrees.
    """
    _classify(config)
    if config.model_spec is None:
        raise TracememError("the torchtitan config has no model_spec (its registry function "
                            "sets it)")
    cfg = torchtitan_model_config(config.model_spec)
    par = config.parallelism
    degrees = _degrees(par, world_size)
    recompute = _recompute(config.activation_checkpoint)
    kernel_options = _loss(config.loss)
    layers = list(config.model_spec.model.layers)
    if hasattr(layers[0].attention, "qkv_linear") and not _fused_qkv(config.model_spec):
        kernel_options["fused_qkv"] = False  # QKVLinear: wq, wk, wv apart
    if config.training.disable_cuda_graphs:  # trainer.py: zero_grad(set_to_none=this)
        kernel_options["zero_grad_set_to_none"] = True
    tp = degrees["tp"]
    training = config.training
    # the batch is split over dp_replicate x dp_shard (ParallelDims.dp: the HSDP mesh)
    dp = degrees["dp_shard"] * degrees["dp_replicate"]
    global_batch = training.global_batch_size
    if global_batch == -1:  # torchtitan's default: local x DP, one accumulation step
        global_batch = training.local_batch_size * dp
    batch: dict[str, Any] = {"micro_batch_size": training.local_batch_size,
                             "global_batch_size": global_batch}
    if degrees["pp"] > 1:
        batch = _pipeline(config, cfg.num_layers, degrees["pp"], global_batch, dp)
    return {
        "model": cfg, "world_size": world_size, "seq_length": training.seq_len, **batch,
        "tp": tp, "sp": bool(par.enable_sequence_parallel and tp > 1), "cp": degrees["cp"],
        "ep": par.expert_parallel_degree, "etp": 1, "pp": degrees["pp"], "zero": 3,
        "precision": "fsdp2", "kernels": "torch", "attention": "flash",
        **({"kernel_options": kernel_options} if kernel_options else {}),
        # HSDP: FSDP2 within each replica (tracemem.parallel, tracemem.zero3)
        **({"num_distributed_optimizer_instances": degrees["dp_replicate"]}
           if degrees["dp_replicate"] > 1 else {}),
        "optimizer": _optimizer(config.optimizer), **recompute,
    }


def _pipeline(config, num_layers: int, pp: int, global_batch: int, dp: int) -> dict[str, Any]:
    """The PP keywords: schedule, vpp, pp_layout (torchtitan's own split:
    ``torchtitan/distributed/pipeline_parallel.py`` ``_get_pipeline_metadata`` for the number
    of virtual stages, ``_generate_llm_fqn_per_model_part`` for the modules of each, counted
    as decoder layers), the pipeline microbatch and M = local_batch_size / it.

    Raises:
        TracememError: a schedule tracemem does not run, ``fsdp_reshard_after_forward``
            always under PP, gradient accumulation under PP, a split torchtitan refuses.
    """
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    par, training = config.parallelism, config.training
    name = par.pipeline_parallel_schedule
    if name not in SCHEDULES:
        raise TracememError(f"--parallelism.pipeline_parallel_schedule {name}: {_NMY}that "
                            f"schedule; choose one of {', '.join(SCHEDULES)} ({_AT})")
    if par.fsdp_reshard_after_forward != "default":
        raise TracememError(f"--parallelism.fsdp_reshard_after_forward "
                            f"{par.fsdp_reshard_after_forward} with PP: {_NMY}resharding after "
                            f"each microbatch's forward under PP; use default ({_AT})")
    if global_batch != training.local_batch_size * dp:
        raise TracememError(f"--training.global_batch_size {global_batch} with PP: {_NMY}"
                            f"gradient accumulation over several pipeline runs; use "
                            f"local_batch_size x DP = {training.local_batch_size * dp}")
    mb = par.pipeline_parallel_microbatch_size
    if training.local_batch_size % mb:  # Trainer.Config.__post_init__ refuses it too
        raise TracememError(f"--training.local_batch_size {training.local_batch_size} is not "
                            f"divisible by --parallelism.pipeline_parallel_microbatch_size {mb}")
    single = SCHEDULES[name] != "interleaved-1f1b"
    first, last = (par.pipeline_parallel_first_stage_less_layers,
                   par.pipeline_parallel_last_stage_less_layers)
    if par.module_fqns_per_model_part is not None:
        parts = par.module_fqns_per_model_part
    else:
        per = par.pipeline_parallel_layers_per_stage
        # _get_pipeline_metadata: ceil((layers + first + last) / layers_per_stage) stages,
        # else 1 per rank (single-stage schedules) or 2 (looped ones)
        stages = -(-(num_layers + first + last) // per) if per is not None else \
            pp * (1 if single else 2)
        try:
            parts = _generate_llm_fqn_per_model_part(stages, num_layers, first, last)
        except ValueError as error:
            raise TracememError(f"torchtitan {PIN}'s pipeline split: {error}") from None
    if len(parts) % pp or (single and len(parts) != pp) or (not single and len(parts) < 2 * pp):
        raise TracememError(f"{len(parts)} pipeline model parts on PP {pp} under {name} "
                            f"(torchtitan's _get_pipeline_metadata: 1 per rank for a single-"
                            f"stage schedule, at least 2 for a looped one)")
    layout = tuple(sum(m.startswith("layers.") for m in part) for part in parts)
    return {"micro_batch_size": mb, "num_microbatches": training.local_batch_size // mb,
            "global_batch_size": None, "schedule": SCHEDULES[name], "vpp": len(parts) // pp,
            "pp_layout": layout}


def torchtitan_approximations(config) -> list[str]:
    """What tracemem does not trace of this (accepted) job, one line each."""
    notes = []
    if not config.training.disable_cuda_graphs:
        notes.append("training.disable_cuda_graphs False: forward + backward run as a CUDA "
                     "graph; its allocations are those of the eager step traced here, but "
                     "its private memory pool is not shared with the optimizer step (the "
                     "reserved memory may be higher)")
    # (disable_cuda_graphs True: zero_grad(set_to_none=True), traced: the sharded gradients
    # made by the step's first backward, the torch profile's zero_grad_set_to_none)
    if config.parallelism.pipeline_parallel_degree > 1:
        notes.append("PP with FSDP2: the stage's bf16 unsharded parameters and fp32 unsharded "
                     "gradients are counted through the optimizer step too; they are freed "
                     "after the last microbatch's backward (its reduce-scatter), so the "
                     "optimizer step's peak is overstated by them, not the backward's")
    if any(_qual(node) == "MoE.Config" for _, node in _walk(config.model_spec.model)):
        extra = "" if config.model_spec.name == "deepseek_v3" else \
            " and, with load_balance_coeff, expert_bias_E"
        notes.append(f"MoE: torchtitan's tokens_per_expert_E buffer{extra} (num_experts fp32 "
                     f"per MoE layer, torchtitan/models/common/moe.py MoE.__init__) are not "
                     f"counted")
    return notes


def torchtitan_job(config, *, world_size: int, **fields):
    """``tracemem.job.Job`` of ``torchtitan_job_kwargs(config, world_size=...)`` with
    ``fields`` (Job keywords) over it.

    Raises:
        TracememError: see ``torchtitan_job_kwargs`` and ``tracemem.job.Job``.
    """
    from tracemem.job import Job

    return Job(**(torchtitan_job_kwargs(config, world_size=world_size) | dict(fields)
                  | {"origin": "torchtitan"}))
