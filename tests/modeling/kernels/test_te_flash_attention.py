"""TE's FlashAttention backend (Megatron's ``--attention-backend flash``) over flash-attn 2: what
one attention call allocates, keeps and frees, how ``auto`` resolves, and the Megatron-LM front
door.

Reference, read by hand: TransformerEngine d0067d0 ``pytorch/attention/dot_product_attention/
dot_product_attention.py`` ``DotProductAttention.forward`` (``get_qkv_layout``,
``_pad_qkv_head_dim``, ``_trim_output``), ``backends.py`` ``FlashAttention.forward`` (sbhd ->
bshd ``x.transpose(0, 1).contiguous()``, the output's ``.view(b, s, -1).transpose(0,
1)...contiguous()``), ``utils.py`` ``get_attention_backend``; flash-attn v2.8.3
``flash_attn/flash_attn_interface.py`` ``FlashAttnFunc`` and ``csrc/flash_attn/flash_api.cpp``
``mha_fwd`` (out ``empty_like(q)``, ``softmax_lse`` ``[b, h, s]`` fp32, ``rng_state`` ``[2]``
int64) / ``mha_bwd`` (``softmax_d`` ``[b, h, round(s, 128)]`` fp32, ``dq_accum`` ``[b,
round(s, 128), h, round(d, 32)]`` fp32, GQA's ``dk_expanded`` / ``dv_expanded`` ``[b, s, h,
d]``); Megatron-LM d98e8a6 ``megatron/training/arguments.py`` (``--attention-backend``, default
auto). Every expected byte is numel x element size (bf16 2 B, fp32 4 B, int64 8 B), written out.
"""

import dataclasses

import pytest
import torch

from modeling import load_config
from modeling.common.attention.gqa import GQA
from modeling.kernels import get_profile
from modeling.kernels.attention import te_auto_attention_backend, te_flash_attention
from tracemem.validation.kernel_trace import leaf, peak_of, trace_call
from tracemem import MemoryTracer
from tracemem.errors import TracememError
from tracemem.frontdoors.megatron import megatron_job_kwargs, to_megatron_args

BF16, F32, I64 = torch.bfloat16, torch.float32, torch.int64


def trace_flash(q, k, v):
    """Forward and backward of one flash attention call traced: (forward allocations as
    (shape, dtype), forward peak, bytes made in forward and kept after it besides the output,
    backward allocations as (shape, dtype), backward peak above its start, the output)."""
    t = trace_call(te_flash_attention, [q, k, v])
    return ([(e.shape, e.dtype) for e in t.allocs(t.forward)], peak_of(t.forward),
            t.kept_bytes, [(e.shape, e.dtype) for e in t.allocs(t.backward)],
            peak_of(t.backward), t.out)


def test_gqa_flash_attention_copies_to_bshd_and_back_at_b2():
    # b = 2, s = 4, h = 2 query heads, g = 1 key/value head, d = 8: q 128 el = 256 B, k and v
    # 64 el = 128 B each; softmax_lse [2, 2, 4] fp32 = 64 B; rng_state 16 B
    q, k, v = leaf(2, 4, 2, 8), leaf(2, 4, 1, 8), leaf(2, 4, 1, 8)
    forward, fwd_peak, kept, backward, bwd_peak, out = trace_flash(q, k, v)
    assert out.shape == (2, 4, 16)  # (b, s, h * d_v)
    assert forward == [
        ((2, 4, 2, 8), BF16), ((2, 4, 1, 8), BF16), ((2, 4, 1, 8), BF16),  # bshd copies
        ((2, 4, 2, 8), BF16),  # mha_fwd: out = empty_like(q), 256 B
        ((2, 2, 4), F32), ((2,), I64),  # softmax_lse 64 B, rng_state 16 B
        ((2, 4, 16), BF16)]  # the sbhd output, a copy of out: 256 B
    # nothing is freed in forward: 256 + 128 + 128 + 256 + 64 + 16 + 256
    assert fwd_peak == 1104
    # saved: the bshd q, k, v 512, out 256, softmax_lse 64, rng_state 16
    assert kept == 512 + 256 + 64 + 16
    assert backward == [
        ((2, 4, 2, 8), BF16), ((2, 4, 1, 8), BF16), ((2, 4, 1, 8), BF16),  # dq, dk, dv
        ((2, 2, 128), F32),  # softmax_d [b, h, round(4, 128)]: 512 el = 2048 B
        ((2, 128, 2, 32), F32),  # dq_accum [b, 128, h, round(8, 32)]: 16384 el = 65536 B
        ((2, 4, 2, 8), BF16), ((2, 4, 2, 8), BF16)]  # dk / dv expanded to h heads: 256 B each
    # all at once inside mha_bwd: 256 + 128 + 128 + 2048 + 65536 + 256 + 256
    assert bwd_peak == 68608
    # the gradients pass back through the copies: q.grad is flash-attn's dq itself
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    assert q.grad.untyped_storage().nbytes() == 256


