"""Megatron's unfused attention, dropout and Megatron-Core's cross entropies keep and allocate
what their sources do.

Reference: the sources each kernel cites, read by hand (Megatron-LM d98e8a6:
megatron/core/transformer/dot_product_attention.py ``DotProductAttention.forward``,
megatron/core/fusions/fused_softmax.py, fused_bias_dropout.py, fused_cross_entropy.py,
tensor_parallel/cross_entropy.py, models/common/language_module/language_module.py
``compute_language_model_loss``; TransformerEngine d0067d0:
transformer_engine/pytorch/attention/dot_product_attention/backends.py
``UnfusedDotProductAttention``, softmax.py, utils.py ``get_full_mask``; torch 2.13
aten/src/ATen/native/Dropout.cpp). Every expected byte count below is numel x element size,
written out: bf16 2 B, fp32 4 B, int32 4 B, int64 8 B, bool 1 B.
"""

import dataclasses

import pytest
import torch

from modeling import load_config
from modeling.common.model import build_model
from modeling.common.routing import Balanced
from modeling.kernels import get_profile
from modeling.kernels.attention import fused_softmax_available, megatron_unfused_attention
from modeling.kernels.dropout import native_dropout, torch_dropout
from modeling.kernels.loss import megatron_cross_entropy
from tracemem import MemoryTracer
from tracemem.errors import TracememError

BF16, F32 = torch.bfloat16, torch.float32


def leaf(*shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)


def run(fn, inputs, externals=()):
    """``fn(*inputs)`` forward and backward traced: (forward allocations as (bytes, dtype),
    bytes made in forward and kept after it besides the output, forward peak, backward
    allocations as (bytes, dtype)); peaks above the inputs."""
    tracer = MemoryTracer(rounding=None)
    tracer.track_external(*inputs, *externals)
    with tracer:
        out = fn(*inputs)
        peak = tracer.peak_bytes - tracer.baseline_bytes
    forward = [(e.nbytes, e.dtype) for e in tracer.events
               if e.action == "alloc" and e.phase.value == "forward"]
    out_id = tracer._live[out.untyped_storage()._cdata].sid
    kept = sorted((i.nbytes, str(i.dtype)) for i in tracer.live_at("now")
                  if i.phase.value == "forward" and i.storage_id != out_id)
    grad = torch.empty(out.shape, dtype=out.dtype, device="meta")
    tracer.track_external(grad)
    start = len(tracer.events)
    with tracer:
        out.backward(grad)
    backward = [(e.nbytes, e.dtype) for e in tracer.events[start:] if e.action == "alloc"]
    return forward, kept, peak, backward


# ------------------------------------------------------------------------------ dropout
def test_cuda_dropout_keeps_a_bool_mask_and_cpu_dropout_a_noise_tensor():
    # aten native_dropout (CUDA's path): output and a bool mask; NativeDropoutBackward0 saves
    # the mask. _dropout_impl (CPU / meta): noise = empty_like(x).bernoulli_(1 - p).div_(1 - p)
    # and x * noise; MulBackward0 saves the noise, in x's dtype
    forward, kept, _, backward = run(lambda x: native_dropout(x, 0.1), [leaf(6, 8)])
    assert forward == [(6 * 8 * 2, BF16), (6 * 8 * 1, torch.bool)]
    assert kept == [(6 * 8 * 1, "torch.bool")]
    assert backward == [(6 * 8 * 2, BF16)]  # native_dropout_backward: grad * mask * scale
    forward, kept, _, _ = run(lambda x: torch_dropout(x, 0.1), [leaf(6, 8)])
    assert forward == [(6 * 8 * 2, BF16), (6 * 8 * 2, BF16)]  # the noise, the product
    assert kept == [(6 * 8 * 2, "torch.bfloat16")]


