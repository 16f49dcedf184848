"""Megatron-Core's own pipeline schedules (issue 23, item 3, a first part): the order of one
rank's forward and backward steps, held against ``tracemem.schedules``.

For one layout (``ScheduleCase``: PP, VPP, the number of microbatches M, the rank) the rank's
model chunks (deepseek-tiny with 4 layers, ``oracle_model_config(4)``, b = 1, s = 16) are built
on meta under the fake process group and the patches of ``megatron_patches``, and Megatron-Core
0.16.1's schedule runs them: ``pipeline_parallel/schedules.py``
``forward_backward_pipelining_without_interleaving`` (VPP 1) or
``forward_backward_pipelining_with_interleaving`` (VPP > 1, ``microbatch_group_size_per_vp_
stage`` = PP, its default). Two more patches, local to this module: the point-to-point sends
and receives (``p2p_communication._batched_p2p_ops``: ``batch_isend_irecv``, which the fake
backend refuses for meta tensors) post nothing, the receive buffers being allocated by
``P2PCommunicator._communicate`` itself as on a GPU, and ``torch.cuda.synchronize`` (after
the batched ops) is a no-op.

Recorded per step, by wrapping ``schedules.forward_step`` (its ``vp_stage`` and
``current_microbatch``) and ``schedules.backward_step`` (matched to its forward by the output
tensor): the step in ``tracemem.schedules`` notation (virtual stage = chunk x PP + rank, "F" or
"B", microbatch), the microbatches in flight after it, the activation bytes alive after it
(every storage the schedule made, parameters and their gradients excluded) and the bytes
``deallocate_output_tensor`` frees (the output's ``.data`` replaced by a 1-element tensor once
sent: ``config.deallocate_pipeline_outputs``, Megatron-LM's default). Compared: the step
order and the in-flight peak with ``tracemem.schedules.schedule``; the bytes are reported,
not compared (tracemem's replay of them is issue 23 item 3's second part, not built).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from unittest import mock

import torch

__all__ = ["ScheduleCase", "SCHEDULE_CASES", "ScheduleResult", "run_schedule_case",
           "run_schedule_cases", "format_results", "results_json"]


@dataclass(frozen=True)
class ScheduleCase:
    """One pipeline rank of ``pp`` x ``vpp`` virtual stages and ``num_microbatches`` (DP 1,
    TP 1)."""

    pp: int
    num_microbatches: int
    rank: int
    vpp: int = 1

    @property
    def name(self) -> str:
        vpp = f" VPP{self.vpp}" if self.vpp > 1 else ""
        return f"PP{self.pp}{vpp} M{self.num_microbatches}, rank {self.rank}"

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
)


@dataclass
class ScheduleResult:
    case: ScheduleCase
    megatron_steps: list[str]
    tracemem_steps: list[str]
    live_bytes: list[int] = field(default_factory=list)  # Megatron-Core, after each step
    deallocated_bytes: int = 0  # freed by deallocate_output_tensor

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
        return out


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
        from megatron.core.pipeline_parallel import p2p_communication, schedules

        with patches.fake_process_groups(world_size=case.pp, rank=case.rank, pp=case.pp,
                                         vpp=case.vpp), patches.applied():
            extra = dict(pipeline_model_parallel_size=case.pp, pipeline_dtype=torch.bfloat16)
            if case.vpp > 1:
                extra["virtual_pipeline_model_parallel_size"] = case.vpp
            config = _megatron_config(cfg, OracleCase(), **extra)
            patches.set_routing(Balanced())
            chunks = []
            for vp in range(case.vpp):
                chunks.append(gpt_model_chunk(config, cfg, vp, case.vpp))
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
            tracer.track_external(chunks, [tokens])
            with mock.patch.object(p2p_communication, "_batched_p2p_ops",
                                   lambda **kwargs: []), \
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
    return ScheduleResult(case, steps, ours, live, freed)


def run_schedule_cases(cases=None) -> list[ScheduleResult]:
    """``run_schedule_case`` for each of ``cases`` (default ``SCHEDULE_CASES``)."""
    return [run_schedule_case(c) for c in (SCHEDULE_CASES if cases is None else cases)]


def format_results(results: list[ScheduleResult]) -> str:
    """One row per case: the steps (one string when both sides agree), the in-flight peak,
    Megatron-Core's peak of live activation bytes between steps and what
    ``deallocate_output_tensor`` freed."""
    from tabulate import tabulate

    rows = []
    for r in results:
        same = r.megatron_steps == r.tracemem_steps
        steps = " ".join(r.megatron_steps) if same else (
            " ".join(r.megatron_steps) + "  /  " + " ".join(r.tracemem_steps))
        peaks = (max(r.inflight(r.megatron_steps), default=0),
                 max(r.inflight(r.tracemem_steps), default=0))
        rows.append([r.case.name, peaks[0] if peaks[0] == peaks[1] else f"{peaks[0]} / "
                     f"{peaks[1]}", f"{max(r.live_bytes, default=0):,}",
                     f"{r.deallocated_bytes:,}", steps])
    table = tabulate(rows, headers=["schedule: layout, rank", "in flight", "live B (Megatron)",
                                    "deallocated B", "steps (Megatron-Core / tracemem)"],
                     disable_numparse=True, colalign=("left", "right", "right", "right",
                                                      "left"))
    bad = [line for r in results for line in r.unexplained]
    verdict = ([f"FAIL: {len(bad)} schedule difference(s):", *(f"- {b}" for b in bad)] if bad
               else ["OK: every rank runs its steps in tracemem's order."])
    legend = ("Megatron-Core's forward_backward_pipelining_without_interleaving / "
              "_with_interleaving on meta, one rank, deepseek-tiny with 4 layers, b=1, s=16; "
              "steps in tracemem.schedules notation (virtual stage, F/B, microbatch).")
    return "\n".join([table, "", legend, *verdict])


def results_json(results: list[ScheduleResult]) -> list[dict]:
    return [{"layout": r.case.name, "megatron_core": r.megatron_steps,
             "tracemem": r.tracemem_steps, "live_bytes": r.live_bytes,
             "deallocated_bytes": r.deallocated_bytes, "unexplained": r.unexplained}
            for r in results]