def test_flash_attention_at_b1_copies_nothing():
    # b = 1: [s, 1, h, d] transposed to [1, s, h, d] is contiguous already, so neither the
    # inputs nor the output are copied; the returned output is flash-attn's saved out
    q, k, v = leaf(1, 4, 2, 8), leaf(1, 4, 2, 8), leaf(1, 4, 2, 8)
    forward, fwd_peak, kept, backward, bwd_peak, out = trace_flash(q, k, v)
    assert forward == [((1, 4, 2, 8), BF16), ((1, 2, 4), F32), ((2,), I64)]
    assert fwd_peak == 128 + 32 + 16  # out 64 el, softmax_lse 8 el fp32, rng_state
    assert kept == 32 + 16  # besides out, which is the returned output's own storage
    # MHA: no expanded dk / dv; softmax_d [1, 2, 128] 1024 B, dq_accum [1, 128, 2, 32] 32768 B
    assert backward == [((1, 4, 2, 8), BF16)] * 3 + [((1, 2, 128), F32),
                                                      ((1, 128, 2, 32), F32)]
    assert bwd_peak == 3 * 128 + 1024 + 32768


def test_mla_pads_the_value_head_and_trims_the_output():
    # MLA: d_qk 16, d_v 8 (b 1, s 4, h 2): _pad_qkv_head_dim pads v to 16 (F.pad: [1, 4, 2,
    # 16] 256 B), flash-attn runs at d 16, _trim_output copies [..., :8] out: [1, 4, 16] 128 B
    q, k, v = leaf(1, 4, 2, 16), leaf(1, 4, 2, 16), leaf(1, 4, 2, 8)
    forward, fwd_peak, kept, backward, bwd_peak, out = trace_flash(q, k, v)
    assert out.shape == (1, 4, 16)  # h * d_v = 2 * 8
    assert forward == [((1, 4, 2, 16), BF16),  # padded v, saved by flash-attn
                       ((1, 4, 2, 16), BF16), ((1, 2, 4), F32), ((2,), I64),  # out, lse, rng
                       ((1, 4, 2, 8), BF16)]  # the trimmed output's copy, viewed (1, 4, 16)
    assert fwd_peak == 256 + 256 + 32 + 16 + 128
    assert kept == 256 + 256 + 32 + 16  # padded v, out, softmax_lse, rng_state
    # backward: the trim's slice gradient [1, 4, 2, 16] (zeros, 256 B) first, then dq, dk, dv
    # at d 16 (dv of the padded v) 256 B each, softmax_d [1, 2, 128] 1024 B, dq_accum [1, 128,
    # 2, 32] 32768 B; after mha_bwd, F.pad's backward (constant_pad_nd of dv, negated) makes
    # v's gradient [1, 4, 2, 8] 128 B
    assert backward == [((1, 4, 2, 16), BF16)] * 4 + [((1, 2, 128), F32),
                                                      ((1, 128, 2, 32), F32),
                                                      ((1, 4, 2, 8), BF16)]
    assert bwd_peak == 256 + 3 * 256 + 1024 + 32768
    assert v.grad.shape == (1, 4, 2, 8)


# TE checks max(d_qk, d_v), the head dim after _pad_qkv_head_dim
@pytest.mark.parametrize("d_qk, d_v", [(264, 264), (12, 12), (64, 264)])
def test_head_dims_flash_attn_2_does_not_take_are_refused(d_qk, d_v):
    q, k, v = leaf(1, 4, 1, d_qk), leaf(1, 4, 1, d_qk), leaf(1, 4, 1, d_v)
    with pytest.raises(TracememError, match=f"got d_qk {d_qk}, d_v {d_v}: use "
                                            f"--attention-backend fused"):
        te_flash_attention(q, k, v)


@pytest.mark.parametrize("arch, flash_attn, expected", [
    ((8, 0), True, "flash"),  # sm80: FlashAttention when flash-attn 2 is installed
    ((8, 0), False, "fused"),
    ((8, 0), None, "fused"),  # not known (the CI containers): fused kept
    ((9, 0), True, "fused"),  # "Select FusedAttention for performance" on sm90+
    ((10, 0), True, "fused"),
    (None, True, "fused")])  # no GPU given
def test_auto_follows_te_get_attention_backend(arch, flash_attn, expected):
    assert te_auto_attention_backend(arch, flash_attn) == expected


