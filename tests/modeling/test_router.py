"""Router variants and the Qwen2-MoE shared-expert gate: values and what each keeps.

References, read by hand: Hugging Face transformers ``modeling_qwen3_moe.py`` /
``modeling_qwen2_moe.py`` ``*SparseMoeBlock.forward`` (softmax in fp32 over all experts, topk,
optional renormalisation, cast to the hidden dtype; ``F.sigmoid(shared_expert_gate(x)) *
shared_expert(x)``); mistral-inference ``moe.py`` ``MoeLayer.forward`` (topk of the logits,
fp32 softmax of the k, cast); Megatron-Core ``moe_utils.py``
``topk_routing_with_score_function`` and ``shared_experts.py`` ``SharedExpertMLP`` (Megatron-LM
d98e8a6); torch 2.13's ``derivatives.yaml`` for what each op saves (softmax its result, topk
its indices, div both operands, mul both operands, sigmoid its result, dtype casts nothing).
The expected allocations are written out from those, in order; bytes are numel * size.
"""

import dataclasses

import pytest
import torch

from modeling.common.moe import MoE
from modeling.common.router import Gate, RouterSpec
from modeling.common.routing import Balanced
from modeling.kernels import get_profile
from modeling.registry import load_config
from tracemem import MemoryTracer
from tracemem.errors import TracememError

BF16, F32, I64 = torch.bfloat16, torch.float32, torch.int64
CFG = load_config("deepseek-tiny")  # h = 64
T, E, K = 6, 8, 2
QWEN3 = RouterSpec(E, K, "softmax", pre_softmax=True, norm_topk_prob=True)
QWEN2 = RouterSpec(E, K, "softmax", pre_softmax=True, norm_topk_prob=False)
MIXTRAL = RouterSpec(E, K, "softmax", pre_softmax=False)


def _gate(spec, device="meta", dtype=BF16):
    with torch.device(device):
        gate = Gate(CFG, spec)
    return gate.to(dtype)


def test_values_are_the_references_on_real_tensors():
    torch.manual_seed(0)
    x = torch.randn(T, 64)
    for spec in (QWEN3, QWEN2, MIXTRAL):
        gate = _gate(spec, "cpu", F32)
        torch.nn.init.normal_(gate.weight)
        weights, ids = gate(x)
        logits = x @ gate.weight.T
        probs = logits.softmax(-1)
        top, top_ids = probs.topk(K)
        assert torch.equal(ids, top_ids)  # every variant picks the k largest logits
        if spec is QWEN2:  # Qwen1.5-MoE: softmax over all, no renormalisation
            torch.testing.assert_close(weights, top)
        else:  # Qwen3 (renormalised) and Mixtral (softmax of the k logits) agree
            torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))
            torch.testing.assert_close(weights, logits.topk(K)[0].softmax(-1))


def _traced(fn, inputs, externals):
    """Forward of ``fn`` traced: its allocations (shape, dtype) in order, and what it keeps
    besides its outputs, sorted."""
    tracer = MemoryTracer(rounding=None)
    tracer.track_external(*inputs, *externals)
    with tracer:
        outputs = fn(*inputs)
    allocs = [(e.shape, e.dtype) for e in tracer.events
              if e.action == "alloc" and e.category.value not in ("input", "parameter")]
    out_ids = {tracer._live[o.untyped_storage()._cdata].sid for o in outputs}
    kept = sorted(((i.shape, i.dtype) for i in tracer.live_at("now")
                   if i.phase.value == "forward" and i.storage_id not in out_ids), key=str)
    return allocs, kept


# (spec, profile, forward allocations, kept besides the weights and ids). softmax(dtype=fp32)
# of a bf16 tensor is a cast copy, then the softmax (aten/src/ATen/native/SoftMax.cpp
# ``softmax``: only fp16 on CUDA fuses the cast).
ROUTERS = [
    # Hugging Face Qwen3-MoE: logits, cast, softmax, topk, sum, div, cast
    (QWEN3, "eager", [((T, E), BF16), ((T, E), F32), ((T, E), F32), ((T, K), F32),
                      ((T, K), I64), ((T, 1), F32), ((T, K), F32), ((T, K), BF16)],
     [((T, 1), F32), ((T, K), F32), ((T, E), F32)]),
    # Qwen1.5-MoE: no renormalisation; the topk values die after the cast
    (QWEN2, "eager", [((T, E), BF16), ((T, E), F32), ((T, E), F32), ((T, K), F32),
                      ((T, K), I64), ((T, K), BF16)],
     [((T, E), F32)]),
    # Mixtral: topk of the bf16 logits, cast and softmax of the k (kept), cast back
    (MIXTRAL, "eager", [((T, E), BF16), ((T, K), BF16), ((T, K), I64), ((T, K), F32),
                        ((T, K), F32), ((T, K), BF16)],
     [((T, K), F32)]),
    # Megatron, use_pre_softmax False (Qwen3 and Mixtral alike): fp32 logits, topk, softmax
    (QWEN3, "megatron-te", [((T, E), F32), ((T, K), F32), ((T, K), I64), ((T, K), F32)], []),
    (MIXTRAL, "megatron-te", [((T, E), F32), ((T, K), F32), ((T, K), I64), ((T, K), F32)], []),
    # Megatron, use_pre_softmax True (Qwen1.5-MoE): fp32 logits, softmax (kept), topk
    (QWEN2, "megatron-te", [((T, E), F32), ((T, E), F32), ((T, K), F32), ((T, K), I64)],
     [((T, E), F32)]),
]


