"""``tracemem validate --against megatron-ci``: tracemem against Megatron-LM's measured CI runs.

Each selected case (``tracemem.validation.megatron_ci.selection``: a golden file whose job the
Megatron-LM front door expresses) is built into a ``Job`` through that front door, unchanged
(``case_job_kwargs``), and only the logged rank is estimated: global rank ``world_size - 1``
(``megatron_ci``'s module docstring: Megatron-LM's ``_set_tensorboard_writer``), which is the
last pipeline stage and the last EP rank. Its rank class is found among the job's
(``tracemem.estimator.rank_classes``), traced, replayed through the schedule and through the
simulated caching allocator (``allocator_row``); the figure held against the measured
``mem-max-allocated-bytes`` (``allocated_bytes.all.peak``) is the simulated
``max_memory_allocated`` of the whole step, optimizer step included (``allocated_peak_bytes``).

Scored at iteration 2 (or the first logged iteration after 1): the peak since the process
started, so it covers iteration 1 (whose optimizer step makes Adam's moments) and iteration 2
(the first with them present from the start). tracemem's step has them from the start.

A second check on the same case: what is alive after the step (``mem-allocated-bytes``,
``allocated_bytes.all.current`` at the same iteration) against tracemem's static memory
(parameters, gradient buffers, optimizer states, buffers) and workspaces, the memory that
outlives a step. A third: iteration 1's ``mem-max-allocated-bytes`` against the same step with
the optimizer state that TE's ``FusedAdam`` makes lazily (the moments; the master weights too
under the precision-aware optimizer) absent until its first step (``first_step_peak``), except
where the checkpoint loader makes it before iteration 1 (``state_before_first_step``:
Megatron-FSDP with ``--ckpt-format fsdp_dtensor`` and ``--load``).

Beside it, Megatron-LM's own closed form on the same arguments
(``tracemem.formulas.megatron.theoretical_memory_usage``, d98e8a6, term by term): what its
users have today. Its weight term describes a "most loaded shard" and its activation term the
first stage, which is not the logged rank; the board shows its error all the same, since that
is the figure a user would read.

The residue of a case is what tracemem knows it does not trace for that job
(``megatron_approximations``: the front door's stated approximations), and the rest; beyond
1 % the board itemises what is known of it (``residue_leads``: a learned MoE router, the same
arguments' errors on other GPUs and containers), or says it is unexplained. Nothing here is
tuned to a measured value.
"""

from __future__ import annotations

import hashlib
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from tracemem.errors import TracememError

__all__ = ["BoardRow", "score_case", "score_cases", "summary", "format_board",
           "first_step_peak", "lazy_optimizer_bytes", "state_before_first_step", "moe_router",
           "residue_leads", "LEAD_THRESHOLD"]


@dataclass(frozen=True)
class BoardRow:
    """One scored case: ``measured_bytes`` (the golden file's, at ``measured_iteration``),
    ``tracemem_bytes`` (the logged rank's simulated ``max_memory_allocated``), ``error``
    (tracemem / measured - 1), ``peak_bytes`` (the replayed peak, before the allocator's
    block rounding), the logged rank's ``pp_stage`` and ``rank``, ``approximations`` (the
    front door's stated approximations for the job: known, untraced residue),
    ``workspace_bytes`` (of ``tracemem_bytes``: below the dispatcher, ``tracemem.workspaces``)
    and ``formula_bytes`` (Megatron's ``theoretical_memory_usage`` total)."""

    name: str
    gpu: str | None
    world_size: int
    measured_iteration: int
    measured_bytes: int
    tracemem_bytes: int
    peak_bytes: int
    pp_stage: int
    rank: int
    approximations: tuple[str, ...]
    workspace_bytes: int = 0
    formula_bytes: int | None = None  # Megatron's theoretical_memory_usage total
    # a second check: what is alive after the step (mem-allocated-bytes at the same
    # iteration) against tracemem's static memory and workspaces, which outlive the step
    measured_after_bytes: int | None = None
    tracemem_after_bytes: int | None = None
    # a third check: iteration 1 (mem-max-allocated-bytes there), whose step makes the
    # optimizer's lazily created state (``first_step_peak``)
    measured_first_bytes: int | None = None
    tracemem_first_bytes: int | None = None
    # what was read from the case's history (megatron_ci.INFERENCES), None: nothing
    inferred: str | None = None
    # the MoE router the arguments train ("aux_loss top-2"), None without experts
    router: str | None = None
    # the case's arguments and world size, to find its copies on other GPUs
    args_key: str | None = None
    # the container of its pairing commit ("NGC 26.04"), None where not recorded
    container: str | None = None

    @property
    def error(self) -> float:
        return self.tracemem_bytes / self.measured_bytes - 1

    @property
    def after_error(self) -> float | None:
        if not self.measured_after_bytes or self.tracemem_after_bytes is None:
            return None
        return self.tracemem_after_bytes / self.measured_after_bytes - 1

    @property
    def first_error(self) -> float | None:
        if not self.measured_first_bytes or self.tracemem_first_bytes is None:
            return None
        return self.tracemem_first_bytes / self.measured_first_bytes - 1

    @property
    def formula_error(self) -> float | None:
        if self.formula_bytes is None:
            return None
        return self.formula_bytes / self.measured_bytes - 1


