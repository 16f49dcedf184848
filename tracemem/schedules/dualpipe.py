"""DeepSeek's DualPipe and DualPipeV (DeepSeek-V3 report, arXiv 2412.19437, section 3.2.1;
code: github.com/deepseek-ai/DualPipe at 3da1bbe, ``DualPipe.step`` in dualpipe/dualpipe.py
and ``DualPipeV.step`` in dualpipe/dualpipev.py; PyTorch's port of the latter is
``ScheduleDualPipeV`` in torch/distributed/pipelining/schedules.py, torch 2.13).

Both run the same eight phases on every rank, over two "phases" (model chunks) per rank:

1. nF0: forwards of phase 0;  2. nF0F1: pairs of forwards;  3. nB1W1F1: backward of phase 1
   split into I and W (zero bubble), then a forward of phase 1;  4. nF0B1F1B0 (main): a
   phase-0 forward overlapped with a phase-1 backward, then a phase-1 forward with a phase-0
   backward;  5. nB1F1B0;  6. nB1B0, where the second half of the backwards are split (I now,
   W queued);  7. nWB0: a queued W, then a split phase-0 backward;  8. nW: the queued W's.

W's are queued first in, first out (``WeightGradStore``). An overlapped forward-backward pair
is written F then B (its memory peak: the forward's activations exist before the backward
frees its own; DualPipe's fallback without ``overlapped_forward_backward`` runs exactly that).

DualPipe: ``pp`` ranks, rank r holds chunks r and pp - 1 - r (bidirectional placement); the
counts use half_rank = min(r, pp - 1 - r), pp / 2 ranks per direction and M / 2 microbatches
per direction. Phase 0 is the forward direction on the first half of the ranks, the reverse
direction on the second half (``phase ^= self.is_in_second_half``). DualPipeV: rank r holds
chunks r (phase 0) and 2 * pp - 1 - r (phase 1), counts with r, pp and M.
"""

from __future__ import annotations

from collections import deque

from tracemem.schedules.core import Step

__all__ = ["dualpipe", "dualpipev"]


def _eight_phases(n: int, h: int, m: int, chunk: tuple[int, int],
                  microbatch: tuple[int, int]) -> list[Step]:
    """One rank's steps: ``n`` ranks per direction, ``h`` this rank's (half) rank, ``m``
    microbatches per direction; ``chunk[phase]`` its model chunk and ``microbatch[phase]``
    the number of the phase's first microbatch."""
    f = [0, 0]
    b = [0, 0]
    queue: deque[Step] = deque()
    steps: list[Step] = []

    def forward(phase: int) -> None:
        steps.append(Step(chunk[phase], "F", microbatch[phase] + f[phase]))
        f[phase] += 1

    def backward(phase: int, zero_bubble: bool = False) -> None:
        i = microbatch[phase] + b[phase]
        b[phase] += 1
        steps.append(Step(chunk[phase], "I" if zero_bubble else "B", i))
        if zero_bubble:
            queue.append(Step(chunk[phase], "W", i))

    def weight() -> None:
        steps.append(queue.popleft())

    for _ in range((n - h - 1) * 2):             # 1: nF0
        forward(0)
    for _ in range(h + 1):                       # 2: nF0F1
        forward(0)
        forward(1)
    for _ in range(n - h - 1):                   # 3: nB1W1F1
        backward(1, zero_bubble=True)
        weight()
        forward(1)
    for _ in range(m - 2 * n + h + 1):           # 4: nF0B1F1B0
        forward(0)
        backward(1)
        forward(1)
        backward(0)
    for _ in range(n - h - 1):                   # 5: nB1F1B0
        backward(1)
        forward(1)
        backward(0)
    zero_bubble = False                          # 6: nB1B0, second half split
    for i in range(h + 1):
        if i == (h + 1) // 2 and h % 2 == 1:
            zero_bubble = True
        backward(1, zero_bubble)
        if i == (h + 1) // 2 and h % 2 == 0:
            zero_bubble = True
        backward(0, zero_bubble)
    for _ in range(n - h - 1):                   # 7: nWB0
        weight()
        backward(0, zero_bubble=True)
    for _ in range(h + 1):                       # 8: nW
        weight()
    assert not queue and f == b == [m, m]
    return steps


def dualpipe(pp: int, vpp: int, m: int) -> list[list[Step]]:
    """DualPipe on ``pp`` (even) ranks and ``m`` (even, >= 2 * pp) microbatches: microbatches
    0 .. m/2 - 1 enter at rank 0, m/2 .. m - 1 at rank pp - 1."""
    half = pp // 2
    ranks = []
    for r in range(pp):
        h = min(r, pp - 1 - r)
        # (chunk, first microbatch) of the forward and of the reverse direction on rank r
        down, up = (r, 0), (pp - 1 - r, m // 2)
        phase0, phase1 = (down, up) if r < half else (up, down)
        ranks.append(_eight_phases(half, h, m // 2, (phase0[0], phase1[0]),
                                   (phase0[1], phase1[1])))
    return ranks


def dualpipev(pp: int, vpp: int, m: int) -> list[list[Step]]:
    """DualPipeV on ``pp`` ranks (2 * pp chunks in a V) and ``m`` >= 2 * pp microbatches."""
    return [_eight_phases(pp, r, m, (r, 2 * pp - 1 - r), (0, 0)) for r in range(pp)]
