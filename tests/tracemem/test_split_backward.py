"""The backward split into I (input gradients) and W (Linear weight gradients).

References: DualPipe's ``WeightGradStore`` (deepseek-ai/DualPipe 3da1bbe, dualpipe/utils.py):
a deferred weight gradient keeps the layer's input and output gradient, nothing else; under
recompute (issue 28) the same, recomputed inputs included, as DualPipe's example
``LinearFunc`` and the zero-bubble fork (sail-sg/zero-bubble-pipeline-parallelism 39f2c18,
``WeightGradStore`` after its ``RecomputeStore`` pass) keep them; values: a real CPU run of
the full backward (the split must give the same gradients, with and without each recompute
mechanism); bytes: hand arithmetic (numel * 4 B float32 toys, numel * 2 B bf16
llama-tiny), written out in each test.
"""

import pytest
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


# --- under recompute (issue 28): what W keeps when the backward recomputes ----------------
# DualPipe's LinearFunc.backward (examples/example_dualpipe.py, 3da1bbe) closes over the
# input and output gradient it unpacked, whatever recomputed them; the zero-bubble fork
# (sail-sg/zero-bubble-pipeline-parallelism 39f2c18, megatron/core/tensor_parallel/layers.py
# LinearWithGradAccumulationAndAsyncCommunication.backward) puts (grad_output, input) into
# WeightGradStore the same way, after a recompute pass (zbpp_utils.py RecomputeStore,
# runtime.py schedule_r). So per Linear: its (recomputed) input and output gradient, until W.

def _toy_block(l1, l2, mechanism):
    """x -> L1 -> gelu -> L2 under ``mechanism``: "none"; "reentrant" (Megatron's
    CheckpointFunction around the whole block: full recompute); "torch"
    (torch.utils.checkpoint, non-reentrant); "without-output" (CheckpointWithoutOutput around
    the gelu, as Megatron's moe_act: its output discarded once L2 saved it)."""
    from torch.utils.checkpoint import checkpoint

    from modeling.common.checkpoint import CheckpointWithoutOutput, megatron_checkpoint

    def block(x):
        return l2(F.gelu(l1(x)))

    def run(x):
        if mechanism == "none":
            return block(x)
        if mechanism == "reentrant":
            return megatron_checkpoint(block, None, x)
        if mechanism == "torch":
            return checkpoint(block, x, use_reentrant=False)
        ckpt = CheckpointWithoutOutput()
        y = l2(ckpt.checkpoint(F.gelu, l1(x)))
        ckpt.discard_output_and_register_recompute(y)
        return y
    return run


def _net(events) -> int:
    return sum(e.nbytes if e.action == "alloc" else -e.nbytes for e in events)


def _kept(mechanism) -> tuple[int, int, int]:
    """Bytes alive after one microbatch's F, after its I, after its W (a middle stage, as
    ``_trace_toy``)."""
    l1, l2 = _stage("meta")
    run = _toy_block(l1, l2, mechanism)
    tracer = MemoryTracer(rounding=None)
    tracer.track_external(l1, l2)
    start = len(tracer.events)
    with tracer:
        x = recv_forward((4, 16), torch.float32)
        y = run(x)
        send_forward(y, deallocate=False)
    middle = len(tracer.events)
    with tracer:
        dy = recv_backward((4, 16), torch.float32)
        weights = backward_input([y], [dy], [x], [l1.weight, l2.weight])
        assert l1.weight.grad is None and l2.weight.grad is None  # both deferred
        assert len(weights.deferred) == 2
        x.grad = None
        del x, y, dy
    end = len(tracer.events)
    with tracer:
        weights.run()
        del weights
        assert l1.weight.grad is not None and l2.weight.grad is not None
        l1.weight.grad = l2.weight.grad = None
    f = _net(tracer.events[start:middle])
    i = f + _net(tracer.events[middle:end])
    return f, i, i + _net(tracer.events[end:])


