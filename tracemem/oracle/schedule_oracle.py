"""Megatron-Core's own pipeline schedules (issue 23, item 3): the order of one rank's forward
and backward steps, held against ``tracemem.schedules``, and the bytes alive after each step,
held against tracemem's replay with an itemised residue.

For one layout (``ScheduleCase``: PP, VPP, the number of microbatches M, the rank) the rank's
model chunks (deepseek-tiny with 4 layers, ``oracle_model_config(4)``, b = 1, s = 16) are built
on meta under the fake process group and the patches of ``megatron_patches``, and Megatron-Core
0.16.1's schedule runs them: ``pipeline_parallel/schedules.py``
``forward_backward_pipelining_without_interleaving`` (VPP 1) or
``forward_backward_pipelining_with_interleaving`` (VPP > 1, ``microbatch_group_size_per_vp_
stage`` = PP, its default). Two more patches, local to this module: the point-to-point sends
and receives (``p2p_communication._batched_p2p_ops``: ``batch_isend_irecv``, which the fake
backend refuses for meta tensors, and ``_p2p_ops``, the p2p overlap's ``isend`` / ``irecv``)
post nothing, the receive buffers being allocated by
``P2PCommunicator._communicate`` itself as on a GPU, and ``torch.cuda.synchronize`` (after
the batched ops) is a no-op.

Each model chunk is wrapped in Megatron-Core's ``DistributedDataParallel``
(``grad_reduce_in_fp32``, ``use_distributed_optimizer``: Megatron-LM's defaults with
``--use-distributed-optimizer`` and bf16), as Megatron-LM trains: weight gradients go into its
preallocated grad buffer (made before the step, external like the parameters), not into
``.grad`` tensors kept across microbatches.

Recorded per step, by wrapping ``schedules.forward_step`` (its ``vp_stage`` and
``current_microbatch``) and ``schedules.backward_step`` (matched to its forward by the output
tensor): the step in ``tracemem.schedules`` notation (virtual stage = chunk x PP + rank, "F" or
"B", microbatch), the microbatches in flight after it, the bytes alive when it returns (every
storage the schedule made; parameters and DDP's buffers are external) and the bytes
``deallocate_output_tensor`` frees (the output's ``.data`` replaced by a 1-element tensor once
sent: ``config.deallocate_pipeline_outputs``, Megatron-LM's default).

Compared: the step order and the in-flight peak with ``tracemem.schedules.schedule``; and the
bytes alive after every step with tracemem's replay of the same job
(``tracemem.estimator.replay_events`` over the rank's traced segments, the optimizer step
excluded, plus the RoPE frequencies ``tracemem.workspaces`` keeps from the first forward on):
Megatron-Core minus tracemem must equal the residue at that step, to the byte
(``step_residue``: ``SCHEDULE_RESIDUE``'s rows for 1F1B; for the interleaved schedule, the same
rows per model chunk). The pipeline tensors the interleaved schedule's lists and locals hold are
tracemem's own model (``tracemem.schedules.megatron_refs``, held by its replay), so this
comparison holds that model to the byte.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable
from unittest import mock

import torch

from tracemem.schedules.megatron_refs import INTERLEAVED_REFERENCES, interleaved_references

__all__ = ["ScheduleCase", "SCHEDULE_CASES", "ScheduleResult", "SCHEDULE_RESIDUE",
           "ScheduleResidueRow", "INTERLEAVED_REFERENCES", "step_residue",
           "interleaved_references", "interleaved_residue", "run_schedule_case",
           "run_schedule_cases", "format_results", "results_json"]


@dataclass(frozen=True)
class ScheduleCase:
    """One pipeline rank of ``pp`` x ``vpp`` virtual stages and ``num_microbatches`` (DP 1,
    TP 1); ``overlap_p2p_comm``: the interleaved schedule's p2p overlap (Megatron-LM's
    default there; ``batch_p2p_comm`` off with it)."""

    pp: int
    num_microbatches: int
    rank: int
    vpp: int = 1
    overlap_p2p_comm: bool = False

    @property
    def name(self) -> str:
        vpp = f" VPP{self.vpp}" if self.vpp > 1 else ""
        overlap = ", p2p overlap" if self.overlap_p2p_comm else ""
        return f"PP{self.pp}{vpp} M{self.num_microbatches}, rank {self.rank}{overlap}"

    @property
    def schedule(self) -> str:
        return "interleaved-1f1b" if self.vpp > 1 else "1f1b"


SCHEDULE_CASES: tuple[ScheduleCase, ...] = (
    ScheduleCase(pp=2, num_microbatches=4, rank=0),
    ScheduleCase(pp=2, num_microbatches=4, rank=1),
    ScheduleCase(pp=4, num_microbatches=8, rank=0),
    ScheduleCase(pp=4, num_microbatches=8, rank=2),
    ScheduleCase(pp=2, vpp=2, num_microbatches=4, rank=0),
    ScheduleCase(pp=2, vpp=2, num_microbatches=4, rank=1),
    ScheduleCase(pp=2, vpp=2, num_microbatches=4, rank=0, overlap_p2p_comm=True),
    ScheduleCase(pp=2, vpp=2, num_microbatches=4, rank=1, overlap_p2p_comm=True),
)


@dataclass
class ScheduleResult:
    case: ScheduleCase
    megatron_steps: list[str]
    tracemem_steps: list[str]
    live_bytes: list[int] = field(default_factory=list)  # Megatron-Core, after each step
    deallocated_bytes: int = 0  # freed by deallocate_output_tensor
    # tracemem's replay after each step (RoPE's cache included)
    tracemem_bytes: list[int] | None = None
    residue: list[dict[str, int]] = field(default_factory=list)  # per step, row -> bytes

    @staticmethod
    def inflight(steps: list[str]) -> list[int]:
        held, out = 0, []
        for step in steps:
            held += 1 if "F" in step else -1
            out.append(held)
        return out

    @property
    def unexplained(self) -> list[str]:
        out = []
        if self.megatron_steps != self.tracemem_steps:
            first = next((i for i, (a, b) in enumerate(zip(self.megatron_steps,
                                                           self.tracemem_steps)) if a != b),
                         min(len(self.megatron_steps), len(self.tracemem_steps)))
            out.append(f"schedule {self.case.name}: step {first} is "
                       f"{self.megatron_steps[first:first + 1]} on Megatron-Core's side, "
                       f"{self.tracemem_steps[first:first + 1]} on tracemem's")
        m, t = self.inflight(self.megatron_steps), self.inflight(self.tracemem_steps)
        if max(m, default=0) != max(t, default=0):
            out.append(f"schedule {self.case.name}: in-flight peak {max(m, default=0)} / "
                       f"{max(t, default=0)}")
        if self.tracemem_bytes is not None:
            for step, a, b, rows in zip(self.megatron_steps, self.live_bytes,
                                        self.tracemem_bytes, self.residue):
                if a - b != sum(rows.values()):
                    out.append(f"schedule {self.case.name}: after {step} Megatron-Core holds "
                               f"{a:,} B, tracemem {b:,} B: {a - b:+,} B; the residue "
                               f"explains {sum(rows.values()):+,} B")
        return out


@dataclass(frozen=True)
class _StepDims:
    """What a ``SCHEDULE_RESIDUE`` row reads at one step of one rank (VPP 1): the step's kind
    ("F" / "B"); the rank's place (``first``: embedding, ``last``: output layer and loss);
    ``backwards``, the backward steps done so far (this one included); ``prior_backward``, a
    backward step ran before this one; ``inflight``, forwards minus backwards after it;
    sizes: ``hidden`` the bytes of one [s, b, h] bf16 pipeline tensor, ``tokens`` b x s,
    ``layers`` on the rank, ``rope`` the RoPE head dim."""

    kind: str
    first: bool
    last: bool
    backwards: int
    prior_backward: bool
    inflight: int
    hidden: int
    tokens: int
    layers: int
    rope: int


@dataclass(frozen=True)
class ScheduleResidueRow:
    """One row of ``SCHEDULE_RESIDUE``: bytes Megatron-Core holds after a step and tracemem's
    replay does not (negative: the reverse), as a function of the step's ``_StepDims``;
    ``reason`` cites the source (Megatron-Core 0.16.1 unless named) that makes it."""

    tensor: str
    bytes: Callable[[_StepDims], int]
    reason: str


_MCORE = "megatron-core 0.16.1 megatron/core/"

SCHEDULE_RESIDUE: tuple[ScheduleResidueRow, ...] = (
    ScheduleResidueRow(
        "RoPE inv_freq [d_r / 2] fp32, per MLA layer",
        lambda d: 4 * (d.rope // 2) * d.layers,
        _MCORE + "models/common/embeddings/rotary_pos_embedding.py RotaryEmbedding.__init__ "
        "makes self.inv_freq a plain attribute (not a buffer), one per MLA layer's "
        "RotaryEmbedding; on a GPU it exists from construction, the tracer first sees it at "
        "the first forward; tracemem's static memory does not count it (16 B a layer here)"),
    ScheduleResidueRow(
        "labels (and, first stage, token ids) int64 [b, s] per microbatch in flight",
        lambda d: -d.inflight * 8 * d.tokens * (2 if d.first else 1),
        "tracemem.estimator._trace_fb makes each microbatch's labels, and the first stage's "
        "token ids, in its forward and drops them after its backward; this oracle's data "
        "iterator hands Megatron-Core one external tensor (the setup, not a fault)"),
    ScheduleResidueRow(
        "total_num_tokens int32 [] and the MoE aux-loss scale fp32 [1]",
        lambda d: 4 + 4,
        _MCORE + "pipeline_parallel/schedules.py forward_backward_pipelining_without_"
        "interleaving: total_num_tokens = torch.zeros([], dtype=torch.int); "
        "forward_step_calc_loss: MoEAuxLossAutoScaler.set_loss_scale (transformer/moe/"
        "moe_utils.py keeps it as a class attribute)"),
    ScheduleResidueRow(
        "each finished microbatch's loss fp32 [] in forward_data_store (last stage)",
        lambda d: 4 * d.backwards if d.last else 0,
        _MCORE + "pipeline_parallel/schedules.py forward_step_calc_loss appends loss_reduced "
        "(this oracle's loss_func: loss.detach(), the loss's storage) for the whole step; "
        "tracemem's loss dies with its backward"),
    ScheduleResidueRow(
        "the output [s, b, h] bf16 still whole when forward_step returns, less its stand-in",
        lambda d: d.hidden - 2 if d.kind == "F" and not d.last else 0,
        _MCORE + "pipeline_parallel/schedules.py: the 1F1B loop calls "
        "deallocate_output_tensor after the send, once forward_step has returned; tracemem's "
        "forward segment ends with the output replaced (modeling.parallel.pp.send_forward)"),
    ScheduleResidueRow(
        "the last backward's loss stand-in fp32 [1] (last stage)",
        lambda d: 4 if d.backwards and d.last else 0,
        _MCORE + "pipeline_parallel/schedules.py: the 1F1B loop deallocates the last stage's "
        "output too (the loss: a 1-element stand-in, the loss itself kept by forward_data_"
        "store) and output_tensor = output_tensors.pop(0) holds it until the next pop; "
        "tracemem's last stage sends nothing, so it has no stand-in (the other stages' are "
        "held by its replay: Segments.megatron_1f1b)"),
    ScheduleResidueRow(
        "the previous backward's input gradient [s, b, h] bf16 while backward_step runs",
        lambda d: d.hidden if d.kind == "B" and d.prior_backward and not d.first else 0,
        _MCORE + "pipeline_parallel/schedules.py: input_tensor_grad = backward_step(...): the "
        "local still holds the previous input gradient until backward_step returns; "
        "tracemem's replay holds it through that backward and frees it at its end "
        "(Segments.megatron_1f1b), which is where its step is counted"),
)


def step_residue(case: ScheduleCase, cfg, steps: list[str]) -> list[dict[str, int]]:
    """The residue after each of ``steps`` (a rank of ``case``, deepseek-tiny cut to
    ``cfg``'s layers, b = 1, s = 16): per step, row -> bytes (rows of 0 omitted). VPP 1:
    ``SCHEDULE_RESIDUE``'s rows; VPP > 1: ``interleaved_residue``."""
    from tracemem.parallel import ParallelConfig

    if case.vpp > 1:
        return interleaved_residue(case, cfg, steps)
    par = ParallelConfig.create(cfg, world_size=case.pp, pp=case.pp)
    layers = [i for chunk in par.layers_of_stage(case.rank) for i in chunk]
    out, inflight, backwards = [], 0, 0
    for step in steps:
        kind = "F" if "F" in step else "B"
        prior = backwards > 0
        if kind == "F":
            inflight += 1
        else:
            inflight, backwards = inflight - 1, backwards + 1
        d = _StepDims(kind, case.rank == 0, case.rank == case.pp - 1, backwards, prior,
                      inflight, 16 * cfg.hidden_size * 2, 16, len(layers),
                      cfg.qk_rope_head_dim)
        out.append({row.tensor: n for row in SCHEDULE_RESIDUE if (n := row.bytes(d))})
    return out


def interleaved_residue(case: ScheduleCase, cfg, steps: list[str]) -> list[dict[str, int]]:
    """The residue of an interleaved (VPP > 1) rank after each of ``steps``: per model chunk,
    ``SCHEDULE_RESIDUE``'s RoPE ``inv_freq`` row once the chunk has run a forward, tracemem's
    labels and token ids per microbatch in flight, the schedule
    scalars, RoPE's cache of the chunks whose first forward is still to come (negative:
    tracemem counts the rank's from its first forward, Megatron-Core's ``lru_cache`` fills per
    layer). The pipeline tensors the schedule's lists and locals hold
    (``tracemem.schedules.megatron_refs``) are in tracemem's replay (``Segments.
    schedule_refs``), so they are no residue: a fault in that model fails the comparison.

    Raises:
        TracememError: ``steps`` is not the schedule ``interleaved_references`` models.
    """
    from tracemem.errors import TracememError
    from tracemem.parallel import ParallelConfig
    from tracemem.schedules import placement

    par = ParallelConfig.create(cfg, world_size=case.pp, pp=case.pp, vpp=case.vpp)
    chunks = par.layers_of_stage(case.rank, placement(case.schedule, case.pp, case.vpp,
                                                      case.num_microbatches))
    hidden = 16 * cfg.hidden_size * 2
    tokens, rope = 16, cfg.qk_rope_head_dim
    refs = interleaved_references(case.pp, case.vpp, case.num_microbatches, case.rank,
                                  hidden, case.overlap_p2p_comm)
    if [name for name, _ in refs] != list(steps):
        raise TracememError(f"schedule {case.name}: Megatron-Core's steps are not the "
                            f"interleaved schedule the residue models")
    inv_freq, labels, scalars = SCHEDULE_RESIDUE[:3]  # evaluated per chunk below

    def dims(chunk: int, inflight: int = 0) -> _StepDims:
        # the rank's chunk as if it were a stage of its own (the rows above read these)
        return _StepDims("F", chunk == 0 and case.rank == 0, False, 0, False, inflight,
                         hidden, tokens, len(chunks[chunk]), rope)

    ran: set[int] = set()
    inflight: set[tuple[int, int]] = set()
    out = []
    for step, _ in refs:  # the pipeline tensors: tracemem's replay holds them too
        kind = "F" if "F" in step else "B"
        stage, mb = map(int, step.split(kind))
        c = stage // case.pp
        if kind == "F":
            ran.add(c)
            inflight.add((c, mb))
        else:
            inflight.discard((c, mb))
        rows = {
            inv_freq.tensor: sum(inv_freq.bytes(dims(x)) for x in ran),
            labels.tensor: sum(labels.bytes(dims(x, 1)) for x, _ in inflight),
            scalars.tensor: scalars.bytes(dims(c)),
            "RoPE's cache [s, 1, 1, d_r] fp32 of layers whose chunk has not run a forward yet":
                -sum(4 * tokens * rope * len(chunks[x]) for x in range(case.vpp)
                     if x not in ran),
        }
        out.append({k: v for k, v in rows.items() if v})
    return out


def _tracemem_bytes(case: ScheduleCase, cfg) -> list[int]:
    """tracemem's bytes alive after each step of ``case``'s rank (the optimizer step
    excluded): ``replay_events`` over the rank's traced segments (megatron-te kernels,
    Megatron-Core's default loss, no rounding), plus the RoPE frequencies
    ``tracemem.workspaces`` keeps from the first forward on."""
    from tracemem.estimator import TraceCache, _placement, rank_classes, replay_events, \
        trace_classes
    from tracemem.job import Job

    job = Job(model=cfg, world_size=case.pp, pp=case.pp, vpp=case.vpp, micro_batch_size=1,
              seq_length=16, num_microbatches=case.num_microbatches, schedule=case.schedule,
              kernels="megatron-te", kernel_options={"cross_entropy_fusion": "none"},
              rounding=None, gpu="H100")
    if not case.overlap_p2p_comm:
        # the interleaved schedule without the overlap at PP 2: Megatron-LM's validate_args
        # refuses it and so does the Job (several p2p ops between the same two ranks in one
        # batch); Megatron-Core's schedule runs it here, where nothing is sent, and the
        # references model is held against that run (the field is read at replay time)
        object.__setattr__(job, "overlap_p2p_comm", False)
    traced = next(t for t in trace_classes(job, rank_classes(job), TraceCache())
                  if t.unit.stage == case.rank)
    where = _placement(job)
    rope = sum(w.nbytes for w in traced.static.workspaces
               if "rotary_pos_embedding.py" in w.source and w.first_use == "forward")
    steps = [s for s in traced.steps if s.kind != "O"]
    alive, cur, i = [0] * len(steps), 0, 0
    for ev in replay_events(steps, case.pp, traced.segments,
                            lambda v: where.chunk_index(case.rank, v)):
        while i < ev.step_index:
            alive[i], i = cur, i + 1
        cur += ev.nbytes if ev.action == "alloc" else -ev.nbytes
    alive[i:] = [cur] * (len(steps) - i)
    forwarded = [any(s.kind == "F" for s in steps[:k + 1]) for k in range(len(steps))]
    return [a + (rope if f else 0) for a, f in zip(alive, forwarded)]


def _megatron(case: ScheduleCase, cfg) -> tuple[list[str], list[int], int]:
    from tracemem.categories import Phase
    from tracemem.oracle import megatron_patches as patches
    from tracemem.oracle.compare import OracleCase, _megatron_config
    from tracemem.oracle.megatron_spec import gpt_model_chunk
    from tracemem.tracer import MemoryTracer
    from modeling.common.routing import Balanced

    patches.require_megatron()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.distributed import (DistributedDataParallel,
                                               DistributedDataParallelConfig)
        from megatron.core.pipeline_parallel import p2p_communication, schedules

        with patches.fake_process_groups(world_size=case.pp, rank=case.rank, pp=case.pp,
                                         vpp=case.vpp), patches.applied():
            extra = dict(pipeline_model_parallel_size=case.pp, pipeline_dtype=torch.bfloat16)
            if case.vpp > 1:
                extra["virtual_pipeline_model_parallel_size"] = case.vpp
            config = _megatron_config(cfg, OracleCase(), **extra)
            patches.set_routing(Balanced())
            chunks = []
            for vp in range(case.vpp):  # as megatron/training/training.py get_model wraps
                # each chunk (bucketing off after the first)
                ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                    use_distributed_optimizer=True)
                chunks.append(DistributedDataParallel(config, ddp,
                                                      gpt_model_chunk(config, cfg, vp, case.vpp),
                                                      disable_bucketing=vp > 0))
            buffers = [b for c in chunks for b in c.buffers + c.expert_parallel_buffers]
            tokens = torch.zeros((1, 16), dtype=torch.long, device="meta")

            def data():
                while True:
                    yield tokens

            def forward_step_func(iterator, model):
                t = next(iterator)
                out = model(t, None, None, labels=t)

                def loss_func(output):
                    loss = output.float().sum()
                    return loss, {"loss": loss.detach()}
                return out, loss_func

            steps: list[str] = []
            live: list[int] = []
            made: dict[int, tuple[int, int]] = {}
            freed = [0]
            tracer = MemoryTracer(rounding=None, devices={"meta"})

            def alive() -> int:
                return sum(s.nbytes for s in tracer.live_at(len(tracer.events) - 1)
                           if s.phase is not Phase.EXTERNAL) if tracer.events else 0

            forward, backward = schedules.forward_step, schedules.backward_step
            dealloc = schedules.deallocate_output_tensor

            def forward_step(*args, **kwargs):
                vp = kwargs.get("vp_stage") or 0
                mb = kwargs.get("current_microbatch")
                out = forward(*args, **kwargs)
                tensor = out[0][0] if isinstance(out[0], list) else out[0]
                made[id(tensor)] = (vp, mb)
                steps.append(f"{vp * case.pp + case.rank}F{mb}")
                live.append(alive())
                return out

            def backward_step(input_tensor, output_tensor, *args, **kwargs):
                tensor = output_tensor[0] if isinstance(output_tensor, list) else output_tensor
                vp, mb = made[id(tensor)]
                out = backward(input_tensor, output_tensor, *args, **kwargs)
                steps.append(f"{vp * case.pp + case.rank}B{mb}")
                live.append(alive())
                return out

            def deallocate_output_tensor(out, deallocate_pipeline_outputs=False):
                # a scalar (the last stage's loss) or an output already replaced by its
                # 1-element stand-in frees nothing worth counting
                if out is not None and deallocate_pipeline_outputs and out.numel() > 1:
                    freed[0] += out.untyped_storage().nbytes()
                return dealloc(out, deallocate_pipeline_outputs)

            run = (schedules.forward_backward_pipelining_with_interleaving if case.vpp > 1
                   else schedules.forward_backward_pipelining_without_interleaving)
            config.deallocate_pipeline_outputs = True  # Megatron-LM's default (arguments.py)
            # the p2p overlap: Megatron-LM turns batch_p2p_comm off with it
            # (megatron/training/argument_utils.py), so the sends and receives go through
            # _p2p_ops, which posts nothing here (no handles to wait on)
            config.overlap_p2p_comm = case.overlap_p2p_comm
            config.batch_p2p_comm = not case.overlap_p2p_comm
            # parameters and DDP's buffers exist before the step (DDP's own `buffers`
            # attribute hides Module.buffers: track the wrapped modules)
            tracer.track_external([c.module for c in chunks], [tokens],
                                  [b.grad_data for b in buffers],
                                  [b.param_data for b in buffers if b.param_data is not None])
            with mock.patch.object(p2p_communication, "_batched_p2p_ops",
                                   lambda **kwargs: []), \
                    mock.patch.object(p2p_communication, "_p2p_ops", lambda **kwargs: {}), \
                    mock.patch.object(torch.cuda, "synchronize", lambda *a, **k: None), \
                    mock.patch.object(schedules, "forward_step", forward_step), \
                    mock.patch.object(schedules, "backward_step", backward_step), \
                    mock.patch.object(schedules, "deallocate_output_tensor",
                                      deallocate_output_tensor), tracer:
                run(forward_step_func=forward_step_func,
                    data_iterator=[data() for _ in chunks] if case.vpp > 1 else data(),
                    model=chunks, num_microbatches=case.num_microbatches, seq_length=16,
                    micro_batch_size=1)
            patches.set_routing(None)
    return steps, live, freed[0]


