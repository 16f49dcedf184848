"""Every ``--recompute-modules`` value of Megatron-Core (Megatron-LM d98e8a6,
megatron/core/transformer/transformer_config.py ``recompute_modules``), full recompute and
``--distribute-saved-activations``, each with Megatron's own mechanism
(modeling/common/checkpoint.py), by hand on a tiny model: what each keeps from forward to
backward, what it discards, and that backward allocates the discarded tensors again.

Reference: Megatron-Core's source (cited per test) and hand arithmetic. The model:
deepseek-tiny with 3 layers (layer 0 dense, layers 1 and 2 MoE), bf16, megatron-te kernels,
one rank (TP 1, EP 1), b = 1, s = 16 tokens: h = 64, 4 heads, q LoRA 48, kv LoRA 32, qk head
16 + 8 (RoPE) = 24, v head 16, dense FFN 128 (fc1 2 x 128 = 256), 8 routed experts top-2 of
width 32 (fc1 64), one shared expert of width 32. Routed rows R = 16 tokens x top-2 = 32.
"""

from collections import Counter

import pytest
import torch

from modeling.common.routing import Balanced
from modeling.kernels import get_profile
from modeling.parallel import build_rank
from modeling.parallel.pp import recv_backward, recv_forward
from tracemem.categories import Phase
from tracemem.errors import TracememError
from tracemem.oracle.compare import oracle_model_config
from tracemem.parallel import ParallelConfig
from tracemem.tracer import MemoryTracer

S, H = 16, 64
BF16, FP32 = "bfloat16", "float32"


def _trace(recompute="none", modules=(), distribute=False, overlap=True, experts="grouped",
           kernels="megatron-te", **layout):
    """Forward then backward of the 3 decoder layers on a received input (a middle pipeline
    stage); the tracer and the index of the forward's last event."""
    cfg = oracle_model_config()
    layout = {"world_size": 1, **layout}
    par = ParallelConfig.create(cfg, **layout)
    options = {"moe_shared_expert_overlap": overlap} if kernels == "megatron-te" else {}
    model = build_rank(cfg, par, 0, dtype=torch.bfloat16, experts=experts,
                       kernels=get_profile(kernels, **options))
    for block in model.layers.values():
        block.set_recompute(recompute, frozenset(modules), distribute)
    tracer = MemoryTracer(rounding=None, devices={"meta"})
    tracer.track_external(model)
    local = S // (par.tp if par.sp else 1)
    with tracer:
        x = recv_forward((1, local, H), torch.bfloat16)
        out = x
        for i in range(cfg.num_layers):
            out = model.layers[str(i)](out, Balanced())
        end = len(tracer.events) - 1
        out.backward(recv_backward(tuple(out.shape), torch.bfloat16))
        del out, x
    return tracer, end


def _kept(tracer, end, layer):
    """(bytes, dtype, shape) of each storage layer ``layer`` made in forward and still holds
    when the forward ends."""
    prefix = f"layers.{layer}"
    return Counter((i.nbytes, str(i.dtype).removeprefix("torch."), i.shape)
                   for i in tracer.live_at(end) if i.phase is Phase.FORWARD
                   and (i.module == prefix or i.module.startswith(prefix + ".")))


def _backward_allocs(tracer, end):
    return Counter((e.nbytes, str(e.dtype).removeprefix("torch."), e.shape)
                   for e in tracer.events[end + 1:] if e.action == "alloc")


@pytest.fixture(scope="module")
def none():
    return _trace()


def _compare(none, recompute, modules=(), **kw):
    """Per layer: the storages ``none`` keeps and the recompute does not, and the reverse;
    the storages backward allocates beyond ``none``'s."""
    t0, e0 = none
    t1, e1 = _trace(recompute, modules, **kw)
    per_layer = {}
    for layer in range(3):
        k0, k1 = _kept(t0, e0, layer), _kept(t1, e1, layer)
        per_layer[layer] = (k0 - k1, k1 - k0)
    return per_layer, _backward_allocs(t1, e1) - _backward_allocs(t0, e0)


def _assert_recomputed(dropped: Counter, more: Counter) -> None:
    """Each discarded storage is made again in backward (the recompute)."""
    assert not dropped - more, f"discarded but not recomputed: {dropped - more}"