@pytest.mark.parametrize("fn", [native_dropout, torch_dropout])
def test_dropout_with_p_zero_or_outside_training_is_the_input_itself(fn):
    x = leaf(6, 8)
    assert fn(x, 0.0) is x and fn(x, 0.1, training=False) is x


# h 64, 4 query heads in 2 key/value groups, two layers
LLAMA = dataclasses.replace(load_config("llama-tiny"), num_layers=2)


def _kept_after_forward(cfg, kernels, attention="flash", b=1, s=32, **options):
    """Bytes born in one forward of ``cfg``'s whole model on meta and alive after it."""
    model = build_model(cfg, "meta", attention=attention, dtype=torch.bfloat16,
                        kernels=get_profile(kernels, **options))
    tokens = torch.zeros(b, s, dtype=torch.long, device="meta")
    tracer = MemoryTracer(rounding=None)
    tracer.track_external(model, tokens)
    with tracer:
        loss = model(tokens, tokens, Balanced())
    return tracer.current_bytes - tracer.baseline_bytes - loss.untyped_storage().nbytes()


@pytest.mark.parametrize("kernels, mask_bytes", [("megatron-te", 1), ("torch", 1),
                                                 ("eager", 2)])
def test_hidden_dropout_keeps_one_mask_per_residual_branch_and_one_for_the_embedding(
        kernels, mask_bytes):
    # Megatron-Core: bias_dropout_add after attention and after the MLP of each layer
    # (TransformerLayer._apply_self_attn_bda_step / _apply_mlp_bda_step) and the embedding's
    # dropout (LanguageModelEmbedding.embedding_dropout): 2 x 2 layers + 1 masks of [b, s, h]
    # = 1 x 32 x 64, bool (CUDA) or the bf16 noise (eager, as on a CPU); the dropped tensors
    # replace the undropped ones (the residual add and the first norm save them instead)
    b, s, h = 1, 32, LLAMA.hidden_size
    base = _kept_after_forward(LLAMA, kernels)
    with_dropout = _kept_after_forward(dataclasses.replace(LLAMA, hidden_dropout=0.1), kernels)
    assert with_dropout - base == (2 * LLAMA.num_layers + 1) * b * s * h * mask_bytes == 10_240 \
        * mask_bytes


def test_attention_dropout_under_te_fused_attention_keeps_nothing_more():
    # TE fused_attn_fwd returns aux_ctx_tensors = [softmaxStats, rng_state] whatever the
    # dropout; FusedAttnFunc saves those (the rng state is kept already)
    base = _kept_after_forward(LLAMA, "megatron-te")
    assert _kept_after_forward(dataclasses.replace(LLAMA, attention_dropout=0.1),
                               "megatron-te") == base


@pytest.mark.parametrize("attention, extra_per_score", [("unfused", 1 + 2), ("local", 1)])
def test_attention_dropout_under_unfused_attention_keeps_a_mask_and_the_dropped_probs(
        attention, extra_per_score):
    # per layer and score element [b, n, s, s] = 1 x 4 x 32 x 32: the bool mask, and
    # - TE ("unfused"): its fused softmax runs (sq 32 a multiple of 8 batches per block) and
    #   keeps its bf16 output; the dropped bf16 probabilities, saved by the bmm with v, come
    #   on top (without dropout the bmm saves the softmax output itself): 1 + 2 B;
    # - Megatron ("local"): b x heads = 4 is not a multiple of 8, so torch's fp32 softmax runs;
    #   its bf16 cast, saved by the bmm without dropout, is replaced by the dropped copy: 1 B
    base = _kept_after_forward(LLAMA, "megatron-te", attention)
    extra = _kept_after_forward(dataclasses.replace(LLAMA, attention_dropout=0.1),
                                "megatron-te", attention) - base
    assert extra == LLAMA.num_layers * 4 * 32 * 32 * extra_per_score


