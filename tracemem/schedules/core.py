"""Schedule steps, the three schedules, and their checks (see the package docstring)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import networkx as nx
from tabulate import tabulate

from tracemem.errors import TracememError

__all__ = ["Step", "SCHEDULES", "schedule", "check_schedule", "inflight_peak", "format_grid"]

_NOTATION = re.compile(r"^(\d+)([FB])(\d+)$")


@dataclass(frozen=True, order=True)
class Step:
    """One forward (``"F"``) or backward (``"B"``) of ``microbatch`` on virtual ``stage``."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @classmethod
    def parse(cls, text: str) -> Step:
        """``"0F3"`` -> ``Step(0, "F", 3)``.

        Raises:
            TracememError: not STAGE F|B MICROBATCH.
        """
        match = _NOTATION.match(text)
        if not match:
            raise TracememError(f"step {text!r} is invalid; write STAGE F|B MICROBATCH, e.g. 0F3")
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


SCHEDULES = {"1f1b": one_f_one_b, "gpipe": gpipe, "interleaved-1f1b": interleaved_1f1b}


def schedule(name: str, pp: int, vpp: int, num_microbatches: int) -> list[list[Step]]:
    """The steps of every pipeline rank, checked (``check_schedule``).

    Raises:
        TracememError: unknown schedule, a VPP the schedule does not take, or a microbatch
            count it rejects (Megatron's interleaved schedule needs M to be a multiple of pp).
    """
    if name not in SCHEDULES:
        raise TracememError(f"--schedule {name!r} is invalid; choose one of "
                            f"{', '.join(SCHEDULES)}")
    if num_microbatches <= 0:
        raise TracememError(f"--num-microbatches {num_microbatches} must be a positive integer")
    if name == "interleaved-1f1b":
        if vpp < 2:
            raise TracememError("--schedule interleaved-1f1b needs --vpp 2 or more; use 1f1b "
                                "for one model chunk per rank")
        if num_microbatches % pp:
            raise TracememError(
                f"--num-microbatches {num_microbatches} must be a multiple of --pp {pp} for "
                f"the interleaved schedule (Megatron-LM rejects it); try "
                f"{-(-num_microbatches // pp) * pp}")
    elif vpp != 1:
        raise TracememError(f"--schedule {name} runs one model chunk per rank; --vpp {vpp} "
                            f"needs --schedule interleaved-1f1b")
    steps = SCHEDULES[name](pp, vpp, num_microbatches)
    check_schedule(steps, pp * vpp, num_microbatches)
    return steps


def check_schedule(ranks: list[list[Step]], num_stages: int, num_microbatches: int) -> nx.DiGraph:
    """Build the DAG of data dependencies (F of stage v before F of v + 1, the last F before
    its B, B of v + 1 before B of v) and of each rank's order; check that every step occurs
    exactly once and that the graph is acyclic (a cycle is a deadlock). Returns the graph.

    Raises:
        AssertionError: an internal schedule is incomplete or deadlocks.
    """
    graph = nx.DiGraph()
    expected = {Step(v, k, i) for v in range(num_stages) for k in "FB"
                for i in range(num_microbatches)}
    seen = [step for steps in ranks for step in steps]
    assert sorted(seen) == sorted(expected), "a schedule must run every step exactly once"
    graph.add_nodes_from(expected)
    for i in range(num_microbatches):
        for v in range(num_stages - 1):
            graph.add_edge(Step(v, "F", i), Step(v + 1, "F", i))
            graph.add_edge(Step(v + 1, "B", i), Step(v, "B", i))
        graph.add_edge(Step(num_stages - 1, "F", i), Step(num_stages - 1, "B", i))
    for steps in ranks:
        nx.add_path(graph, steps)
    assert nx.is_directed_acyclic_graph(graph), "the schedule deadlocks"
    return graph


def inflight_peak(steps: list[Step]) -> int:
    """The most microbatch forwards a rank holds at once (forwards done minus backwards done),
    counted in model chunks."""
    held = peak = 0
    for step in steps:
        held += 1 if step.kind == "F" else -1
        peak = max(peak, held)
    return peak


def format_grid(ranks: list[list[Step]]) -> str:
    """A time-step x rank grid of the steps (PyTorch pipelining's ``_format_pipeline_order``)."""
    length = max(len(steps) for steps in ranks)
    rows = [[t] + [str(steps[t]) if t < len(steps) else "" for steps in ranks]
            for t in range(length)]
    return tabulate(rows, headers=["step"] + [f"rank {p}" for p in range(len(ranks))])