def moe_router(argv) -> str | None:
    """The router of a Megatron-LM MoE job's arguments, "TYPE top-K", read by the front
    door's parser with Megatron-LM's defaults (``parse_megatron_args``:
    ``--moe-router-load-balancing-type`` aux_loss, ``--moe-router-topk`` 2 at d98e8a6), with
    " + expert bias" under ``--moe-router-enable-expert-bias``; None without experts."""
    from tracemem.frontdoors.megatron_args import parse_megatron_args

    ns = parse_megatron_args(argv)
    if not ns.num_experts:
        return None
    kind = ns.moe_router_load_balancing_type  # nargs "+": one type, or one per layer group
    kind = "/".join(kind) if isinstance(kind, list) else kind
    bias = " + expert bias" if ns.moe_router_enable_expert_bias else ""
    return f"{kind} top-{ns.moe_router_topk}{bias}"


# a case's residue beyond this |error| is itemised (issue 21's "every residue above 1 %")
LEAD_THRESHOLD = 0.01


def residue_leads(row: BoardRow, rows: list[BoardRow]) -> list[str]:
    """What is known of ``row``'s residue beyond what tracemem traces, as leads (none is
    scored): its learned MoE router (tracemem routes balanced; the golden files do not log
    the expert loads), and its copies with the same arguments, environment and world size,
    by GPU and container (a copy within ``LEAD_THRESHOLD`` says the residue comes with this
    run's GPU, container or run, which the arguments do not say); "unexplained" where neither
    applies. What tracemem approximates of the arguments is the board's "approx." column
    (``megatron_approximations``)."""
    leads = []
    if row.router is not None:
        leads.append(f"routing: a learned {row.router} router (tracemem routes balanced; "
                     f"the run's expert loads are not logged)")
    copies = sorted((r for r in rows if r.args_key == row.args_key and r.name != row.name
                     and r.args_key is not None), key=lambda r: r.name)
    if copies:
        said = ", ".join(f"{r.gpu}" + (f" {r.container}" if r.container else "")
                         + f" {r.error:+.1%}" for r in copies)
        close = any(abs(r.error) <= LEAD_THRESHOLD for r in copies)
        leads.append(f"the same arguments: {said}"
                     + (" (within 1 % there: the residue comes with this run's GPU, "
                        "container or run)" if close else ""))
    return leads or ["unexplained"]


def _container_tag(container: str | None) -> str | None:
    """``nvcr.io/nvidia/pytorch:26.04-py3`` -> ``NGC 26.04`` (the NGC PyTorch container);
    another image as given."""
    if container is None:
        return None
    prefix = "nvcr.io/nvidia/pytorch:"
    if container.startswith(prefix):
        return "NGC " + container.removeprefix(prefix).removesuffix("-py3")
    return container


