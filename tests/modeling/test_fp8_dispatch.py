"""DeepSeek-V3's FP8 dispatch (arXiv 2412.19437 3.3.3; the megatron-te option ``fp8_dispatch``,
``modeling.kernels.fp8_dispatch``) on one MoE layer, by hand.

deepseek-tiny's MoE without shared experts: h 64, expert width f 32, 8 experts, EP 2 (4 local
experts), top-2, balanced routing, T = 64 tokens: 128 slots leave, 128 rows arrive (every EP
peer routes like this rank), 32 per local expert (aligned: no FP8 padding). Blockwise FP8 on
Hopper. The payload (DeepEP's dispatch tuple) of n rows: (n, 64) uint8 = 64n B and (n, 64 /
128 -> 1) fp32 scales = 4n B.
"""

import dataclasses

import pytest
import torch

from modeling.common.moe import MoE
from modeling.common.routing import Balanced
from modeling.kernels import get_profile
from modeling.registry import load_config
from tracemem import MemoryTracer
from tracemem.errors import TracememError
from tracemem.job import Job

BF16 = torch.bfloat16
CFG = dataclasses.replace(load_config("deepseek-tiny"), num_shared_experts=0)


def _trace(dispatch: bool, tokens: int = 64):
    """(what the layer keeps after forward, the forward's events, the backward's events,
    bytes alive at the end) under the tracer, exact bytes."""
    k = get_profile("megatron-te", fp8_recipe="blockwise", fp8_format="e4m3", fp8_arch="sm90",
                    fp8_dispatch=dispatch)
    with torch.device("meta"):
        moe = MoE(CFG, "grouped", expert_ids=range(0, 4), ep=2, kernels=k).to(BF16)
    x = torch.empty(1, tokens, 64, dtype=BF16, device="meta", requires_grad=True)
    tracer = MemoryTracer(rounding=None, devices={"meta"})
    tracer.track_external(x, moe)
    with tracer:
        y = moe(x, Balanced())
        kept = sorted((i.nbytes, str(i.dtype).removeprefix("torch."), tuple(i.shape))
                      for i in tracer.live_at(len(tracer.events) - 1)
                      if i.phase.value != "external")
        n = len(tracer.events)
        y.sum().backward()
        del y
    return kept, tracer.events[:n], tracer.events[n:], tracer.current_bytes


def _payloads(events):
    """The FP8 payloads' allocations, in order: 2-D uint8 data and (n, 1) fp32 scales made
    by ``torch.empty`` (the router's (T, 1) sums are other ops)."""
    return [(str(e.dtype).removeprefix("torch."), tuple(e.shape)) for e in events
            if e.action == "alloc" and len(e.shape) == 2 and e.op == "aten::empty.memory_format"
            and (e.dtype == torch.uint8 or (e.dtype == torch.float32 and e.shape[1] == 1))]


def test_fc1_keeps_the_received_payload_instead_of_its_own_fp8_copy():
    off, *_ = _trace(False)
    on, *_ = _trace(True)
    # off: TE's split-quantised column-wise input, one bulk buffer: 4 experts x (64, 32)
    # uint8 = 8,192 B, 4 x (ceil(32 / 128), roundup(64, 4)) = (1, 64) fp32 = 1,024 B, + 256
    # B of pad = 9,472 B; on: the sorted payload, 128 x 64 = 8,192 B and (128, 1) fp32 512 B
    assert (9_472, "uint8", (9_472,)) in off
    expected = sorted([t for t in off if t != (9_472, "uint8", (9_472,))]
                      + [(8_192, "uint8", (128, 64)), (512, "float32", (128, 1))])
    assert on == expected
    assert sum(b for b, *_ in off) - sum(b for b, *_ in on) == 9_472 - 8_704 == 768


