"""Communication buffers of one rank: what SP, EP, ETP and CP allocate, forward and backward.

Reference: hand arithmetic of the buffer shapes for deepseek-tiny (h 64, 4 heads, q_lora 48,
kv_lora 32, RoPE 8, 8 experts of width 32, top-2) at b = 2, s = 32 in bfloat16, and the
collectives' definitions (Megatron-Core tensor_parallel/mappings.py and moe/token_dispatcher.py:
an all-gather's backward is a reduce-scatter, an all-to-all's backward the reverse all-to-all).
"""

import torch

from modeling import load_config
from modeling.parallel.build import build_rank
from modeling.common.routing import Balanced
from tracemem import MemoryTracer
from tracemem.parallel import ParallelConfig

CFG = load_config("deepseek-tiny")
B, S = 2, 32


def trace(**layout):
    par = ParallelConfig.create(CFG, **layout)
    model = build_rank(CFG, par, rank=0, dtype=torch.bfloat16)
    tokens = torch.zeros(B, S // par.cp, dtype=torch.long, device="meta")
    tracer = MemoryTracer()
    tracer.track_external(model, tokens)
    with tracer:
        model(tokens, tokens, Balanced()).backward()
    return tracer


def comm(tracer, module, phase, category="comm_buffer"):
    """Allocations of ``category``: a received buffer that is saved for backward is an
    ``activation``, one that is not stays a ``comm_buffer``."""
    return sorted((e.shape, e.nbytes) for e in tracer.events if e.action == "alloc"
                  and e.category.value == category and e.module == module
                  and e.phase.value == phase)


def shapes(allocs):
    return [shape for shape, _ in allocs]


def test_sequence_parallel_attention_gathers_the_latents_and_scatters_the_output():
    tracer = trace(world_size=2, tp=2, sp=True)
    # wo's output reduce-scattered to s / 2, and the RoPE key gathered to s (RoPE's products
    # save cos / sin, not it): communication buffers, not kept for backward
    assert comm(tracer, "layers.0.attn", "forward") == [
        ((2, 16, 64), 2 * 16 * 64 * 2), ((2, 32, 8), 2 * 32 * 8 * 2)]
    # the gathered q and kv latents are saved by the up projections: activations
    saved = comm(tracer, "layers.0.attn", "forward", "activation")
    for shape in [(2, 32, 48), (2, 32, 32)]:
        assert (shape, 2 * 32 * shape[-1] * 2) in saved  # bf16
    # backward: each gather's gradient is reduce-scattered, the scatter's gathered
    assert sorted(shape for shape, _ in comm(tracer, "layers.0.attn", "backward")) == [
        (2, 16, 8), (2, 16, 32), (2, 16, 48), (2, 32, 64)]


def test_sequence_parallel_dense_mlp_gathers_its_input():
    tracer = trace(world_size=2, tp=2, sp=True)
    assert comm(tracer, "layers.0.ffn", "forward") == [((2, 16, 64), 4096)]  # output scattered
    assert ((2, 32, 64), 8192) in comm(tracer, "layers.0.ffn", "forward", "activation")


def test_expert_parallel_all_to_all_carries_the_token_slots():
    # 64 local tokens * top-2 = 128 slots; balanced over 8 experts, 16 each; EP rank 0 holds
    # experts 0-1 and receives 4 peers * 32 = 128 rows of h = 64 (bf16: 16,384 B) each way
    tracer = trace(world_size=4, ep=4)
    # both all-to-all outputs are saved (by the experts' GEMM and by the gate-weight product)
    forward = comm(tracer, "layers.2.ffn", "forward", "activation")
    assert forward.count(((128, 64), 16384)) >= 2
    assert comm(tracer, "layers.2.ffn", "backward") == [((128, 64), 16384)] * 2


def test_expert_tensor_parallel_gathers_tokens_across_the_etp_group():
    tracer = trace(world_size=4, ep=2, etp=2)
    # EP 2: experts 0-3 receive 2 * 64 = 128 rows; ETP 2 gathers them to 256 (saved by the
    # experts) and reduce-scatters the experts' output back to 128 (sent on, not kept)
    assert ((256, 64), 32768) in comm(tracer, "layers.2.ffn", "forward", "activation")
    assert ((128, 64), 16384) in comm(tracer, "layers.2.ffn", "forward")
    assert ((256, 64), 32768) in comm(tracer, "layers.2.ffn", "backward")


def test_context_parallel_gathers_keys_and_values():
    tracer = trace(world_size=2, cp=2)
    # (b, n_h, s, d): keys 16 + 8 = 24 wide, values 16, gathered from s / 2 = 16 to 32, saved
    # by the attention kernel
    saved = comm(tracer, "layers.0.attn", "forward", "activation")
    assert ((2, 4, 32, 16), 2 * 4 * 32 * 16 * 2) in saved
    assert ((2, 4, 32, 24), 2 * 4 * 32 * 24 * 2) in saved
    assert sorted(shapes(comm(tracer, "layers.0.attn", "backward"))) == [
        (2, 4, 16, 16), (2, 4, 16, 24)]  # their gradients reduce-scattered back