# ----------------------------------------------------------------------- unfused attention
S, N, NKV, D = 32, 8, 2, 8  # b = 1; 8 query heads in 2 groups: k and v are repeated 4 times
SCORES = N * S * S  # [b * n, s, s] elements: 8192
KV_REPEATED = 2 * S * N * D * 2  # repeat_interleave of k and of v, bf16


def _attention(impl, fusion=True, dropout=0.1):
    q, k, v = leaf(1, S, N, D), leaf(1, S, NKV, D), leaf(1, S, NKV, D)
    return run(lambda q, k, v: megatron_unfused_attention(
        q, k, v, D ** -0.5, impl, dropout, native_dropout, fusion), [q, k, v])


def test_fused_softmax_is_chosen_as_megatron_and_te_choose_it():
    # Megatron-Core is_kernel_available: 16 < sk <= 4096, sq, sk, b * np multiples of 4 and
    # (causal) b * np a multiple of the batches per block (8 up to 128 keys, 4 above)
    assert fused_softmax_available("local", 8, 32, 32, BF16)
    assert not fused_softmax_available("local", 4, 32, 32, BF16)  # 4 % 8
    assert fused_softmax_available("local", 4, 256, 256, BF16)  # 4 per block above 128
    assert not fused_softmax_available("local", 8, 8192, 8192, BF16)  # sk > 4096
    assert not fused_softmax_available("local", 8, 32, 32, F32)  # not fp16 / bf16
    assert not fused_softmax_available("local", 8, 32, 32, BF16, fusion=False)
    # TE: 16 < sk < 16384, sk % 8, sq % 4, b * np % 4, sq a multiple of the batches per block
    assert fused_softmax_available("unfused", 4, 32, 32, BF16)
    assert fused_softmax_available("unfused", 4, 8192, 8192, BF16)
    assert not fused_softmax_available("unfused", 4, 36, 36, BF16)  # 36 % 8


def test_local_attention_with_the_fused_softmax_keeps_its_output_the_mask_and_the_dropout():
    forward, kept, peak, backward = _attention("local")
    # repeated k, v; Megatron's global-memory-buffer tensor [b * np, sq, sk]; the baddbmm
    # scores; the fused softmax output (ScaledUpperTriangMaskedSoftmax); native_dropout's
    # output and bool mask; the bmm context [b * np, s, d]; its permute(...).contiguous()
    assert forward == [(S * N * D * 2, BF16)] * 2 + [(SCORES * 2, BF16)] * 4 + [
        (SCORES, torch.bool), (N * S * D * 2, BF16), (S * N * D * 2, BF16)]
    # kept: repeated k (baddbmm), repeated v (bmm), softmax output (its kernel), dropout mask
    # (NativeDropoutBackward0), dropped probabilities (bmm)
    assert sum(n for n, _ in kept) == KV_REPEATED + SCORES * 2 + SCORES + SCORES * 2 == 49_152
    # everything alive at the last copy: the buffer and the scores are locals to the end
    assert peak == KV_REPEATED + 4 * SCORES * 2 + SCORES + 2 * N * S * D * 2 == 90_112
    # the softmax backward is in place (Apex bwd_cuda): no [b * np, s, s] buffer of its own
    assert backward.count((SCORES * 2, BF16)) == 2  # bmm's probs gradient, dropout's


def test_te_unfused_attention_builds_its_mask_and_drops_its_score_buffer():
    forward, kept, peak, backward = _attention("unfused")
    # get_full_mask (causal): two int32 aranges [s], three int32 [1, 1, s, s] (the
    # difference, swa_left, swa_right), five bool [1, 1, s, s] comparisons / negations
    assert forward[:10] == [(S * 4, torch.int32)] * 2 + [(S * S * 4, torch.int32)] * 3 + [
        (S * S, torch.bool)] * 5
    assert sum(n for n, _ in kept) == KV_REPEATED + SCORES * 2 + SCORES + SCORES * 2 == 49_152
    # the mask [1, 1, s, s] stays to the end; the torch.empty buffer goes after baddbmm
    assert peak == S * S + KV_REPEATED + 3 * SCORES * 2 + SCORES + 2 * N * S * D * 2 == 74_752
    # TE's softmax backward writes the input gradient into the incoming one (softmax.cpp
    # scaled_masked_softmax_backward, "Produce gradients in place", v2.14 to v2.18)
    assert backward.count((SCORES * 2, BF16)) == 2


