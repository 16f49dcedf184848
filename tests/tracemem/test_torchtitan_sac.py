"""torchtitan's op-level selective activation checkpointing (modeling.common.sac) and chunked
loss (modeling.kernels.loss.chunked_cross_entropy), by hand.

References: torchtitan 0.3.0 (package registry wheel) torchtitan/distributed/
activation_checkpoint.py ``SelectiveAC._wrap_block`` / ``_get_default_save_ops`` (mm saved
except every second one, SDPA and topk saved, router gate's mm recomputed) and
torchtitan/components/loss.py ``ChunkedLossWrapper.__call__`` / ``GradAccumulator``; byte
counts are numel x element size, multiplied out in the comments. Two tests also trace
torchtitan's own ``SelectiveAC._wrap_block`` and ``ChunkedLossWrapper`` on meta beside tracemem's
(skipped when torchtitan is not importable; tests/tracemem/frontdoors/test_torchtitan.py names
the pinned set).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

from modeling import load_config
from modeling.common.block import Block
from modeling.common.model import cast_parameters
from modeling.common.sac import op_sac_policy
from modeling.kernels import get_profile
from modeling.kernels.loss import chunked_cross_entropy, eager_cross_entropy
from tracemem.errors import TracememError
from tracemem.job import Job
from tracemem.tracer import MemoryTracer

MM = torch.ops.aten.mm.default


def _block_after_forward(recompute: str, modules: frozenset[str], wrap=None):
    """llama-tiny's layer 0 (h 64, 4 heads of 16, 2 KV heads, FFN 128) under the torch profile,
    b 2, s 32: the tracer's categories once its forward has run, then (bytes kept after the
    forward, the step's peak, the number of events) after its backward. ``wrap``: a wrapper
    of the block (torchtitan's own)."""
    cfg = load_config("llama-tiny")
    with torch.device("meta"):
        block = Block(0, cfg, kernels=get_profile("torch"))
    cast_parameters(block, torch.bfloat16)
    block.set_recompute(recompute, modules)
    run = wrap(block) if wrap is not None else block
    x = torch.empty(2, 32, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    tracer = MemoryTracer(devices={"meta"})
    tracer.track_external(block, x)
    with tracer:
        y = run(x, None)
        after = tracer.by_category(at=len(tracer.events) - 1)
        kept = tracer.current_bytes - tracer.baseline_bytes
        y.sum().backward()
    return after, (kept, tracer.peak_bytes - tracer.baseline_bytes, len(tracer.events))


def test_op_policy_saves_every_other_mm_attention_and_nothing_else():
    # T = b s = 64 tokens. The block's mms in order (GQA's fused wqkv, wo; MLP w1, w3, w2:
    # torchtitan's FusedQKVLinear, the torch profile's fused_qkv), the counter saving the odd
    # ones: wqkv (64 x (4 + 2 x 2) x 16 = 64 x 128) saved, wo recomputed, w1 (64 x 128) saved,
    # w3 recomputed, w2 (64 x 64) saved; the split's q, k, v copies are not mm: recomputed.
    # SDPA (_scaled_dot_product_efficient_attention, compute_intensive_ops) saved whole: out
    # (2, 4, 32, 16) bf16, log-sum-exp (2, 4, 32) fp32, philox seed and offset (int64 scalars).
    saved = (64 * 128 * 2 + 64 * 128 * 2 + 64 * 64 * 2             # 16384 16384 8192
             + 2 * 4 * 32 * 16 * 2 + 2 * 4 * 32 * 4 + 2 * 8)       # 8192 1024 16
    assert saved == 50192
    after, _ = _block_after_forward("selective", frozenset({"op"}))
    assert after["activation"] == saved  # the block input x is an "input" (tracked)
    # what else is live: the block output y (2, 32, 64) bf16, nothing the policy recomputes
    assert after["temporary"] == 2 * 32 * 64 * 2


def test_op_policy_traces_as_torchtitans_own_selective_ac():
    # torchtitan 0.3.0's SelectiveAC._wrap_block around the same block (its recompute "none"):
    # the same bytes kept after forward, the same peak, the same events
    ac = pytest.importorskip("torchtitan.distributed.activation_checkpoint")

    def titan(block):
        return ac.SelectiveAC(ac.SelectiveAC.Config())._wrap_block(block, base_fqn="layers.0")

    _, ours = _block_after_forward("selective", frozenset({"op"}))
    _, theirs = _block_after_forward("none", frozenset(), wrap=titan)
    assert ours == theirs
    assert ours[0] == 50192 + 2 * 32 * 64 * 2  # the saved set and the block's output


def test_op_policy_recomputes_the_router_gate_without_counting_it():
    policy = op_sac_policy(frozenset({(64, 8)}))
    fwd = SelectiveCheckpointContext(is_recompute=False)
    x = torch.empty(16, 64, device="meta")
    gate, w = torch.empty(64, 8, device="meta"), torch.empty(64, 64, device="meta")
    # the gate's (64, 8) is force-recomputed and leaves the count at 0; the next mm is the
    # first counted (saved), then the second (recomputed)
    assert policy(fwd, MM, x, gate) is CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(fwd, MM, x, w) is CheckpointPolicy.MUST_SAVE
    assert policy(fwd, MM, x, w) is CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(fwd, torch.ops.aten.silu.default, x) is CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(fwd, torch.ops.aten.topk.default, x, 2) is CheckpointPolicy.MUST_SAVE


def test_op_policy_saves_what_a_reduce_scatter_or_an_all_to_all_makes():
    from modeling.parallel.collectives import _running

    policy = op_sac_policy()
    fwd = SelectiveCheckpointContext(is_recompute=False)
    x = torch.empty(8, 4, device="meta")
    aten = torch.ops.aten
    # torchtitan's save list has reduce_scatter_tensor and all_to_all_single, not all_gather:
    # the stand-ins' allocating ops are saved, their views and an all-gather's cat are not
    with _running("all_to_all"):
        assert policy(fwd, aten.new_empty.default, x, [8, 4]) is CheckpointPolicy.MUST_SAVE
    with _running("reduce_scatter"):
        assert policy(fwd, aten.narrow.default, x, 0, 0, 4) is \
            CheckpointPolicy.PREFER_RECOMPUTE
        assert policy(fwd, aten.clone.default, x) is CheckpointPolicy.MUST_SAVE
    assert policy(fwd, aten.cat.default, [x, x]) is CheckpointPolicy.PREFER_RECOMPUTE


def test_op_recompute_is_refused_where_it_is_not_modelled():
    step = dict(model="llama-tiny", world_size=2, micro_batch_size=1, seq_length=32,
                num_microbatches=1, recompute="selective", recompute_modules=("op",))
    with pytest.raises(TracememError, match=r"--recompute-modules op is torchtitan's "
                                            r"SelectiveAC and needs --kernels torch"):
        Job(**step, kernels="megatron-te")
    with pytest.raises(TracememError, match=r"--recompute-modules op with --cp 2: not "
                                            r"modelled yet"):
        Job(**step, kernels="torch", cp=2)
    with pytest.raises(TracememError, match=r"cannot be combined with core_attn"):
        Job(**(step | {"recompute_modules": ("op", "core_attn")}), kernels="torch")


def _chunked(titan: bool = False):
    """b 2, s 8, h 16, V 64, N 2 chunks: (the loss, bytes alive after the call, the tracer),
    tracemem's chunked loss or torchtitan 0.3.0's own ChunkedLossWrapper."""
    b, s, h, v, n_chunks = 2, 8, 16, 64, 2
    with torch.device("meta"):
        head = nn.Linear(h, v, bias=False, dtype=torch.bfloat16)
    hidden = torch.empty(b, s, h, device="meta", dtype=torch.bfloat16, requires_grad=True)
    labels = torch.empty(b, s, device="meta", dtype=torch.int64)
    tracer = MemoryTracer(devices={"meta"})
    tracer.track_external(head, hidden, labels)
    with tracer:
        if titan:
            from torchtitan.components.loss import ChunkedLossWrapper

            wrapper = ChunkedLossWrapper(ChunkedLossWrapper.Config(num_chunks=n_chunks))
            wrapper.set_lm_head(head)
            loss, _ = wrapper(hidden, labels)
        else:
            loss = chunked_cross_entropy(hidden, labels, head, eager_cross_entropy, n_chunks)
        kept = tracer.current_bytes - tracer.baseline_bytes
    return loss, kept, tracer


def test_chunked_loss_traces_as_torchtitans_own_wrapper():
    pytest.importorskip("torchtitan.components.loss")
    _, kept, ours = _chunked()
    _, kept_titan, theirs = _chunked(titan=True)
    # the same bytes after the call and at the peak (the event counts differ by the mean
    # reduction's scalars: torchtitan sums and divides by global_valid_tokens elsewhere)
    assert (kept, ours.peak_bytes - ours.baseline_bytes) == \
        (kept_titan, theirs.peak_bytes - theirs.baseline_bytes) == (2564, 10892)


def test_chunked_loss_peak_by_hand():
    # b 2, s 8, h 16, V 64, N 2 chunks of n = 4 positions (T = b n = 8 rows per chunk)
    loss, kept, tracer = _chunked()
    # the peak: chunk 1's log_softmax backward output, with alive
    peak = (2 * (2 * 4 * 16 * 2)     # the hidden chunks' contiguous copies (b > 1), bf16
            + 2 * (2 * 4 * 8)        # the label chunks' copies, int64
            + 2 * 8 * 16 * 4         # GradAccumulator's fp32 (b, s, h)
            + 4                      # the running total loss, fp32
            + 64 * 16 * 2            # the head's weight gradient from chunk 0, bf16
            + 8 * 64 * 2             # chunk 1's logits, bf16 (chunk 0's went at the rebinding)
            + 8 * 64 * 4             # chunk 1's log-softmax, fp32, saved
            + 4 + 4                  # chunk 1's loss and nll_loss's total_weight, fp32
            + 8 * 64 * 4             # nll_loss_backward's gradient, fp32
            + 8 * 64 * 4)            # log_softmax_backward's output, fp32
    assert peak == 10892
    assert tracer.peak_bytes - tracer.baseline_bytes == peak
    # after the call: the bf16 accumulated gradient (kept by _DecoderOutputGradientBackProp),
    # the head's weight gradient and the total loss
    assert kept == 2 * 8 * 16 * 2 + 64 * 16 * 2 + 4 == 2564
    assert loss.requires_grad


def test_chunked_loss_needs_chunks_that_divide_the_sequence():
    hidden = torch.empty(1, 6, 4, device="meta", requires_grad=True)
    with pytest.raises(TracememError, match=r"--loss.num_chunks 4 must divide the sequence "
                                            r"length 6"):
        chunked_cross_entropy(hidden, torch.empty(1, 6, dtype=torch.int64, device="meta"),
                              nn.Linear(4, 8, device="meta"), eager_cross_entropy, 4)


def test_loss_chunks_is_a_torch_profile_option():
    assert get_profile("torch", loss_chunks=8).loss_chunks == 8
    assert get_profile("torch").options == {}  # the default stays out of the cache key
    with pytest.raises(TracememError, match=r"kernel option 'loss_chunks' does not apply to "
                                            r"--kernels eager"):
        get_profile("eager", loss_chunks=8)
