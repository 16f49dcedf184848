"""Schedule steps, the 1F1B family, the registry, and the checks (see the package docstring)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import networkx as nx
from tabulate import tabulate

from tracemem.errors import TracememError
from tracemem.schedules.placement import Placement

__all__ = ["Step", "SCHEDULES", "schedule", "placement", "check_placement", "check_schedule",
           "inflight_peak", "format_grid"]

# PyTorch's letters (torch/distributed/pipelining/schedules.py, ``_ComputationType``):
# F forward, B full backward, I backward for the input gradient, W backward for the weights
_NOTATION = re.compile(r"^(\d+)([FBIW])(\d+)$")


@dataclass(frozen=True, order=True)
class Step:
    """One forward (``"F"``), full backward (``"B"``), input-gradient backward (``"I"``) or
    weight-gradient backward (``"W"``) of ``microbatch`` on model chunk (virtual stage)
    ``stage``; which rank runs it is ``Placement.rank_of``."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Step:
        """``"0F3"`` -> ``Step(0, "F", 3)``.

        Raises:
            TracememError: not STAGE F|B|I|W MICROBATCH.
        """
        match = _NOTATION.match(text)
        if not match:
            raise TracememError(f"step {text!r} is invalid; write STAGE F|B|I|W MICROBATCH, "
                                f"e.g. 0F3")
        return cls(int(match[1]), match[2], int(match[3]))


def gpipe(pp: int, vpp: int, m: int) -> list[list[Step]]:
    """All forwards, then all backwards (Huang et al. 2019); rank p holds all M microbatches."""
    return [[Step(p, "F", i) for i in range(m)] + [Step(p, "B", i) for i in range(m)]
            for p in range(pp)]


def one_f_one_b(pp: int, vpp: int, m: int) -> list[list[Step]]:
    """Megatron's non-interleaved 1F1B (megatron/core/pipeline_parallel/schedules.py,
    ``forward_backward_pipelining_without_interleaving``): rank p runs min(pp - p - 1, M)
    warm-up forwards, then alternates one forward and one backward, then drains the backwards.
    """
    ranks = []
    for p in range(pp):
        warmup = min(pp - p - 1, m)
        steps = [Step(p, "F", i) for i in range(warmup)]
        for i in range(m - warmup):
            steps += [Step(p, "F", warmup + i), Step(p, "B", i)]
        steps += [Step(p, "B", i) for i in range(m - warmup, m)]
        ranks.append(steps)
    return ranks


