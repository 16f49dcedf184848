"""Zero-bubble schedules (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241):
each backward is split into I (input gradient, on the critical path) and W (weight gradient,
deferred into the bubbles).

- ``zb_h1``: ZB-H1 (the paper's section 3.1; "ZB1P" in the DeepSeek-V3 report), as PyTorch
  builds it with one stage per rank: torch/distributed/pipelining/schedules.py (torch 2.13),
  ``ScheduleInterleavedZeroBubble._calculate_single_rank_operations`` and
  ``_get_1f1b_rank_ops(enable_zero_bubble=True)``.
- ``zbv``: ZB-V (the paper's section 6), two chunks per rank in a V:
  ``ScheduleZBVZeroBubble._calculate_single_rank_operations``.
"""

from __future__ import annotations

from collections import deque

from tracemem.schedules.core import Step

__all__ = ["zb_h1", "zbv"]


def zb_h1(pp: int, vpp: int, m: int) -> list[list[Step]]:
    """Rank p runs 1F1B's min(pp - p - 1, M) warm-up forwards, then F and I in turn; its
    first p input backwards keep their W pending, after that every I is followed by the
    oldest pending W; the W's still pending run at the end. Rank p holds at most
    min(pp - p, M) full activations (like 1F1B) and up to p + 1 microbatches' W inputs."""
    ranks = []
    for p in range(pp):
        warmup = min(pp - p - 1, m)
        steps = [Step(p, "F", i) for i in range(warmup)]
        pending: deque[int] = deque()
        for k in range(m):  # the k-th I; ops before it: warmup + k (torch's op counter)
            if k < m - warmup:
                steps.append(Step(p, "F", warmup + k))
            steps.append(Step(p, "I", k))
            pending.append(k)
            if k >= p:  # torch: op - warmup_ops >= num_1f1b_microbatches (= rank)
                steps.append(Step(p, "W", pending.popleft()))
        steps += [Step(p, "W", i) for i in pending]
        ranks.append(steps)
    return ranks


def zbv(pp: int, vpp: int, m: int) -> list[list[Step]]:
    """ZB-V on the V placement: rank p holds chunks p (going down) and 2 * pp - 1 - p
    (coming back). Warm-up: 2 * (pp - p) - 1 forwards of chunk p, then p pairs (chunk-1
    forward, chunk-0 forward), then pp - p times (chunk-1 F, I, W); steady state: chunk-0
    F, I, W and chunk-1 F, I, W; cool-down: p pairs of I (chunk 0, chunk 1), pp - p times
    chunk-0 I and W, then the pending W's of chunk 1, then of chunk 0. PyTorch plans
    max(2 * pp - 1, M) microbatches and drops the steps of those beyond M."""
    n = max(2 * pp - 1, m)
    ranks = []
    for p in range(pp):
        c0, c1 = p, 2 * pp - 1 - p
        f = {c0: 0, c1: 0}
        b = {c0: 0, c1: 0}
        steps: list[Step] = []

        def add(chunk: int, kind: str, counter: dict[int, int]) -> None:
            steps.append(Step(chunk, kind, counter[chunk]))
            counter[chunk] += 1

        for _ in range(2 * (pp - p) - 1):
            add(c0, "F", f)
        for _ in range(p):
            add(c1, "F", f)
            add(c0, "F", f)
        for _ in range(pp - p):
            add(c1, "F", f)
            steps.append(Step(c1, "I", b[c1]))
            add(c1, "W", b)
        while f[c1] < f[c0] or f[c0] < n:
            if f[c0] < n:
                add(c0, "F", f)
            steps.append(Step(c0, "I", b[c0]))
            add(c0, "W", b)
            add(c1, "F", f)
            steps.append(Step(c1, "I", b[c1]))
            add(c1, "W", b)
        w = dict(b)
        for _ in range(p):
            add(c0, "I", b)
            add(c1, "I", b)
        for _ in range(pp - p):
            add(c0, "I", b)
            add(c0, "W", w)
        while w[c1] < b[c1]:
            add(c1, "W", w)
        while w[c0] < b[c0]:
            add(c0, "W", w)
        assert f == b == w == {c0: n, c1: n}
        ranks.append([s for s in steps if s.microbatch < m])
    return ranks