# --- per module -------------------------------------------------------------------------
def test_core_attn_keeps_qkv_and_recomputes_the_softmax_statistics(none):
    """transformer/attention.py ``_checkpointed_attention_forward``: reentrant
    ``tensor_parallel.checkpoint`` over core attention. It keeps its inputs q, k, v (kept
    anyway: without recompute the fused attention saves the same storages) and its output is
    linear_proj's saved input: only the attention's own saved state goes, the softmax
    statistics [b, n, s, 1] fp32 = 4 x 16 x 4 = 256 B and the RNG state 2 x int64 = 16 B."""
    layers, more = _compare(none, "selective", ("core_attn",))
    for layer in range(3):
        dropped, added = layers[layer]
        assert dropped == Counter({(256, FP32, (1, 4, S, 1)): 1, (16, "int64", (2,)): 1})
        assert not added
    _assert_recomputed(layers[1][0], more)


def test_mla_up_proj_discards_query_key_value_after_core_attention(none):
    """transformer/multi_latent_attention.py ``get_query_key_value_tensors``: the up
    projections and RoPE under ``CheckpointWithoutOutput``, their outputs freed once core
    attention has saved them (``discard_output_and_register_recompute(core_attn_out)``).
    Gone: query and key [1, 16, 4, 24] bf16 = 16 x 4 x 24 x 2 = 3,072 B each, value
    [1, 16, 4, 16] = 2,048 B; what the up projections saved under grad: q's normed latent
    [16, 48] bf16 1,536 B, kv's contiguous input and normed latent [16, 32] 1,024 B each, both
    rstd [16] fp32 64 B, the RoPE cos / sin of q and k 4 x [16, 1, 8] bf16 256 B: 12,928 B.
    Kept instead: the checkpoint's input kv_compressed is a split view of linear_kv_down_proj's
    output, so that whole [16, 40] bf16 = 1,280 B stays (without recompute only the contiguous
    copy stays)."""
    layers, more = _compare(none, "selective", ("mla_up_proj",))
    for layer in range(3):
        dropped, added = layers[layer]
        assert dropped == Counter({
            (3072, BF16, (1, S, 4, 24)): 2, (2048, BF16, (1, S, 4, 16)): 1,
            (1536, BF16, (1, S, 48)): 1, (1024, BF16, (1, S, 32)): 2,
            (64, FP32, (1, S)): 2, (256, BF16, (1, S, 1, 8)): 4})
        assert sum(n * c for (n, _, _), c in dropped.items()) == 12_928
        assert added == Counter({(1280, BF16, (1, S, 40)): 1})
    _assert_recomputed(layers[1][0], more)


def test_layernorm_discards_the_separate_norm_outputs(none):
    """transformer_layer.py ``_run_input_layernorm`` / ``_forward_pre_mlp_layernorm``: the
    norm under ``CheckpointWithoutOutput``, its output [1, 16, 64] bf16 = 2,048 B freed after
    the attention (or MoE) has saved it, its rstd [16] fp32 = 64 B not saved (no_grad). MLA's
    input norm is a separate TENorm on every layer; the pre-MLP norm is separate on the MoE
    layers only (the dense MLP fuses it into fc1, ``IdentityOp`` in the spec)."""
    layers, more = _compare(none, "selective", ("layernorm",))
    norm = Counter({(2048, BF16, (1, S, H)): 1, (64, FP32, (1, S)): 1})
    assert layers[0] == (norm, Counter())
    for layer in (1, 2):
        assert layers[layer] == (norm + norm, Counter())
    _assert_recomputed(layers[1][0], more)


def test_mlp_recomputes_the_dense_mlp_whole(none):
    """transformer_layer.py ``_run_mlp``: reentrant ``tensor_parallel.checkpoint`` over the
    dense MLP (its fused pre-MLP norm included). Gone on the dense layer: fc1's output
    [1, 16, 256] bf16 = 8,192 B, the SwiGLU output [1, 16, 128] = 4,096 B, fc1's normed input
    [1, 16, 64] = 2,048 B and rstd 64 B: 14,400 B. The MoE layers are not "mlp"."""
    layers, more = _compare(none, "selective", ("mlp",))
    assert layers[0] == (Counter({(8192, BF16, (1, S, 256)): 1, (4096, BF16, (1, S, 128)): 1,
                                  (2048, BF16, (1, S, H)): 1, (64, FP32, (1, S)): 1}),
                         Counter())
    assert layers[1] == layers[2] == (Counter(), Counter())
    _assert_recomputed(layers[0][0], more)


