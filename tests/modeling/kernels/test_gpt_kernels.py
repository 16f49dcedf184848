"""The kernels Megatron's GPT adds (LayerNorm, LayerNorm fused into a TE linear, bias-GELU,
squared ReLU) allocate, keep and free what their sources do.

Reference: the sources each kernel cites, read by hand: TransformerEngine d0067d0
``pytorch/ops/basic/layer_norm.py`` ``LayerNorm.op_forward`` / ``op_backward`` and
``csrc/extensions/normalization.cpp`` ``layernorm_fwd`` (mu and rsigma ``[tokens]`` fp32),
``module/layernorm_linear.py`` ``_LayerNormLinear`` (saves inputmat, ln_out, mu, rsigma;
``layernorm_bwd`` gives dx, dgamma, dbeta); Megatron-LM d98e8a6 ``core/fusions/
fused_bias_gelu.py`` ``GeLUFunction`` and ``core/activations.py`` ``squared_relu``; torch 2.13
derivatives.yaml ``native_layer_norm`` (saves mean and rstd ``(..., 1)``). Bytes are numel *
element size, written out.
"""

import torch
from torch import nn

from modeling.common.norm import LayerNorm
from modeling.kernels import get_profile
from modeling.kernels.activations import compiled_squared_relu, fused_bias_gelu
from modeling.kernels.linear import te_linear
from modeling.kernels.norm import te_layer_norm
from tracemem.validation.kernel_trace import leaf, trace_call

BF16, F32 = torch.bfloat16, torch.float32


def run(fn, inputs, externals=()):
    """``fn(*inputs)`` forward and backward traced: (forward allocations, the storages made in
    forward and alive after it besides the output, backward allocations besides the seed),
    each as sorted or ordered (shape, dtype) pairs, and the kept bytes."""
    t = trace_call(fn, inputs, externals)
    return ([(e.shape, e.dtype) for e in t.allocs(t.forward)],
            sorted(((i.shape, i.dtype) for i in t.kept), key=str),
            [(e.shape, e.dtype) for e in t.allocs(t.backward)], t.kept_bytes)


def test_te_layer_norm_keeps_its_input_mu_and_rsigma():
    # T = 2 * 6 = 12 tokens of h = 8, bf16; the norm's input is made inside the trace (x * 1)
    # so that it counts as kept: x 12 * 8 * 2 B = 192, mu and rsigma 12 * 4 B = 48 each
    norm = LayerNorm(8, kernels=get_profile("megatron-te")).to(device="meta", dtype=BF16)
    forward, kept, backward, kept_bytes = run(lambda x: norm(x * 1), [leaf(2, 6, 8)],
                                              externals=[norm])
    assert forward == [((2, 6, 8), BF16), ((2, 6), F32), ((2, 6), F32), ((2, 6, 8), BF16)]
    assert kept == sorted([((2, 6, 8), BF16), ((2, 6), F32), ((2, 6), F32)], key=str)
    assert kept_bytes == 12 * 8 * 2 + 12 * 4 + 12 * 4 == 288
    # layernorm_bwd: dx (2, 6, 8), dgamma (8,), dbeta (8,); then x * 1's gradient
    assert backward[:3] == [((2, 6, 8), BF16), ((8,), BF16), ((8,), BF16)]


def test_te_layer_norm_copies_a_strided_input():
    norm = nn.LayerNorm(4, device="meta", dtype=BF16)
    forward, kept, _, _ = run(lambda x: te_layer_norm(norm, x.split([4, 2], dim=-1)[0]),
                              [leaf(3, 6)], externals=[norm])
    assert forward[0] == ((3, 4), BF16)  # input_.contiguous()
    assert kept == sorted([((3, 4), BF16), ((3,), F32), ((3,), F32)], key=str)


def test_eager_layer_norm_keeps_mean_and_rstd_with_a_trailing_one():
    # aten::native_layer_norm on meta (CUDA's statistics: fp32 for a bf16 input), the eager
    # and torch profiles' kernel
    for profile in ("eager", "torch"):
        norm = LayerNorm(8, kernels=get_profile(profile)).to(device="meta", dtype=BF16)
        _, kept, backward, kept_bytes = run(norm, [leaf(2, 6, 8)], externals=[norm])
        assert kept == [((2, 6, 1), F32), ((2, 6, 1), F32)] and kept_bytes == 2 * 12 * 4
        assert sorted(backward, key=str) == sorted(
            [((2, 6, 8), BF16), ((8,), BF16), ((8,), BF16)], key=str)  # dx, dgamma, dbeta


def test_te_layernorm_linear_with_a_layernorm_keeps_mu_too_and_allocates_dbeta():
    norm = nn.LayerNorm(4, device="meta", dtype=BF16)
    w = leaf(10, 4)

    def fn(combined, w):
        x, _ = combined.split([4, 2], dim=-1)  # not contiguous: TE copies it
        return te_linear(x, [w], "column", 2, norm)
    forward, kept, backward, kept_bytes = run(fn, [leaf(1, 3, 6), w], externals=[norm])
    # inputmat copy (1, 3, 4), ln_out (1, 3, 4), mu and rsigma (1, 3) fp32; then the SP
    # all-gather of ln_out (1, 6, 4) and the GEMM output (1, 6, 10)
    assert forward == [((1, 3, 4), BF16), ((1, 3, 4), BF16), ((1, 3), F32), ((1, 3), F32),
                       ((1, 6, 4), BF16), ((1, 6, 10), BF16)]
    assert kept_bytes == 2 * (3 * 4 * 2) + 2 * (3 * 4) == 72
    # re-gathered ln_out (1, 6, 4), dgrad (1, 6, 4), its reduce-scatter (1, 3, 4), then
    # layernorm_bwd: dx (1, 3, 4), dgamma, dbeta (4,); (the split's backward follows)
    assert backward[:6] == [((1, 6, 4), BF16), ((1, 6, 4), BF16), ((1, 3, 4), BF16),
                            ((1, 3, 4), BF16), ((4,), BF16), ((4,), BF16)]


def test_fused_bias_gelu_keeps_its_input_and_reduces_the_bias_gradient():
    bias = leaf(6)
    forward, kept, backward, _ = run(lambda y, b: fused_bias_gelu(y * 1, b), [leaf(5, 6), bias])
    assert forward == [((5, 6), BF16), ((5, 6), BF16)]  # y * 1, the GELU output
    assert kept == [((5, 6), BF16)]  # ctx.save_for_backward(input, bias): bias a leaf
    # bias_gelu_back's one (5, 6) tensor, then autograd's reduction of it to the bias's
    # shape (at::sum_to: a keepdim sum (1, 6), viewed as (6,))
    assert backward[:2] == [((5, 6), BF16), ((1, 6), BF16)]


def test_compiled_squared_relu_keeps_one_tensor_of_its_input_size():
    forward, kept, backward, _ = run(lambda y: compiled_squared_relu(y * 1), [leaf(5, 6)])
    assert forward == [((5, 6), BF16), ((5, 6), BF16)] and kept == [((5, 6), BF16)]
    assert backward[0] == ((5, 6), BF16)
