"""Static memory from Megatron-Core's own objects (issue 23, item 1), held against
``tracemem.static.static_memory`` per rank.

For one small DeepSeek-architecture config (``oracle_model_config(4)``: deepseek-tiny with 4
layers, the first dense, no MTP, bf16) and one layout (``StaticCase``: TP with SP, CP, EP,
ETP, PP, VPP, DP from the world size, ``--overlap-grad-reduce`` / ``--overlap-param-gather``),
global rank ``rank`` is built twice on the meta device:

- Megatron-Core 0.16.1, under the fake process group and the patches of
  ``tracemem.oracle.megatron_patches``: ``GPTModel`` (embedding and output layer included)
  for each of the rank's model chunks (``pre_process`` / ``post_process`` / ``vp_stage`` as
  Megatron-LM's ``get_model`` sets them), each wrapped in ``DistributedDataParallel``
  (``use_distributed_optimizer=True``, ``grad_reduce_in_fp32=True``: Megatron-LM's defaults
  with ``--use-distributed-optimizer`` and bf16; bucketing disabled on chunks after the first,
  as ``get_model`` does), then ``get_megatron_optimizer`` (Adam, ``bf16``, the distributed
  optimizer), and one optimizer step: ``prepare_grads`` and ``step_with_ready_grads`` (the
  step without the gradient norm and clipping, which read a value with ``.item()``; they
  allocate no static memory). Read per rank: the bytes of every DDP buffer's ``param_data``
  and ``grad_data``, of the distributed optimizer's fp32 main-parameter shards
  (``shard_fp32_from_float16_groups``) and of every device tensor of Adam's state (its
  ``step`` counters are host tensors, not counted), and the model's persistent buffers;
- tracemem: ``modeling.parallel.build_rank(..., kernels="megatron-te")`` and
  ``tracemem.static.static_memory(model, par, rank)``.

The precision-aware optimizer (``--use-precision-aware-optimizer``) is not built: its
optimizer is Transformer Engine's ``FusedAdam`` (optimizer/__init__.py
``_get_megatron_optimizer_based_on_param_groups``), which does not install without CUDA.
"""

from __future__ import annotations

import warnings
from unittest import mock
from dataclasses import dataclass, field

import torch

__all__ = ["StaticCase", "STATIC_CASES", "StaticBytes", "StaticResult", "STATIC_RESIDUE",
           "run_static_case", "run_static_cases", "format_results", "results_json"]

FIELDS = ("param_bytes", "grad_bytes", "optimizer_bytes", "buffer_bytes", "step_peak_bytes")


@dataclass(frozen=True)
class StaticCase:
    """One layout and one global rank; ``world_size`` ranks (DP = world / (TP x CP x PP))."""

    world_size: int
    rank: int = 0
    tp: int = 1
    sp: bool = False
    cp: int = 1
    ep: int = 1
    etp: int = 1
    pp: int = 1
    vpp: int = 1
    overlap: bool = False  # --overlap-grad-reduce --overlap-param-gather
    bucket_size: int | None = None  # --ddp-bucket-size (elements), with overlap
    grad_reduce_in_bf16: bool = False  # --grad-reduce-in-bf16: a bf16 grad buffer
    tied: bool = False  # tied word embeddings (shared_embedding buckets under PP)
    instances: int = 1  # --num-distributed-optimizer-instances

    @property
    def name(self) -> str:
        parts = [f"TP{self.tp}{'+SP' if self.sp else ''}"]
        for label, value in (("CP", self.cp), ("EP", self.ep), ("ETP", self.etp),
                             ("PP", self.pp), ("VPP", self.vpp)):
            if value > 1:
                parts.append(f"{label}{value}")
        dp = self.world_size // (self.tp * self.cp * self.pp)
        parts.append(f"DP{dp}")
        if self.overlap:
            parts.append("overlap" + (f" bucket {self.bucket_size:,}" if self.bucket_size
                                      else ""))
        if self.grad_reduce_in_bf16:
            parts.append("bf16 grads")
        if self.tied:
            parts.append("tied embeddings")
        if self.instances > 1:
            parts.append(f"{self.instances} optimizer instances")
        return f"{' '.join(parts)}, rank {self.rank}"