def interleaved_1f1b(pp: int, vpp: int, m: int) -> list[list[Step]]:
    """Megatron's interleaved 1F1B (``forward_backward_pipelining_with_interleaving``): M must
    be a multiple of pp; rank p runs (pp - p - 1) * 2 + (vpp - 1) * pp warm-up forwards (all
    M * vpp if fewer), then 1F1B. The k-th forward of a rank is chunk (k // pp) % vpp of
    microbatch (k // (pp * vpp)) * pp + k % pp; backwards walk the chunks in reverse.
    """
    total = m * vpp
    ranks = []
    for p in range(pp):
        warmup = min((pp - p - 1) * 2 + (vpp - 1) * pp, total)

        def forward(k: int, p: int = p) -> Step:
            chunk = (k // pp) % vpp
            return Step(chunk * pp + p, "F", (k // (pp * vpp)) * pp + k % pp)

        def backward(k: int, p: int = p) -> Step:
            chunk = vpp - 1 - (k // pp) % vpp
            return Step(chunk * pp + p, "B", (k // (pp * vpp)) * pp + k % pp)

        steps = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            steps += [forward(warmup + k), backward(k)]
        steps += [backward(k) for k in range(total - warmup, total)]
        ranks.append(steps)
    return ranks


def _registry() -> dict:
    from tracemem.schedules.dualpipe import dualpipe, dualpipev
    from tracemem.schedules.zero_bubble import zb_h1, zbv
    # name -> (steps function (pp, vpp, M), placement style, model chunks per rank or None
    # for --vpp)
    return {"1f1b": (one_f_one_b, "loop", 1), "gpipe": (gpipe, "loop", 1),
            "interleaved-1f1b": (interleaved_1f1b, "loop", None),
            "zb-h1": (zb_h1, "loop", 1), "zbv": (zbv, "v", 2),
            "dualpipe": (dualpipe, "bidirectional", 1), "dualpipev": (dualpipev, "v", 2)}


SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zbv", "dualpipe", "dualpipev")


def placement(name: str, pp: int, vpp: int, num_microbatches: int) -> Placement:
    """Where schedule ``name`` puts the model chunks (``pp * vpp`` of them)."""
    style = _registry()[name][1]
    return Placement(style, pp, pp * vpp, num_microbatches)


def check_placement(name: str, pp: int, vpp: int) -> Placement:
    """The placement of schedule ``name`` on ``pp`` ranks with ``vpp`` chunks per rank, for
    what does not depend on the microbatches (static memory).

    Raises:
        TracememError: unknown schedule, or a PP / VPP it does not take.
    """
    if name not in SCHEDULES:
        raise TracememError(f"--schedule {name!r} is invalid; choose one of "
                            f"{', '.join(SCHEDULES)}")
    chunks = _registry()[name][2]
    if name == "interleaved-1f1b" and vpp < 2:
        raise TracememError("--schedule interleaved-1f1b needs --vpp 2 or more; use 1f1b "
                            "for one model chunk per rank")
    if name == "interleaved-1f1b" and pp < 2:
        # Megatron-LM d98e8a6 megatron/training/arguments.py validate_args: "When interleaved
        # schedule is used, pipeline-model-parallel size should be greater than 1"
        raise TracememError(f"--vpp {vpp} (the interleaved 1F1B schedule) needs --pp 2 or "
                            f"more, as Megatron-LM requires; got --pp {pp}")
    if chunks == 2 and vpp != 2:
        raise TracememError(f"--schedule {name} places two model chunks on every rank in a V; "
                            f"give --vpp 2 (and a layout of 2 * pp stages), not --vpp {vpp}")
    if chunks == 1 and vpp != 1:
        hint = ("dualpipev" if name == "dualpipe" else "interleaved-1f1b"
                + (" (or zbv / dualpipev)" if vpp == 2 else ""))
        raise TracememError(f"--schedule {name} runs one model chunk per rank; --vpp {vpp} "
                            f"needs --schedule {hint}")
    if name == "dualpipe" and (pp < 2 or pp % 2):
        raise TracememError(f"--schedule dualpipe needs an even --pp (DualPipe pairs rank "
                            f"r with rank pp - 1 - r); got --pp {pp}")
    return placement(name, pp, vpp, 0)


def _validate(name: str, pp: int, vpp: int, m: int) -> None:
    check_placement(name, pp, vpp)
    if m <= 0:
        raise TracememError(f"--num-microbatches {m} must be a positive integer")
    if name == "interleaved-1f1b":
        if m % pp:
            raise TracememError(
                f"--num-microbatches {m} must be a multiple of --pp {pp} for "
                f"the interleaved schedule (Megatron-LM rejects it); try "
                f"{-(-m // pp) * pp}")
    if name == "dualpipe":
        # deepseek-ai/DualPipe dualpipe.py, DualPipe.step: num_ranks % 2 == 0,
        # num_chunks % 2 == 0 and num_chunks >= num_ranks * 2
        if m % 2 or m < 2 * pp:
            raise TracememError(
                f"--num-microbatches {m} must be even and at least 2 * pp = {2 * pp} for "
                f"dualpipe (DualPipe.step asserts it); try {max(2 * pp, m + m % 2)}")
    if name == "dualpipev" and m < 2 * pp:
        # dualpipev.py, DualPipeV.step: num_chunks >= num_ranks * 2 (PyTorch's
        # ScheduleDualPipeV: at least as many microbatches as stages)
        raise TracememError(f"--num-microbatches {m} must be at least 2 * pp = {2 * pp} for "
                            f"dualpipev (DualPipeV.step asserts it)")


def schedule(name: str, pp: int, vpp: int, num_microbatches: int) -> list[list[Step]]:
    """The steps of every pipeline rank, checked (``check_schedule``).

    Raises:
        TracememError: unknown schedule, a VPP the schedule does not take, or a microbatch
            count it rejects (Megatron's interleaved schedule needs M to be a multiple of pp;
            DualPipe an even M >= 2 * pp; DualPipeV M >= 2 * pp).
    """
    _validate(name, pp, vpp, num_microbatches)
    steps = _registry()[name][0](pp, vpp, num_microbatches)
    check_schedule(steps, placement(name, pp, vpp, num_microbatches), num_microbatches)
    return steps


def check_schedule(ranks: list[list[Step]], where: Placement,
                   num_microbatches: int) -> nx.DiGraph:
    """Build the DAG of data dependencies (F of chunk v before F of v + 1, the last F before
    its backward, the backward (B or I) of v + 1 before that of v, I before W) and of each
    rank's order; check that every microbatch has one F and either one B or one I and one W
    on every chunk, each on the rank ``where`` puts it, and that the graph is acyclic (a
    cycle is a deadlock). Returns the graph.

    Raises:
        AssertionError: an internal schedule is incomplete, misplaced or deadlocks.
    """
    num_stages = where.num_chunks
    graph = nx.DiGraph()
    seen = [step for steps in ranks for step in steps]
    assert len(seen) == len(set(seen)), "a schedule must run every step once"
    for rank, steps in enumerate(ranks):
        for step in steps:
            assert where.rank_of(step.stage, step.microbatch) == rank, (rank, str(step))
    split = {(s.stage, s.microbatch) for s in seen if s.kind == "I"}
    expected = set()
    for v in range(num_stages):
        for i in range(num_microbatches):
            expected.add(Step(v, "F", i))
            expected |= ({Step(v, "I", i), Step(v, "W", i)} if (v, i) in split
                         else {Step(v, "B", i)})
    assert set(seen) == expected, "a schedule must run every step exactly once"
    graph.add_nodes_from(expected)

    def backward(v: int, i: int) -> Step:
        return Step(v, "I" if (v, i) in split else "B", i)

    for i in range(num_microbatches):
        for v in range(num_stages - 1):
            graph.add_edge(Step(v, "F", i), Step(v + 1, "F", i))
            graph.add_edge(backward(v + 1, i), backward(v, i))
        graph.add_edge(Step(num_stages - 1, "F", i), backward(num_stages - 1, i))
        for v in range(num_stages):
            if (v, i) in split:
                graph.add_edge(Step(v, "I", i), Step(v, "W", i))
    for steps in ranks:
        nx.add_path(graph, steps)
    assert nx.is_directed_acyclic_graph(graph), "the schedule deadlocks"
    return graph


def inflight_peak(steps: list[Step]) -> int:
    """The most microbatch forwards a rank holds at once (forwards done minus full or
    input-gradient backwards done: after I only W's inputs remain), counted in model chunks."""
    held = peak = 0
    for step in steps:
        held += {"F": 1, "B": -1, "I": -1, "W": 0}[step.kind]
        peak = max(peak, held)
    return peak


def format_grid(ranks: list[list[Step]]) -> str:
    """A time-step x rank grid of the steps (PyTorch pipelining's ``_format_pipeline_order``)."""
    length = max(len(steps) for steps in ranks)
    rows = [[t] + [str(steps[t]) if t < len(steps) else "" for steps in ranks]
            for t in range(length)]
    return tabulate(rows, headers=["step"] + [f"rank {p}" for p in range(len(ranks))])
