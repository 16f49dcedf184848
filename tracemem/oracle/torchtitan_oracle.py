"""``tracemem validate --against torchtitan``: torchtitan 0.3.0's own model, parallelised by
its own ``parallelize_fn``, held against tracemem's ``build_rank(..., kernels="torch")``
part by part.

For a torchtitan debug flavor (``TitanCase.module``: llama3 ``debugmodel``) and a layout
(``TitanCase``: FSDP2 degree ``dp``, TP ``tp`` with sequence parallelism), both models run
one whole step's forward and backward, token ids and labels to the loss, on the meta
device under ``MemoryTracer``, rank 0 of the layout, batch 1, ``seq_len`` tokens:

- torchtitan 0.3.0: ``model_spec.model.build()`` on meta after ``update_from_config``
  (``torchtitan/trainer.py`` ``Trainer.__init__``), then ``model_spec.parallelize_fn``
  (``torchtitan/models/llama3/parallelize.py`` ``parallelize_llama``: TP when enabled, then
  ``apply_fsdp_to_decoder``, FSDP2 ``fully_shard`` per block, the embedding, ``[norm,
  lm_head]`` and the root, bf16 parameters and fp32 gradient reduction) with activation
  checkpointing off and compile off, under a fake process group and the patches of
  ``tracemem.oracle.torchtitan_patches``; the loss is ``config.loss.build()``
  (``CrossEntropyLoss``, ``torchtitan/components/loss.py``), as
  ``Trainer._forward_backward_body`` runs it;
- tracemem: ``modeling.parallel.build_rank(cfg, ParallelConfig(zero=3, precision="fsdp2"),
  0, kernels="torch")`` of the ModelConfig the torchtitan front door reads from the same
  config (``tracemem.frontdoors.torchtitan.torchtitan_model_config``), with
  ``tracemem.zero3.Zero3Gathers.for_layout`` installed (FSDP2's own buffers over the FSDP
  group, ``fsdp2_group``: copy-in, flat all-gather output, one buffer per parameter, the
  world-size-1 copies; ``[norm, head]`` one unit).

Parts (``compare.LayerBytes``): -1 the embedding, each decoder layer, ``num_layers`` the
output (final norm, head, loss); per part the bytes its forward made that are alive when
the forward ends, its forward and backward peaks (above what was alive when the part's
first allocation ran) and its parameter bytes (the rank's fp32 FSDP2 shards on
torchtitan's side; tracemem: 4 B per element of its TP-local parameters / DP, the
``fsdp2`` recipe's fp32 sharded parameter).

Every known difference is a row of ``TITAN_RESIDUE``; ``unexplained`` lists the rest and
``run_command`` returns exit code 1 when anything is unexplained.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tracemem.oracle.compare import LayerBytes, _layer_bytes, _part_index

__all__ = ["TitanCase", "TITAN_CASES", "TitanResult", "TitanRule", "TITAN_RESIDUE",
           "titan_residue", "unexplained", "run_case", "format_results", "results_json",
           "run_command"]


@dataclass(frozen=True)
class TitanCase:
    """One layout of torchtitan's ``ParallelDims``: ``dp`` (``data_parallel_shard_degree``,
    FSDP2), ``tp`` (``tensor_parallel_degree``) with ``sp`` (``enable_sequence_parallel``,
    torchtitan's default); world size ``dp * tp``. ``module`` / ``config``: the torchtitan
    config-registry function; ``seq_len``: ``training.seq_len`` (batch 1)."""

    dp: int = 1
    tp: int = 1
    sp: bool = True
    module: str = "llama3"
    config: str = "llama3_debugmodel_ce_loss"
    seq_len: int = 16
    spmd_backend: str = "spmd_types"  # parallelism.spmd_backend (torchtitan's default)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    @property
    def name(self) -> str:
        sp = "+SP" if self.sp and self.tp > 1 else ""
        return f"{self.module} dp_shard {self.dp} TP{self.tp}{sp}"

    def overrides(self) -> list[str]:
        """The torchtitan flags of this layout (``--section.option VALUE``)."""
        return ["--compile.no-enable", "--training.local_batch_size", "1",
                "--training.seq_len", str(self.seq_len),
                "--parallelism.data_parallel_shard_degree", str(self.dp),
                "--parallelism.tensor_parallel_degree", str(self.tp),
                "--parallelism.spmd_backend", self.spmd_backend,
                "--parallelism.enable_sequence_parallel" if self.sp else
                "--parallelism.no-enable-sequence-parallel"]


# FSDP2 degree 2 runs under spmd_backend partial_dtensor: under torchtitan's default
# spmd_types, fully_shard with dp_mesh_dims refuses the plain (not distributed) parameters
# (torch 2.13 _fsdp_param.py _init_sharding_spec) on this fake-group, meta-device run
TITAN_CASES: tuple[TitanCase, ...] = (
    TitanCase(),
    TitanCase(dp=2, spmd_backend="partial_dtensor"),
)


@dataclass
class TitanResult:
    case: TitanCase
    cfg: object = None
    torchtitan: dict[int, LayerBytes] = field(default_factory=dict)
    tracemem: dict[int, LayerBytes] = field(default_factory=dict)

    @property
    def equal(self) -> bool:
        return all(self.torchtitan[i].totals == self.tracemem.get(i, LayerBytes(0, 0, 0, 0))
                   .totals for i in self.torchtitan)

    @property
    def unexplained(self) -> list[str]:
        return unexplained(self)


# ---------------------------------------------------------------------------- the runs
def _config(case: TitanCase):
    from tracemem.frontdoors.torchtitan import torchtitan_config

    # torchtitan logs host-side notes on the root logger while it builds a config (no
    # tokenizer assets, no checkpoint to load): none concerns memory; the oracle prints
    # nothing on stderr
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        config = torchtitan_config(case.module, case.config, case.overrides())
    finally:
        logging.disable(previous)
    # activation checkpointing off (tyro's activation-checkpoint:none subcommand is the
    # config's None): what the torch profile's recompute "none" traces
    config.activation_checkpoint = None
    return config


def _param_bytes(model, part_of) -> dict[int, int]:
    out: dict[int, int] = {}
    for name, p in model.named_parameters():
        part = part_of(name)
        if part is None:
            continue
        local = p.to_local() if hasattr(p, "to_local") else p
        out[part] = out.get(part, 0) + local.numel() * local.element_size()
    return out


def _trace_step(model, step, part_of, params: dict[int, int], seq_len: int,
                state=(), after_backward=lambda: None) -> dict[int, LayerBytes]:
    """Trace ``step(tokens, labels)`` -> a scalar loss, forward then backward; tokens and
    labels ``(1, seq_len)`` int64 made before the trace (the data loader's)."""
    from tracemem.tracer import MemoryTracer

    tracer = MemoryTracer(rounding=None, devices={"meta"})
    inputs = tuple(torch.zeros((1, seq_len), dtype=torch.long, device="meta")
                   for _ in range(2))
    tracer.track_external(model, list(state), list(inputs))
    with tracer, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = step(*inputs)
        end_forward = len(tracer.events) - 1
        loss.backward()
        after_backward()
        del loss
    return _layer_bytes(tracer, part_of, params, end_forward)


def _run_torchtitan(case: TitanCase):
    from tracemem.oracle import torchtitan_patches as patches

    patches.require_torchtitan()
    config = _config(case)
    with patches.fake_process_group(case.world_size), patches.applied(), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchtitan.config import TORCH_DTYPE_MAP
        from torchtitan.distributed import ParallelDims
        from torchtitan.distributed import utils as dist_utils
        from torchtitan.tools import utils

        # Trainer.__init__ (torchtitan/trainer.py): the SPMD backend the loss and the
        # distributed helpers read
        dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
        parallel_dims = ParallelDims.from_config(config.parallelism, case.world_size)
        spec = config.model_spec
        model_config = spec.model
        model_config.update_from_config(config=config)
        with torch.device("meta"), utils.set_default_dtype(
                TORCH_DTYPE_MAP[config.training.dtype]):
            model = model_config.build()
        model = spec.parallelize_fn(model, parallel_dims=parallel_dims,
                                    training=config.training,
                                    parallelism=config.parallelism,
                                    compile_config=config.compile, ac_config=None,
                                    dump_folder="/nonexistent")
        model.train()
        loss_fn = config.loss.build(compile_config=config.compile)
        mask = patches.causal_block_mask(case.seq_len)
        valid = torch.tensor(case.seq_len, device="meta")
        n = len(model_config.layers)
        part = _part_index("layers.", ("tok_embeddings",), ("norm", "lm_head"), n)
        params = _param_bytes(model, part)

        def step(tokens, labels):
            pred = model(tokens, attention_masks=mask)
            loss, _ = loss_fn(pred, labels, valid)
            return loss

        # MemoryTracer.track_external registers a DTensor parameter's wrapper, not its local
        # shard, whose storage it would otherwise first see as an op input in the forward
        # (category input, born mid-step): the shards are state held before the step
        shards = [p._local_tensor for p in model.parameters() if hasattr(p, "_local_tensor")]
        blocks = [t for t in mask.as_tuple() if isinstance(t, torch.Tensor)]
        buffers = [*shards, *blocks, valid]
        return _trace_step(model, step, part, params, case.seq_len, buffers), spec


def _run_tracemem(cfg, case: TitanCase) -> dict[int, LayerBytes]:
    from modeling.common.routing import Balanced
    from modeling.kernels import get_profile
    from modeling.parallel import build_rank
    from tracemem.parallel import ParallelConfig
    from tracemem.zero3 import Zero3Gathers

    par = ParallelConfig.create(cfg, world_size=case.world_size, tp=case.tp,
                                sp=case.sp and case.tp > 1, zero=3, precision="fsdp2")
    # one step from scratch: no gradients before it, as after torchtitan's
    # zero_grad(set_to_none=True) (--training.disable_cuda_graphs; the first step of a run)
    kernels = get_profile("torch", zero_grad_set_to_none=True)
    model = build_rank(cfg, par, 0, dtype=torch.bfloat16, kernels=kernels)
    gathers = Zero3Gathers.for_layout(par, kernels=kernels).install(model)
    part = _part_index("layers.", ("embed",), ("norm", "head"), cfg.num_layers)
    params = {k: v * 2 // case.dp for k, v in _param_bytes(model, part).items()}
    routing = Balanced()

    def step(tokens, labels):
        return model(tokens, labels, routing)

    try:
        # FSDP2's root final callback reshards what is still gathered (Zero3Gathers)
        out = _trace_step(model, step, part, params, case.seq_len,
                          after_backward=gathers.end_backward)
    finally:
        gathers.remove()
    return out


def run_case(case: TitanCase) -> TitanResult:
    """Trace both models for ``case``.

    Raises:
        TracememError: torchtitan missing or not 0.3.0; a layout torchtitan refuses.
    """
    from tracemem.frontdoors.torchtitan import torchtitan_model_config

    # read before update_from_config fills in its sharding configs
    cfg = torchtitan_model_config(_config(case).model_spec)
    titan, _ = _run_torchtitan(case)
    return TitanResult(case, cfg, titan, _run_tracemem(cfg, case))


# ---------------------------------------------------------------------------- the residue
@dataclass(frozen=True)
class _Dims:
    """What the residue's bytes are made of, for one part of one layout: ``s`` tokens, ``n``
    attention heads, ``n_kv`` key / value heads and ``d`` head dim on this rank, ``h`` the
    hidden size, ``ffn`` the MLP's intermediate size on this rank, ``part`` "layer",
    "embedding" or "output"."""

    case: TitanCase
    part: str
    s: int
    n: int
    d: int
    h: int
    n_kv: int
    ffn: int


@dataclass(frozen=True)
class TitanRule:
    """One row of ``TITAN_RESIDUE``: torchtitan minus tracemem, bytes (``kept``,
    ``forward_peak``, ``backward_peak``) of each part where ``applies``; ``storages`` /
    ``tracemem_storages``: the (bytes, dtype) of each kept storage only that side has;
    ``reason`` cites the source that makes it."""

    tensor: str
    where: str
    applies: Callable[[_Dims], bool]
    kept: Callable[[_Dims], int]
    forward_peak: Callable[[_Dims], int]
    backward_peak: Callable[[_Dims], int]
    storages: Callable[[_Dims], tuple]
    tracemem_storages: Callable[[_Dims], tuple]
    reason: str


def _pad32(s: int) -> int:
    return -(-s // 32) * 32


TITAN_RESIDUE: tuple[TitanRule, ...] = (
    TitanRule(
        "attention statistics: flex logsumexp and max_scores [b, n, s] fp32 (torchtitan) / "
        "SDPA logsumexp [b, n, pad32(s)] fp32 and philox seed, offset int64 (tracemem)",
        "every layer", lambda d: d.part == "layer",
        kept=lambda d: 2 * d.n * d.s * 4 - (d.n * _pad32(d.s) * 4 + 2 * 8),
        forward_peak=lambda d: 0,
        backward_peak=lambda d: d.n * _pad32(d.s) * 4 + 2 * 8 - 2 * d.n * d.s * 4,
        storages=lambda d: ((d.n * d.s * 4, "float32"),) * 2,
        tracemem_storages=lambda d: ((d.n * _pad32(d.s) * 4, "float32"), (8, "int64"),
                                     (8, "int64")),
        reason="torchtitan 0.3.0 models/common/attention.py FlexAttention runs flex_attention: "
               "torch 2.13 torch/_higher_order_ops/flex_attention.py flex_attention_fake_impl "
               "(the fused kernel's outputs) makes logsumexp and max_scores [B, H, L] fp32, "
               "both alive at the end of the forward (FlexAttentionAutogradOp saves "
               "logsumexp; max_scores is an output of the autograd Function nobody frees "
               "before backward); tracemem's torch profile runs SDPA's memory-efficient "
               "kernel: logsumexp padded to a multiple of 32 queries, philox seed and offset. "
               "Each side frees its own in the attention's backward, before the layer's "
               "backward peak (FSDP2's reduce-scatter at degree 1, the wqkv gradient GEMMs at "
               "degree 2), so there the difference is the kept one reversed"),
    TitanRule(
        "flex_attention's eager score_mod examples: 4 int32 and 2 bf16 scalars", "every layer",
        lambda d: d.part == "layer",
        kept=lambda d: 4 * 4 + 2 * 2, forward_peak=lambda d: 0, backward_peak=lambda d: 0,
        storages=lambda d: ((4, "int32"),) * 4 + ((2, "bfloat16"),) * 2,
        tracemem_storages=lambda d: (),
        reason="torch 2.13 flex_attention.py flex_attention_autograd makes example_vals (the "
               "score and its b, h, m, n indices: query.new_zeros(()), four int32) and "
               "create_fw_bw_graph an example output (_from_fun, bf16), held by the traced "
               "score_mod graphs until backward; the eager path does this every call (the "
               "oracle's patch), torch.compile once at compile time: not a GPU allocation of "
               "a compiled torchtitan step"),
    TitanRule(
        "FSDP2's world-size-1 copy-out: one bf16 cast beside the next, in each side's "
        "parameter order", "every layer, FSDP degree 1", lambda d: d.part == "layer"
        and d.case.dp == 1,
        kept=lambda d: 0,
        forward_peak=lambda d: (_copy_out_peak(_titan_block_order(d))
                                - _copy_out_peak(_tracemem_block_order(d))),
        backward_peak=lambda d: 0, storages=lambda d: (), tracemem_storages=lambda d: (),
        reason="torch 2.13 _fsdp_param_group.py FSDPParamGroup.wait_for_unshard at world "
               "size 1 copies each parameter from its bf16 cast (all_gather_input = "
               "fsdp_param.all_gather_inputs[0]) into its unsharded buffer; the loop "
               "variable holds the previous cast until the next is made, so the copy-out "
               "peaks at max over i of (the unsharded buffers before parameter i, plus the "
               "casts of parameters i - 1 and i); tracemem.zero3 does the same in tracemem's "
               "order. torchtitan 0.3.0 models/common/decoder.py TransformerBlock registers "
               "attention (one fused qkv_linear.wqkv, wo), feed_forward (w1, w2, w3), then "
               "attention_norm and ffn_norm; tracemem's Block registers attn_norm, wqkv (the "
               "torch profile's fused_qkv), wo, ffn_norm, w1, w2, w3: the same bytes "
               "gathered, a different order "
               "(modeling's module layout, not a gather fault)"),
)


def _copy_out_peak(sizes: list[int]) -> int:
    """Bytes at the peak of FSDP2's world-size-1 copy-out of parameters of ``sizes`` bf16
    bytes, in order: unsharded buffers so far plus the previous and the current cast."""
    return max(sum(sizes[:i]) + (sizes[i - 1] if i else 0) + sizes[i]
               for i in range(len(sizes)))


def _titan_block_order(d: _Dims) -> list[int]:
    """torchtitan's TransformerBlock parameters, bf16 bytes, in registration order."""
    h, q, kv, f = d.h, d.n * d.d, d.n_kv * d.d, d.ffn
    return [2 * x for x in ((q + 2 * kv) * h, h * q, f * h, h * f, f * h, h, h)]


def _tracemem_block_order(d: _Dims) -> list[int]:
    """tracemem's Block parameters (GQA, SwiGLU MLP), bf16 bytes, in registration order."""
    h, q, kv, f = d.h, d.n * d.d, d.n_kv * d.d, d.ffn
    return [2 * x for x in (h, (q + 2 * kv) * h, h * q, h, f * h, h * f, f * h)]


def _dims(case: TitanCase, cfg, part: int) -> _Dims:
    kind = "embedding" if part < 0 else "output" if part >= cfg.num_layers else "layer"
    return _Dims(case, kind, case.seq_len, cfg.num_attention_heads // case.tp,
                 cfg.head_dim, cfg.hidden_size, cfg.num_key_value_heads // case.tp,
                 cfg.intermediate_size // case.tp)


def titan_residue(case: TitanCase, cfg, part: int) -> list[TitanRule]:
    """The rows of ``TITAN_RESIDUE`` that apply to ``part`` of ``case``."""
    d = _dims(case, cfg, part)
    return [r for r in TITAN_RESIDUE if r.applies(d)]


def _diff(a: LayerBytes, b: LayerBytes) -> tuple[list, list]:
    only_a, only_b = list(a.kept_storages), list(b.kept_storages)
    for key in (lambda s: (s[0], s[1], s[4]), lambda s: (s[0], s[1])):
        for item in list(only_a):
            match = next((t for t in only_b if key(t) == key(item)), None)
            if match is not None:
                only_a.remove(item)
                only_b.remove(match)
    return only_a, only_b


def unexplained(result: TitanResult) -> list[str]:
    """One line per difference the residue does not name: a part's kept, forward peak or
    backward peak difference other than the residue's sum, unequal parameter bytes, a part
    on one side only, a kept storage on one side without a residue row for it."""
    out, name = [], result.case.name
    for part in sorted(set(result.torchtitan) | set(result.tracemem)):
        where = f"{name}, part {_part_name(result, part)}"
        if part not in result.torchtitan or part not in result.tracemem:
            out.append(f"{where}: traced on one side only")
            continue
        a, b = result.torchtitan[part], result.tracemem[part]
        d = _dims(result.case, result.cfg, part)
        rows = titan_residue(result.case, result.cfg, part)
        for attr in ("kept", "forward_peak", "backward_peak"):
            got = getattr(a, attr) - getattr(b, attr)
            want = sum(getattr(r, attr)(d) for r in rows)
            if got != want:
                out.append(f"{where}: {attr} differs by {got:+,} B; the residue "
                           f"explains {want:+,} B")
        if a.params != b.params:
            out.append(f"{where}: params {a.params:,} / {b.params:,} B")
        only_a, only_b = _diff(a, b)
        for side, items, want in (
                ("torchtitan", only_a, [s for r in rows for s in r.storages(d)]),
                ("tracemem", only_b, [s for r in rows for s in r.tracemem_storages(d)])):
            got = sorted((s[0], s[1]) for s in items)
            if got != sorted(want):
                out.append(f"{where}: kept storages only on {side}'s side "
                           f"{[(s[0], s[1], list(s[2]), s[4], s[3]) for s in items]}; the "
                           f"residue names {sorted(want)}")
    return out


def _part_name(result: TitanResult, part: int) -> str:
    if part < 0:
        return "embedding"
    return "output" if part >= result.cfg.num_layers else str(part)


def format_results(results: list[TitanResult]) -> str:
    """One row per (layout, part): torchtitan's and tracemem's bytes ('a / b' where they
    differ), the residue and the verdict (``tracemem.oracle.compare.oracle_report``)."""
    from tracemem.oracle.compare import byte_cells, oracle_report

    rows = [[r.case.name, _part_name(r, i),
             *byte_cells(r.torchtitan[i], r.tracemem.get(i, LayerBytes(0, 0, 0, 0)))]
            for r in results for i in sorted(r.torchtitan)]
    legend = ("Cells: equal bytes, or 'torchtitan / tracemem'; kept: what the part's forward "
              "made that is alive when the forward ends (saved for backward); the peaks are "
              "above what was alive at the part's first allocation. dp_shard: FSDP2's shard "
              "degree (data_parallel_shard_degree). Rank 0 of each layout, b=1, "
              "s=16, torchtitan 0.3.0 llama3 debugmodel (FlexAttention, CrossEntropyLoss, "
              "no activation checkpointing, no compile) under its own parallelize_llama "
              "(FSDP2) vs tracemem build_rank kernels=torch with Zero3Gathers. Parts: the "
              "embedding, each layer, the output (final norm, head, loss).")
    return oracle_report(
        rows, "part", legend, [], "The residue (torchtitan minus tracemem):", TITAN_RESIDUE,
        [line for r in results for line in r.unexplained],
        "tracemem.oracle.torchtitan_oracle.TITAN_RESIDUE")


def results_json(results: list[TitanResult]) -> list[dict]:
    """Per layout: both sides' bytes per part and the unexplained differences."""
    out = []
    for r in results:
        parts = {_part_name(r, i): {side: {k: getattr(b[i], k) for k in
                                           ("kept", "forward_peak", "backward_peak",
                                            "params")}
                                    for side, b in (("torchtitan", r.torchtitan),
                                                    ("tracemem", r.tracemem)) if i in b}
                 for i in sorted(r.torchtitan)}
        out.append({"layout": r.case.name, "equal": r.equal,
                    "explained": not r.unexplained, "unexplained": r.unexplained,
                    "parts": parts})
    return out


def run_command(json_out: bool = False, cases=None) -> tuple[str, int]:
    """``tracemem validate --against torchtitan``: every case of ``cases`` (default
    ``TITAN_CASES``) run; returns the text (the table, or JSON with ``json_out``) and the
    exit code: 0 when every difference is in ``TITAN_RESIDUE``, 1 otherwise.

    Raises:
        TracememError: torchtitan missing or not 0.3.0.
    """
    import json

    results = [run_case(case) for case in (TITAN_CASES if cases is None else cases)]
    bad = [line for r in results for line in r.unexplained]
    text = (json.dumps({"ok": not bad, "parts": results_json(results), "unexplained": bad,
                        "residue": [{"tensor": r.tensor, "where": r.where, "reason": r.reason}
                                    for r in TITAN_RESIDUE]}, indent=2)
            if json_out else format_results(results))
    return text, 1 if bad else 0