@pytest.mark.parametrize("impl, mask_kept", [("local", S * S), ("unfused", S * S)])
def test_unfused_attention_torch_softmax_keeps_fp32_probabilities_and_the_mask(impl, mask_kept):
    # forward_torch_softmax: the scores cast to fp32 and masked in place (the bool causal mask
    # [s, s] / [1, 1, s, s] saved by masked_fill_), torch's fp32 softmax (its output saved),
    # the bf16 cast (dropped: native_dropout saves its mask only)
    _, kept, _, _ = _attention(impl, fusion=False)
    assert sum(n for n, _ in kept) == (KV_REPEATED + mask_kept + SCORES * 4 + SCORES
                                       + SCORES * 2) == 66_560


def test_unfused_attention_without_dropout_keeps_the_softmax_output_once():
    _, kept, _, _ = _attention("local", dropout=0.0)
    assert sum(n for n, _ in kept) == KV_REPEATED + SCORES * 2 == 24_576


@pytest.mark.parametrize("kernels", ["eager", "torch"])
@pytest.mark.parametrize("attention", ["unfused", "local"])
def test_unfused_attention_needs_megatron_te(kernels, attention):
    with pytest.raises(TracememError, match=f"--attention {attention} is Megatron's "
                                            f"--attention-backend {attention} and needs "
                                            f"--kernels megatron-te"):
        build_model(LLAMA, "meta", attention=attention, kernels=kernels)


def test_unfused_attention_refuses_context_parallelism():
    from modeling.common.attention.gqa import GQA

    with pytest.raises(TracememError, match="--attention local does not support context "
                                            "parallelism"):
        GQA(LLAMA, "local", cp=2, kernels=get_profile("megatron-te"))


# ---------------------------------------------------------------------------- cross entropy
B, SEQ, VP = 2, 4, 10  # b = 2: compute_language_model_loss's transposes copy
ROWS = B * SEQ
LOGITS_F32, LOGITS_BF16 = ROWS * VP * 4, ROWS * VP * 2


def _cross_entropy(fusion):
    labels = torch.zeros(B, SEQ, dtype=torch.long, device="meta")
    return run(lambda logits: megatron_cross_entropy(logits, labels, 1, fusion),
               [leaf(B, SEQ, VP)], [labels])


def test_unfused_vocab_parallel_cross_entropy_keeps_an_fp32_softmax_mask_and_targets():
    forward, kept, peak, backward = _cross_entropy("none")
    # labels [b, s] -> [s, b] contiguous (int64); the fp32 logits; max values fp32 and
    # indices int64; two bool comparisons and their or; the target clone and minus start
    # (int64); a 0-d int64 fill value; arange int64 [N]; gathered and cloned predicted
    # logits fp32 [N]; a 0-d fp32 fill; exp sums, log, loss fp32 [s, b]; the loss back to
    # [b, s] (a copy); its mean
    assert forward == [(ROWS * 8, torch.int64), (LOGITS_F32, F32), (ROWS * 4, F32),
                       (ROWS * 8, torch.int64)] + [(ROWS, torch.bool)] * 3 + [
        (ROWS * 8, torch.int64)] * 2 + [(8, torch.int64), (ROWS * 8, torch.int64)] + [
        (ROWS * 4, F32)] * 2 + [(4, F32)] + [(ROWS * 4, F32)] * 4 + [(4, F32)]
    # saved: the softmax (the fp32 logits, in place), target_mask, masked_target_1d
    assert kept == [(ROWS, "torch.bool"), (ROWS * 8, "torch.int64"),
                    (LOGITS_F32, "torch.float32")]
    # backward: in place into the softmax; autograd casts the fp32 gradient to bf16
    assert (LOGITS_BF16, BF16) in backward and (LOGITS_F32, F32) not in backward