def test_moe_recomputes_the_moe_layer_whole(none):
    """moe_layer.py ``MoELayer.forward``: reentrant ``tensor_parallel.checkpoint`` over the
    MoE layer (router, dispatch, experts, shared experts, combine). Everything it saved goes
    (15,744 B): the sorted tokens [32, 64] bf16 4,096 B, grouped fc1's output [32, 64] 4,096 B,
    fc2's input [32, 32] 2,048 B, the shared expert's fc1 output [1, 16, 64] 2,048 B and SwiGLU
    output [1, 16, 32] 1,024 B, the row-id map [16, 17] int32 1,088 B, the router's scores
    [16, 8] fp32 512 B, top-k indices [16, 2] int64 256 B and gathered scores [16, 2] fp32
    128 B, the sort's two row maps [32] int32 128 B each, the sorted probabilities [32] fp32
    128 B, the score sum [16, 1] fp32 64 B."""
    layers, more = _compare(none, "selective", ("moe",))
    assert layers[0] == (Counter(), Counter())
    for layer in (1, 2):
        dropped, added = layers[layer]
        assert dropped == Counter({
            (4096, BF16, (32, H)): 2, (2048, BF16, (32, 32)): 1, (2048, BF16, (1, S, 64)): 1,
            (1024, BF16, (1, S, 32)): 1, (1088, "int32", (S, 17)): 1,
            (512, FP32, (S, 8)): 1, (256, "int64", (S, 2)): 1, (128, FP32, (S, 2)): 1,
            (128, "int32", (32,)): 2, (128, FP32, (32,)): 1, (64, FP32, (S, 1)): 1})
        assert sum(n * c for (n, _, _), c in dropped.items()) == 15_744
        assert not added
    _assert_recomputed(layers[1][0], more)


def test_moe_act_discards_fc2s_input(none):
    """moe/experts.py ``TEGroupedMLP.forward``: the weighted SwiGLU under
    ``CheckpointWithoutOutput`` (its inputs, fc1's output [32, 64] and the probabilities
    [32, 1], are kept, as they are without recompute); its output, fc2's input [R, f] =
    [32, 32] bf16 = 2,048 B, is freed once fc2 has saved it and recomputed when fc2's output
    gradient arrives."""
    layers, more = _compare(none, "selective", ("moe_act",))
    assert layers[0] == (Counter(), Counter())
    for layer in (1, 2):
        assert layers[layer] == (Counter({(2048, BF16, (32, 32)): 1}), Counter())
    _assert_recomputed(layers[1][0], more)


def test_shared_experts_recompute_the_shared_expert_whole(none):
    """moe_layer.py ``MoELayer.shared_experts_compute``: reentrant ``tensor_parallel.
    checkpoint`` over the shared experts (only without ``--moe-shared-expert-overlap``).
    Gone: their fc1 output [1, 16, 2 x 32] bf16 = 2,048 B and SwiGLU output [1, 16, 32] =
    1,024 B; their input is the pre-MLP norm's output, kept by the router anyway."""
    base = _trace(overlap=False)
    layers, more = _compare(base, "selective", ("shared_experts",), overlap=False)
    assert layers[0] == (Counter(), Counter())
    for layer in (1, 2):
        assert layers[layer] == (Counter({(2048, BF16, (1, S, 64)): 1,
                                          (1024, BF16, (1, S, 32)): 1}), Counter())
    _assert_recomputed(layers[1][0], more)


def test_full_recompute_keeps_one_input_per_layer(none):
    """megatron/core/recompute.py ``checkpointed_forward`` (uniform, 1 layer): each layer under
    reentrant ``tensor_parallel.checkpoint`` keeps only its input, the previous layer's output
    [1, 16, 64] bf16 = 2,048 B (layer 0's input is the received tensor, made outside the
    layers; layer 2's output is the stage's output)."""
    t1, e1 = _trace("full")
    for layer in range(3):
        assert _kept(t1, e1, layer) == Counter({(2048, BF16, (1, S, H)): 1})


