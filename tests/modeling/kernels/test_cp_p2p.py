"""Context parallelism with ``--cp-comm-type p2p``: TE's ring attention allocates, keeps and frees
what its source does, and the Megatron-LM front door selects it.

Reference: TransformerEngine d0067d0 ``pytorch/attention/dot_product_attention/
context_parallel.py`` ``AttnFuncWithCPAndKVP2P.forward`` / ``backward`` (with
``cp_p2p_fwd_prepare_qkv``, ``cp_p2p_fwd_fused_attn``, ``cp_p2p_bwd_fused_attn``) and
``csrc/extensions/attention.cpp`` ``fused_attn_fwd`` (O, rng_state ``[2]`` int64, softmax
statistics ``[b, h, sq, 1]`` fp32) / ``fused_attn_bwd`` (dQ, dK, dV: three ``torch::empty`` for
sbhd_sbhd_sbhd), read by hand; Megatron-LM d98e8a6 ``megatron/training/arguments.py``
(``--cp-comm-type`` default ``["p2p"]``) and ``megatron/core/extensions/transformer_engine.py``
``TEDotProductAttention``. Every expected byte below is numel x element size (bf16 2 B, fp32 4
B, int64 8 B), written out.
"""

import dataclasses

import pytest
import torch

from modeling import load_config
from modeling.common.attention.gqa import GQA
from modeling.kernels import get_profile
from modeling.kernels.context_parallel import ring_sections, te_ring_attention
from tracemem.validation.kernel_trace import leaf, peak_of, trace_call
from tracemem import MemoryTracer
from tracemem.errors import TracememError
from tracemem.frontdoors.megatron import megatron_job_kwargs, to_megatron_args

BF16, F32, I64 = torch.bfloat16, torch.float32, torch.int64


def trace_ring(q, k, v, cp, rank):
    """Forward and backward of the ring attention traced: (forward allocations as (shape,
    dtype, category), bytes made in forward and kept after it besides the output, forward
    peak, backward allocations as (shape, dtype), backward peak above its start)."""
    t = trace_call(lambda q, k, v: te_ring_attention(q, k, v, cp, rank), [q, k, v])
    forward = [(e.shape, e.dtype, e.category.value) for e in t.allocs(t.forward)]
    backward = [(e.shape, e.dtype) for e in t.allocs(t.backward)]
    return forward, t.kept_bytes, peak_of(t.forward), backward, peak_of(t.backward), t.out


def test_ring_sections_follow_te_tiles():
    # AttnFuncWithCPAndKVP2P.forward's table for cp_size = 4 (rows: rank, columns: step)
    assert [ring_sections(4, r) for r in range(4)] == [
        ["diagonal", "upper-triangle", "upper-triangle", "upper-triangle"],
        ["diagonal", "lower-triangle", "upper-triangle", "upper-triangle"],
        ["diagonal", "lower-triangle", "lower-triangle", "upper-triangle"],
        ["diagonal", "lower-triangle", "lower-triangle", "lower-triangle"]]
    # backward: step CP-1 diagonal, i >= CP - rank - 1 lower
    assert ring_sections(2, 0, backward=True) == ["upper-triangle", "diagonal"]
    assert ring_sections(2, 1, backward=True) == ["lower-triangle", "diagonal"]