def test_the_tokens_leave_in_fp8_and_the_combine_stays_bf16():
    _, forward, backward, _ = _trace(True)
    # forward: the T = 64 tokens quantised, then each hop a new payload of the 128 slots /
    # rows: the permute, the all-to-all, the sort by local expert
    assert _payloads(forward) == [("uint8", (64, 64)), ("float32", (64, 1))] + [
        ("uint8", (128, 64)), ("float32", (128, 1))] * 3
    # the three bf16 (128, 64) token buffers of Megatron's dispatch (permuted, received,
    # sorted) are not made; the other bf16 (128, 64) ones (fc1's (128, 2f) output, fc2's
    # output, the unsort, the combine's all-to-all) are
    _, off_forward, _, _ = _trace(False)

    def bf16_rows(events):
        return sum(e.action == "alloc" and e.dtype == BF16 and tuple(e.shape) == (128, 64)
                   for e in events)
    assert bf16_rows(off_forward) - bf16_rows(forward) == 3
    # backward: the (T, h) output gradient quantised and permuted by the combine's
    # unpermute, then the all-to-all and the unsort move the payload to fc2, which converts
    # a column-wise copy (one bulk buffer, 4 x (64, 32) uint8 + 4 x (1, 64) fp32 + 256 B =
    # 9,472 B) for its wgrad; the dispatch's backward stays bf16: fc1's dgrad (128, 64),
    # the sort's and the all-to-all's (128, 64) and the permute's (64, 64)
    assert _payloads(backward) == [("uint8", (64, 64)), ("float32", (64, 1))] + [
        ("uint8", (128, 64)), ("float32", (128, 1))] * 3
    grads = [(e.nbytes, tuple(e.shape)) for e in backward
             if e.action == "alloc" and e.dtype == BF16 and e.op == "aten::new_empty"]
    # fc2's dgrad (128, f), fc1's dgrad (128, h), the sort's and the all-to-all's backward,
    # the permute's token gradient (T, h)
    assert grads == [(8_192, (128, 32))] + [(16_384, (128, 64))] * 3 + [(8_192, (64, 64))]


def test_unaligned_rows_pad_the_payload_and_nothing_is_left():
    # T = 40: 80 slots, 20 rows a local expert, padded to 32 under FP8 (Fp8Padding): the
    # payload is padded in forward (80 slots -> 80 received -> 4 x 32 = 128 rows) and the
    # gradient's in backward; after backward the same bytes are alive as without the option
    # (the gradients of the input and the weights): no payload is left behind
    *_, alive_off = _trace(False, tokens=40)
    _, forward, backward, alive_on = _trace(True, tokens=40)
    assert _payloads(forward)[-2:] == [("uint8", (128, 64)), ("float32", (128, 1))]
    assert ("uint8", (128, 64)) in _payloads(backward)
    assert alive_on == alive_off


@pytest.mark.parametrize("extra, message", [
    (dict(kernel_options={"fp8_dispatch": True, "fp8_recipe": "tensorwise"}),
     "kernel option fp8_dispatch (DeepSeek-V3's FP8 dispatch) sends 1x128-tile FP8 tokens: "
     "give --fp8-format and --fp8-recipe blockwise"),
    (dict(kernel_options={"fp8_dispatch": True, "fp8_recipe": "blockwise"}),
     "kernel option fp8_dispatch (DeepSeek-V3's FP8 dispatch): DeepEP's FP8 dispatch needs "
     "the hidden size to be a multiple of 128 (one scale per 1x128 tile); it is 64"),
    (dict(kernel_options={"fp8_dispatch": True, "fp8_recipe": "blockwise"}, ep=1),
     "kernel option fp8_dispatch (DeepSeek-V3's FP8 dispatch): EP 1 sends no tokens over an "
     "all-to-all: give --ep > 1"),
    (dict(kernels="torch", kernel_options={"fp8_dispatch": True}),
     "kernel option fp8_dispatch (DeepSeek-V3's FP8 scheme) needs --kernels megatron-te; "
     "--kernels torch runs bf16"),
])
def test_the_option_is_refused_where_it_is_not_modelled(extra, message):
    fields = dict(world_size=8, ep=8, micro_batch_size=1, seq_length=64, num_microbatches=1,
                  gpu="H100") | extra
    with pytest.raises(TracememError) as error:
        Job.create("deepseek-tiny", **fields)
    assert str(error.value) == message
