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
        "moe_permute_fusion": True, "moe_token_dispatcher": "alltoall",
        "moe_router_dtype": "fp32", "masked_softmax_fusion": True,
        "cp_comm_type": "allgather", "attention_backend": "fused",
        # FP8 off by default (no GPU given: Hopper's layouts; tests/modeling/kernels/test_fp8.py)
        "fp8_recipe": "none", "fp8_format": "hybrid", "fp8_param_gather": False,
        "fp8_arch": "sm90", "fp8_amax_history_len": 1, "fp8_layers_at_start_in_bf16": 0,
        "fp8_layers_at_end_in_bf16": 0, "e5m6_attention_output": False, "fp8_dispatch": False,
        "fp8_moe_act_cache": False}
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


# --- Megatron's unfused token permutation, GELU experts, Sinkhorn routing --------------------
# moe_utils.py permute / unpermute (fused=False), experts.py TEGroupedMLP.forward's
# bias_act_func without fusion, router.py TopKRouter.sinkhorn_load_balancing (Megatron-LM
# d98e8a6), read by hand; autograd's saved tensors from torch 2.13's derivatives
# (IndexBackward0 saves the indices, IndexSelectBackward0 the index, MulBackward0 the other
# operand of each input that needs a gradient, SigmoidBackward0 its result).


def test_unfused_permute_keeps_the_int64_argsort_and_the_sorted_indices():
    from modeling.kernels.moe import megatron_permute
    tokens, experts, slots, h = 4, 3, 8, 8  # top-2: 8 token-slots

    def fn(x, probs, routing_map):
        permuted, permuted_probs, _ = megatron_permute(x, routing_map, slots, probs)
        return permuted * permuted_probs.unsqueeze(-1)  # (8, 8) fp32
    x, probs = leaf(tokens, h), leaf(tokens, experts, dtype=F32)
    routing_map = torch.empty((tokens, experts), dtype=torch.bool, device="meta")
    forward, kept, _ = run(fn, [x, probs, routing_map])
    # routing_map.T.contiguous() (3, 4) bool; argsort of its 12 entries: (12,) int64;
    # flat_sorted[:8] % 4: sorted_indices (8,) int64; probs.T.contiguous() (3, 4) fp32,
    # indexed: (8,) fp32; index_select: (8, 8) bf16; the product: the output
    assert ((3, 4), torch.bool, "temporary") in forward
    assert ((3, 4), F32, "temporary") in forward
    # kept: the argsort's storage (indexing saves the view flat_sorted), sorted_indices
    # (index_select saves it), and the product's operands (both need gradients)
    assert kept == _sorted([((12,), torch.int64), ((8,), torch.int64), ((8, 8), BF16),
                            ((8,), F32)])


def test_unfused_unpermute_scatters_into_a_zero_buffer_and_keeps_nothing_new():
    from modeling.kernels.moe import megatron_unpermute
    sorted_indices = torch.empty((8,), dtype=torch.int64, device="meta")
    forward, kept, backward = run(lambda y: megatron_unpermute(y, sorted_indices, 4),
                                  [leaf(8, 6)], externals=[sorted_indices])
    assert forward == [((4, 6), BF16, "temporary")]  # torch.zeros; .to(bf16) is a no-op
    assert kept == []  # scatter_add_ saves the index: the caller's sorted_indices
    assert backward == [((8, 6), BF16, "gradient")]  # gather of the output gradient


def test_gelu_experts_keep_fc1_out_the_gelu_and_its_bf16_cast_the_fp32_product_is_transient():
    from modeling.common.moe import _megatron_experts
    kern = get_profile("megatron-te", gradient_accumulation_fusion=True)
    rows, h, inter = 6, 4, 8
    w1, w2 = leaf(1, inter, h), leaf(1, h, inter)

    def fn(x, probs):
        return _megatron_experts(kern, x, probs, [w1], [w2], gated=False, activation="gelu")
    forward, kept, _ = run(fn, [leaf(rows, h), leaf(rows, 1, dtype=F32)], externals=[w1, w2])
    # fc1 (6, 8) bf16; F.gelu (6, 8) bf16; * probs (6, 1) fp32: (6, 8) fp32; .to(bf16)
    # (6, 8) bf16; fc2: the output (6, 4) bf16
    assert [f[:2] for f in forward] == [((6, 8), BF16), ((6, 8), BF16), ((6, 8), F32),
                                        ((6, 8), BF16), ((6, 4), BF16)]
    # gelu saves fc1's output, the product saves the gelu output (for the probabilities'
    # gradient), fc2 saves the cast; the fp32 product dies with the cast
    assert kept == _sorted([((6, 8), BF16)] * 3)


def test_sinkhorn_routing_keeps_the_activation_and_the_bool_map():
    from types import SimpleNamespace

    from modeling.common.router import Gate, RouterSpec
    tokens, h = 4, 8
    with torch.device("meta"):
        gate = Gate(SimpleNamespace(hidden_size=h),
                    RouterSpec(num_experts=3, top_k=1, sinkhorn=True)).to(BF16)
    kern = get_profile("megatron-te")
    forward, kept, _ = run(lambda x: gate.route_megatron(x, kern)[0], [leaf(tokens, h)],
                           externals=[gate.weight])
    # fp32 logits (4, 3) (the router GEMM saves x and the weight: the caller's); under
    # no_grad exp (4, 3) and Sinkhorn's temporaries, freed; the top-1 ids (4, 1) int64;
    # sigmoid (4, 3) fp32; the map (4, 3) int32 then bool; the product: the output.
    # Kept: the sigmoid's result (SigmoidBackward0 saves it; the logits die) and the bool
    # map (the product saves it for the activation's gradient)
    assert kept == _sorted([((4, 3), F32), ((4, 3), torch.bool)])
    assert ((4, 3), torch.int32, "temporary") in forward


def test_sequential_experts_run_one_te_linear_pair_each_and_concatenate():
    # experts.py SequentialMLP.forward: split by count (views), each expert's MLP.forward
    # with per_token_scale (TE fc1, F.gelu, * probs, .to(bf16), TE fc2), torch.cat
    from types import SimpleNamespace

    from modeling.common.mlp import MLP
    from modeling.common.moe import MoE
    h, f = 4, 8
    with torch.device("meta"):
        experts = nn.ModuleList(MLP(h, f, component="routed_experts", kind="expert", ep=True,
                                    gated=False, activation="gelu") for _ in range(2)).to(BF16)
    layer = SimpleNamespace(experts=experts, kernels=get_profile("megatron-te"),
                            cfg=SimpleNamespace(gated_mlp=False, hidden_act="gelu"))
    weights = [p for p in experts.parameters()]
    forward, kept, _ = run(lambda x, p: MoE._experts_megatron(layer, x, p, [2, 4]),
                           [leaf(6, h), leaf(6, 1, dtype=F32)], externals=weights)
    per_expert = lambda c: [((c, f), BF16), ((c, f), BF16), ((c, f), F32), ((c, f), BF16),
                            ((c, h), BF16)]
    assert [a[:2] for a in forward] == per_expert(2) + per_expert(4) + [((6, h), BF16)]
    # kept: fc1's output, the GELU output, the bf16 cast of each expert (2 and 4 rows); the
    # experts' fc2 outputs die with the concatenation (the output)
    assert kept == _sorted([((2, f), BF16)] * 3 + [((4, f), BF16)] * 3)