def test_gqa_ring_attention_at_cp2_last_rank():
    # this rank's s = 4 tokens (two chunks of 2), b = 1, h = 2 query heads, g = 1 KV head,
    # d = d_v = 4: q 32 el = 64 B, k 16 el = 32 B, v 32 B; kv = 16 + 16 = 32 el = 64 B
    q, k, v = leaf(1, 4, 2, 4), leaf(1, 4, 1, 4), leaf(1, 4, 1, 4)
    forward, kept, fwd_peak, backward, bwd_peak, out = trace_ring(q, k, v, cp=2, rank=1)
    assert out.shape == (1, 4, 8)  # (b, s, h * d_v)
    # rank 1 of 2: step 0 diagonal, step 1 lower-triangle (all 4 queries, first key chunk)
    assert forward == [
        ((32,), BF16, "comm_buffer"),  # p2p_comm_buffers[0] = cat(k, v): 64 B
        ((32,), BF16, "activation"),  # p2p_comm_buffers[1], received; saved as kv: 64 B
        ((1, 4, 2, 4), BF16, "temporary"), ((2,), I64, "activation"),  # step 0: O 64, rng 16
        ((1, 2, 4, 1), F32, "temporary"),  # step 0: S [b, h, 4, 1] 32 B
        ((1, 4, 2, 4), BF16, "temporary"), ((2,), I64, "activation"),  # step 1: O 64, rng 16
        ((1, 2, 4, 1), F32, "temporary"),  # step 1: S 32 B (lower-triangle: all queries)
        ((1, 2, 4), F32, "activation"),  # softmax_lse = clone(S_0).squeeze: 32 B
        ((1, 4, 2, 4), BF16, "activation")]  # out (the correction's output, returned): 64 B
    # everything lives to the end of forward: 64 + 64 + (64 + 16 + 32) * 2 + 32 + 64 = 448
    assert fwd_peak == 448
    # kept besides out: kv 64 + softmax_lse 32 + two rng states 16 * 2 = 128 B
    assert kept == 128
    assert backward == [
        ((1, 4, 2, 4), BF16),  # dq_buffer = empty_like(q): 64 B
        ((2, 32), BF16), ((2, 32), BF16),  # two [KV, dKV] ring buffers: 128 B each
        ((1, 4, 2, 4), BF16), ((1, 2, 1, 4), BF16), ((1, 2, 1, 4), BF16),  # step 0, lower:
        # dq_ 64, dk_ dv_ of the first key chunk 16 each
        ((1, 4, 2, 4), BF16), ((1, 4, 1, 4), BF16), ((1, 4, 1, 4), BF16)]  # step 1, diagonal:
    # dq_ 64, dk_ dv_ 32 each, after step 0's 96 B are freed
    # peak in step 1: dq_buffer 64 + rings 256 + 64 + 32 + 32 = 448 (step 0: 64 + 256 + 96)
    assert bwd_peak == 448
    # dk and dv are views of the last received dKV half: they hold its whole ring buffer
    assert k.grad.untyped_storage().nbytes() == 128 and \
        k.grad.untyped_storage()._cdata == v.grad.untyped_storage()._cdata
    assert q.grad.shape == q.shape and v.grad.shape == v.shape


def test_ring_attention_first_rank_attends_half_chunks_above_the_diagonal():
    # the same shapes at rank 0 of 2: forward step 1 upper-triangle (the second query chunk
    # only: O [1, 2, 2, 4] 32 B, S [1, 2, 2, 1] 16 B); backward step 0 upper-triangle and the
    # second half of softmax_lse made contiguous first ([1, 2, 2] fp32, 16 B)
    q, k, v = leaf(1, 4, 2, 4), leaf(1, 4, 1, 4), leaf(1, 4, 1, 4)
    forward, kept, fwd_peak, backward, bwd_peak, _ = trace_ring(q, k, v, cp=2, rank=0)
    assert forward[5:8] == [((1, 2, 2, 4), BF16, "temporary"), ((2,), I64, "activation"),
                            ((1, 2, 2, 1), F32, "temporary")]
    assert fwd_peak == 448 - 32 - 16  # 400
    assert kept == 128
    assert backward[:4] == [((1, 2, 2), F32), ((1, 4, 2, 4), BF16), ((2, 32), BF16),
                            ((2, 32), BF16)]
    # step 0: dq_ [1, 2, 2, 4] 32, dk_ dv_ [1, 4, 1, 4] 32 each; step 1 diagonal 64 + 32 + 32
    assert backward[4:] == [((1, 2, 2, 4), BF16), ((1, 4, 1, 4), BF16), ((1, 4, 1, 4), BF16),
                            ((1, 4, 2, 4), BF16), ((1, 4, 1, 4), BF16), ((1, 4, 1, 4), BF16)]
    assert bwd_peak == 16 + 64 + 256 + 128  # 464