def state_before_first_step(argv) -> bool:
    """Whether the job's optimizer state exists before iteration 1 (so nothing of it is made
    at the first step): Megatron-FSDP with ``--ckpt-format fsdp_dtensor``, the distributed
    optimizer and ``--load`` given (Megatron-LM's CI passes it on a first run too, an empty
    directory: tests/test_utils/shell_scripts/run_ci_test.sh), without ``--finetune`` or
    ``--no-load-optim``. Megatron-LM d98e8a6 ``megatron/training/checkpointing.py``
    ``load_checkpoint``: the ``elif args.ckpt_format == 'fsdp_dtensor'`` branch tests the
    argument, not the format found on disk, and builds the loading state dict
    (``generate_state_dict(..., optimizer=optimizer)``, ``is_loading=True``) before it finds
    nothing to load; ``megatron/core/optimizer/distrib_optimizer.py``
    ``sharded_param_state_fsdp_dtensor`` then runs ``_init_optimizer_states_with_dummy_values``:
    zero gradients, ``self.optimizer.step()`` (TE ``FusedAdam.step`` initialises every empty
    state), ``zero_grad()``. The other formats load the optimizer only from a checkpoint found
    (``ckpt_format == 'torch_dist'``, the detected value), so their state stays lazy."""
    from tracemem.frontdoors.megatron import expand_megatron_args, parse_with_given

    ns, _ = parse_with_given(expand_megatron_args(list(argv)))
    return bool(getattr(ns, "use_megatron_fsdp", False) and ns.ckpt_format == "fsdp_dtensor"
                and ns.use_distributed_optimizer and ns.load is not None
                and not ns.finetune and not ns.no_load_optim)


def lazy_optimizer_bytes(job, optimizer_bytes: int) -> int:
    """Of a rank's ``optimizer_bytes`` (master weights + Adam moments), what the optimizer
    creates at its first step: TE's ``FusedAdam.step`` (transformer_engine/pytorch/optimizers/
    fused_adam.py at d0067d0, Megatron's Adam when TE is present: megatron/core/optimizer/
    __init__.py) runs ``initialize_state`` for each parameter whose state is empty: exp_avg and
    exp_avg_sq, and the master weights when it keeps them (``master_weights``, Megatron's
    ``--use-precision-aware-optimizer``). Without it the fp32 master weights are made when the
    optimizer is built (megatron/core/optimizer/distrib_optimizer.py
    ``_build_model_and_main_param_groups``; optimizer.py ``Float16OptimizerWithFloat16Params``
    ``__init__``), before iteration 1. The share is per element, so it is exact on the
    rank's (padded) shard."""
    recipe = job.parallel.precision_spec
    lazy = recipe.optimizer_bytes - (0 if job.use_precision_aware_optimizer
                                     else recipe.master_bytes)
    return optimizer_bytes * lazy // recipe.optimizer_bytes


def first_step_peak(job, traced) -> int:
    """The simulated ``max_memory_allocated`` of iteration 1 of ``traced`` (replayed): the
    same schedule with the optimizer's lazily created state (``lazy_optimizer_bytes``) absent
    until the optimizer step, then allocated at its start (``FusedAdam.step`` initialises
    every empty state before its kernels run), one block."""
    from tracemem.categories import Category
    from tracemem.estimator import _placement, replay_events
    from tracemem.memory.timeline import replay_through_allocator
    from types import SimpleNamespace

    static, steps = traced.static, traced.steps
    lazy = (0 if state_before_first_step(job.megatron_args)
            else lazy_optimizer_bytes(job, static.optimizer_bytes))
    stage, where = traced.unit.stage, _placement(job)
    optimizer_step = next(i for i, s in enumerate(steps) if s.kind == "O")
    made = SimpleNamespace(category=Category.OPTIMIZER_STATE, module="optimizer",
                           op="FusedAdam.initialize_state")

    def events():
        inserted = False
        for item in replay_events(steps, job.parallel.pp, traced.segments,
                                  lambda v: where.chunk_index(stage, v)):
            if not inserted and item[0] >= optimizer_step:
                yield optimizer_step, ("first-step optimizer state",), "alloc", lazy, made
                inserted = True
            yield item
        if not inserted:
            yield optimizer_step, ("first-step optimizer state",), "alloc", lazy, made
    static_items = ([("parameter", static.param_bytes), ("gradient", static.grad_bytes),
                     ("optimizer_state", static.optimizer_bytes - lazy),
                     ("buffer", static.buffer_bytes)]
                    + [("workspace", w.nbytes) for w in static.workspaces])
    timeline, _ = replay_through_allocator(events(), steps, static_items, "iteration 1",
                                           config=job.alloc_config)
    return timeline.stats.allocated_peak