@pytest.mark.parametrize("mechanism, forward_kept, input_grad", [
    # float32: x (4, 16) 256 B, h = L1(x) and a = gelu(h) (4, 32) 512 B each, y (4, 16) 256 B
    ("none", 256 + 512 + 512 + 256, 0),  # x, h (gelu's), a (L2's), y (the send)
    # the checkpoint's input x and y: h, a freed in forward. L1's input in the recomputed
    # graph is the checkpoint's detached input itself, a leaf: a saved leaf unpacks as the
    # same tensor (torch SavedVariable), whose .grad (dx, 256 B) the checkpoint's backward
    # filled and nobody clears: kept with it until W (as in DualPipe's LinearFunc, whose
    # ctx.saved_tensors are the same objects)
    ("reentrant", 256 + 256, 256),
    ("torch", 256 + 256, 0),  # as reentrant in F (holders: 0 B); gradients reach x itself
    ("without-output", 256 + 512 + 256, 0),  # x (L1's), h (the checkpoint's input), y; a: 0 B
])
def test_under_recompute_w_keeps_each_linears_input_and_output_gradient(
        mechanism, forward_kept, input_grad):
    # After I, whatever the mechanism: L1's input x 256 + its output gradient dh 512, L2's
    # input a 512 (recomputed in I under recompute) + its output gradient dy 256 = 1,536 B
    # (+ input_grad); W frees them all (0 B). Without-output: a's storage was discarded and,
    # at Megatron-LM d98e8a6, points at the recomputed a (share_storage): W keeps those 512 B,
    # not the recomputed graph (h goes in I).
    assert _kept(mechanism) == (forward_kept, 256 + 512 + 512 + 256 + input_grad, 0)


@pytest.mark.parametrize("mechanism", ["reentrant", "torch", "without-output"])
def test_split_gradients_under_recompute_equal_the_full_backward_on_cpu(mechanism):
    # real values on CPU: the split (I, then W) against a plain backward of the same block.
    # Without-output's consumer here is a scalar multiply (it saves nothing): the checkpoint
    # still recomputes, but no saved tensor is a discarded one (tracemem models
    # share_storage's bytes, not its data, so a discarded saved output has no values on CPU)
    from modeling.common.checkpoint import CheckpointWithoutOutput

    l1, l2 = _stage("cpu")
    norm = nn.LayerNorm(16)
    params = [l1.weight, l2.weight, norm.weight, norm.bias]
    run = _toy_block(l1, l2, mechanism)

    def forward(x):
        if mechanism != "without-output":
            return run(norm(x))
        ckpt = CheckpointWithoutOutput()
        y = l2(ckpt.checkpoint(lambda t: l1(norm(t)), x) * 2.0)  # norm and L1 recomputed
        ckpt.discard_output_and_register_recompute(y)
        return y

    grads = []
    for split in (False, True):
        for p in params:
            p.grad = None
        x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1),
                        requires_grad=True)
        y = forward(x)
        dy = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(2))
        if split:
            weights = backward_input([y], [dy], [x], params)
            assert l1.weight.grad is None and l2.weight.grad is None
            assert norm.weight.grad is not None and x.grad is not None
            assert {id(p) for p in weights.params} == {id(l1.weight), id(l2.weight)}
            weights.run()
        else:
            y.backward(dy)
        grads.append([p.grad.clone() for p in params] + [x.grad.clone()])
    for full, split in zip(*grads):
        torch.testing.assert_close(split, full)


def _kept_after_i(schedule: str, recompute: str, modules=("core_attn",),
                  kernels: str = "eager", model: str = "llama-tiny") -> list[int]:
    """llama-tiny on pp 2, b 1, s 8, M 4: rank 0's bytes alive after each of its model
    chunks' microbatch-0 F and I (what W keeps), checked against W freeing them."""
    from tracemem.estimator import TraceCache, rank_classes, trace_classes
    from tracemem.job import Job

    job = Job(model=model, world_size=2, pp=2, micro_batch_size=1, seq_length=8,
              num_microbatches=4, kernels=kernels, recompute=recompute,
              recompute_modules=modules, rounding=None, schedule=schedule)
    traced = trace_classes(job, rank_classes(job)[:1], TraceCache())[0]
    kept = []
    for chunk in sorted({c for c, kind, _ in traced.segments.events if kind == "I"}):
        i = _net(traced.segments.events[(chunk, "Fs", 0)]) + \
            _net(traced.segments.events[(chunk, "I", 0)])
        assert _net(traced.segments.events[(chunk, "W", 0)]) == -i  # W frees all it kept
        kept.append(i)
    return kept