def test_distribute_saved_activations_keeps_a_tp_share_of_each_input():
    """``--distribute-saved-activations`` with TP 2 (no SP): ``CheckpointFunction.forward``
    keeps ``split_tensor_into_1d_equal_chunks(input, new_buffer=True)``, 1-D [16 x 64 / 2 =
    512] bf16 = 1,024 B, and releases the full [1, 16, 64] = 2,048 B input; backward gathers it
    back (``gather_split_1d_tensor``). Layers 0 and 1 split the inputs of layers 1 and 2
    (made by layers 0 and 1) and layer 0 the received input: at the forward's end 3 x 1,024 B
    less than without it."""
    t0, e0 = _trace("full", tp=2, world_size=2)
    t1, e1 = _trace("full", distribute=True, tp=2, world_size=2)
    for layer in (0, 1):
        assert _kept(t0, e0, layer) == Counter({(2048, BF16, (1, S, H)): 1})
    assert _kept(t1, e1, 0) == Counter({(1024, BF16, (512,)): 1})
    assert _kept(t1, e1, 1) == Counter({(1024, BF16, (512,)): 1})
    # layer 2 keeps its split input (1-D, made in layer 2's checkpoint) and makes the output
    assert _kept(t1, e1, 2) == Counter({(1024, BF16, (512,)): 1, (2048, BF16, (1, S, H)): 1})
    assert t0.events[e0].total_bytes - t1.events[e1].total_bytes == 3 * 1024
    # every input is gathered back: both traces end with nothing alive but the externals
    assert t1.events[-1].total_bytes == t0.events[-1].total_bytes


# --- refusals ----------------------------------------------------------------------------
def _block(**kw):
    cfg = oracle_model_config()
    par = ParallelConfig.create(cfg, **{"world_size": 1, **kw.pop("layout", {})})
    model = build_rank(cfg, par, 0, dtype=torch.bfloat16, **kw)
    return model.layers["1"]


@pytest.mark.parametrize("kw, args, message", [
    (dict(experts="sequential", kernels=get_profile("megatron-te")),
     ("selective", frozenset({"moe_act"})),
     r"^moe_act in recompute_modules is only supported with moe_grouped_gemm"),
    (dict(kernels=get_profile("megatron-te")), ("selective", frozenset({"shared_experts"})),
     r"^shared_experts recompute cannot work with --moe-shared-expert-overlap\. \(Megatron's "
     r"rule: add --no-moe-shared-expert-overlap\)$"),
    (dict(kernels=get_profile("megatron-te"), layout=dict(world_size=2, tp=2, sp=True)),
     ("full", frozenset(), True),
     r"^Megatron-LM refuses this job: distribute_saved_activations: True must be false when "
     r"sequence parallel is enabled"),
    (dict(kernels=get_profile("megatron-te")), ("selective", frozenset({"core_attn"}), True),
     r"^--distribute-saved-activations applies to --recompute full"),
    (dict(kernels=get_profile("eager")), ("full", frozenset(), True),
     r"^--distribute-saved-activations is Megatron's checkpoint and needs --kernels "
     r"megatron-te"),
    (dict(), ("selective", frozenset({"gdn_norm_out"})),
     r"^--recompute-modules gdn_norm_out is invalid; choose from core_attn, mla_up_proj, "
     r"layernorm, mlp, moe, moe_act, shared_experts, op$"),
])
def test_refused_recompute(kw, args, message):
    block = _block(**kw)
    with pytest.raises(TracememError, match=message):
        block.set_recompute(*args)


def test_eager_moe_act_discards_the_swiglu_product():
    """Under the eager profile (torch's grouped GEMMs, unfused SwiGLU) ``moe_act`` keeps the
    two GEMM outputs w1 x and w3 x (the checkpoint's inputs, [32, 32] bf16 each, which silu
    and the product save anyway) and discards what the unfused activation saved beyond them:
    silu(w1 x), the product's saved input, and the product, w2's input, [32, 32] bf16 =
    2,048 B each per MoE layer."""
    t0, e0 = _trace(kernels="eager")
    t1, e1 = _trace("selective", ("moe_act",), kernels="eager")
    for layer in (1, 2):
        assert _kept(t0, e0, layer) - _kept(t1, e1, layer) \
            == Counter({(2048, BF16, (32, 32)): 2})