@pytest.mark.parametrize("spec, profile, allocs, kept", ROUTERS,
                         ids=[f"{s.pre_softmax}-{s.norm_topk_prob}-{p}" for s, p, *_ in ROUTERS])
def test_router_allocations_and_saved_tensors(spec, profile, allocs, kept):
    gate = _gate(spec)
    x = torch.empty(T, 64, dtype=BF16, device="meta", requires_grad=True)
    kernels = get_profile(profile)
    got_allocs, got_kept = _traced(lambda x: gate(x, kernels), [x], [gate])
    assert got_allocs == allocs
    assert got_kept == sorted(kept, key=str)


def test_torch_profile_routes_as_eager():
    gate = _gate(MIXTRAL)
    x = torch.empty(T, 64, dtype=BF16, device="meta", requires_grad=True)
    assert _traced(lambda x: gate(x, get_profile("torch")), [x], [gate]) == \
        _traced(lambda x: gate(x), [x], [gate])


def test_bad_router_specs_are_one_line_errors():
    with pytest.raises(TracememError, match=r"router top_k=9 is invalid; it must be in 1..8"):
        RouterSpec(8, 9)
    with pytest.raises(TracememError, match=r"scoring_func='relu' is invalid"):
        RouterSpec(8, 2, "relu")
    with pytest.raises(TracememError, match=r"a shared-expert gate needs shared experts"):
        MoE(dataclasses.replace(CFG, num_shared_experts=0), shared_expert_gate=True)


# ------------------------------------------------------------------ the shared-expert gate
B, S, H = 2, 4, 64


def _moe(gate, profile="eager", device="meta", dtype=BF16, **kwargs):
    with torch.device(device):
        moe = MoE(CFG, "sequential", shared_expert_gate=gate, kernels=get_profile(profile),
                  **kwargs)
    return moe.to(dtype)


def test_shared_expert_gate_scales_the_shared_output_by_a_sigmoid():
    torch.manual_seed(0)
    moe = _moe(True, device="cpu", dtype=F32)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    torch.nn.init.zeros_(moe.shared_expert_gate.weight)  # sigmoid(0) = 1/2 for every token
    x = torch.randn(B, S, H)
    gated = moe(x, Balanced())
    moe.shared_expert_gate = None
    ungated = moe(x, Balanced())
    torch.testing.assert_close(ungated - gated, moe.shared_experts(x) / 2)


@pytest.mark.parametrize("profile, options", [("eager", {}), ("torch", {}),
                                              ("megatron-te", {}),
                                              ("megatron-te",
                                               {"moe_shared_expert_overlap": False})])
def test_shared_expert_gate_keeps_the_shared_output_and_its_score(profile, options):
    # mul saves both operands: the shared experts' output (B, S, H) and the score (B, S, 1)
    # (which sigmoid saves too: the same storage); the (B, S, 1) logits die
    kept = []
    for gate in (False, True):
        with torch.device("meta"):
            moe = MoE(CFG, "sequential", shared_expert_gate=gate,
                      kernels=get_profile(profile, **options)).to(BF16)
        x = torch.empty(B, S, H, dtype=BF16, device="meta", requires_grad=True)
        tracer = MemoryTracer(rounding=None)
        tracer.track_external(x, moe)
        with tracer:
            y = moe(x, Balanced())
        kept.append(tracer.current_bytes - tracer.baseline_bytes - y.numel() * 2)
    assert kept[1] - kept[0] == B * S * H * 2 + B * S * 1 * 2
    assert sum(p.numel() for p in moe.shared_expert_gate.parameters()) == H  # (1, h), no bias
