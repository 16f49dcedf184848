"""Megatron's ``--attention-backend local`` attention with hidden and attention dropout, and its
unfused vocab-parallel cross entropy, under megatron-te against Megatron-Core's own code.

Reference: megatron-core 0.16.1 (the `megatron` extra), whose ``DotProductAttention``,
``fusions/fused_softmax.py`` torch fallback and ``tensor_parallel/cross_entropy.py`` read the
same as Megatron-LM d98e8a6 (diffed: only import lines differ), traced on meta under a fake
process group (tracemem.oracle): its TransformerLayer built from the TE layer spec with
``core_attention=DotProductAttention`` (what megatron/training/models/gpt.py does for ``local``),
``masked_softmax_fusion=False`` (the fused kernel is Apex's CUDA extension) and
``bias_dropout_fusion=False`` (its torch.compile does not trace meta tensors), against
tracemem's ``build_rank`` with ``attention="local"``. On meta ``F.dropout`` takes aten's CPU
path (a noise tensor); on CUDA it runs ``native_dropout`` (a bool mask): both sides run CUDA's
(``modeling.kernels.dropout.native_dropout``), so what a layer keeps and its peaks depend only
on the orchestration and must be equal to the byte.
"""

import dataclasses
import warnings

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed: "
                                            "pip install 'tracemem[megatron]' (make test does)")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from modeling import load_config  # noqa: E402
from modeling.common.routing import Balanced  # noqa: E402
from modeling.kernels import get_profile  # noqa: E402
from modeling.kernels.dropout import native_dropout  # noqa: E402
from modeling.kernels.loss import _VocabParallelCrossEntropy  # noqa: E402
from tracemem import MemoryTracer  # noqa: E402
from tracemem.oracle import compare  # noqa: E402
from tracemem.oracle import megatron_patches as patches  # noqa: E402
from tracemem.oracle.megatron_spec import TENorm, TracememSpecProvider  # noqa: E402

DROPOUT = 0.1


@pytest.fixture
def cuda_dropout(monkeypatch):
    """``F.dropout`` as on CUDA (nn.Dropout and bias_dropout_add call it by attribute)."""
    monkeypatch.setattr(F, "dropout", lambda x, p=0.5, training=True, inplace=False:
                        native_dropout(x, p, training))


def _run_megatron(cfg, case):
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    with warnings.catch_warnings(), patches.fake_process_groups(
            world_size=case.world_size, tp=case.tp, ep=1, etp=1), patches.applied():
        warnings.simplefilter("ignore")
        config = TransformerConfig(
            num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads,
            num_query_groups=cfg.num_key_value_heads, kv_channels=cfg.head_dim,
            ffn_hidden_size=cfg.intermediate_size, tensor_model_parallel_size=case.tp,
            sequence_parallel=case.sp, normalization="RMSNorm",
            layernorm_epsilon=cfg.rms_norm_eps, add_bias_linear=False, add_qkv_bias=False,
            gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=True,
            bf16=True, params_dtype=torch.bfloat16, perform_initialization=False,
            use_cpu_initialization=True, hidden_dropout=DROPOUT, attention_dropout=DROPOUT,
            bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
            persist_layer_norm=False, gradient_accumulation_fusion=False)
        backend = TracememSpecProvider()
        layer = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            self_attention=ModuleSpec(
                module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=backend.column_parallel_layer_norm_linear(),
                    core_attention=DotProductAttention,
                    linear_proj=backend.row_parallel_linear(), q_layernorm=IdentityOp,
                    k_layernorm=IdentityOp)),
            self_attn_bda=get_bias_dropout_add, pre_mlp_layernorm=IdentityOp,
            mlp=get_mlp_module_spec_for_backend(backend=backend, num_experts=None,
                                                moe_grouped_gemm=True),
            mlp_bda=get_bias_dropout_add))
        block = TransformerBlockSubmodules(layer_specs=[layer] * cfg.num_layers,
                                           layer_norm=TENorm)
        with torch.device("meta"):
            model = GPTModel(config, block, vocab_size=cfg.vocab_size,
                             max_sequence_length=cfg.max_position_embeddings,
                             pre_process=False, post_process=False,
                             position_embedding_type="rope", rotary_base=int(cfg.rope_theta))

        def run(x):
            model.set_input_tensor(x)
            return model(input_ids=None, position_ids=None, attention_mask=None)

        local = case.seq_length // (case.tp if case.sp else 1)
        return compare._trace(model, run, (local, 1, cfg.hidden_size),
                              compare._layer_index("decoder.layers."),
                              compare._layer_index("decoder.layers."))