def test_cross_entropy_paths_peak_as_their_buffers_add_up():
    # forward peaks above the bf16 logits; every path holds the [s, b] label copy (64 B)
    labels_copy = ROWS * 8
    _, _, peak, _ = _cross_entropy("none")
    # at the loss's `log(sum) - predicted`: fp32 logits 320, max values 32 (the indices went
    # with the tuple), target_mask 8 (its two operands went), masked target 64 (its clone
    # went), arange 64, predicted logits 32 (the gathered ones went), exp sums 32, log 32,
    # loss 32: the function's locals live until it returns
    assert peak == labels_copy + LOGITS_F32 + 32 + 8 + 64 + 64 + 32 + 32 + 32 + 32 == 680
    _, kept, peak, backward = _cross_entropy("native")
    # torch.compile'd regions: fp32 copy, max (no indices), mask 8, target 64, two fp32
    # intermediates [N] 32 and [s, b] 32, the concatenation [2s, b] 64
    assert peak == labels_copy + LOGITS_F32 + 32 + 8 + 64 + 32 + 32 + 64 == 616
    assert kept == [(ROWS, "torch.bool"), (ROWS * 8, "torch.int64"),
                    (LOGITS_F32, "torch.float32")]
    # calculate_gradients: an fp32 [N, V/TP] copy for the target update, the bf16 gradient
    assert backward[-2:] == [(LOGITS_F32, F32), (LOGITS_BF16, BF16)]
    _, kept, peak, _ = _cross_entropy("te")
    # TE >= 2.18: loss [N] 32, m_d_X_y [3N] 96, the fp32 gradient 320 (kept)
    assert kept == [(LOGITS_F32, "torch.float32")]
    assert peak == labels_copy + 32 + 96 + LOGITS_F32 == 512


# ------------------------------------------------------------------------------- inventory
def test_inventory_lists_the_new_saved_tensors_with_their_sources():
    from tracemem.inventory import get_inventory

    cfg = dataclasses.replace(load_config("llama-tiny"), hidden_dropout=0.1,
                              attention_dropout=0.1, dtype="bfloat16")
    s, n, h, vocab = 64, 4, 64, 256  # b = 1, TP 1
    rows = get_inventory(cfg, world_size=1, micro_batch_size=1, seq_length=s,
                         part="layer 0", attention="unfused").rows
    by = {}
    for row in rows:
        by.setdefault((row.saved_by[:1], row.dtype), []).append(row)
    # TE's fused causal softmax output [b, n, s, s] bf16, cited to TE's softmax.py
    (softmax,) = by[(("_TEScaledMaskedSoftmaxBackward",), "bfloat16")]
    assert softmax.nbytes == n * s * s * 2 and "softmax.py" in softmax.source
    # three bool dropout masks: attention probabilities [b, n, s, s], two residual branches
    masks = sorted(r.nbytes for r in by[(("NativeDropoutBackward0",), "bool")])
    assert masks == [s * h, s * h, n * s * s]
    loss = get_inventory(cfg, world_size=1, micro_batch_size=1, seq_length=s, part="loss",
                         kernel_options={"cross_entropy_fusion": "none"}).rows
    mine = [r for r in loss if r.saved_by[:1] == ("_VocabParallelCrossEntropyBackward",)]
    assert sorted((r.nbytes, r.dtype) for r in mine) == [
        (s, "bool"), (s * 8, "int64"), (s * vocab * 4, "float32")]
    assert all("tensor_parallel/cross_entropy.py" in r.source for r in mine)