def run_schedule_case(case: ScheduleCase, cfg=None) -> ScheduleResult:
    """Megatron-Core's steps for ``case`` and tracemem's (``tracemem.schedules.schedule``).

    Raises:
        TracememError: megatron-core missing or not the pinned version; a bad layout.
    """
    from tracemem.oracle.compare import oracle_model_config
    from tracemem.schedules import schedule

    cfg = cfg or oracle_model_config(4)
    steps, live, freed = _megatron(case, cfg)
    ours = [str(s) for s in schedule(case.schedule, case.pp, case.vpp,
                                     case.num_microbatches)[case.rank]]
    return ScheduleResult(case, steps, ours, live, freed, _tracemem_bytes(case, cfg),
                          step_residue(case, cfg, steps))


def run_schedule_cases(cases=None) -> list[ScheduleResult]:
    """``run_schedule_case`` for each of ``cases`` (default ``SCHEDULE_CASES``)."""
    return [run_schedule_case(c) for c in (SCHEDULE_CASES if cases is None else cases)]


def format_results(results: list[ScheduleResult]) -> str:
    """One row per case: the steps (one string when both sides agree), the in-flight peak,
    the bytes alive after Megatron-Core's busiest step on both sides (tracemem's replay, and
    the residue there) and what
    ``deallocate_output_tensor`` freed; then the residue rows with their bytes at that step."""
    from tabulate import tabulate

    rows, residue_rows = [], []
    for r in results:
        same = r.megatron_steps == r.tracemem_steps
        steps = " ".join(r.megatron_steps) if same else (
            " ".join(r.megatron_steps) + "  /  " + " ".join(r.tracemem_steps))
        peaks = (max(r.inflight(r.megatron_steps), default=0),
                 max(r.inflight(r.tracemem_steps), default=0))
        busiest = max(range(len(r.live_bytes)), key=r.live_bytes.__getitem__, default=None)
        ours = rest = "-"
        if r.tracemem_bytes is not None and busiest is not None:
            ours = f"{r.tracemem_bytes[busiest]:,}"
            rest = f"{sum(r.residue[busiest].values()):+,}"
            residue_rows += [[r.case.name, r.megatron_steps[busiest], tensor, f"{n:+,}"]
                             for tensor, n in r.residue[busiest].items()]
        rows.append([r.case.name, peaks[0] if peaks[0] == peaks[1] else f"{peaks[0]} / "
                     f"{peaks[1]}", f"{max(r.live_bytes, default=0):,}", ours, rest,
                     f"{r.deallocated_bytes:,}", steps])
    table = tabulate(rows, headers=["schedule: layout, rank", "in flight", "Megatron B",
                                    "tracemem B", "residue B", "deallocated B",
                                    "steps (Megatron-Core / tracemem)"],
                     disable_numparse=True, colalign=("left", "right", "right", "right",
                                                      "right", "right", "left"))
    bad = [line for r in results for line in r.unexplained]
    verdict = ([f"FAIL: {len(bad)} schedule difference(s):", *(f"- {b}" for b in bad)] if bad
               else ["OK: every rank runs its steps in tracemem's order and holds "
                     "tracemem's bytes plus the residue after every step."])
    legend = ("Megatron-Core's forward_backward_pipelining_without_interleaving / "
              "_with_interleaving on meta (each chunk in its DistributedDataParallel), one "
              "rank, deepseek-tiny with 4 layers, b=1, s=16; steps in tracemem.schedules "
              "notation (virtual stage, F/B, microbatch); bytes alive after Megatron-Core's "
              "busiest step, parameters and DDP buffers excluded (tracemem: its replay plus "
              "RoPE's cache).")
    parts = [table, "", legend]
    if residue_rows:
        parts += ["", tabulate(residue_rows, headers=["schedule: layout, rank", "at",
                                                      "residue (Megatron-Core - tracemem)",
                                                      "B"],
                               disable_numparse=True,
                               colalign=("left", "left", "left", "right"))]
    return "\n".join(parts + ["", *verdict])


def results_json(results: list[ScheduleResult]) -> list[dict]:
    return [{"layout": r.case.name, "megatron_core": r.megatron_steps,
             "tracemem": r.tracemem_steps, "live_bytes": r.live_bytes,
             "tracemem_bytes": r.tracemem_bytes, "residue": r.residue,
             "deallocated_bytes": r.deallocated_bytes, "unexplained": r.unexplained}
            for r in results]
