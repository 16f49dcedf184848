"""``estimate(job)``: the peak memory of every distinct rank of a training job (a
``tracemem.job.Job``), by tracing one rank per class on the meta device and replaying its
microbatches in pipeline-schedule order. The stages, each a function: ``rank_classes``,
``trace_classes`` (through a ``TraceCache``), ``replay_class``, ``allocator_row`` (or
``screened_row``), then the ``Estimate``, which carries its ``Job``.

For each rank class (a pipeline stage; under skewed routing, the stage's most loaded EP rank)
the rank's model (``build_rank``) runs two microbatches, forward and backward, under a
``MemoryTracer``; each forward and each backward is an event segment. The schedule
(``tracemem.schedules``) gives the rank's order of forward and backward steps; replaying the
segments in that order, with distinct storages per microbatch, on top of the static memory
(``tracemem.static``), gives the rank's memory at every event. Microbatches are independent
apart from gradient accumulation, which the second microbatch's segments capture, so the
replay is exact for what the tracer sees. The schedule's steady state is walked until the
replay's state provably repeats, then its remaining cycles are skipped (``tracemem.periodic``;
the same figures). ``estimate(screen=True)`` rejects a job on static memory alone before
tracing (``static_floors``), then on the replayed peak before the allocator.

Conventions, each a line item:
- Parameters are bf16 (every precision recipe trains in bf16) whatever the config's dtype.
- Gradients live in preallocated fp32 main-grad buffers (Megatron-Core DDP), counted in static
  memory; the bf16 gradient a backward produces is a transient, added to the main grad and
  freed at once.
- A stage keeps its received input until the microbatch's backward; its sent output's data is
  freed at once (Megatron's ``deallocate_output_tensor``, on by default). Under Megatron-Core's
  interleaved schedule the replay also holds the pipeline tensors its loop keeps, with or
  without its p2p overlap (``tracemem.schedules.megatron_refs``).
- Megatron-LM's batch: under the megatron orchestration and the schedules Megatron-LM runs,
  the stages that read the batch hold the dataloader's attention mask through each forward
  (``_dataloader_mask``; off with ``--no-create-attention-mask-in-dataloader``).
- The whole iteration: after the schedule's last step the optimizer step is replayed as step
  "O" (``tracemem.optimizer_step``: the distributed optimizer's fp32 gradient copies, the Adam
  kernel's temporaries); ``RankEstimate.peak_phase`` says which phase holds the peak.
- Below the dispatcher: with ``Job.gpu``, the workspaces a rank keeps (``tracemem.workspaces``:
  cuBLAS workspaces, TE's dummy weight gradients, Megatron's global memory buffer, RoPE's
  cache) are static blocks from the start of the step (``RankEstimate.workspace_bytes``);
  without a GPU none is counted. NCCL's own buffers are outside PyTorch's allocator.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from itertools import chain, islice
from pathlib import Path
from typing import NamedTuple

import torch

from modeling.common import cpu_offload, offload
from modeling.common.block import Block
from modeling import ModelConfig
from modeling.common.custom import CustomBlock
from modeling.kernels import KernelProfile, get_profile
from modeling.parallel.build import build_rank, coordinates
from modeling.parallel.groups import numel_by_kind
from modeling.parallel.pp import (
    backward_from,
    recv_backward,
    recv_forward,
    send_forward,
)
from modeling.common.routing import Counts, RoutingModel
from tracemem.categories import Category, Phase
from tracemem.schedules.megatron_refs import INTERLEAVED_REFERENCES, REFERENCE_NAMES
from tracemem.errors import TracememError
from tracemem.job import (  # noqa: F401  (re-exported: their home was here)
    MAX_EP_CLASSES,
    MAX_HBM_BYTES,
    MAX_MICROBATCHES,
    MAX_TOKENS,
    NON_PYTORCH_MEMORY_DEFAULT,
    Job,
    check_job,
    parse_bytes,
)
from tracemem.memory import MemoryTimeline, write_snapshot
from tracemem.memory.plot import check_plot_path, plot_timelines
from tracemem.memory.timeline import replay_through_allocator, step_at
from tracemem.offload import offload_static
from tracemem.optimizer_step import trace_optimizer_step
from tracemem.parallel import SHARDING, ParallelConfig
from tracemem.periodic import MAX_PROBES, ReplaySink, periodic_stretches, probed
from tracemem.schedules import Placement, Step, placement
from tracemem.recompute import apply_recompute_method
from tracemem.split_backward import backward_input
from tracemem.static import StaticMemory, fused_wgrad_modules, is_fused_wgrad, static_memory
from tracemem.tracer import MemoryEvent, MemoryTracer
from tracemem.zero3 import Zero3Gathers, fsdp2_group, pp_keeps_gathered

__all__ = ["RankEstimate", "Estimate", "estimate", "parse_bytes", "Segments", "ReplayPeak",
           "TraceCache", "CachedEvent", "check_job", "Job", "RankClass", "TracedClass",
           "rank_classes", "trace_classes", "replay_class", "screened_row", "allocator_row",
           "trace_key", "step_key", "replay_schedule", "replay_events", "ReplayedEvent",
           "segment_key"]



@dataclass(frozen=True)
class RankEstimate:
    """The peak of one rank class. Every ``*_bytes`` is what is alive at the peak.

    Attributes:
        pp_stage: pipeline rank; ep_rank: the EP rank traced (None when all are alike);
        ep_ranks: the EP ranks of the class, which trace alike (``ep_rank_classes``) and so
            share this peak (empty when all are alike);
        rank: the global rank traced; layers: its decoder layers.
        inflight_microbatches: microbatch forwards (model chunks) held at the peak.
        peak_phase: "forward", "backward" (B, I or W steps) or "optimizer" (the step after
            the schedule, ``tracemem.optimizer_step``): where the peak is; None: static alone.
        peak_step: the schedule step running at the peak (``"0F3"``, or ``"optimizer"``), or
            None if the static
            memory alone is the peak.
        peak_bytes: the peak; parameter / gradient / optimizer_state / buffer bytes come from
            ``static``; activation / comm_buffer / temporary / input bytes from the replay.
        allocated_peak_bytes, reserved_peak_bytes: what ``torch.cuda.max_memory_allocated``
            / ``max_memory_reserved`` would report: the same events through the simulated
            CUDA caching allocator (``tracemem.memory``; whole blocks, segments).
        fragmentation_bytes, largest_free_block_bytes: reserved minus allocated, and the
            largest cached free block, at the reserved peak; reserved_peak_step: the step
            running then.
        fits: reserved peak + non-PyTorch memory <= ``--hbm`` with no allocator OOM on the
            way (None without ``--hbm``); memory: the per-event ``MemoryTimeline``.
    """

    pp_stage: int
    ep_rank: int | None
    rank: int
    layers: list[int]
    inflight_microbatches: int
    peak_step: str | None
    peak_bytes: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    buffer_bytes: int
    activation_bytes: int
    comm_buffer_bytes: int
    temporary_bytes: int
    input_bytes: int
    zero3_gather_bytes: int
    static: StaticMemory = field(repr=False)
    by_module: dict[str, int] = field(default_factory=dict, repr=False)
    largest: list[dict] = field(default_factory=list, repr=False)
    allocated_peak_bytes: int = 0
    reserved_peak_bytes: int = 0
    fragmentation_bytes: int = 0
    largest_free_block_bytes: int = 0
    reserved_peak_step: str | None = None
    fits: bool | None = None
    memory: MemoryTimeline | None = field(default=None, repr=False)
    peak_phase: str | None = None
    ep_ranks: tuple[int, ...] = ()
    workspace_bytes: int = 0  # below the dispatcher (tracemem.workspaces; 0 without a GPU)
    # host memory of --optimizer-cpu-offload (StaticMemory.host_bytes), not in peak_bytes
    host_bytes: int = 0
    host_pinned_bytes: int = 0

    def dominant(self) -> tuple[str, int]:
        """The largest line item at the peak."""
        items = {"parameters": self.parameter_bytes, "gradients": self.gradient_bytes,
                 "optimizer states": self.optimizer_state_bytes,
                 "activations": self.activation_bytes,
                 "communication buffers": self.comm_buffer_bytes,
                 "temporaries": self.temporary_bytes,
                 "workspaces below the dispatcher": self.workspace_bytes}
        return max(items.items(), key=lambda kv: kv[1])


@dataclass(frozen=True)
class Estimate:
    """The result of ``estimate``: the ``Job`` and one ``RankEstimate`` per rank class;
    ``screened``: ``estimate(screen=True)`` skipped the allocator (the job does not fit);
    ``before_tracing``: and the traces too, static memory alone being over (each row's
    ``peak_bytes`` then its static floor)."""

    job: Job
    ranks: list[RankEstimate]
    screened: bool = False
    before_tracing: bool = False  # screened on static memory alone (``static_floors``)

    @property
    def model(self) -> str:
        return self.job.config.name

    @property
    def parallel(self) -> ParallelConfig:
        return self.job.parallel

    @property
    def hbm_bytes(self) -> int | None:
        return self.job.hbm_bytes

    @property
    def settings(self) -> dict:
        return self.job.settings()

    @property
    def worst(self) -> RankEstimate:
        return max(self.ranks, key=lambda r: r.peak_bytes)


@dataclass
class Segments:
    """Traced event segments of one rank: ``(chunk, kind, microbatch)`` -> the
    ``MemoryEvent`` list of that forward (``"F"``) or full backward (``"B"``), or, for a
    microbatch whose backward is split (``tracemem.split_backward``), of its forward
    (``"Fs"``), input-gradient backward (``"I"``) and weight-gradient backward (``"W"``).
    ``chunk`` is the position among the rank's model chunks. Microbatch 0 is the first;
    microbatch 1 stands for every later one (gradients then accumulate)."""

    events: dict[tuple[int, str, int], list] = field(default_factory=dict)
    # False when the trace itself makes and frees the gradients (FSDP2's unsharded bf16
    # gradients, freed at the unit's reduce-scatter, and its fp32 sharded gradients, made by
    # the first backward: tracemem.zero3), so the replay keeps each gradient storage as
    # traced; True: Megatron's, each added into a preallocated main grad (replay_events)
    transient_grads: bool = True
    # fine-grained activation offloading (modeling.common.offload): a microbatch whose
    # manager decisions differ from microbatch 1's replays its own traced variant,
    # (chunk, microbatch) -> the variant in the key's last place (0 and 1 as above)
    variants: dict[tuple[int, int], int] = field(default_factory=dict)
    # (chunk, variant) -> the host copies its forward makes (modeling.common.offload.HostBuffer;
    # also TE's CPU offloading's, modeling.common.cpu_offload)
    host: dict[tuple[int, int], tuple] = field(default_factory=dict)
    # (chunk, variant) -> positions in its B segment where a group start finds its own reload
    # stack empty (Megatron reloads a group of the next backward chunk there), and the
    # (start, end) events of each group its backward reloads first (ChunkPlan.pre); the
    # chunks that have offloading groups
    offload_marks: dict[tuple[int, int], tuple] = field(default_factory=dict)
    prereloads: dict[tuple[int, int], tuple] = field(default_factory=dict)
    offload_chunks: frozenset[int] = frozenset()
    # Megatron-Core's 1F1B (forward_backward_pipelining_without_interleaving): the references
    # its loop keeps to a finished microbatch's pipeline tensors (the "pp.*" slots
    # _trace_fb marks), honoured by replay_events; set per job (trace_classes), not traced
    megatron_1f1b: bool = False
    # Megatron-Core's interleaved schedule: step name -> the pipeline tensors its loop holds
    # while the step runs beyond the traced storages, (kind, bytes) each
    # (tracemem.schedules.megatron_refs); replay_events holds them as storages of their own;
    # set per rank (trace_classes), not traced
    schedule_refs: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class ReplayPeak:
    """The peak of a replay: bytes, the index of the step running (None: before any step),
    microbatch forwards held (forwards started minus backwards finished), and the bytes alive
    by category and by module (replayed storages only)."""

    peak_bytes: int
    step_index: int | None
    inflight: int
    by_category: dict[str, int]
    by_module: dict[str, int]
    largest: list[dict] = field(default_factory=list)  # the 8 largest storages alive
    # each of them's (virtual stage, microbatch): to rename them for a class that shares
    # this replay (replay_class's memo)
    largest_keys: list[tuple[int, int] | None] = field(default_factory=list, repr=False)


def _trace_rank(cfg: ModelConfig, par: ParallelConfig, rank: int, *, optimizer: str = "fused",
                **options) -> tuple[object, Segments]:
    """``rank``'s model and its segments, the optimizer step's included (``_trace_fb`` and
    ``_trace_step``; ``options``: ``_trace_fb``'s keywords)."""
    model, tracer, segments = _trace_fb(cfg, par, rank, **options)
    return model, _trace_step(model, tracer, par, optimizer, segments)[1]


def _dataloader_mask(b: int, s: int, cp: int) -> torch.Tensor:
    """Megatron-LM's dataloader attention mask on a rank whose virtual stage reads the batch
    (the first and the last, and MTP's), ``[b, 1, s / CP, s]`` bool, made before the model's
    forward and freed when ``forward_step_func`` returns (after the forward and its loss).
    Megatron-LM d98e8a6: ``GPTDataset`` makes it unless ``--no-create-attention-mask-in-
    dataloader`` (``megatron/core/datasets/gpt_dataset.py``, ``pretrain_gpt.py``
    ``core_gpt_dataset_config_from_args`` ``create_attention_mask``); ``pretrain_gpt.py``
    ``get_batch`` moves it to the GPU on TP rank 0 and ``megatron/core/utils.py``
    ``get_batch_on_this_tp_rank`` broadcasts it into a ``torch.empty((b, 1, s, s),
    dtype=torch.bool)`` on the others, on the first and last pipeline stages (every stage
    with PP 1); ``get_batch_on_this_cp_rank`` then keeps this CP rank's two chunks of the
    query dimension (``index_select``: a new tensor; the whole mask freed once replaced).
    TE's fused and flash attention take the causal mask type and never read it; it is
    memory all the same."""
    full = torch.zeros(b, 1, s, s, dtype=torch.bool, device="meta")
    if cp == 1:
        return full
    mine = torch.empty(b, 1, s // cp, s, dtype=torch.bool, device="meta")
    del full
    return mine


def _reads_dataloader_mask(job: Job) -> bool:
    """Whether ``job``'s batch carries Megatron-LM's dataloader attention mask
    (``_dataloader_mask``): ``create_attention_mask_in_dataloader`` under the megatron
    orchestration and a schedule Megatron-LM's training loop runs (1F1B, interleaved 1F1B);
    DualPipe, zero-bubble and GPipe jobs are not Megatron-LM's ``pretrain_gpt.py``."""
    return (job.create_attention_mask_in_dataloader and job.profile.orchestration == "megatron"
            and job.schedule in ("1f1b", "interleaved-1f1b"))


def _trace_fb(cfg: ModelConfig, par: ParallelConfig, rank: int, *, b: int, s: int,
              routing: RoutingModel, attention: str, experts: str, recompute: str,
              recompute_modules: frozenset[str], deallocate: bool,
              recompute_method: tuple[str, int] = ("uniform", 1),
              distribute_saved_activations: bool = False,
              rounding: int | None, kernels: KernelProfile | str = "eager",
              zero3_prefetch: bool = True, where: Placement | None = None,
              kinds: frozenset[str] = frozenset("B"), replace=None,
              activation_offload: ActivationOffload | None = None,
              te_cpu_offload: int = 0, dataloader_mask: bool = False
              ) -> tuple[object, MemoryTracer, Segments]:
    """The forward and backward segments of ``rank`` (``kinds``: "B" traces forwards with full
    backwards, "I" forwards with split ones), with the model and the tracer that traced them
    (``_trace_step`` adds the optimizer step). ``activation_offload``: Megatron's
    fine-grained activation offloading (``modeling.common.offload``): each chunk's
    microbatches are traced once per distinct manager plan (``offload_plan`` over the rank's
    schedule), microbatch 0 and 1 as always, a later one whose plan differs as its own
    variant (``Segments.variants``). ``te_cpu_offload``: TE's CPU offloading of that many
    decoder layers (``modeling.common.cpu_offload``; one synchronizer per traced
    microbatch, its host copies in ``Segments.host``). ``dataloader_mask``: Megatron-LM's
    dataloader attention mask on the chunks that read the batch (``_dataloader_mask``)."""
    model = build_rank(cfg, par, rank, attention=attention, experts=experts,
                       dtype=torch.bfloat16, kernels=kernels, placement=where, replace=replace)
    numel_by_kind(model)  # every parameter declares its group: say so before tracing
    # ZeRO-3: every unit's all-gathers are traced events (tracemem.zero3)
    # (not under torchtitan's PP + FSDP2: every unit stays gathered, static memory)
    # (torchtitan's FSDP2 recipe: FSDP2's own copy-in, flat and unsharded buffers)
    gathers = Zero3Gathers.for_layout(par, zero3_prefetch, model.kernels).install(model) \
        if par.zero == 3 and not pp_keeps_gathered(par) else None
    for module in model.modules():
        if isinstance(module, (Block, CustomBlock)):
            if isinstance(module, Block):
                module.set_recompute(recompute, recompute_modules,
                                     distribute_saved_activations)
            else:
                module.set_recompute(recompute, recompute_modules)
    if recompute == "full":
        apply_recompute_method(model, *recompute_method)
    seq = s // par.cp
    local = seq // (par.tp if par.sp else 1)
    tracer = MemoryTracer(rounding=rounding, devices={"meta"})
    tracer.track_external(model)
    # FSDP2 (fsdp2_group): the trace makes the gradients (Zero3Gathers._reduce)
    segments = Segments(transient_grads=gathers is None or gathers.fsdp2_group is None)
    last_chunk = len(model.chunks) - 1
    plans, groups = _offload_plans(model, activation_offload)
    if groups is not None:
        segments.offload_chunks = frozenset(c for c, names in enumerate(groups) if names)
    for chunk in range(len(model.chunks)):
        first = chunk == 0 and model.pre_process
        last = chunk == last_chunk and model.post_process
        runs = [(k == "I", mb) for k in sorted(kinds) for mb in (0, 1)]
        if plans is not None:  # a variant per distinct plan of a later microbatch
            later = {}
            for (c, m), plan in sorted(plans.items()):
                if c == chunk and m >= 1 and plan != plans.get((chunk, 1)):
                    variant = later.setdefault(plan, 2 + len(later))
                    segments.variants[(chunk, m)] = variant
            runs += [(k == "I", v) for k in sorted(kinds) for v in later.values()]
            plan_of = {0: plans.get((chunk, 0)), 1: plans.get((chunk, 1)),
                       **{v: p for p, v in later.items()}}
        for split, mb in runs:
            if mb == 0 and gathers is not None:
                gathers.zero_grad()  # the step's first backward makes FSDP2's gradients
            handler = None if plans is None else offload.ChunkHandler(
                activation_offload.modules, activation_offload.min_size,
                plan_of[mb] or offload.ChunkPlan(), groups[chunk])
            sync = cpu_offload.Synchronizer(len(model.chunks[chunk]), te_cpu_offload) \
                if te_cpu_offload else None
            start = len(tracer.events)
            with tracer:
                mask = _dataloader_mask(b, s, par.cp) if dataloader_mask and (
                    first or last) else None
                labels = torch.zeros(b, seq, dtype=torch.long, device="meta")
                inputs = (torch.zeros(b, seq, dtype=torch.long, device="meta") if first else
                          recv_forward((b, local, cfg.hidden_size), torch.bfloat16))
                if not first:  # Segments.megatron_1f1b: kept past the backward
                    tracer.retain(inputs, "pp.input")
                with offload.chunk(handler), cpu_offload.synchronizer(sync):
                    output = model(inputs, labels, routing, chunk)
                del mask  # a local of forward_step_func: gone when it returns
                if not last:
                    send_forward(output, deallocate)
                    tracer.retain(output, "pp.output")  # the stand-in, when deallocated
            if sync is not None:
                segments.host[(chunk, mb)] = tuple(sync.host)
            if handler is not None:
                if handler.names != tuple(groups[chunk]):
                    raise AssertionError(f"offload groups of chunk {chunk}: traced "
                                         f"{handler.names}, predicted {groups[chunk]}")
                segments.host[(chunk, mb)] = tuple(handler.host)
            middle = len(tracer.events)
            if split:
                with tracer:  # I: input gradients; Linear weight gradients deferred
                    grad = None if last else recv_backward((b, local, cfg.hidden_size),
                                                           torch.bfloat16)
                    weights = backward_input([output], [grad], [inputs],
                                             list(model.parameters()))
                    if inputs.requires_grad:
                        inputs.grad = None  # sent to the previous stage
                    del inputs, output, labels, grad
                    for param in model.parameters():
                        param.grad = None
                end_input = len(tracer.events)
                with tracer:  # W
                    weights.run()
                    del weights
                    if gathers is not None:
                        gathers.end_backward()  # FSDP2's root final callback
                    for param in model.parameters():
                        param.grad = None
                segments.events[(chunk, "Fs", mb)] = tracer.events[start:middle]
                segments.events[(chunk, "I", mb)] = tracer.events[middle:end_input]
                segments.events[(chunk, "W", mb)] = tracer.events[end_input:len(tracer.events)]
                continue
            with tracer:
                grad = None if last else recv_backward((b, local, cfg.hidden_size),
                                                       torch.bfloat16)
                if grad is not None:
                    tracer.retain(grad, "pp.output_grad")
                backward_from(output, grad)
                if not first and inputs.grad is not None:
                    tracer.retain(inputs.grad, "pp.input_grad")
                if gathers is not None:
                    gathers.end_backward()  # FSDP2's root final callback
                del inputs, output, labels, grad  # the schedule drops them after backward
                # Megatron adds each .grad into the fp32 main grad and drops it, so every
                # microbatch's backward makes a fresh gradient, like the first one
                for param in model.parameters():
                    param.grad = None
            segments.events[(chunk, "F", mb)] = tracer.events[start:middle]
            segments.events[(chunk, "B", mb)] = tracer.events[middle:len(tracer.events)]
            if handler is not None:
                segments.offload_marks[(chunk, mb)] = tuple(m - middle for m in handler.marks)
                segments.prereloads[(chunk, mb)] = tuple((a - middle, b - middle)
                                                         for a, b in handler.prereloads)
    # --gradient-accumulation-fusion with kernels that do not fuse: no transient weight grads
    if par.precision_spec.gradient_accumulation_fusion \
            and get_profile(kernels).name != "megatron-te":
        fused = fused_wgrad_modules(model)
        for key, events in segments.events.items():
            if key[1] in ("B", "I", "W"):
                segments.events[key] = [e for e in events if not is_fused_wgrad(e, fused)]
    return model, tracer, segments


@dataclass(frozen=True)
class ActivationOffload:
    """What ``_trace_fb`` needs for fine-grained activation offloading: the
    ``--offload-modules`` ``modules``, ``--min-offloaded-tensor-size`` ``min_size``
    (elements), the rank's schedule ``steps``, ``chunk_of_stage`` (virtual stage -> the rank's
    model chunk) and ``warmup`` (the first iteration's decisions, else a later one's:
    ``modeling.common.offload.offload_plan``)."""

    modules: frozenset[str]
    min_size: int
    steps: tuple
    chunk_of_stage: Callable[[int], int] = field(compare=False)
    warmup: bool = False


def _offload_plans(model, activation_offload: ActivationOffload | None):
    """The manager's plan per (chunk, microbatch) and each chunk's predicted group names
    (``Block.offload_groups``), or (None, None) without offloading."""
    if activation_offload is None:
        return None, None

    def names(layer) -> list[str]:  # a user's own block starts no group
        return layer.offload_groups(activation_offload.modules) \
            if isinstance(layer, Block) else []

    groups = [[name for i in layers for name in names(model.layers[str(i)])]
              for layers in model.chunks]
    if model.post_process and len(model.mtp):  # the MTP layers run after the decoder's
        groups[-1] += [name for module in model.mtp.values() for name in names(module.block)]
    plans = offload.offload_plan(activation_offload.steps, groups,
                                 activation_offload.chunk_of_stage,
                                 warmup=activation_offload.warmup)
    return plans, groups


def activation_host_bytes(steps: list[Step], segments: Segments,
                          chunk_index: Callable[[int], int]) -> int:
    """The pinned host memory fine-grained activation offloading (or TE's CPU offloading,
    ``modeling.common.cpu_offload``: unpooled copies) holds at most over a rank's schedule
    ``steps`` (``Segments.host``): each forward's host copies are held until its backward;
    Megatron's (shape, dtype) pool (``GPUTensorPool``, never shrunk) keeps as many buffers per
    key as were ever held at once, the unpooled ones (``expert_fc1``,
    ``moe_act``: pinned ``torch.empty``) stay cached in PyTorch's caching host allocator by
    rounded size; every buffer a pinned block (``tracemem.offload.pinned_block``: a power of
    two). Pooled and unpooled blocks are counted apart (an approximation: the host allocator
    may hand a cached unpooled block to a pool miss of the same rounded size)."""
    from tracemem.offload import pinned_block

    if not segments.host:
        return 0
    held: dict[tuple, int] = {}
    most: dict[tuple, int] = {}
    for step in steps:
        if step.kind not in ("F", "B"):
            continue
        chunk = chunk_index(step.stage)
        variant = segments.variants.get((chunk, step.microbatch), min(step.microbatch, 1))
        sign = 1 if step.kind == "F" else -1
        for buf in segments.host.get((chunk, variant), ()):
            size = pinned_block(buf.nbytes)
            key = (buf.shape, buf.dtype, size) if buf.pooled else ("unpooled", size)
            held[key] = held.get(key, 0) + sign
            most[key] = max(most.get(key, 0), held[key])
    return sum(count * key[-1] for key, count in most.items())


def _trace_step(model, tracer: MemoryTracer, par: ParallelConfig, optimizer: str,
                segments: Segments, offload=None) -> tuple[StaticMemory, Segments]:
    """The static memory of a traced rank's ``model`` under ``par`` and its ``segments`` with
    the optimizer step after the schedule (``tracemem.optimizer_step``, replayed as step "O")
    traced on the same ``tracer``: the part of a rank's trace that depends on the ZeRO stage
    and the DP / EDP sizes. ``segments`` is not changed."""
    start = len(tracer.events)
    trace_optimizer_step(model, par, tracer, optimizer, offload=offload)
    events = dict(segments.events)
    events[(0, "O", 0)] = [e for e in tracer.events[start:] if e.phase is not Phase.EXTERNAL]
    static = static_memory(model, par)
    if offload is not None:  # --optimizer-cpu-offload: part of the state on the host
        static = offload_static(static, model, par, offload)
    return static, replace(segments, events=events)



TRACE_CACHE_FORMAT = 2  # bump when what a cache file holds changes


class CachedEvent:
    """A ``MemoryEvent``'s fields as plain attributes, without the tracer's storage record: what
    the disk cache of ``TraceCache`` stores (picklable) and replays identically."""

    __slots__ = ("index", "action", "nbytes", "total_bytes", "phase", "op", "storage_id",
                 "category", "module", "device", "dtype", "shape", "retain")

    def __init__(self, event) -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(event, name))

    def __getstate__(self):
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setstate__(self, state) -> None:
        for name, value in zip(self.__slots__, state):
            setattr(self, name, value)


def _source_digest() -> str:
    """A digest of tracemem's and modeling's Python sources: a disk-cache key part that
    changes with the code even when the version string does not."""
    import hashlib

    import modeling

    digest = hashlib.sha256()
    for package in (Path(__file__).parent, Path(modeling.__file__).parent):
        for path in sorted(package.rglob("*.py")):
            digest.update(str(path.relative_to(package.parent)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


class TraceCache:
    """Rank-class traces shared by the ``estimate`` calls of one run, and optionally on disk.

    A rank class's forward and backward trace depends only on its own signature: the model
    config, the TP / SP / CP / EP / ETP degrees and plan (its shard shapes), its layers
    (numbers, dense or MoE, chunks, whether it holds the embedding / head), its EP rank, b, s,
    routing, kernels and their options, recompute, rounding, the schedule's step kinds (B or
    I / W), and under ZeRO-3 the unit shards; not on PP, the number of microbatches, the
    schedule's order or the rest of the layout. Those traces are kept in memory by that key
    (``fb``); the static memory and the optimizer-step segment, which also depend on the ZeRO
    stage, the DP / EDP sizes, the precision recipe and the optimizer, are made from the cached
    model by a second key (``step``). With ``directory``, each (``fb``, ``step``) result is
    also a pickle file there, named by a SHA-256 of both keys, the cache format, tracemem's
    version and source digest and torch's version, so a later run (or another worker process)
    loads it instead of tracing.

    Counters (per rank class asked for): ``computed`` traced here, ``reused`` served from
    memory, ``loaded`` from disk.

    Raises:
        TracememError: ``directory`` cannot be made or is not a directory.
    """

    def __init__(self, directory: str | Path | None = None) -> None:
        self._fb: dict = {}
        self._step: dict = {}
        self.floors: dict = {}  # static_floors: static memory built, not traced
        self.computed = self.reused = self.loaded = 0
        self.directory = None
        self._version = None
        if directory is not None:
            self.directory = _output_dir(str(directory), "--cache-dir")
            from tracemem import __version__
            self._version = (TRACE_CACHE_FORMAT, __version__, _source_digest(),
                             torch.__version__)

    def counts(self) -> dict[str, int]:
        """``{"computed": ..., "reused": ..., "loaded": ...}``."""
        return {"computed": self.computed, "reused": self.reused, "loaded": self.loaded}

    def _path(self, fb, step) -> Path:
        import hashlib

        name = hashlib.sha256(repr((self._version, fb, step)).encode()).hexdigest()
        return self.directory / f"{name}.pickle"

    def get(self, fb, step, trace: Callable[[], tuple], finish: Callable[..., tuple]
            ) -> tuple[StaticMemory, Segments]:
        """The ``(static, segments)`` of key ``fb`` + ``step``: from memory, from disk, or by
        ``trace()`` (model, tracer, forward / backward segments) and ``finish(model, tracer,
        segments)`` (static, segments with the optimizer step)."""
        import os
        import pickle

        found = self._step.get((fb, step))
        if found is not None:
            self.reused += 1
            return found
        path = self._path(fb, step) if self.directory is not None else None
        if path is not None and path.exists():
            try:
                with open(path, "rb") as f:
                    found = pickle.load(f)
            except Exception:  # a partial or foreign file: trace again and rewrite it
                found = None
            if found is not None:
                self.loaded += 1
                self._step[(fb, step)] = found
                return found
        if fb in self._fb:
            self.reused += 1
        else:
            self.computed += 1
            self._fb[fb] = trace()
        found = finish(*self._fb[fb])
        self._step[(fb, step)] = found
        if path is not None:
            static, segments = found
            frozen = Segments({key: [CachedEvent(e) for e in events]
                               for key, events in segments.events.items()},
                              segments.transient_grads, segments.variants, segments.host,
                              segments.offload_marks, segments.prereloads,
                              segments.offload_chunks)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            with open(tmp, "wb") as f:
                pickle.dump((static, frozen), f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)  # atomic: parallel workers never read half a file
        return found


class ReplayedEvent(NamedTuple):
    """One allocation or free of a replay, in replay order (``replay_events``).

    Attributes:
        step_index: index in ``steps`` of the step running.
        key: ``(virtual stage, microbatch, traced storage id)``: the replayed storage (each
            microbatch has its own copy of every traced storage).
        action: ``"alloc"`` or ``"free"``.
        nbytes: bytes allocated or freed (>= 0).
        event: the traced ``MemoryEvent`` that allocated the storage (for a free too).
    """

    step_index: int
    key: tuple[int, int, int]
    action: str
    nbytes: int
    event: MemoryEvent


def segment_key(step: Step, pp: int, chunk_index: Callable[[int], int] | None = None,
                split: bool = False) -> tuple[int, str, int]:
    """The ``Segments`` key that schedule step ``step`` replays: (model chunk, kind,
    microbatch 0 or 1). Virtual stage v is model chunk ``chunk_index(v)`` of the rank (default
    v // pp, the loop placement); microbatch 1 stands for every later one; the forward of a
    ``split`` microbatch (one with an I step) is ``"Fs"``."""
    chunk = chunk_index(step.stage) if chunk_index else step.stage // pp
    kind = "Fs" if split and step.kind == "F" else step.kind
    return (chunk, kind, min(step.microbatch, 1))


def _replayed_key(step: Step, pp: int, chunk_index, split: set, variants: dict
                  ) -> tuple[int, str, int]:
    """The ``Segments.events`` key ``replay_events`` plays for ``step``: ``segment_key``
    (``split``: the (stage, microbatch) pairs with an I step) with the offload variant of
    the microbatch where it has one (``Segments.variants``)."""
    key = segment_key(step, pp, chunk_index, (step.stage, step.microbatch) in split)
    if variants:
        variant = variants.get((key[0], step.microbatch))
        if variant is not None:
            key = (key[0], key[1], variant)
    return key


def replay_signature(steps: list[Step], pp: int, segments: Segments,
                     chunk_index: Callable[[int], int] | None = None,
                     contents: dict | None = None) -> tuple | None:
    """What ``replay_events``' stream depends on, up to the names of its storage keys
    ((stage, microbatch, storage id): identifiers only): per step, its microbatch renumbered
    in order of first appearance, the step's place among that microbatch's steps, and the
    content of all that microbatch's traced events (action, bytes, category, module, op,
    storage ids renumbered in order of first appearance), as a number from ``contents`` (a
    dict shared by the ranks compared). Two ranks with the same signature replay the same
    allocs and frees, of the same sizes and categories, in the same order (DualPipe's rank s
    and rank PP - 1 - s: the same two model chunks, the mirror schedule, the first
    microbatch of one direction traced as microbatch 0 and of the other as a later one, their
    events the same). None under fine-grained activation offloading (its early reloads play
    another microbatch's events inside a step)."""
    if segments.offload_marks:
        return None
    contents = {} if contents is None else contents
    split = {(s.stage, s.microbatch) for s in steps if s.kind == "I"}
    keys = [_replayed_key(s, pp, chunk_index, split, segments.variants) for s in steps]
    # the optimizer step's events share microbatch 0's names only if they touch its
    # storages; else it is its own (on a rank whose first chunk never runs microbatch 0,
    # DualPipe's second half, it is alone either way)
    own = {e.storage_id for key in set(keys) if key[1] != "O" for e in segments.events[key]}
    alone = all(e.storage_id not in own for key in set(keys) if key[1] == "O"
                for e in segments.events[key])

    def name(step: Step) -> tuple:
        return ("O",) if alone and step.kind == "O" else (step.stage, step.microbatch)

    played: dict[tuple, list] = {}
    for step, key in zip(steps, keys):
        played.setdefault(name(step), []).append(key)
    content_of: dict[tuple, int] = {}
    for run in {tuple(run) for run in played.values()}:
        ids: dict[int, int] = {}
        fingerprint = (segments.transient_grads, segments.megatron_1f1b,
                       tuple(sorted(segments.schedule_refs.items()))) + tuple(
            (key[1], tuple((e.action, e.nbytes, e.category, e.module, e.op, e.retain,
                            ids.setdefault(e.storage_id, len(ids)))
                           for e in segments.events[key])) for key in run)
        content_of[run] = contents.setdefault(fingerprint, len(contents))
    numbers: dict[tuple, int] = {}
    place: dict[tuple, int] = {}
    out = []
    for step in steps:
        mb = name(step)
        at = place.get(mb, 0)
        place[mb] = at + 1
        out.append((numbers.setdefault(mb, len(numbers)), at,
                    content_of[tuple(played[mb])]))
    return tuple(out)


def _interleaved_refs(job: Job, rank: int) -> dict[str, tuple[tuple[str, int], ...]]:
    """``Segments.schedule_refs`` of pipeline rank ``rank`` under Megatron-Core's interleaved
    schedule (``tracemem.schedules.megatron_refs``): its pipeline tensors are this rank's
    [s / CP / (TP with SP), b, h] bf16 receive buffers (``_trace_fb``'s ``recv_forward``)."""
    from tracemem.schedules.megatron_refs import interleaved_reference_tensors

    par = job.parallel
    local = job.seq_length // par.cp // (par.tp if par.sp else 1)
    hidden = job.micro_batch_size * local * job.config.hidden_size * 2
    r = job.rounding  # each tensor its own storage, rounded as the tracer rounds

    def rounded(n: int) -> int:
        return n if r is None else -(-n // r) * r
    return {step: tuple((kind, rounded(n)) for kind, n in tensors)
            for step, tensors in interleaved_reference_tensors(par.pp, par.vpp,
                                                               job.microbatches, rank, hidden,
                                                               job.overlap_p2p_comm)}


_LOSSES = INTERLEAVED_REFERENCES[5]  # the losses in forward_data_store, kept after the loop


class _ScheduleRef:
    """The storage of a pipeline tensor Megatron's interleaved loop holds
    (``Segments.schedule_refs``): what a ``MemoryEvent`` reads of its storage."""

    __slots__ = ("sid", "nbytes", "category", "module", "device", "dtype", "shape", "retain")

    def __init__(self, sid: int, nbytes: int, kind: str):
        self.sid, self.nbytes = sid, nbytes
        self.category = Category.COMM_BUFFER
        name = REFERENCE_NAMES[INTERLEAVED_REFERENCES.index(kind)]
        self.module = f"pipeline schedule: {name}"
        self.dtype = torch.float32 if kind == _LOSSES else torch.bfloat16  # bytes, rounded
        self.device, self.shape, self.retain = "meta", (nbytes // self.dtype.itemsize,), None


def replay_events(steps: list[Step], pp: int, segments: Segments,
                  chunk_index: Callable[[int], int] | None = None, *,
                  periodic: bool = False, sink: ReplaySink | None = None
                  ) -> Iterator[ReplayedEvent]:
    """The allocations and frees of a rank's schedule ``steps`` replayed over its traced
    ``segments``, in order, with O(1) work per traced event.

    Each microbatch gets its own copy of every storage. A storage of category ``gradient`` is
    a transient (it is added into a preallocated main-grad buffer and freed): its alloc is
    followed at once by its free; unless ``segments.transient_grads`` is False (FSDP2: the
    trace frees its gradients itself, and keeps the sharded ones it makes). A free of a
    storage the replay does not hold (one allocated before the segment, e.g. an external) is
    dropped. A second alloc of a held storage
    (``resize_``) replaces the held record. A storage its module keeps as state
    (``MemoryTracer.retain``: the MoE dispatchers' probabilities and maps) outlives its traced
    free: it is freed when its slot's next storage is allocated (a later microbatch's forward
    of the same layer, or the recompute in a backward), else held to the end of the replay
    (through the optimizer step, as on a GPU). With ``segments.megatron_1f1b`` (Megatron-Core's
    ``forward_backward_pipelining_without_interleaving``) the "pp.*" storages ``_trace_fb``
    marks outlive their backward as that loop's references keep them: the received input and
    the output's stand-in to the start of the next B step, the input gradient to its end, the
    output gradient to the next one's receive, all to the schedule's return (before "O").
    With ``segments.schedule_refs`` (Megatron-Core's interleaved schedule) the pipeline
    tensors its loop holds while a step runs are held as storages of their own (keys
    ``("pp-ref", kind, bytes, i)``, category ``comm_buffer``), set before the step's own
    events; after the schedule only its losses stay, through the optimizer step.

    With ``periodic``, the repeated stretches of the schedule (``tracemem.periodic``) are
    walked only until the replay's state (the storages held, and ``sink``'s own state when a
    consumer with state is given) returns to an earlier period boundary's, renumbered; then
    the remaining whole cycles are skipped (the held storages and ``sink``'s keys renumbered,
    ``sink``'s counters advanced) and the replay goes on from the equivalent step. Every
    event after a skip is the event the full replay gives there; the skipped ones repeat the
    cycle before (same bytes, same order), so peaks and what is alive at them are unchanged.
    """
    live: dict[tuple[int, int, int], MemoryEvent] = {}
    gradient = Category.GRADIENT if segments.transient_grads else None
    split = {(s.stage, s.microbatch) for s in steps if s.kind == "I"}
    variants = segments.variants
    new = tuple.__new__  # ReplayedEvent(...) without its Python-level __new__: the hot path
    marks_of, prereloads_of = segments.offload_marks, segments.prereloads
    # fine-grained activation offloading: the groups a backward chunk reloads for the next
    # non-empty one (modeling.common.offload ChunkHandler.marks / prereloads); early_done:
    # (stage, microbatch) of that chunk -> how many of its groups were replayed early
    early_done: dict[tuple[int, int], int] = {}
    following: dict[int, int] = {}  # a B step -> the next B step of a chunk with groups
    if marks_of:
        later = None
        for i in range(len(steps) - 1, -1, -1):
            if steps[i].kind == "B":
                if later is not None:
                    following[i] = later
                if segment_key(steps[i], pp, chunk_index)[0] in segments.offload_chunks:
                    later = i

    def key_of(step: Step) -> tuple[int, str, int]:
        return _replayed_key(step, pp, chunk_index, split, variants)

    # module state (MemoryTracer.retain): slot -> the key its module holds now; released:
    # held keys the trace has dropped, alive only through their slot or a schedule reference
    holder: dict[str, tuple[int, int, int]] = {}
    released: set[tuple[int, int, int]] = set()
    # Megatron's 1F1B loop (Segments.megatron_1f1b), for the "pp.*" slots _trace_fb marks:
    # the popped output keeps its graph, whose AccumulateGrad Node keeps the received input,
    # until the next pop (the start of the next B step); the local input_tensor_grad keeps
    # the input gradient until the next backward_step returns (the end of the next B step);
    # the local output_tensor_grad keeps the output gradient until the next receive (the slot
    # "pp.output_grad"); all until the schedule returns (before the optimizer step)
    locals_1f1b = segments.megatron_1f1b
    until_start: list[tuple[int, int, int]] = []  # freed at the next B step's start
    until_end: list[tuple[int, int, int]] = []  # freed at the next B step's end
    later: tuple[list, list] = ([], [])  # this B step's, for the next one

    def outlives(slot: str) -> bool:
        """A slot whose storages outlive their traced free in this replay."""
        return not slot.startswith("pp.") or locals_1f1b

    def drop(index: int, keys) -> Iterator[ReplayedEvent]:
        for old in keys:
            released.discard(old)
            held = live.pop(old, None)
            if held is not None:
                yield new(ReplayedEvent, (index, old, "free", held.nbytes, held))

    def play(index: int, stage: int, microbatch: int, events) -> Iterator[ReplayedEvent]:
        for event in events:
            key = (stage, microbatch, event.storage_id)
            if event.action == "free":
                held = live.get(key)
                if held is None:
                    continue
                slot = held.retain
                if slot is not None and outlives(slot):
                    if holder.get(slot) == key:
                        released.add(key)  # its module (or the loop) still holds it
                        continue
                    if slot in ("pp.input", "pp.output", "pp.input_grad"):
                        released.add(key)
                        later[slot == "pp.input_grad"].append(key)
                        continue
                del live[key]
                yield new(ReplayedEvent, (index, key, "free", held.nbytes, held))
                continue
            yield new(ReplayedEvent, (index, key, "alloc", event.nbytes, event))
            if event.category is gradient:  # into the main grad
                live.pop(key, None)
                yield new(ReplayedEvent, (index, key, "free", event.nbytes, event))
                continue
            live[key] = event
            slot = event.retain
            if slot is not None and (slot == "pp.output_grad" and locals_1f1b
                                     or not slot.startswith("pp.")):
                # the attribute (or local) now points here: the old one goes
                old = holder.get(slot)
                holder[slot] = key
                if old is not None and old != key and old in released:
                    yield from drop(index, (old,))

    def loop_step(index: int, step: Step, inner) -> Iterator[ReplayedEvent]:
        """A step of Megatron's 1F1B loop around ``inner`` (the step's own replay): a B step
        first drops what the previous one left to its start and, at its end, what it left to
        its end; the optimizer step runs after the schedule has returned, its locals gone."""
        if step.kind == "O":
            yield from drop(index, until_start + until_end + later[0] + later[1] + [
                holder.pop(slot) for slot in [s for s in holder if s.startswith("pp.")]])
            until_start.clear(), until_end.clear(), later[0].clear(), later[1].clear()
        elif step.kind == "B":
            yield from drop(index, until_start)
            until_start.clear()
        yield from inner
        if step.kind == "B":
            yield from drop(index, until_end)
            until_end[:] = later[1]
            until_start[:] = later[0]
            later[0].clear(), later[1].clear()

    def early(index: int) -> Iterator[ReplayedEvent]:
        """At a mark of B step ``index``: the next reloaded group of the next chunk."""
        j = following.get(index)
        if j is None:
            return
        target = steps[j]
        tkey = key_of(target)
        ranges = prereloads_of.get((tkey[0], tkey[2]), ())
        done = early_done.get((target.stage, target.microbatch), 0)
        if done < len(ranges):
            a, b = ranges[done]
            early_done[(target.stage, target.microbatch)] = done + 1
            yield from play(index, target.stage, target.microbatch,
                            segments.events[tkey][a:b])

    # Megatron's interleaved loop (Segments.schedule_refs): the pipeline tensors it holds
    # while a step runs, as storages of their own (cached events, so periods compare equal)
    refs = segments.schedule_refs
    ref_events: dict[tuple, MemoryEvent] = {}
    held_refs: set[tuple] = set()

    def reference(index: int, step: Step) -> Iterator[ReplayedEvent]:
        """Before ``step`` runs: free the tensors the loop no longer holds, allocate those it
        now does; the optimizer step runs after the schedule has returned, which keeps only
        its losses (forward_data_store)."""
        want = refs.get(str(step), ()) if step.kind != "O" else tuple(
            (kind, n) for kind, n, _ in (k[1:] for k in held_refs) if kind == _LOSSES)
        target, seen = set(), {}
        for kind, n in want:
            i = seen[(kind, n)] = seen.get((kind, n), -1) + 1
            target.add(("pp-ref", kind, n, i))
        for key in sorted(held_refs - target):
            held_refs.discard(key)
            held = live.pop(key)
            yield new(ReplayedEvent, (index, key, "free", held.nbytes, held))
        for key in sorted(target - held_refs):
            event = ref_events.get(key)
            if event is None:
                event = ref_events[key] = MemoryEvent(
                    -1, "alloc", key[2], 0, Phase.FORWARD, None,
                    _ScheduleRef(-1 - len(ref_events), key[2], key[1]))
            held_refs.add(key)
            live[key] = event
            yield new(ReplayedEvent, (index, key, "alloc", event.nbytes, event))

    def run(index: int) -> Iterator[ReplayedEvent]:
        step = steps[index]
        key_of_step = key_of(step)
        events = segments.events[key_of_step]
        if not marks_of or step.kind != "B":  # play's own generator: one frame less an event
            inner = play(index, step.stage, step.microbatch, events)
        else:
            inner = marked(index, step, key_of_step, events)
        if refs:
            inner = chain(reference(index, step), inner)
        return loop_step(index, step, inner) if locals_1f1b and step.kind != "F" else inner

    def marked(index: int, step: Step, key_of_step, events) -> Iterator[ReplayedEvent]:
        """A B step with offload marks: the next chunk's groups reloaded at its marks."""
        stage, microbatch = step.stage, step.microbatch
        where = (key_of_step[0], key_of_step[2])
        done = early_done.pop((stage, microbatch), 0)
        skip = prereloads_of.get(where, ())[:done]  # replayed at the previous chunk's marks
        marks = marks_of.get(where, ())
        cuts = sorted({0, len(events), *marks, *(p for r in skip for p in r)})
        m = 0
        for a, b in zip(cuts, cuts[1:] + [None]):
            while m < len(marks) and marks[m] == a:
                yield from early(index)
                m += 1
            if b is None or any(r[0] <= a and b <= r[1] for r in skip):
                continue
            yield from play(index, stage, microbatch, events[a:b])

    index = 0
    stretches = periodic_stretches(steps, split) if periodic else ()
    last = {step.microbatch: i for i, step in enumerate(steps)}  # mb -> its last step
    for stretch in stretches:
        while index < stretch.start:
            yield from run(index)
            index += 1
        # sizes: a quick summary of each probed boundary's state (equal states, equal
        # summaries: a replay whose state grows, GPipe's forwards, never computes the whole
        # state); seen: the hash of a whole state -> its boundary; pending: a cycle the hashes
        # suggest, (boundary, cycle, its state, its counters), proven or dropped by comparing
        # the whole state one cycle later
        k, probing, sizes, seen, pending = 0, True, set(), {}, None
        while k < stretch.count:
            boundary = stretch.start + k * stretch.period
            check = False
            if probing and k < MAX_PROBES:
                if pending is not None:
                    check = k == pending[0] + pending[1]
                else:
                    size = (len(live), sink.cheap_state() if sink is not None else None)
                    check = size in sizes and probed(k)
                    sizes.add(size)
            if check:
                # a microbatch's storages renumber while it is in flight, or while only its
                # module holds them (released: the same state, a cycle later)
                def canon(key, boundary=boundary, offset=k * stretch.shift):
                    if type(key) is tuple and len(key) == 3 and type(key[0]) is int \
                            and key[1] >= 1 and (last[key[1]] >= boundary or key in released):
                        return (key[0], key[1] - offset, key[2])
                    return ("held", key)

                state = (frozenset((canon(key), id(e)) for key, e in live.items()),
                         sink.state(canon) if sink is not None else None,
                         frozenset((canon((st, mb, None)), n)
                                   for (st, mb), n in early_done.items()),
                         frozenset((slot, canon(key)) for slot, key in holder.items()),
                         tuple(tuple(canon(key) for key in keys)
                               for keys in (until_start, until_end, *later)))
                if pending is not None:  # k is one cycle past it
                    cycle = pending[1]
                    if state == pending[2] and (stretch.count - k) // cycle:
                        # the state of boundary k - cycle, renumbered: skip whole cycles
                        cycles = (stretch.count - k) // cycle
                        shift = cycles * cycle * stretch.shift

                        # the released keys as they are now: rename is called again by
                        # the sink after released itself is renamed below
                        def rename(key, boundary=boundary, shift=shift,
                                   kept=frozenset(released)):
                            if type(key) is tuple and len(key) == 3 \
                                    and type(key[0]) is int and key[1] >= 1 \
                                    and (last[key[1]] >= boundary or key in kept):
                                return (key[0], key[1] + shift, key[2])
                            return key

                        moved = {rename(key): e for key, e in live.items()}
                        live.clear()
                        live.update(moved)
                        slots = {slot: rename(key) for slot, key in holder.items()}
                        holder.clear()
                        holder.update(slots)
                        for keys in (until_start, until_end, *later):
                            keys[:] = [rename(key) for key in keys]
                        renamed = {rename(key) for key in released}
                        released.clear()
                        released.update(renamed)
                        held_early = {rename((st, mb, None))[:2]: n
                                      for (st, mb), n in early_done.items()}
                        early_done.clear()
                        early_done.update(held_early)
                        if sink is not None:
                            sink.skip(rename, cycles, tuple(
                                a - b for a, b in zip(sink.counters(), pending[3])))
                        k += cycles * cycle
                        probing = False
                        seen.clear()
                        continue
                    pending = None
                digest = hash(state)
                if pending is None and digest in seen:
                    pending = (k, k - seen[digest], state,
                               sink.counters() if sink is not None else ())
                seen[digest] = k
            elif probing and k >= MAX_PROBES:
                probing = False
                seen.clear()
            for i in range(boundary, boundary + stretch.period):
                yield from run(i)
            k += 1
        index = stretch.start + stretch.count * stretch.period
    while index < len(steps):
        yield from run(index)
        index += 1


class _RenameAlive:
    """``replay_schedule``'s second pass as a ``ReplaySink`` with no state of its own (its
    state and counters are those of no sink, so the replay skips exactly where the first
    pass's did): at a skip it renames the storages alive it is rebuilding, as the replay
    renames its own held storages, so the frees after the skip find them."""

    def __init__(self, alive: dict) -> None:
        self.alive = alive

    def cheap_state(self) -> None:
        return None

    def state(self, canon) -> None:
        return None

    def counters(self) -> tuple[int, ...]:
        return ()

    def skip(self, rename, cycles: int, per_cycle: tuple[int, ...]) -> None:
        moved = {rename(key): event for key, event in self.alive.items()}
        self.alive.clear()
        self.alive.update(moved)


def replay_schedule(steps: list[Step], pp: int, segments: Segments,
                    base_bytes: int, chunk_index: Callable[[int], int] | None = None,
                    periodic: bool = True) -> ReplayPeak:
    """Replay a rank's schedule ``steps`` over its traced ``segments`` (``replay_events``) on
    top of ``base_bytes`` (static memory): the peak, the step running there, the microbatch
    forwards in flight and what is alive. ``chunk_index``: see ``segment_key``.

    Linear in the events replayed: one pass finds the peak (the first event that reaches the
    highest total), a second pass rebuilds the storages alive at that event, once. With
    ``periodic`` (the default) both passes skip the schedule's repeated cycles once the
    storages held repeat (``replay_events``): the same peak, step and storages alive, in time
    that stops growing with the number of microbatches once the steady state is reached.
    """
    current = peak = base_bytes
    peak_at = peak_n = None
    for n, (index, _, action, nbytes, _) in enumerate(
            replay_events(steps, pp, segments, chunk_index, periodic=periodic)):
        if action == "alloc":
            current += nbytes
            if current > peak:
                peak, peak_n, peak_at = current, n, index
        else:
            current -= nbytes
    peak_live: dict[tuple[int, int, int], MemoryEvent] = {}
    inflight_at_peak = 0
    if peak_n is not None:
        renamer = _RenameAlive(peak_live)
        for _, key, action, _, event in islice(
                replay_events(steps, pp, segments, chunk_index, periodic=periodic,
                              sink=renamer), peak_n + 1):
            if action == "alloc":
                peak_live[key] = event
            else:
                peak_live.pop(key, None)
        # forwards started (the running step included) minus backwards (B or I) finished
        inflight_at_peak = (sum(step.kind == "F" for step in steps[:peak_at + 1])
                            - sum(step.kind in "BI" for step in steps[:peak_at]))
    by_category: dict[str, int] = {}
    by_module: dict[str, int] = {}
    for event in peak_live.values():
        nbytes = event.nbytes
        by_category[event.category.value] = by_category.get(event.category.value, 0) + nbytes
        by_module[event.module] = by_module.get(event.module, 0) + nbytes
    largest = [{"bytes": event.nbytes, "shape": list(event.shape),
                "dtype": str(event.dtype).removeprefix("torch."),
                "category": event.category.value, "module": event.module,
                "microbatch": key[1]}
               for key, event in sorted(peak_live.items(), key=lambda kv: -kv[1].nbytes)[:8]]
    step_events = {id(e) for key, events in segments.events.items() if key[1] == "O"
                   for e in events}  # the optimizer step's: no microbatch's, never renamed
    keys = [None if id(event) in step_events else key[:2]
            for key, event in sorted(peak_live.items(), key=lambda kv: -kv[1].nbytes)[:8]]
    return ReplayPeak(peak, peak_at, inflight_at_peak, by_category, by_module, largest, keys)


_PHASES = {"F": "forward", "B": "backward", "I": "backward", "W": "backward", "O": "optimizer"}


def _check_counts_cover(cfg: ModelConfig, routing: RoutingModel) -> None:
    """A counts file given per layer must cover every MoE layer, MTP modules' included; a
    missing one is named as the user knows it (``MTP module 1 (layer 61)``).

    Raises:
        TracememError: the first MoE layer without counts.
    """
    if not isinstance(routing, Counts) or routing.default is not None:
        return
    for layer in range(cfg.num_layers + cfg.num_mtp_modules):
        if cfg.is_moe_layer(layer) and layer not in (routing.per_layer or {}):
            name = (f"decoder layer {layer}" if layer < cfg.num_layers else
                    f"MTP module {layer - cfg.num_layers + 1} (layer {layer})")
            raise TracememError(
                f"--routing {routing.spec}: no counts for {name}, an MoE layer of "
                f"{cfg.name} (decoder layers are 0 to {cfg.num_layers - 1}; MTP module i is "
                f"layer {cfg.num_layers - 1} + i)")


def _ranks_text(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def _moe_layers_of_stage(cfg: ModelConfig, par: ParallelConfig, stage: int,
                         where: Placement) -> list[int]:
    """The MoE layer numbers (routing-model layer ids) pipeline rank ``stage`` runs: its
    decoder layers', and where it holds the last model chunk its MTP modules'
    (``num_layers + i``, ``modeling.common.model.Transformer``)."""
    layers = [i for chunk in par.layers_of_stage(stage, where) for i in chunk]
    if where.num_chunks - 1 in where.chunks_of(stage):
        layers += [cfg.num_layers + i for i in range(cfg.num_mtp_modules)]
    return [layer for layer in layers if cfg.is_moe_layer(layer)]


def ep_rank_classes(cfg: ModelConfig, par: ParallelConfig, stage: int, routing: RoutingModel,
                    tokens: int, where: Placement) -> list[list[int]]:
    """The EP ranks of pipeline rank ``stage`` grouped into classes that trace alike: ranks
    whose local routed experts receive equal token-slot counts, expert by expert, in every MoE
    layer of the stage (``routing.counts`` of ``tokens`` local tokens; ``where``: the
    schedule's chunk placement). A rank's model and its
    MoE forward depend on nothing else that differs between EP ranks (``modeling.common.moe.MoE``
    reads only its own experts' counts), so one trace per class gives each rank's exact peak.

    Returns the classes in order of their lowest EP rank, each a sorted list of EP ranks.
    """
    per_ep = cfg.num_routed_experts // par.ep
    rows = [routing.counts(tokens, cfg.num_experts_per_tok, cfg.num_routed_experts, layer)
            for layer in _moe_layers_of_stage(cfg, par, stage, where)]
    classes: dict[tuple, list[int]] = {}
    for e in range(par.ep):
        key = tuple(tuple(row[e * per_ep:(e + 1) * per_ep]) for row in rows)
        classes.setdefault(key, []).append(e)
    return list(classes.values())


@dataclass(frozen=True)
class RankClass:
    """One rank class of a job (``rank_classes``): pipeline rank ``stage``; ``ep_ranks``, the
    EP ranks that trace alike (all of them under balanced routing); ``num_classes``, how many
    classes the stage has; ``rank``, the global rank traced; ``layers``, its decoder layers;
    ``signature``, what its trace depends on within the job (stages of one signature share
    one trace); ``chunks``, the layers per model chunk of the first stage of that
    signature."""

    stage: int
    ep_ranks: tuple[int, ...]
    ep_rank: int | None
    num_classes: int
    rank: int
    layers: tuple[int, ...]
    kinds: frozenset[str]
    signature: tuple
    chunks: tuple[tuple[int, ...], ...]


@dataclass
class TracedClass:
    """A rank class with its traces (``trace_classes``): the static memory, the event
    segments, the schedule steps it replays (the optimizer step "O" last) and, after
    ``replay_class``, its replay."""

    unit: RankClass
    static: StaticMemory
    segments: Segments
    steps: list[Step]
    replayed: ReplayPeak | None = None
    # fine-grained activation offloading's and TE CPU offloading's pinned host buffers
    # (activation_host_bytes)
    activation_host_bytes: int = 0


def rank_classes(job: Job) -> list[RankClass]:
    """Every rank class of ``job``: each pipeline stage, and under routing other than
    balanced with EP > 1 each class of its EP ranks that trace alike (``ep_rank_classes``).

    Raises:
        TracememError: a stage with more EP-rank classes than ``job.max_ep_classes``.
    """
    cfg, par, where = job.config, job.parallel, _placement(job)
    tokens = job.micro_batch_size * job.seq_length // (par.cp * (par.tp if par.sp else 1))
    out: list[RankClass] = []
    representative: dict[tuple, tuple] = {}  # signature -> the first stage's chunks
    for stage in range(par.pp):
        classes = [list(range(par.ep))]
        if job.routing != "balanced" and par.ep > 1:
            classes = ep_rank_classes(cfg, par, stage, job.routing_model, tokens, where)
            if len(classes) > job.max_ep_classes:
                raise TracememError(
                    f"--routing {job.routing} gives pipeline stage {stage} {len(classes)} "
                    f"distinct EP-rank loads (EP ranks whose experts receive different token "
                    f"counts), each traced once; the cap is --max-ep-classes "
                    f"{job.max_ep_classes}: raise it to {len(classes)} (about {len(classes)} "
                    f"traces per stage)")
        by_chunk = tuple(tuple(c) for c in par.layers_of_stage(stage, where))
        layers = tuple(i for chunk in by_chunk for i in chunk)
        held = where.chunks_of(stage)
        kinds = frozenset(s.kind for s in job.steps[stage]) & {"B", "I"}
        for ep_ranks in classes:
            ep_rank = None if len(ep_ranks) == par.ep else ep_ranks[0]
            rank = stage * (par.world_size // par.pp) + (ep_rank or 0) * par.etp
            assert coordinates(par, rank).ep_rank == (ep_rank or 0)
            signature = (0 in held, where.num_chunks - 1 in held, ep_rank,
                         tuple(len(c) for c in by_chunk),
                         tuple(cfg.is_moe_layer(i) for i in layers),
                         None if job.routing == "balanced" else layers, kinds,
                         # --first-last-layers-bf16: which layers run without FP8
                         tuple(job.profile.bf16_layer(i, cfg.num_layers) is not job.profile
                               for i in layers) if hasattr(job.profile, "bf16_layer")
                         else None,
                         # fine-grained activation offloading: the manager's decisions follow
                         # the stage's schedule
                         tuple((s.kind, where.chunk_index(stage, s.stage), s.microbatch)
                               for s in job.steps[stage]) if job.activation_offload else None)
            # stages of one signature share the first one's trace (its module paths
            # included), in this call and, through the cache, in any call with the same key
            chunks = representative.setdefault(signature, by_chunk)
            out.append(RankClass(stage, tuple(ep_ranks), ep_rank, len(classes), rank, layers,
                                 kinds, signature, chunks))
    return out


def _placement(job: Job) -> Placement:
    return placement(job.schedule, job.parallel.pp, job.parallel.vpp, job.microbatches)


def trace_key(job: Job) -> tuple | None:
    """What a rank class's forward / backward trace depends on beyond its signature
    (``TraceCache``), or None when it cannot be shared (the user's own layers, a counts
    file's routing)."""
    from modeling.common.routing import Counts

    par, profile = job.parallel, job.profile
    if isinstance(job.routing_model, Counts) or job.replacements:
        return None
    full, selective = job.recompute == "full", job.recompute == "selective"
    return (repr(job.config), par.tp, par.sp, par.cp, par.ep, par.etp, par.plan,
            par.precision_spec.gradient_accumulation_fusion,
            # ZeRO-3's traced gathers: the unit shards (tracemem.zero3)
            (par.zero, tuple(par.shards(r.quantity, r.kind) for r in SHARDING),
             pp_keeps_gathered(par), fsdp2_group(par)) if par.zero == 3 else None,
            job.micro_batch_size, job.seq_length, (job.routing, job.seed), job.attention,
            job.experts, job.recompute, job.recompute_modules if selective else (),
            (job.recompute_method, job.recompute_num_layers,
             job.distribute_saved_activations) if full else None,
            job.deallocate_pipeline_outputs, job.rounding, profile.name,
            tuple(sorted(profile.options.items())), job.zero3_prefetch,
            job.activation_offload, job.cpu_offloading_num_layers,
            _reads_dataloader_mask(job))


def step_key(job: Job) -> tuple:
    """What the static memory and the optimizer step depend on (``TraceCache``'s second
    key): the ZeRO stage, the shards, the precision recipe, the optimizer, and the GPU (the
    workspaces below the dispatcher, ``tracemem.workspaces``)."""
    par = job.parallel
    return (par.zero, tuple(par.shards(r.quantity, r.kind) for r in SHARDING),
            repr(par.precision_spec), job.optimizer, job.gpu, job.cublas_workspace_config,
            job.torch_cublas_default,
            job.optimizer_offload, pp_keeps_gathered(par), job.ema)


def _finish(job: Job, model, tracer: MemoryTracer, fb: Segments) -> tuple[StaticMemory,
                                                                          Segments]:
    """``_trace_step``, then the rank's workspaces below the dispatcher
    (``tracemem.workspaces``: none without ``job.gpu``) in its static memory."""
    static, segments = _trace_step(model, tracer, job.parallel, job.optimizer, fb,
                                   job.optimizer_offload)
    return _with_workspaces(job, model, static), segments


def _with_workspaces(job: Job, model, static: StaticMemory) -> StaticMemory:
    """``static`` with the rank's workspaces below the dispatcher (``tracemem.workspaces``:
    none without ``job.gpu``) and, under ``--ema host``, the EMA's host bytes."""
    from dataclasses import replace

    from tracemem.workspaces import workspaces

    kept = workspaces(model, gpu=job.gpu, kernels=job.profile, recompute=job.recompute,
                      micro_batch_size=job.micro_batch_size, seq_length=job.seq_length,
                      cublas_workspace_config=job.cublas_workspace_config,
                      torch_cublas_default=job.torch_cublas_default)
    if job.ema == "host":  # DeepSeek-V3's EMA in CPU memory: host bytes only
        from tracemem.offload import ema_host_bytes

        static = replace(static, host_bytes=static.host_bytes + ema_host_bytes(model))
    return replace(static, workspaces=tuple(kept))


def static_floors(job: Job, classes: list[RankClass], cache: TraceCache) -> list[StaticMemory]:
    """Each class's static memory (``static_memory``, the offloaded part moved to the host,
    the workspaces below the dispatcher) from its model built on meta, without tracing: the
    same ``StaticMemory`` the traced class gets (``_finish``), at the cost of a build. Its
    device bytes (``floor_bytes``) are where every replay of the class starts, so a lower
    bound of its peak. Kept in ``cache`` by the trace and step keys."""
    par, where = job.parallel, _placement(job)
    key, step = trace_key(job), step_key(job)
    out = []
    for unit in classes:
        name = (key, unit.signature, unit.chunks, step)
        found = cache.floors.get(name) if key is not None else None
        if found is None:
            model = build_rank(job.config, par, unit.rank, attention=job.attention,
                               experts=job.experts, dtype=torch.bfloat16, kernels=job.profile,
                               placement=where, replace=job.replacements)
            found = static_memory(model, par)
            if job.optimizer_offload is not None:
                found = offload_static(found, model, par, job.optimizer_offload)
            found = _with_workspaces(job, model, found)
            if key is not None:
                cache.floors[name] = found
        out.append(found)
    return out


def floor_bytes(static: StaticMemory) -> int:
    """The device bytes a class's replay starts from (``replay_class``'s base): its static
    memory less the ZeRO-3 gathers and FSDP2's gradients (traced events), plus its
    workspaces."""
    return (static.total_bytes - static.zero3_gather_bytes - static.traced_grad_bytes
            + static.workspace_bytes)


def _class_text(unit: RankClass, pp: int) -> str:
    """A rank class in a progress line: "pipeline stage 3/16", with its EP ranks where a stage
    has several classes."""
    return f"pipeline stage {unit.stage + 1}/{pp}" + (
        f", EP ranks {_ranks_text(list(unit.ep_ranks))}" if unit.num_classes > 1 else "")


def trace_classes(job: Job, classes: list[RankClass], cache: TraceCache,
                  progress: Callable[[str], None] | None = None, *,
                  offload_warmup: bool = False) -> list[TracedClass]:
    """Each class's static memory and segments, from ``cache`` or traced (``_trace_fb``, then
    ``_trace_step`` for the optimizer step), with the schedule steps it replays.
    ``offload_warmup``: under fine-grained activation offloading, the first iteration's
    manager decisions (everything offloaded) instead of a later iteration's."""
    par, where = job.parallel, _placement(job)
    key, step = trace_key(job), step_key(job)
    if key is not None and job.activation_offload:
        key = key + (offload_warmup,)
    if key is None:  # nothing to share with other calls
        cache = TraceCache()
    out = []
    for unit in classes:
        if progress:
            progress(f"tracing {_class_text(unit, par.pp)}")

        def trace(unit=unit):
            return _trace_fb(
                job.config, par, unit.rank, b=job.micro_batch_size, s=job.seq_length,
                routing=job.routing_model, attention=job.attention, experts=job.experts,
                recompute=job.recompute, recompute_modules=frozenset(job.recompute_modules),
                recompute_method=(job.recompute_method, job.recompute_num_layers),
                distribute_saved_activations=job.distribute_saved_activations,
                deallocate=job.deallocate_pipeline_outputs, rounding=job.rounding,
                zero3_prefetch=job.zero3_prefetch, kernels=job.profile, where=where,
                kinds=unit.kinds, replace=job.replacements,
                te_cpu_offload=job.cpu_offloading_num_layers,
                dataloader_mask=_reads_dataloader_mask(job),
                activation_offload=None if not job.activation_offload else ActivationOffload(
                    *job.activation_offload, tuple(job.steps[unit.stage]),
                    lambda v, stage=unit.stage: where.chunk_index(stage, v), offload_warmup))
        static, segments = cache.get((key, unit.signature, unit.chunks), step, trace,
                                     lambda model, tracer, fb: _finish(job, model, tracer, fb))
        if job.schedule == "1f1b" and job.profile.orchestration == "megatron":
            segments = replace(segments, megatron_1f1b=True)  # the same events, shared
        elif job.schedule == "interleaved-1f1b" and job.profile.orchestration == "megatron" \
                and job.deallocate_pipeline_outputs:
            segments = replace(segments, schedule_refs=_interleaved_refs(job, unit.stage))
        steps = job.steps[unit.stage]
        # the optimizer step after the schedule's last step, on the traced "O" segment
        first = next(s for s in steps if where.chunk_index(unit.stage, s.stage) == 0)
        out.append(TracedClass(unit, static, segments, steps + [Step(first.stage, "O", 0)]))
    return out


def replay_class(job: Job, traced: TracedClass, memo: dict | None = None) -> ReplayPeak:
    """The class's schedule replayed over its segments on top of its static memory
    (``replay_schedule``; ZeRO-3 gathers are traced events, not the static line item).
    ``memo`` (a dict shared by the classes of one job): a class with another's floor and
    ``replay_signature`` takes that one's replay, its largest storages' microbatches renamed
    to its own (the same stream, so the same peak, step index, in-flight count and bytes
    alive)."""
    stage, where = traced.unit.stage, _placement(job)
    chunk_index = lambda v: where.chunk_index(stage, v)  # noqa: E731
    floor = floor_bytes(traced.static)
    signature = None
    if memo is not None:
        stream = replay_signature(traced.steps, job.parallel.pp, traced.segments, chunk_index,
                                  memo.setdefault("contents", {}))
        signature = None if stream is None else (floor, stream)
    found = memo.get(signature) if signature is not None else None
    if found is not None:
        peak, steps = found
        rename: dict[tuple[int, int], int] = {}
        for a, b in zip(steps, traced.steps):
            if a.kind != "O":  # the optimizer step's microbatch is no microbatch's
                rename.setdefault((a.stage, a.microbatch), b.microbatch)
        traced.replayed = replace(peak, largest=[
            {**entry, "microbatch": entry["microbatch"] if key is None else rename[key]}
            for entry, key in zip(peak.largest, peak.largest_keys)])
    else:
        traced.replayed = replay_schedule(traced.steps, job.parallel.pp, traced.segments,
                                          floor, chunk_index)
        if signature is not None:
            memo[signature] = (traced.replayed, traced.steps)
    traced.activation_host_bytes = activation_host_bytes(
        traced.steps, traced.segments, lambda v: where.chunk_index(stage, v))
    return traced.replayed


def _row_fields(traced: TracedClass) -> dict:
    """What a rank's row holds with or without the allocator simulation."""
    unit, static, steps, replayed = traced.unit, traced.static, traced.steps, traced.replayed
    at, live = replayed.step_index, replayed.by_category
    return dict(
        pp_stage=unit.stage, ep_rank=unit.ep_rank, rank=unit.rank, layers=list(unit.layers),
        inflight_microbatches=replayed.inflight,
        peak_step=None if at is None else
        "optimizer" if steps[at].kind == "O" else str(steps[at]),
        peak_phase=None if at is None else _PHASES[steps[at].kind],
        peak_bytes=replayed.peak_bytes, parameter_bytes=static.param_bytes,
        gradient_bytes=static.held_grad_bytes + live.get("gradient", 0),
        optimizer_state_bytes=static.optimizer_bytes,
        buffer_bytes=static.buffer_bytes + live.get("buffer", 0),
        activation_bytes=live.get("activation", 0),
        comm_buffer_bytes=live.get("comm_buffer", 0),
        temporary_bytes=live.get("temporary", 0), input_bytes=live.get("input", 0),
        zero3_gather_bytes=live.get("parameter", 0), static=static,
        workspace_bytes=static.workspace_bytes,
        host_bytes=static.host_bytes + traced.activation_host_bytes,
        host_pinned_bytes=static.host_pinned_bytes + traced.activation_host_bytes,
        ep_ranks=unit.ep_ranks if unit.ep_rank is not None else ())


def _static_row(job: Job, unit: RankClass, static: StaticMemory) -> RankEstimate:
    """A row from static memory alone (``static_floors``): its peak is the floor, a lower
    bound; over ``hbm`` it does not fit, else unknown (None)."""
    floor = floor_bytes(static)
    return RankEstimate(
        pp_stage=unit.stage, ep_rank=unit.ep_rank, rank=unit.rank, layers=list(unit.layers),
        inflight_microbatches=0, peak_step=None, peak_bytes=floor,
        parameter_bytes=static.param_bytes, gradient_bytes=static.held_grad_bytes,
        optimizer_state_bytes=static.optimizer_bytes, buffer_bytes=static.buffer_bytes,
        activation_bytes=0, comm_buffer_bytes=0, temporary_bytes=0, input_bytes=0,
        zero3_gather_bytes=0, static=static, workspace_bytes=static.workspace_bytes,
        host_bytes=static.host_bytes, host_pinned_bytes=static.host_pinned_bytes,
        ep_ranks=unit.ep_ranks if unit.ep_rank is not None else (),
        fits=False if floor + job.non_pytorch_memory_bytes > job.hbm_bytes else None)


def screened_row(job: Job, traced: TracedClass) -> RankEstimate:
    """A row without the allocator: reserved >= allocated >= the replayed peak, so a rank
    already over ``hbm`` does not fit; the others are unknown (None)."""
    over = traced.replayed.peak_bytes + job.non_pytorch_memory_bytes > job.hbm_bytes
    return RankEstimate(**_row_fields(traced), fits=False if over else None)


def allocator_row(job: Job, traced: TracedClass, snapshot_dir: Path | None = None,
                  series: bool = False, memo: dict | None = None) -> RankEstimate:
    """A row with the replay through the simulated CUDA caching allocator
    (``tracemem.memory``): allocated and reserved peaks, fragmentation, the verdict; with
    ``snapshot_dir`` a snapshot pickle per class, with ``series`` the timeline for a plot.

    ``memo`` (a dict shared by the rows of one job; not with a snapshot): a rank class whose
    allocator input is another's (the same traced segments and static memory, the same
    ``replay_signature``) takes that one's simulation, its step labels renamed to its own
    steps' (the stream is the same, so is every allocator figure)."""
    unit, static, replayed = traced.unit, traced.static, traced.replayed
    stage, where = unit.stage, _placement(job)
    hbm = job.hbm_bytes
    label = f"stage{stage}" + ("" if unit.ep_rank is None else f"_ep{unit.ep_rank}")
    statics = [("parameter", static.param_bytes), ("gradient", static.held_grad_bytes),
               ("optimizer_state", static.optimizer_bytes), ("buffer", static.buffer_bytes)] \
        + [("workspace", w.nbytes) for w in static.workspaces]
    shown = label.replace("stage", "stage ").replace("_ep", ", EP rank ")
    signature = None
    if memo is not None and snapshot_dir is None:
        stream = replay_signature(traced.steps, job.parallel.pp, traced.segments,
                                  lambda v: where.chunk_index(stage, v),
                                  memo.setdefault("contents", {}))
        signature = None if stream is None else (tuple(statics), series, stream)
        found = memo.get(signature) if signature is not None else None
        if found is not None:
            timeline, steps = found
            rename: dict[str, str] = {}
            if all(rename.setdefault(str(a), str(b)) == str(b)
                   for a, b in zip(steps, traced.steps)):  # labels map one to one
                timeline = replace(timeline, label=shown,
                                   steps=[(e, rename[name]) for e, name in timeline.steps])
                return _allocator_result(job, traced, timeline)
            signature = None

    def events_for(sink):  # the repeated cycles skipped where the allocator can say so
        return replay_events(traced.steps, job.parallel.pp, traced.segments,
                             lambda v: where.chunk_index(stage, v), periodic=sink is not None,
                             sink=sink)

    timeline, allocator = replay_through_allocator(
        events_for, traced.steps,
        # each workspace its own block, as its library allocates it (held from the start:
        # an approximation for those first made in backward, Workspace.first_use)
        statics, shown,
        config=job.alloc_config,
        capacity=None if hbm is None else hbm - job.non_pytorch_memory_bytes,
        device_total=hbm, record_history=snapshot_dir is not None, series=series)
    if snapshot_dir is not None:
        write_snapshot(allocator.sim, snapshot_dir / f"{label}.pickle")
    if signature is not None:
        memo[signature] = (timeline, traced.steps)
    return _allocator_result(job, traced, timeline)


def _allocator_result(job: Job, traced: TracedClass, timeline) -> RankEstimate:
    """``allocator_row``'s row from the class's own replay and the allocator's ``timeline``."""
    replayed, hbm = traced.replayed, job.hbm_bytes
    mem = timeline.stats
    return RankEstimate(
        **_row_fields(traced),
        by_module=dict(sorted(replayed.by_module.items(), key=lambda kv: -kv[1])[:10]),
        largest=replayed.largest, allocated_peak_bytes=mem.allocated_peak,
        reserved_peak_bytes=mem.reserved_peak, fragmentation_bytes=mem.fragmentation_bytes,
        largest_free_block_bytes=mem.largest_free_block,
        reserved_peak_step=step_at(timeline, mem.reserved_peak_event),
        fits=None if hbm is None else (
            mem.reserved_peak + job.non_pytorch_memory_bytes <= hbm and mem.num_ooms == 0),
        memory=timeline)


def estimate(job: Job | str | ModelConfig, /, *, progress: Callable[[str], None] | None = None,
             trace_cache: TraceCache | None = None, screen: bool = False,
             snapshot: str | None = None, plot: str | None = None, **fields) -> Estimate:
    """Peak memory of every distinct rank of ``job``.

    The stages the data goes through, each its own function: ``rank_classes`` (pipeline
    stage x EP-rank class), ``trace_classes`` (traces through ``trace_cache``),
    ``replay_class`` (the schedule replayed over the traces), ``allocator_row`` (the replay
    through the simulated caching allocator; ``screened_row`` without it) and the
    ``Estimate``.

    Args:
        job: a ``tracemem.job.Job``; or a model (preset, config.json path or
            ``ModelConfig``) with the job's fields as keywords (``Job.create``: the names are
            the CLI's, ``schedule`` not ``schedule_name``; an unknown one is refused).
        progress: called with a message before each rank class is traced.
        trace_cache: a ``TraceCache`` to take rank-class traces from and add them to, shared
            by the estimates of one run (``tracemem fit``, ``--what-fits``); default: a fresh
            one per call. Results are the same either way.
        screen: with ``hbm``: when any rank class's static memory (``static_floors``, built
            without tracing) plus ``non_pytorch_memory`` is already over ``hbm``, trace
            nothing (``Estimate.before_tracing``); else when any rank class's replayed peak
            (``peak_bytes``) plus ``non_pytorch_memory`` is already over ``hbm``, skip the
            allocator simulation of every rank class (its reserved peak can only be higher,
            so the job does not fit). Either way ``Estimate.screened`` is True: allocator
            figures 0, ``fits`` False for the ranks over and None for the others.
        snapshot: a directory to write one ``torch.cuda.memory._snapshot()`` pickle per rank
            class into (``stage3.pickle``, ``stage3_ep5.pickle``).
        plot: a .png or .svg file to draw every rank class's memory over the step into.

    Raises:
        TracememError: any invalid input, with the flag, the value and a fix (``Job``);
            fields beside a ``Job``.
    """
    if isinstance(job, Job):
        if fields:
            raise TracememError(f"estimate(job, {next(iter(fields))}=...): change a Job with "
                                f"dataclasses.replace(job, ...) or job.with_changes(...)")
    else:
        job = Job.create(job, **fields)
    snapshot_dir = _output_dir(snapshot) if snapshot is not None else None
    if plot is not None:
        check_plot_path(plot)
    _check_counts_cover(job.config, job.routing_model)
    from tracemem.torch_state import preserved_torch_state

    cache = trace_cache or TraceCache()
    hbm = job.hbm_bytes
    with preserved_torch_state():  # an interrupt while tracing leaves torch as it was
        classes = rank_classes(job)
        if screen and hbm is not None:  # static memory alone over: no trace at all
            floors = static_floors(job, classes, cache)
            if any(floor_bytes(f) + job.non_pytorch_memory_bytes > hbm for f in floors):
                return Estimate(job, [_static_row(job, unit, static)
                                      for unit, static in zip(classes, floors)],
                                screened=True, before_tracing=True)
        traced = trace_classes(job, classes, cache, progress)
    pp = job.parallel.pp
    replays: dict = {}  # rank classes of one replayed stream share it
    for one in traced:
        if progress:
            progress(f"replaying {_class_text(one.unit, pp)} through the schedule")
        replay_class(job, one, replays)
    screened = screen and hbm is not None and any(
        t.replayed.peak_bytes + job.non_pytorch_memory_bytes > hbm for t in traced)
    ranks = []
    memo: dict = {}  # rank classes of one allocator stream share its simulation
    for t in traced:
        if progress and not screened:
            progress(f"simulating the caching allocator for {_class_text(t.unit, pp)}")
        ranks.append(screened_row(job, t) if screened else
                     allocator_row(job, t, snapshot_dir, plot is not None, memo))
    if plot is not None:
        plot_timelines([r.memory for r in ranks], plot, hbm_bytes=hbm,
                       usable_bytes=None if hbm is None else hbm - job.non_pytorch_memory_bytes,
                       title=f"{job.config.name}: memory over one step per rank class "
                             f"({job.alloc_config.text or 'default allocator settings'})")
    return Estimate(job, ranks, screened)


def _output_dir(path: str, flag: str = "--snapshot") -> Path:
    """``--snapshot`` (or ``flag``'s) directory, made if missing."""
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TracememError(f"{flag} {path!r}: cannot make the directory: "
                            f"{e.strerror}") from None
    if not out.is_dir():
        raise TracememError(f"{flag} {path!r} is not a directory")
    return out


def stderr_progress(quiet: bool) -> Callable[[str], None] | None:
    """A progress printer on stderr, or None when quiet or stderr is not a terminal."""
    if quiet or not sys.stderr.isatty():
        return None

    def report(message: str) -> None:
        print(f"\r{message:<60}", end="", file=sys.stderr, flush=True)
    return report
