"""What a traced deepseek-tiny step makes: attention kernels, router tensors, module paths.

Reference: hand arithmetic of the tensor shapes (b, n_h, s, s) and (T, E), and the storages
the fused attention kernel keeps (output and logsumexp, aten's meta kernel for
_scaled_dot_product_efficient_attention: logsumexp padded to a multiple of 32 positions).
"""

import functools

import pytest
import torch

from modeling import load_config
from modeling.common.model import build_model
from modeling.common.routing import Balanced
from tracemem import MemoryTracer

CFG = load_config("deepseek-tiny")  # 4 heads, 8 routed experts, top-2
B, S = 2, 40


@functools.cache
def trace(attention, experts="sequential"):
    dtype = torch.bfloat16 if experts == "grouped" else torch.float32  # grouped GEMM needs bf16
    model = build_model(CFG, "meta", attention=attention, experts=experts, dtype=dtype)
    tokens = torch.zeros(B, S, dtype=torch.long, device="meta")
    tracer = MemoryTracer()
    tracer.track_external(model, tokens)
    with tracer:
        model(tokens, tokens, Balanced()).backward()
    return tracer


def allocs(tracer, shape=None, module_prefix=""):
    return [e for e in tracer.events if e.action == "alloc" and e.module.startswith(module_prefix)
            and (shape is None or e.shape == shape)]


def test_eager_attention_materialises_scores_and_saves_them():
    tracer = trace("eager")
    scores = allocs(tracer, (B, 4, S, S), "layers.0.attn")
    assert scores and any(e.category.value == "activation" for e in scores)


def test_flash_attention_keeps_output_and_logsumexp_only():
    tracer = trace("flash")
    assert not allocs(tracer, (B, 4, S, S))
    lse = allocs(tracer, (B, 4, 64), "layers.0.attn")  # ceil(40 / 32) * 32 = 64 positions
    assert [(e.dtype, e.category.value, e.nbytes) for e in lse[:1]] == \
        [(torch.float32, "activation", B * 4 * 64 * 4)]
    out = allocs(tracer, (B, 4, S, CFG.v_head_dim), "layers.0.attn")
    assert out and out[0].category.value == "activation"


def test_router_tensors_are_traced_with_their_true_shapes():
    tracer = trace("flash")
    router = allocs(tracer, (B * S, CFG.num_routed_experts), "layers.2.ffn.gate")
    assert len(router) >= 3  # logits, sigmoid scores, biased scores (and more)
    topk = allocs(tracer, (B * S, CFG.num_experts_per_tok), "layers.2.ffn.gate")
    assert any(e.dtype == torch.int64 for e in topk)


@pytest.mark.parametrize("experts", ["sequential", "grouped"])
def test_routed_tokens_reach_the_experts(experts):
    tracer = trace("flash", experts)
    slots = B * S * CFG.num_experts_per_tok  # 160 token-slots, 20 per expert when balanced
    dispatched = allocs(tracer, (slots, CFG.hidden_size), "layers.2.ffn")
    assert dispatched  # the index_select of the tokens, sorted by expert
    if experts == "sequential":
        assert allocs(tracer, (20, CFG.moe_intermediate_size), "layers.2.ffn.experts.7")


def test_grouped_experts_need_bfloat16_and_auto_picks_the_kernel():
    from modeling.common.moe import GroupedExperts
    from tracemem.errors import TracememError

    with pytest.raises(TracememError, match="--experts grouped needs bfloat16 parameters"):
        build_model(CFG, "meta", experts="grouped")  # deepseek-tiny is float32
    assert not isinstance(build_model(CFG, "meta").layers["2"].ffn.experts, GroupedExperts)
    bf16 = build_model(CFG, "meta", dtype=torch.bfloat16)
    assert isinstance(bf16.layers["2"].ffn.experts, GroupedExperts)


def test_correction_bias_is_a_buffer_not_a_gradient_or_optimizer_state():
    model = build_model(CFG, "meta")
    optimizer = torch.optim.AdamW(model.parameters())
    tracer = MemoryTracer()
    tracer.track_external(model, optimizer)
    by_module = {(info.module, info.category.value) for info in tracer.live_at("now")}
    assert ("layers.2.ffn.gate", "buffer") in by_module
    assert not any(p is model.layers["2"].ffn.gate.e_score_correction_bias
                   for group in optimizer.param_groups for p in group["params"])