def _logged_class(job):
    """The rank class of global rank world_size - 1 (the last stage, the last EP rank)."""
    from tracemem.estimator import rank_classes

    par = job.parallel
    last_ep = par.ep - 1
    for unit in rank_classes(job):
        if unit.stage == par.pp - 1 and last_ep in unit.ep_ranks:
            return unit
    raise AssertionError("no rank class holds the last rank")  # every EP rank is in one


def score_case(case) -> BoardRow:
    """Estimate ``case``'s logged rank (the module docstring).

    Raises:
        TracememError: the front door refuses the case (``case_job_kwargs``).
    """
    from tracemem.estimator import TraceCache, allocator_row, replay_class, trace_classes
    from tracemem.formulas.megatron import formula_bytes_for_job
    from tracemem.frontdoors import megatron_approximations
    from tracemem.job import Job
    from tracemem.validation.megatron_ci import case_job_kwargs

    job = Job(**case_job_kwargs(case))
    unit = _logged_class(job)
    (traced,) = trace_classes(job, [unit], TraceCache())
    replay_class(job, traced)
    row = allocator_row(job, traced)
    notes = tuple(megatron_approximations(case.argv,
                                          env=dict(case.env_vars)))
    formula = formula_bytes_for_job(case.argv, case.world_size, vocab_size=case.vocab_size)
    static = traced.static
    after = (static.param_bytes + static.grad_bytes + static.optimizer_bytes
             + static.buffer_bytes + static.workspace_bytes)
    first = None
    if case.iteration1_bytes:
        warm = traced
        if job.activation_offload:  # iteration 1 is the offload manager's warm-up
            (warm,) = trace_classes(job, [unit], TraceCache(), offload_warmup=True)
        first = first_step_peak(job, warm)
    key = hashlib.sha256(repr((tuple(case.argv), case.world_size,
                               sorted(dict(case.env_vars).items()))).encode()).hexdigest()[:16]
    return BoardRow(case.name, case.gpu, case.world_size, case.measured_iteration,
                    case.measured_bytes, row.allocated_peak_bytes, row.peak_bytes,
                    unit.stage, job.world_size - 1, notes, row.workspace_bytes,
                    formula.total_bytes,
                    (case.allocated or {}).get(case.measured_iteration), after,
                    case.iteration1_bytes, first, case.inferred, moe_router(case.argv), key,
                    _container_tag(case.container))


def score_cases(cases, progress: Callable[[str], None] | None = None
                ) -> tuple[list[BoardRow], list[tuple[object, str]]]:
    """Every case scored, and those that could not be (with the one-line reason)."""
    rows, failed = [], []
    for index, case in enumerate(cases):
        if progress:
            progress(f"megatron-ci: {index + 1}/{len(cases)} {case.name}")
        try:
            rows.append(score_case(case))
        except TracememError as error:
            failed.append((case, str(error).splitlines()[0]))
    return rows, failed


