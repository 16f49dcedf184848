"""The backward split into I (input gradients) and W (Linear weight gradients).

References: DualPipe's ``WeightGradStore`` (deepseek-ai/DualPipe 3da1bbe, dualpipe/utils.py):
a deferred weight gradient keeps the layer's input and output gradient, nothing else; values:
a real CPU run of the full backward (the split must give the same gradients); bytes: hand
arithmetic (numel * 4 B, float32), written out in each test.
"""

import torch
import torch.nn.functional as F
from torch import nn

from modeling.parallel.pp import recv_backward, recv_forward, send_forward
from tracemem import MemoryTracer
from tracemem.estimator import Segments, replay_schedule
from tracemem.schedules import Step, schedule
from tracemem.split_backward import backward_input


def _stage(device):
    torch.manual_seed(0)
    return (nn.Linear(16, 32, bias=False, device=device),
            nn.Linear(32, 16, bias=False, device=device))


def test_split_gradients_equal_the_full_backward_on_cpu():
    l1, l2 = _stage("cpu")
    norm = nn.LayerNorm(16)
    params = [l1.weight, l2.weight, norm.weight, norm.bias]
    grads = []
    for split in (False, True):
        for p in params:
            p.grad = None
        x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1),
                        requires_grad=True)
        y = l2(F.gelu(l1(norm(x))))
        dy = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(2))
        if split:
            weights = backward_input([y], [dy], [x], params)
            # I: input and LayerNorm gradients now, the two Linear weights later
            assert l1.weight.grad is None and l2.weight.grad is None
            assert norm.weight.grad is not None and x.grad is not None
            assert {id(p) for p in weights.params} == {id(l1.weight), id(l2.weight)}
            weights.run()
        else:
            y.backward(dy)
        grads.append([p.grad.clone() for p in params] + [x.grad.clone()])
    for full, split in zip(*grads):
        torch.testing.assert_close(split, full)


def _trace_toy() -> Segments:
    """A middle stage: x (4, 16) received, h = L1(x) (4, 32), a = gelu(h), y = L2(a) (4, 16)
    kept for the send (no deallocation); backward split into I and W."""
    l1, l2 = _stage("meta")
    tracer = MemoryTracer(rounding=None)
    tracer.track_external(l1, l2)
    segments = Segments()
    for mb in (0, 1):
        start = len(tracer.events)
        with tracer:
            x = recv_forward((4, 16), torch.float32)
            y = l2(F.gelu(l1(x)))
            send_forward(y, deallocate=False)
        middle = len(tracer.events)
        with tracer:
            dy = recv_backward((4, 16), torch.float32)
            weights = backward_input([y], [dy], [x], [l1.weight, l2.weight])
            x.grad = None  # sent
            del x, y, dy
        end = len(tracer.events)
        with tracer:
            weights.run()
            del weights
            l1.weight.grad = l2.weight.grad = None
        segments.events[(0, "Fs", mb)] = tracer.events[start:middle]
        segments.events[(0, "I", mb)] = tracer.events[middle:end]
        segments.events[(0, "W", mb)] = tracer.events[end:]
    return segments


def test_deferring_w_raises_the_peak_by_what_w_keeps():
    # Per microbatch, float32: x 256 B, h 512, a = gelu(h) 512, y 256 held after F (1,536).
    # I: dy 256 received; da = dy @ W2 512; dh = gelu_backward(da, h) 512 -> peak
    #    1,536 + 256 + 512 + 512 = 2,816; then h, da, y and dx go; W keeps each Linear's input
    #    and output gradient: x 256 + dh 512 (L1), a 512 + dy 256 (L2) = 1,536 B.
    # W: L2's weight gradient (16 x 32 = 2,048 B) while all 1,536 kept bytes are alive:
    #    1,536 + 2,048 = 3,584, then a, dy go; L1's (32 x 16 = 2,048) on 768 B.
    # W right after I: the peak is one microbatch's W, 3,584 B.
    # ZB-H1's last rank of 2 (1F0 1I0 1F1 1I1 1W0 1W1): W0 runs after F1 and I1, while
    # microbatch 1's F-held 1,536 and microbatch 0's kept 1,536 are alive: 3,072 + 2,048 =
    # 5,120 B, higher by exactly microbatch 0's kept 1,536 B.
    segments = _trace_toy()
    eager = [Step(1, k, i) for i in (0, 1) for k in "FIW"]
    deferred = schedule("zb-h1", 2, 1, 2)[1]
    assert [str(s) for s in deferred] == ["1F0", "1I0", "1F1", "1I1", "1W0", "1W1"]
    at_once = replay_schedule(eager, 2, segments, base_bytes=0, chunk_index=lambda v: 0)
    later = replay_schedule(deferred, 2, segments, base_bytes=0, chunk_index=lambda v: 0)
    assert at_once.peak_bytes == 1536 + 2048
    assert later.peak_bytes == 3072 + 2048
    assert later.peak_bytes - at_once.peak_bytes == 256 + 512 + 512 + 256
    assert str(deferred[later.step_index]) == "1W0"
