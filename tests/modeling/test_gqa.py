"""Grouped-query attention's shapes per rank and under each kernel profile.

References: Megatron-Core d98e8a6 megatron/core/transformer/attention.py (``SelfAttention``:
one linear_qkv of (n_h + 2 n_kv) * d outputs per rank, n_h / TP and n_kv / TP heads per rank);
TransformerEngine d0067d0 module/linear.py ``_Linear.backward`` (a bias gradient per bias);
transformers' partial RoPE (the first head_dim * partial_rotary_factor channels rotated).
"""

import dataclasses

import torch

from modeling import load_config
from modeling.common.attention.gqa import GQA, repeat_kv
from modeling.common.rope import apply_rope, inv_freq


def test_tp_shards_heads_and_query_groups():
    cfg = load_config("llama-tiny")  # 4 heads, 2 KV heads of 16
    with torch.device("meta"):
        attn = GQA(cfg, num_heads=2, num_kv_heads=1)
    assert [tuple(m.weight.shape) for m in (attn.wq, attn.wk, attn.wv, attn.wo)] == \
        [(32, 64), (16, 64), (16, 64), (64, 32)]


def test_megatron_te_gqa_allocates_bias_gradients_and_fuses_the_norm():
    cfg = load_config("qwen2-tiny")  # q, k, v biases
    from modeling.common.norm import RMSNorm
    from modeling.kernels import get_profile
    kern = get_profile("megatron-te")
    with torch.device("meta"):
        attn = GQA(cfg, kernels=kern).to(torch.bfloat16)
        norm = RMSNorm(64, eps=1e-6, kernels=kern).to(torch.bfloat16)
        x = torch.empty(2, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    out = attn(x, norm)
    assert out.shape == (2, 16, 64)
    out.sum().backward()
    # --gradient-accumulation-fusion: weight gradients go to main_grad; biases get theirs
    assert attn.wq.weight.grad is None and attn.wq.bias.grad.shape == (64,)
    assert attn.wk.bias.grad.shape == attn.wv.bias.grad.shape == (32,)
    assert norm.weight.grad.shape == (64,) and x.grad.shape == x.shape


def test_partial_rope_rotates_the_first_channels_only():
    x = torch.randn(1, 5, 2, 8)
    freqs = inv_freq(4, 10000.0)  # partial_rotary_factor 0.5 of head_dim 8
    y = apply_rope(x, freqs)
    assert torch.equal(y[..., 4:], x[..., 4:])
    assert torch.allclose(y[..., :4], apply_rope(x[..., :4].contiguous(), freqs))
    cfg = dataclasses.replace(load_config("llama-tiny"), partial_rotary_factor=0.5)
    assert cfg.rotary_dim == 8 and GQA(cfg).inv_freq.shape == (4,)


def test_repeat_kv_repeats_each_head_for_its_group():
    kv = torch.arange(2 * 3).view(1, 2, 3, 1).float()  # 2 KV heads
    assert repeat_kv(kv, 2)[0, :, :, 0].tolist() == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]
    assert repeat_kv(kv, 1) is kv