def _run_tracemem(cfg, case):
    from modeling.parallel import build_rank
    from tracemem.parallel import ParallelConfig

    par = ParallelConfig.create(cfg, world_size=case.world_size, tp=case.tp, sp=case.sp)
    model = build_rank(cfg, par, 0, dtype=torch.bfloat16, attention="local",
                       kernels=get_profile("megatron-te", masked_softmax_fusion=False))
    layers = [model.layers[str(i)] for i in range(cfg.num_layers)]

    def run(x):
        for layer in layers:
            x = layer(x, Balanced())
        return x

    local = case.seq_length // (case.tp if case.sp else 1)
    return compare._trace(model, run, (1, local, cfg.hidden_size), compare._layer_index("layers."),
                          compare._layer_index("layers."))


@pytest.mark.parametrize("case", [compare.OracleCase(), compare.OracleCase(tp=2, sp=True)],
                         ids=lambda c: c.name)
def test_local_attention_and_dropout_layers_keep_and_peak_as_megatron_core_does(
        cuda_dropout, case):
    cfg = dataclasses.replace(load_config("llama-tiny"), num_layers=2, dtype="bfloat16",
                              hidden_dropout=DROPOUT, attention_dropout=DROPOUT)
    megatron, tracemem = _run_megatron(cfg, case), _run_tracemem(cfg, case)
    assert sorted(megatron) == sorted(tracemem) == [0, 1]
    heads = cfg.num_attention_heads // case.tp
    scores = heads * case.seq_length ** 2  # [b * n, s, s] elements on this rank, b = 1
    # Two named differences. (1) Megatron's score buffer comes from the global memory buffer
    # (utils.py GlobalMemoryBuffer.get_tensor): allocated by layer 0, reused by layer 1, never
    # freed; tracemem traces it as a temporary (docs/kernels.md). (2) The torch fallback's
    # softmax runs in a torch.nn.Softmax made inside FusedScaleMaskSoftmax.forward_torch_softmax,
    # a module outside the model, so the tracer files its fp32 output under "Softmax", not
    # under the layer (it is kept all the same).
    buffer = (scores * 2, "bfloat16")
    softmax = (scores * 4, "float32")
    for layer in (0, 1):
        m, t = megatron[layer], tracemem[layer]
        assert (m.backward_peak, m.params) == (t.backward_peak, t.params)
        assert m.forward_peak - t.forward_peak == (buffer[0] if layer == 0 else 0)
        mine = sorted(s[:2] for s in t.kept_storages)
        theirs = [s[:2] for s in m.kept_storages if not (layer == 0 and s[4] ==
                                                          "aten::empty.memory_format"
                                                          and s[:2] == buffer)]
        assert len(theirs) == len(m.kept_storages) - (layer == 0)
        assert sorted(theirs + [softmax]) == mine
    # by hand, at TP 1 (s 16, b 1, h 64, 4 heads): the bool masks tracemem keeps per layer:
    # two bias-dropout-add masks [s, h], the attention-dropout mask [b, n, s, s], the causal
    # mask [s, s] (masked_fill_ saves it)
    if case.tp == 1:
        bools = sum(s[0] for s in tracemem[0].kept_storages if s[1] == "bool")
        assert bools == 2 * 16 * 64 + 4 * 16 * 16 + 16 * 16 == 3_328


def _allocations(fn, shape=(4, 2, 10)):
    """(bytes, dtype, op) of each allocation of ``fn(logits, target)``'s forward and backward
    on fresh meta inputs (logits [s, b, V / TP] bf16, target [s, b])."""
    logits = torch.empty(shape, dtype=torch.bfloat16, device="meta", requires_grad=True)
    target = torch.zeros(shape[:2], dtype=torch.long, device="meta")
    tracer = MemoryTracer(rounding=None)
    tracer.track_external(logits, target)
    with tracer:
        loss = fn(logits, target)
        start = len(tracer.events)
        loss.backward(torch.empty_like(loss))
    made = [(e.nbytes, e.dtype, e.op) for e in tracer.events if e.action == "alloc" and e.op]
    return made, start


@pytest.mark.parametrize("tp", [1, 2])
def test_unfused_cross_entropy_allocates_as_megatron_cores(tp):
    with warnings.catch_warnings(), patches.fake_process_groups(world_size=tp, tp=tp), \
            patches.applied():
        warnings.simplefilter("ignore")
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        megatron = _allocations(vocab_parallel_cross_entropy)
    tracemem = _allocations(_VocabParallelCrossEntropy.apply)
    assert megatron == tracemem
    # the softmax: the fp32 copy of the logits [s, b, V / TP], made in forward
    assert (4 * 2 * 10 * 4, torch.float32, "aten::_to_copy") in tracemem[0]