def test_mla_shapes_ring_a_narrower_value_head():
    # MLA: g = h = 2 heads, d_qk 6, d_v 4, s 4: k 48 el + v 32 el = kv 80 el; out (1, 4, 2 * 4)
    q, k, v = leaf(1, 4, 2, 6), leaf(1, 4, 2, 6), leaf(1, 4, 2, 4)
    forward, kept, _, backward, _, out = trace_ring(q, k, v, cp=2, rank=1)
    assert out.shape == (1, 4, 8)
    assert forward[:3] == [((80,), BF16, "comm_buffer"), ((80,), BF16, "activation"),
                           ((1, 4, 2, 4), BF16, "temporary")]
    assert kept == 80 * 2 + 4 * 8 + 2 * 16  # kv 160, softmax_lse [1, 2, 4] 32, rng 32
    assert backward[1:3] == [((2, 80), BF16), ((2, 80), BF16)]
    assert v.grad.shape == (1, 4, 2, 4) and k.grad.shape == (1, 4, 2, 6)


def test_flash_backend_copies_to_bshd_and_keeps_flash_attn_scratch_per_step():
    # the shapes of the GQA test at rank 1 of 2 through TE's FlashAttention (flash-attn 2):
    # q, k, v copied to bshd (64 + 32 + 32 B); per step O, softmax_lse [b, h, sq] (no
    # trailing 1), rng_state; the returned output is a copy of the saved bshd out (64 B)
    q, k, v = leaf(1, 4, 2, 4), leaf(1, 4, 1, 4), leaf(1, 4, 1, 4)
    tracer = MemoryTracer(rounding=None)
    tracer.track_external(q, k, v)
    with tracer:
        out = te_ring_attention(q, k, v, 2, 1, backend="flash")
    allocs = [(e.shape, e.dtype) for e in tracer.events if e.action == "alloc"
              and e.phase.value == "forward"]
    assert allocs == [((1, 4, 2, 4), BF16), ((1, 4, 1, 4), BF16), ((1, 4, 1, 4), BF16),
                      ((32,), BF16), ((32,), BF16),
                      ((1, 4, 2, 4), BF16), ((1, 2, 4), F32), ((2,), I64),
                      ((1, 4, 2, 4), BF16), ((1, 2, 4), F32), ((2,), I64),
                      ((1, 2, 4), F32), ((1, 4, 2, 4), BF16), ((1, 4, 8), BF16)]
    # peak at the ring's end: the copies 128 B + the ring's 448 B (the fused test's)
    assert peak_of(e for e in tracer.events if e.phase.value == "forward") == 128 + 448
    out_id = tracer._live[out.untyped_storage()._cdata].sid
    kept = sum(i.nbytes for i in tracer.live_at("now")
               if i.phase.value == "forward" and i.storage_id != out_id)
    # the bshd q copy 64, kv 64, softmax_lse 32, rng 2 x 16, the ring's bshd out 64
    assert kept == 64 + 64 + 32 + 32 + 64
    grad = torch.empty(out.shape, dtype=BF16, device="meta")
    tracer.track_external(grad)
    start = len(tracer.events)
    with tracer:
        out.backward(grad)
    backward = tracer.events[start:]
    # per step, after dq_, dk_, dv_: mha_bwd's softmax_d [1, 2, 128] fp32 (1024 B), dq_accum
    # [1, 128, 2, 32] fp32 (32768 B), dk_expanded and dv_expanded [1, skv, 2, 4] (GQA)
    assert [(e.shape, e.dtype) for e in backward if e.action == "alloc"][6:10] == [
        ((1, 2, 128), F32), ((1, 128, 2, 32), F32), ((1, 2, 2, 4), BF16), ((1, 2, 2, 4), BF16)]
    # step 1 (diagonal): dq_buffer 64 + rings 256 + dq_ dk_ dv_ 128 + 1024 + 32768 + 64 + 64
    assert peak_of(backward) == 64 + 256 + 128 + 1024 + 32768 + 128


def test_ring_attention_refuses_odd_local_sequences():
    with pytest.raises(TracememError, match="even sequence length per CP rank, got 3"):
        te_ring_attention(leaf(1, 3, 2, 4), leaf(1, 3, 1, 4), leaf(1, 3, 1, 4), 2, 1)


def test_profile_option_cp_comm_type():
    assert get_profile("megatron-te").options["cp_comm_type"] == "allgather"
    assert get_profile("megatron-te", cp_comm_type="p2p").cp_ring
    with pytest.raises(TracememError, match=r"cp_comm_type='a2a' is invalid; choose one of "
                                            r"allgather, p2p"):
        get_profile("megatron-te", cp_comm_type="a2a")