STATIC_CASES: tuple[StaticCase, ...] = (
    StaticCase(world_size=1),
    StaticCase(world_size=4),
    StaticCase(world_size=4, rank=3),
    StaticCase(world_size=8, tp=2, sp=True, rank=7),
    StaticCase(world_size=8, ep=4),
    StaticCase(world_size=8, ep=4, rank=7),
    StaticCase(world_size=8, tp=2, sp=True, ep=2, etp=2, rank=5),
    StaticCase(world_size=8, cp=2, rank=3),
    StaticCase(world_size=4, pp=2, rank=0),
    StaticCase(world_size=4, pp=2, rank=3),
    StaticCase(world_size=4, pp=2, vpp=2, rank=1),
    StaticCase(world_size=4, pp=2, vpp=2, rank=2),
    StaticCase(world_size=4, overlap=True, bucket_size=20_000, rank=1),
    StaticCase(world_size=8, ep=4, overlap=True, bucket_size=20_000, rank=6),
    StaticCase(world_size=4, grad_reduce_in_bf16=True, rank=3),
    StaticCase(world_size=8, ep=4, grad_reduce_in_bf16=True, rank=7),
    StaticCase(world_size=4, pp=2, tied=True, rank=0),
    StaticCase(world_size=4, pp=2, tied=True, rank=3),
    StaticCase(world_size=4, pp=2, tied=True, overlap=True, bucket_size=20_000, rank=1),
    StaticCase(world_size=8, instances=2, rank=7),
    StaticCase(world_size=8, ep=2, instances=2, rank=6),
)


