"""Each megatron-te / torch kernel allocates, keeps and frees what its source does.

Reference: the sources each kernel cites (TransformerEngine d0067d0, Megatron-LM d98e8a6, torch
2.13), read by hand: the expected allocations below are written out from them, in order, with
their shapes and dtypes; bytes are numel * element size.
"""

import pytest
import torch
from torch import nn

from modeling.kernels import get_profile
from modeling.kernels.attention import te_fused_attention
from modeling.kernels.linear import te_linear
from modeling.kernels.loss import te_cross_entropy
from modeling.kernels.moe import te_grouped_linear, te_permute, te_sort_chunks, te_unpermute
from modeling.kernels.norm import fused_rms_norm, te_rms_norm
from modeling.kernels.swiglu import fused_swiglu, fused_weighted_swiglu
from tracemem import MemoryTracer
from tracemem.errors import TracememError

BF16, F32 = torch.bfloat16, torch.float32


def leaf(*shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)


def _sorted(pairs):
    return sorted(pairs, key=lambda p: (p[0], str(p[1])))


def run(fn, inputs, grad_shape=None, externals=()):
    """Forward and backward of ``fn(*inputs)`` traced: (forward allocations, storages made in
    forward and kept after it, besides the output, as sorted (shape, dtype), backward
    allocations besides the seed gradient); allocations as (shape, dtype, category)."""
    tracer = MemoryTracer(rounding=None)
    tracer.track_external(*inputs, *externals)
    with tracer:
        out = fn(*inputs)
    forward = [(e.shape, e.dtype, e.category.value) for e in tracer.events
               if e.action == "alloc" and e.phase.value == "forward"]
    out_id = tracer._live[out.untyped_storage()._cdata].sid
    kept = _sorted((i.shape, i.dtype) for i in tracer.live_at("now")
                   if i.phase.value == "forward" and i.storage_id != out_id)
    grad = torch.empty(grad_shape or out.shape, dtype=out.dtype, device="meta")
    tracer.track_external(grad)
    start = len(tracer.events)
    with tracer:
        out.backward(grad)
    backward = [(e.shape, e.dtype, e.category.value) for e in tracer.events[start:]
                if e.action == "alloc"]
    return forward, kept, backward


def test_te_rms_norm_keeps_the_input_and_an_fp32_rstd_per_token():
    norm = nn.RMSNorm(8, device="meta", dtype=BF16)
    x = leaf(6, 8)
    forward, kept, backward = run(lambda x: te_rms_norm(norm, x), [x], externals=[norm])
    assert forward == [((6, 8), BF16, "temporary"), ((6,), F32, "activation")]  # y, rstdevs
    assert kept == [((6,), F32)]  # x itself is the input: kept, not made
    assert backward == [((6, 8), BF16, "gradient"), ((8,), BF16, "gradient")]  # dx, dgamma


def test_torch_fused_rms_norm_keeps_rstd_with_a_trailing_one():
    norm = nn.RMSNorm(8, device="meta", dtype=BF16)
    forward, kept, _ = run(lambda x: fused_rms_norm(norm, x), [leaf(6, 8)], externals=[norm])
    assert kept == [((6, 1), F32)]  # aten::_fused_rms_norm's rstd is (..., 1)


def test_te_column_linear_with_sp_saves_the_local_input_and_regathers_in_backward():
    x, w = leaf(1, 3, 8), leaf(16, 8)
    forward, kept, backward = run(lambda x, w: te_linear(x, [w], "column", 2), [x, w])
    # all-gather buffer (1, 6, 8), GEMM output (1, 6, 16); the buffer is freed after the GEMM
    assert forward == [((1, 6, 8), BF16, "comm_buffer"), ((1, 6, 16), BF16, "temporary")]
    assert kept == []  # the local input is the caller's
    # re-gather (1, 6, 8), dgrad GEMM (1, 6, 8), its reduce-scatter (1, 3, 8); wgrad into
    # main_grad (gradient accumulation fusion): nothing
    assert backward == [((1, 6, 8), BF16, "comm_buffer"), ((1, 6, 8), BF16, "temporary"),
                        ((1, 3, 8), BF16, "comm_buffer")]


def test_te_row_linear_reduce_scatters_forward_and_gathers_the_output_gradient():
    x, w = leaf(1, 6, 16), leaf(8, 16)
    forward, _, backward = run(lambda x, w: te_linear(x, [w], "row", 2, fuse_wgrad=False),
                               [x, w])
    assert forward == [((1, 6, 8), BF16, "temporary"), ((1, 3, 8), BF16, "comm_buffer")]
    # gathered grad_output (1, 6, 8), dgrad (1, 6, 16), and without the fusion a wgrad (8, 16)
    assert backward == [((1, 6, 8), BF16, "comm_buffer"), ((1, 6, 16), BF16, "gradient"),
                        ((8, 16), BF16, "gradient")]


def test_te_layernorm_linear_keeps_a_contiguous_input_copy_ln_out_and_rstd():
    norm = nn.RMSNorm(4, device="meta", dtype=BF16)
    combined = leaf(1, 3, 6)
    w = leaf(10, 4)

    def fn(combined, w):
        x, _ = combined.split([4, 2], dim=-1)  # a view that is not contiguous
        return te_linear(x, [w], "column", 2, norm)
    forward, kept, _ = run(fn, [combined, w], externals=[norm])
    assert kept == _sorted([((1, 3, 4), BF16), ((1, 3, 4), BF16), ((1, 3), F32)])
    assert forward[-2:] == [((1, 6, 4), BF16, "comm_buffer"), ((1, 6, 10), BF16, "temporary")]