def _gqa_forward_allocs(comm_type):
    cfg = dataclasses.replace(load_config("llama-tiny"), attention_dropout=0.0)
    kern = get_profile("megatron-te", cp_comm_type=comm_type)
    with torch.device("meta"):
        attn = GQA(cfg, cp=2, kernels=kern).to(BF16)
        x = torch.empty(1, 8, cfg.hidden_size, dtype=BF16, requires_grad=True)
    tracer = MemoryTracer(rounding=None)
    tracer.track_external(attn, x)
    with tracer:
        attn(x, None).sum().backward()
    return [(e.shape, e.category.value) for e in tracer.events if e.action == "alloc"]


def test_megatron_gqa_rings_keys_and_values_instead_of_gathering_them():
    # llama-tiny: 4 heads, 2 KV heads of 16; this rank's 8 tokens (CP 2 of 16)
    ring, gathered = _gqa_forward_allocs("p2p"), _gqa_forward_allocs("allgather")
    kv = 8 * 2 * 16 * 2  # k and v (1, 8, 2, 16) each: 512 elements
    assert ((kv,), "comm_buffer") in ring and ((2, kv), "comm_buffer") in ring
    # all-gathered K and V (b, S, g, d), which TE's fused attention then saves
    assert ((1, 16, 2, 16), "activation") in gathered
    assert not any(shape == (1, 16, 2, 16) for shape, _ in ring)


# ---- the Megatron-LM front door ----------------------------------------------------------
ARGS = ("--num-layers 2 --hidden-size 512 --num-attention-heads 8 --seq-length 4096 "
        "--max-position-embeddings 4096 --micro-batch-size 1 --bf16 --tokenizer-type "
        "NullTokenizer --vocab-size 32000 --context-parallel-size 2").split()


def test_megatron_context_parallel_defaults_to_ring_attention():
    # --cp-comm-type's default is ["p2p"] (arguments.py _add_distributed_args)
    assert megatron_job_kwargs(ARGS, world_size=4)["kernel_options"]["cp_comm_type"] == "p2p"
    for spelling in ("allgather", "all_gather"):  # the profile's default: left unset
        kwargs = megatron_job_kwargs(ARGS + ["--cp-comm-type", spelling], world_size=4)
        assert "cp_comm_type" not in kwargs["kernel_options"]
    same = megatron_job_kwargs(ARGS + ["--cp-comm-type", "p2p", "p2p"], world_size=4)
    assert same["kernel_options"]["cp_comm_type"] == "p2p"  # one per layer, all p2p
    cp1 = ARGS[:-1] + ["1"]  # --context-parallel-size 1: no CP attention
    assert "cp_comm_type" not in megatron_job_kwargs(cp1, world_size=4)["kernel_options"]


@pytest.mark.parametrize("types, message", [
    (["a2a"], "--cp-comm-type a2a"), (["a2a+p2p"], "--cp-comm-type a2a\\+p2p"),
    (["p2p", "a2a"], "a communication type per layer"),
    (["p2p", "p2p", "p2p"], "Length of cp_comm_type \\(3\\) should equal to the total number "
                            "of transformer layers \\(2\\)")])
def test_megatron_refuses_other_cp_comm_types_by_name(types, message):
    with pytest.raises(TracememError, match=message):
        megatron_job_kwargs(ARGS + ["--cp-comm-type", *types], world_size=4)


def test_to_megatron_args_writes_the_jobs_cp_comm_type():
    kwargs = megatron_job_kwargs(ARGS, world_size=4)
    for key in ("megatron_args", "origin"):
        kwargs.pop(key)
    out = to_megatron_args(kwargs)
    i = out.index("--context-parallel-size")
    assert out[i:i + 4] == ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]
    kwargs["kernel_options"] = {k: v for k, v in kwargs["kernel_options"].items()
                                if k != "cp_comm_type"}
    out = to_megatron_args(kwargs)
    # TE's spelling: attn_forward_func_with_cp takes "all_gather", not Megatron's "allgather"
    assert out[i:i + 4] == ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"]
