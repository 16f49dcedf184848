"""A hand-checkable pipeline: 2 stages, one Linear(16, 16) each, M = 4 microbatches of 4
tokens, 1F1B, float32, exact bytes, outputs kept until backward (no deallocation).

Reference: hand arithmetic (every tensor below is numel * 4 B):
- stage 0, per microbatch: forward makes its input x (4 x 16: 256 B, saved by the matmul) and
  output y (256 B, kept for the send / backward); backward receives dy (256 B) and makes the
  weight gradient (16 x 16: 1,024 B; a transient added into the main-grad buffer on the first
  microbatch, a temporary accumulated into .grad after). 1F1B on stage 0 of 2 holds 2
  microbatches (512 B each), so the peak is 2 * 512 + 256 + 1,024 = 2,304 B, in 0B0.
- stage 1 (last), per microbatch: forward receives x (256 B, requires grad, saved), makes y
  (256 B, freed by the sum) and the loss (4 B); backward makes the loss gradient (4 B), the input
  gradient (256 B) and the weight gradient (1,024 B). 1F1B on the last stage holds 1
  microbatch: peak 256 + 4 + 4 + 256 + 1,024 = 1,544 B.
"""

import torch
from torch import nn

from modeling.parallel.pp import (
    backward_from,
    recv_backward,
    recv_forward,
    send_forward,
)
from tracemem import MemoryTracer
from tracemem.estimator import Segments, replay_schedule
from tracemem.schedules import schedule


def trace_stage(first: bool) -> Segments:
    torch.manual_seed(0)
    linear = nn.Linear(16, 16, bias=False, device="meta")
    tracer = MemoryTracer()
    tracer.track_external(linear)
    segments = Segments()
    for mb in (0, 1):
        start = len(tracer.events)
        with tracer:
            if first:
                x = torch.empty(4, 16, device="meta")
                out = linear(x)
                send_forward(out, deallocate=False)
            else:
                x = recv_forward((4, 16), torch.float32)
                out = linear(x).sum()
        middle = len(tracer.events)
        with tracer:
            grad = recv_backward((4, 16), torch.float32) if first else None
            backward_from(out, grad)
            del x, out, grad
        segments.events[(0, "F", mb)] = tracer.events[start:middle]
        segments.events[(0, "B", mb)] = tracer.events[middle:]
    return segments


def test_two_stage_toy_peaks_match_hand_arithmetic():
    steps = schedule("1f1b", 2, 1, 4)
    stage0 = replay_schedule(steps[0], 2, trace_stage(first=True), base_bytes=0)
    stage1 = replay_schedule(steps[1], 2, trace_stage(first=False), base_bytes=0)
    assert (stage0.peak_bytes, str(steps[0][stage0.step_index]), stage0.inflight) == \
        (2 * 512 + 256 + 1024, "0B0", 2)
    assert (stage1.peak_bytes, stage1.inflight) == (256 + 4 + 4 + 256 + 1024, 1)
    assert str(steps[1][stage1.step_index]) in ("1B0", "1B1")


def test_static_memory_shifts_the_peak_by_itself():
    steps = schedule("1f1b", 2, 1, 4)[0]
    segments = trace_stage(first=True)
    assert replay_schedule(steps, 2, segments, 10_000).peak_bytes == 10_000 + 2304
    assert replay_schedule(schedule("gpipe", 2, 1, 4)[0], 2, segments, 0).peak_bytes == \
        4 * 512 + 256 + 1024  # GPipe holds all 4 microbatches