def test_te_fused_attention_keeps_q_k_v_out_stats_and_rng_state():
    q, k, v = leaf(1, 5, 2, 6), leaf(1, 5, 2, 6), leaf(1, 5, 2, 4)
    forward, kept, backward = run(te_fused_attention, [q, k, v])
    assert forward == [((1, 5, 2, 4), BF16, "activation"), ((1, 2, 5, 1), F32, "activation"),
                       ((2,), torch.int64, "activation")]
    assert kept == _sorted([((1, 2, 5, 1), F32), ((2,), torch.int64)])  # out is the output
    assert backward == [((1, 5, 2, 6), BF16, "gradient"), ((1, 5, 2, 6), BF16, "gradient"),
                        ((1, 5, 2, 4), BF16, "gradient")]


def test_fused_swiglu_keeps_its_input_only_and_weighted_adds_the_probs():
    y = leaf(7, 10)
    forward, kept, backward = run(fused_swiglu, [y])
    assert forward == [((7, 5), BF16, "temporary")] and kept == []
    assert backward == [((7, 10), BF16, "gradient")]
    probs = leaf(7, 1, dtype=F32)
    _, kept, backward = run(fused_weighted_swiglu, [leaf(7, 10), probs])
    assert kept == [] and backward == [((7, 10), BF16, "gradient"), ((7, 1), F32, "gradient")]


def test_te_permute_sort_unpermute_keep_int32_maps_only():
    tokens, experts, top_k, h = 4, 3, 2, 8
    slots = tokens * top_k

    def fn(x, probs):
        permuted, permuted_probs, row_id_map = te_permute(x, probs, slots)
        permuted, permuted_probs = te_sort_chunks(permuted, permuted_probs)
        out, _ = te_sort_chunks(permuted * permuted_probs.unsqueeze(-1).to(BF16))
        return te_unpermute(out, row_id_map, tokens)
    x, probs = leaf(tokens, h), leaf(tokens, experts, dtype=F32)
    _, kept, _ = run(fn, [x, probs])
    int32 = [s for s in kept if s[1] == torch.int32]
    # permute: (tokens, 2 * experts + 1); each chunk sort: (rows,)
    assert _sorted(int32) == _sorted([((4, 7), torch.int32), ((8,), torch.int32),
                                      ((8,), torch.int32)])


def test_te_grouped_linear_saves_its_input_and_allocates_one_dgrad():
    x, w1, w2 = leaf(12, 8), leaf(2, 6, 8), leaf(2, 6, 8)
    forward, kept, backward = run(lambda x, a, b: te_grouped_linear(x, [a, b], 12),
                                  [x, w1, w2])
    assert forward == [((12, 12), BF16, "temporary")] and kept == []
    assert backward == [((12, 8), BF16, "gradient")]


@pytest.mark.parametrize("version, kept_logits", [("2.18", False), ("2.17", True)])
def test_te_cross_entropy_gradient_by_version(version, kept_logits):
    logits = leaf(1, 4, 10)  # (b, s, V / TP)
    forward, kept, backward = run(lambda l: te_cross_entropy(l, None, tp=2,
                                                              te_version=version), [logits])
    rows = 4
    made = [((rows,), F32, "temporary"), ((rows * 3,), F32, "temporary"),
            ((rows * 3 * 2,), F32, "temporary")]  # loss, m_d_X_y, its TP all-gather
    if version == "2.18":
        assert forward[:4] == made + [((1, 4, 10), F32, "activation")]
        assert ((1, 4, 10), F32) in kept
        # the fp32 gradient is returned; autograd casts it to the bf16 logits' dtype
        assert ((1, 4, 10), BF16, "gradient") in backward
    else:
        assert forward[:3] == made
        assert all(shape != (1, 4, 10) for shape, _ in kept)  # the gradient is the logits
        assert not any(s == (1, 4, 10) for s, _, _ in backward)


def test_profiles_validate_names_and_options():
    assert get_profile("megatron-te").options == {
        "te_version": "2.18", "gradient_accumulation_fusion": True,
        "moe_shared_expert_overlap": True, "cross_entropy_fusion": "te",
        "masked_softmax_fusion": True}
    with pytest.raises(TracememError, match="--kernels 'te' is invalid; choose one of "
                                            "megatron-te, torch, eager"):
        get_profile("te")
    with pytest.raises(TracememError, match="does not apply to --kernels eager"):
        get_profile("eager", te_version="2.17")
    with pytest.raises(TracememError, match="te_version='2.16' is invalid"):
        get_profile("megatron-te", te_version="2.16")


def test_delayed_wgrad_keeps_the_gathered_input_and_output_gradient_until_w():
    # TE _Linear.backward with delay_wgrad_compute: wgrad_store.put([inputmat_total,
    # grad_output]); W frees them (with gradient-accumulation fusion, no wgrad is allocated)
    from modeling.kernels.wgrad import delayed_wgrad, run_delayed_wgrad

    x, w = leaf(1, 3, 8), leaf(16, 8)
    tracer = MemoryTracer(rounding=None)
    tracer.track_external(x, w)
    store = []
    with tracer:
        out = te_linear(x, [w], "column", 2)
        with delayed_wgrad(store):
            out.backward(torch.empty_like(out))
        del out
        kept = sorted(i.nbytes for i in tracer.live_at("now") if i.phase.value != "external")
        run_delayed_wgrad(store)
    # x.grad (1, 3, 8) 48 B; the re-gathered input (1, 6, 8) 96 B and the output gradient
    # (1, 6, 16) 192 B, kept for W
    assert kept == [48, 96, 192]
    assert sorted(i.nbytes for i in tracer.live_at("now") if i.phase.value != "external") == [48]