@dataclass(frozen=True)
class StaticBytes:
    """One side's static bytes of one rank (``tracemem.static.StaticMemory``'s fields) and
    ``step_peak_bytes``: the most the optimizer step (after the first, whose state creation
    is static memory) holds above what was alive before it: Megatron-Core's
    ``prepare_grads`` + ``step_with_ready_grads``, tracemem's step O
    (``tracemem.optimizer_step.trace_optimizer_step(..., optimizer="torch")``)."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    buffer_bytes: int
    step_peak_bytes: int = 0


@dataclass
class StaticResult:
    case: StaticCase
    megatron: StaticBytes
    tracemem: StaticBytes
    notes: dict = field(default_factory=dict)

    @property
    def unexplained(self) -> list[str]:
        """Every field that differs by other than ``STATIC_RESIDUE`` says."""
        out = []
        for name in FIELDS:
            got = getattr(self.megatron, name) - getattr(self.tracemem, name)
            want = sum(r[1](self) for r in STATIC_RESIDUE if r[0] == name)
            if got != want:
                out.append(f"static {self.case.name}: {name} "
                           f"{getattr(self.megatron, name):,} / "
                           f"{getattr(self.tracemem, name):,} B (Megatron-Core / tracemem); "
                           f"the residue explains {want:+,} B")
        return out


# (field, bytes as a function of the result, tensor, reason): Megatron-Core minus tracemem.
# Static memory itself agrees to the byte at every case; the one row is the optimizer step.
STATIC_RESIDUE: tuple = (
    ("step_peak_bytes", lambda r: r.notes["step_residue"],
     "Adam's foreach sqrt temporary and the fp32 gradient copies",
     "tracemem.optimizer_step (optimizer='torch') steps one torch Adam over one flat fp32 "
     "master per kind of ceil(N / group) elements (dense over DP x CP, experts over EDP even "
     "at EP 1), so _foreach_sqrt copies every master's second moment at once; Megatron-Core "
     "chains a DistributedOptimizer per kind (optimizer/__init__.py get_megatron_optimizer: "
     "experts apart only with EP > 1) and steps each parameter group (weight decay / none, "
     "_get_param_groups) alone (torch/optim/adamw.py _multi_tensor_adamw per param_group): "
     "its step holds 4 B x the largest group's shard elements "
     "(tracemem.static.megatron_optimizer_groups), plus with --grad-reduce-in-bf16 the fp32 "
     "copies of every shard element (distrib_optimizer.py _copy_model_grads_to_main_grads); "
     "the bytes are those two formulas' difference, computed from tracemem's model"),
)


def _layout(case: StaticCase, cfg):
    from tracemem.parallel import ParallelConfig
    return ParallelConfig.create(cfg, world_size=case.world_size, tp=case.tp, sp=case.sp,
                                 cp=case.cp, ep=case.ep, etp=case.etp, pp=case.pp,
                                 vpp=case.vpp, zero=1,
                                 grad_reduce_in_bf16=case.grad_reduce_in_bf16 or None,
                                 num_distributed_optimizer_instances=case.instances)


def _tracemem(case: StaticCase, cfg) -> StaticBytes:
    from modeling.parallel import build_rank
    from tracemem.static import static_memory

    from tracemem.optimizer_step import trace_optimizer_step
    from tracemem.tracer import MemoryTracer

    from tracemem.optimizer_step import _shard_numels
    from tracemem.static import megatron_optimizer_groups

    par = _layout(case, cfg)
    model = build_rank(cfg, par, case.rank, dtype=torch.bfloat16, kernels="megatron-te")
    mem = static_memory(model, par, case.rank, overlap_grad_reduce=case.overlap,
                        bucket_size=case.bucket_size)
    tracer = MemoryTracer(rounding=None, devices={"meta"})
    trace_optimizer_step(model, par, tracer, "torch")
    step = _step_peak(tracer)
    # the step residue by formula (STATIC_RESIDUE): Megatron-Core's per-group step less
    # tracemem's one flat step, fp32 (4 B) temporaries
    groups = megatron_optimizer_groups(model, par, case.rank, overlap_grad_reduce=case.overlap,
                                       bucket_size=case.bucket_size)
    megatron = max(groups.values()) + (sum(groups.values()) if case.grad_reduce_in_bf16
                                       else 0)
    ours = sum(_shard_numels(model, par, "optimizer_states")) + (
        sum(_shard_numels(model, par, "step_grad_copies")) if case.grad_reduce_in_bf16
        else 0)
    notes = {"step_residue": 4 * (megatron - ours), "optimizer_groups": groups}
    return StaticBytes(mem.param_bytes, mem.grad_bytes, mem.optimizer_bytes, mem.buffer_bytes,
                       step), notes


def _step_peak(tracer) -> int:
    """The bytes the step made that are alive at its peak (what was alive before it is
    registered as external and not counted)."""
    from tracemem.categories import Phase
    events = tracer.events
    if not events:
        return 0
    at = max(range(len(events)), key=lambda i: events[i].total_bytes)
    return sum(s.nbytes for s in tracer.live_at(at) if s.phase is not Phase.EXTERNAL)


def _device_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors
               if isinstance(t, torch.Tensor) and t.device.type == "meta")


def _megatron(case: StaticCase, cfg) -> tuple[StaticBytes, dict]:
    from tracemem.oracle import megatron_patches as patches
    from tracemem.oracle.compare import OracleCase, _megatron_config
    from tracemem.oracle.megatron_spec import gpt_model_chunk
    from tracemem.tracer import MemoryTracer

    patches.require_megatron()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TE / Apex absent; c10d's deprecated names
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        with patches.fake_process_groups(world_size=case.world_size, rank=case.rank,
                                         tp=case.tp, ep=case.ep, etp=case.etp, pp=case.pp,
                                         cp=case.cp, vpp=case.vpp,
                                         instances=case.instances), patches.applied():
            extra = dict(pipeline_model_parallel_size=case.pp, context_parallel_size=case.cp,
                         pipeline_dtype=torch.bfloat16)
            if case.vpp > 1:
                extra["virtual_pipeline_model_parallel_size"] = case.vpp
            config = _megatron_config(cfg, OracleCase(tp=case.tp, sp=case.sp, ep=case.ep,
                                                      etp=case.etp), **extra)
            chunks = []
            for vp in range(case.vpp):
                model = gpt_model_chunk(config, cfg, vp, case.vpp,
                                        share_embeddings_and_output_weights=case.tied)
                ddp_config = DistributedDataParallelConfig(
                    grad_reduce_in_fp32=not case.grad_reduce_in_bf16,
                    use_distributed_optimizer=True,
                    overlap_grad_reduce=case.overlap, overlap_param_gather=case.overlap,
                    bucket_size=case.bucket_size,
                    num_distributed_optimizer_instances=case.instances)
                chunks.append(DistributedDataParallel(config, ddp_config, model,
                                                      disable_bucketing=vp > 0))
            optimizer = get_megatron_optimizer(
                OptimizerConfig(optimizer="adam", lr=1e-4, bf16=True,
                                use_distributed_optimizer=True, clip_grad=0.0),
                chunks, use_gloo_process_groups=False)
            opts = getattr(optimizer, "chained_optimizers", [optimizer])
            for opt in opts:  # torch/optim/optimizer.py _default_to_fused_or_foreach picks
                # foreach for CUDA tensors, the for-loop for meta ones: as on a GPU
                for group in opt.optimizer.param_groups:
                    group["foreach"] = True

            def step():
                optimizer.zero_grad()
                for chunk in chunks:
                    for p in chunk.module.parameters():
                        p.main_grad.zero_()
                optimizer.prepare_grads()
                # step_with_ready_grads ends with the parameters' all-gather
                # (DDP.start_param_sync unless --overlap-param-gather), coalesced c10d ops
                # with no meta kernel; it writes into the param buffer in place: skipped
                with mock.patch.object(DistributedDataParallel, "start_param_sync",
                                       lambda self, *a, **k: None):
                    optimizer.step_with_ready_grads()

            step()  # the first: Adam's state is made (static memory)
            tracer = MemoryTracer(rounding=None, devices={"meta"})
            buffers = [b for c in chunks for b in c.buffers + c.expert_parallel_buffers]
            tracer.track_external([c.module for c in chunks],
                                  [b.param_data for b in buffers if b.param_data is not None],
                                  [b.grad_data for b in buffers],
                                  [o.optimizer for o in opts],
                                  [p for o in opts for g in o.shard_fp32_from_float16_groups
                                   for p in g])
            with tracer:
                step()  # every later one
            step_peak = _step_peak(tracer)

            buffers = [b for c in chunks for b in c.buffers + c.expert_parallel_buffers]
            params = _device_bytes(b.param_data for b in buffers if b.param_data is not None)
            grads = _device_bytes(b.grad_data for b in buffers)
            state = 0
            for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
                state += _device_bytes(p for g in opt.shard_fp32_from_float16_groups
                                       for p in g)
                state += _device_bytes(v for s in opt.optimizer.state.values()
                                       for v in s.values())
            persistent = _device_bytes(
                t for c in chunks for t in c.module.state_dict(keep_vars=True).values())
            persistent -= sum(_device_bytes([p]) for c in chunks
                              for p in c.module.parameters())
            notes = {"buffers": [(b.param_dtype, b.grad_dtype, b.numel, b.numel_unpadded,
                                  len(b.buckets)) for b in buffers]}
    return StaticBytes(params, grads, state, persistent, step_peak), notes


def run_static_case(case: StaticCase, cfg=None) -> StaticResult:
    """Both sides' static bytes of ``case`` (default config ``oracle_model_config(4)``).

    Raises:
        TracememError: megatron-core missing or not the pinned version; a bad layout.
    """
    from tracemem.oracle.compare import oracle_model_config

    import dataclasses
    cfg = cfg or oracle_model_config(4)
    if case.tied:
        cfg = dataclasses.replace(cfg, tie_word_embeddings=True)
    megatron, notes = _megatron(case, cfg)
    ours, more = _tracemem(case, cfg)
    return StaticResult(case, megatron, ours, notes | more)


def run_static_cases(cases=None) -> list[StaticResult]:
    """``run_static_case`` for each of ``cases`` (default ``STATIC_CASES``, read when
    called)."""
    return [run_static_case(c) for c in (STATIC_CASES if cases is None else cases)]


def format_results(results: list[StaticResult]) -> str:
    """One row per case: each field equal, or 'Megatron-Core / tracemem'."""
    from tabulate import tabulate

    rows = []
    for r in results:
        cells = []
        for name in FIELDS:
            a, b = getattr(r.megatron, name), getattr(r.tracemem, name)
            cells.append(f"{a:,}" if a == b else f"{a:,} / {b:,}")
        rows.append([r.case.name, *cells])
    table = tabulate(rows, headers=["static: layout, rank", "param buffer B", "grad buffer B",
                                    "optimizer state B", "buffers B", "step peak B"],
                     disable_numparse=True,
                     colalign=("left", "right", "right", "right", "right", "right"))
    bad = [line for r in results for line in r.unexplained]
    legend = ("Static memory per rank: Megatron-Core's DistributedDataParallel (distributed "
              "optimizer; fp32 main grads unless 'bf16 grads') and DistributedOptimizer "
              "(Adam, bf16) after one step, against tracemem.static.static_memory; step "
              "peak: what the next step holds above static memory, against tracemem's step "
              "O with optimizer='torch'; deepseek-tiny with 4 layers. Cells: equal bytes, or "
              "'Megatron-Core / tracemem'.")
    rules = [f"{i}. {r[2]} ({r[0]}): {r[3]}" for i, r in enumerate(STATIC_RESIDUE, 1)]
    verdict = ([f"FAIL: {len(bad)} static difference(s):", *(f"- {b}" for b in bad)] if bad
               else ["OK: static memory agrees to the byte at every case; the step peak "
                     "differs only by the residue above."])
    return "\n".join([table, "", legend, "", "The residue (Megatron-Core minus tracemem):",
                      *rules, "", *verdict])


def results_json(results: list[StaticResult]) -> list[dict]:
    return [{"layout": r.case.name, "world_size": r.case.world_size, "rank": r.case.rank,
             "megatron_core": {n: getattr(r.megatron, n) for n in FIELDS},
             "tracemem": {n: getattr(r.tracemem, n) for n in FIELDS},
             "unexplained": r.unexplained} for r in results]