def _stats(errors: list[float]) -> dict:
    errors = sorted(abs(e) for e in errors)
    p90 = errors[min(len(errors) - 1, max(0, -(-9 * len(errors) // 10) - 1))]
    return {"median_abs_error": statistics.median(errors), "p90_abs_error": p90,
            "worst_abs_error": errors[-1], "within_5pct": sum(e <= 0.05 for e in errors),
            "within_2pct": sum(e <= 0.02 for e in errors)}


def summary(rows: list[BoardRow]) -> dict:
    """Cases, median |error|, 90th percentile |error| (nearest rank), worst |error|, how
    many are within 5 % and 2 %, the mean error; and the same of Megatron's formula
    (``formula``, over the cases it gives a figure for)."""
    if not rows:
        return {"cases": 0}
    out = {"cases": len(rows), **_stats([r.error for r in rows]),
           "mean_error": statistics.fmean(r.error for r in rows)}
    after = [r.after_error for r in rows if r.after_error is not None]
    if after:
        out["after_step"] = {"cases": len(after), **_stats(after),
                             "mean_error": statistics.fmean(after)}
    first = [r.first_error for r in rows if r.first_error is not None]
    if first:
        out["iteration_1"] = {"cases": len(first), **_stats(first),
                              "mean_error": statistics.fmean(first)}
    formula = [r.formula_error for r in rows if r.formula_error is not None]
    if formula:
        out["formula"] = {"cases": len(formula), **_stats(formula),
                          "mean_error": statistics.fmean(formula)}
    return out


def _summary_line(title: str, s: dict) -> str:
    return (f"{title}: {s['cases']} cases; median |error| {s['median_abs_error']:.1%}, 90th "
            f"percentile {s['p90_abs_error']:.1%}, worst {s['worst_abs_error']:.1%}; within "
            f"5 %: {s['within_5pct']}, within 2 %: {s['within_2pct']}; mean error "
            f"{s['mean_error']:+.1%}")


def format_board(rows: list[BoardRow], left_out: list[tuple[object, str]],
                 failed: list[tuple[object, str]]) -> str:
    """The board (one row per case, bytes and GiB), the summary line, and the counts of the
    cases left out by reason."""
    from tabulate import tabulate

    gib = 2**30
    table = [[r.name + (" *" if r.inferred else ""), r.gpu or "-", r.world_size, r.measured_iteration,
              f"{r.measured_bytes:,}", f"{r.measured_bytes / gib:.3f}",
              f"{r.tracemem_bytes:,}", f"{r.tracemem_bytes / gib:.3f}", f"{r.error:+.1%}",
              f"{r.workspace_bytes / 2**20:.0f}",
              "-" if r.after_error is None else f"{r.after_error:+.1%}",
              "-" if r.first_error is None else f"{r.first_error:+.1%}",
              "-" if r.formula_error is None else f"{r.formula_error:+.1%}",
              len(r.approximations)] for r in sorted(rows, key=lambda r: r.name)]
    lines = [tabulate(table, headers=["case", "GPU", "GPUs", "iter", "measured B",
                                      "GiB", "tracemem B", "GiB", "error", "of it: ws MiB",
                                      "after-step error", "iter-1 error", "formula error",
                                      "approx."],
                      disable_numparse=True,
                      colalign=("left", "left", "right", "right", "right", "right", "right",
                                "right", "right", "right", "right", "right", "right",
                                "right"))]
    s = summary(rows)
    if s["cases"]:
        lines += ["", _summary_line("Summary", s) + " (tracemem / measured - 1; GiB = 2^30 B; "
                  "ws: workspaces below the dispatcher)"]
        lines.append("approx.: how many of the case's Megatron-LM arguments (or environment "
                     "variables) tracemem approximates, each a known residue it does not "
                     "trace (megatron_approximations; --json lists them per case).")
        inferred = sum(1 for r in rows if r.inferred)
        if inferred:
            lines.append(f"*: {inferred} case(s) scored with a launch or argument read from "
                         f"the case's history where its pairing commit does not give it "
                         f"(tracemem.validation.megatron_ci.INFERENCES, each with its "
                         f"evidence; --json: inferred).")
        if "after_step" in s:
            lines.append(_summary_line("After the step (mem-allocated-bytes against static "
                                       "memory + workspaces)", s["after_step"]))
        if "iteration_1" in s:
            lines.append(_summary_line("Iteration 1 (mem-max-allocated-bytes; Adam's moments "
                                       "made at its optimizer step, before it where "
                                       "Megatron-FSDP loads fsdp_dtensor)", s["iteration_1"]))
        if "formula" in s:
            lines.append(_summary_line("Megatron-LM's theoretical_memory_usage on the same "
                                       "cases", s["formula"]))
    beyond = sorted((r for r in rows if abs(r.error) > LEAD_THRESHOLD),
                    key=lambda r: (-abs(r.error), r.name))
    if beyond:
        lines += ["", f"What is known of the residue of the {len(beyond)} case(s) beyond 1 % "
                      f"(leads, not findings: nothing is scored with them; what tracemem "
                      f"approximates of each is its approx. column):"]
        lines.append(tabulate([[r.name, f"{r.error:+.1%}", "; ".join(residue_leads(r, rows))]
                               for r in beyond], headers=["case", "error", "what is known"],
                              disable_numparse=True, colalign=("left", "right", "left"),
                              maxcolwidths=[None, None, 80]))
    reasons: dict[str, int] = {}
    for _, why in left_out + failed:
        reasons[why] = reasons.get(why, 0) + 1
    if reasons:
        lines += ["", f"Left out: {len(left_out) + len(failed)} golden files, by reason "
                      f"(the first 15):"]
        lines += [f"- {n} x {why}" for why, n in sorted(reasons.items(),
                                                        key=lambda kv: -kv[1])[:15]]
    return "\n".join(lines)