def test_profile_option_attention_backend():
    assert get_profile("megatron-te").attention_backend == "fused"
    assert get_profile("megatron-te", attention_backend="flash").attention_backend == "flash"
    # auto: resolved from the GPU's architecture, and kept as what it resolved to
    for arch in (None, (8, 0), (9, 0)):
        profile = get_profile("megatron-te", gpu_arch=arch, attention_backend="auto")
        assert profile.options["attention_backend"] == "fused"
    with pytest.raises(TracememError, match=r"attention_backend='unfused' is invalid; choose "
                                            r"one of fused, flash, auto"):
        get_profile("megatron-te", attention_backend="unfused")


def _gqa_allocs(cp=1, **options):
    cfg = dataclasses.replace(load_config("llama-tiny"), attention_dropout=0.0)
    kern = get_profile("megatron-te", **options)
    with torch.device("meta"):
        attn = GQA(cfg, cp=cp, kernels=kern).to(BF16)
        x = torch.empty(1, 8, cfg.hidden_size, dtype=BF16, requires_grad=True)
    tracer = MemoryTracer(rounding=None)
    tracer.track_external(attn, x)
    with tracer:
        attn(x, None).sum().backward()
    return [(e.shape, e.dtype) for e in tracer.events if e.action == "alloc"]


def test_megatron_gqa_runs_the_backend_of_the_option():
    # llama-tiny: 4 heads, 2 KV heads of 16, b 1, s 8: the softmax statistics tell the
    # backends apart (fused [b, h, s, 1], flash-attn [b, h, s]), and only flash-attn's
    # backward makes the fp32 dq_accum [1, 128, 4, 32] and GQA's expanded dk / dv
    fused, flash = _gqa_allocs(), _gqa_allocs(attention_backend="flash")
    assert ((1, 4, 8, 1), F32) in fused and ((1, 4, 8), F32) not in fused
    assert ((1, 4, 8), F32) in flash and ((1, 4, 8, 1), F32) not in flash
    assert ((1, 128, 4, 32), F32) in flash and ((1, 128, 4, 32), F32) not in fused
    assert flash.count(((1, 8, 4, 16), BF16)) > fused.count(((1, 8, 4, 16), BF16))


def test_ring_attention_follows_the_option():
    # CP 2 with --cp-comm-type p2p: this rank's 8 tokens; fused_attn_fwd's per-step
    # statistics are [b, h, sq, 1], flash-attn's [b, h, sq], and flash-attn's backward makes
    # dq_accum [1, 128, 4, 32] per ring step
    ring = _gqa_allocs(cp=2, cp_comm_type="p2p")
    flash = _gqa_allocs(cp=2, cp_comm_type="p2p", attention_backend="flash")
    assert ((1, 4, 8, 1), F32) in ring and ((1, 4, 8, 1), F32) not in flash
    assert ring.count(((1, 128, 4, 32), F32)) == 0
    assert flash.count(((1, 128, 4, 32), F32)) == 2


# ---- the Megatron-LM front door ----------------------------------------------------------
ARGS = ("--num-layers 2 --hidden-size 512 --num-attention-heads 8 --seq-length 4096 "
        "--max-position-embeddings 4096 --micro-batch-size 1 --bf16 --tokenizer-type "
        "NullTokenizer --vocab-size 32000").split()


@pytest.mark.parametrize("flag, option", [([], None), (["--attention-backend", "auto"], None),
                                          (["--attention-backend", "flash"], "flash"),
                                          (["--attention-backend", "fused"], None)])
def test_megatron_attention_backend_maps_to_the_option(flag, option):
    # auto (Megatron's default) and fused leave the profile's default, fused: TE's auto is
    # fused on every GPU kind while flash-attn's presence is not known
    kwargs = megatron_job_kwargs(ARGS + flag, world_size=1)
    assert kwargs["attention"] == "flash"  # TE's DotProductAttention
    assert kwargs["kernel_options"].get("attention_backend") == option
    for key in ("megatron_args", "origin"):
        kwargs.pop(key)
    out = to_megatron_args(kwargs)
    i = out.index("--attention-backend")
    assert out[i + 1] == (option or "fused")
    kwargs["kernel_options"]["attention_backend"] = "auto"  # Megatron's default: not written
    assert "--attention-backend" not in to_megatron_args(kwargs)


def test_megatron_unfused_attention_sets_no_backend_option():
    kwargs = megatron_job_kwargs(ARGS + ["--attention-backend", "unfused"], world_size=1)
    assert kwargs["attention"] == "unfused"
    assert "attention_backend" not in kwargs["kernel_options"]