# llama-tiny, bf16, b * s = 8 tokens, h 64, 4 heads x 16, 2 KV groups x 16, FFN 128. What
# W keeps per layer, DualPipe's Linear inputs and output gradients:
#   inputs: attn_norm's output 8*64*2 = 1,024 (wq, wk, wv share it), the attention output
#     1,024 (wo), ffn_norm's output 1,024 (w1, w3), silu(gate) * up 8*128*2 = 2,048 (w2):
#     5,120;
#   output gradients: dq 1,024, dk 512, dv 512; wo's: the residual gradient after the MLP
#     1,024; d gate 2,048, d up 2,048; w2's: the layer's output gradient 1,024: 8,192.
#   13,312 a layer, 26,624 for two.
# Rank 0 holds (DualPipe, pp 2) chunk 0 = layers 0-1 with the embedding: 26,624 (layer 1's
# output gradient is the one received); and chunk 1 = layers 2-3, the final norm, the head
# and the loss: 26,624 + the head's input (the final norm's output) 1,024 + its output
# gradient (logits, 8 x 256 x 2) 4,096 + the stage input 1,024 (received; a kept non-leaf
# layer input holds its grad_fn and, through the graph, the stage input's AccumulateGrad and
# tensor, as a tensor held by DualPipe's closure would) = 32,768.
# Under recompute the same: the recomputed inputs (the norms' outputs, the attention output,
# the SwiGLU product) live from I until W, the rest of the recomputation goes in I.
_DUALPIPE_RANK_0 = [2 * 13312, 2 * 13312 + 1024 + 4096 + 1024]


# Under megatron-te (TE kernels, Megatron's reentrant CheckpointFunction for full recompute)
# the same per layer: LayerNormLinear qkv keeps ln_out 1,024 and the fused q/k/v output
# gradient 8 x 128 x 2 = 2,048; proj the attention output 1,024 and its output gradient
# 1,024; LayerNormLinear fc1 ln_out 1,024 and the fused gate/up gradient 8 x 256 x 2 =
# 4,096; fc2 the SwiGLU product 2,048 and the layer's output gradient 1,024: 13,312. The TE
# kernels' kept tensors carry no autograd graph, so chunk 1 keeps no stage input: 26,624 +
# 1,024 + 4,096.
_DUALPIPE_RANK_0_TE = [2 * 13312, 2 * 13312 + 1024 + 4096]


@pytest.mark.parametrize("recompute, modules, kernels, expected", [
    ("none", ("core_attn",), "eager", _DUALPIPE_RANK_0),
    ("selective", ("core_attn",), "eager", _DUALPIPE_RANK_0),  # torch.utils.checkpoint
    ("selective", ("mlp",), "eager", _DUALPIPE_RANK_0),
    ("full", ("core_attn",), "eager", _DUALPIPE_RANK_0),
    ("none", ("core_attn",), "megatron-te", _DUALPIPE_RANK_0_TE),
    ("selective", ("core_attn",), "megatron-te", _DUALPIPE_RANK_0_TE),  # CheckpointFunction
    ("full", ("core_attn",), "megatron-te", _DUALPIPE_RANK_0_TE)])
def test_dualpipe_two_stages_keeps_the_same_bytes_until_w_under_recompute(
        recompute, modules, kernels, expected):
    assert _kept_after_i("dualpipe", recompute, modules, kernels) == expected


def test_deepseek_v3s_recompute_keeps_what_w_needs_until_w():
    # deepseek-tiny under megatron-te with DeepSeek-V3's recompute (RMSNorms, MLA up
    # projections, the experts' activation: CheckpointWithoutOutput, outputs discarded and
    # recomputed in backward): a Linear that saved a discarded output keeps the recomputed
    # data until W (d98e8a6 share_storage), so W keeps what it keeps without recompute. (Not
    # a hand count: the reference is the same trace with --recompute none, whose W bytes the
    # llama-tiny cases above check by hand.)
    none = _kept_after_i("dualpipe", "none", kernels="megatron-te", model="deepseek-tiny")
    assert _kept_after_i("dualpipe", "selective", ("layernorm", "mla_up_proj", "moe_act"),
                         kernels="megatron-te", model="deepseek-tiny") == none


def test_zb_h1_with_full_recompute_on_pp_2():
    # the loop placement: rank 0 is stage 0 (layers 0-1, the embedding), chunk 0 above
    from tracemem.estimator import estimate

    assert _kept_after_i("zb-h1", "full") == _DUALPIPE_RANK_0[:1]
    result = estimate("llama-tiny", world_size=2, pp=2, micro_batch_size=1, seq_length=8,
                      num_microbatches=4, kernels="eager", recompute="full",
                      schedule="zb-h1")
    assert len(result.ranks) == 2  # refused before issue 28 ("checkpointed tensors...")
