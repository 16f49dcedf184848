"""Grouped-query attention under megatron-te against Megatron-Core's own ``SelfAttention``.

Reference: megatron-core 0.16.1 (the `megatron` extra) building its TransformerLayer from the
TE layer spec (models/gpt/gpt_layer_specs.py ``get_gpt_layer_with_transformer_engine_spec``
with ``multi_latent_attention=False``: ``SelfAttention`` with a ``TELayerNormColumnParallelLinear``
linear_qkv, ``TENorm`` q / k layernorms under ``qk_layernorm``, ``TEDotProductAttention``,
``IdentityOp`` pre-MLP norm before the fused fc1), whose TE leaves are tracemem's megatron-te
kernels (tracemem.oracle.megatron_spec), traced on meta under a fake process group layer by
layer against tracemem's ``build_rank`` (tracemem.oracle.compare). Both sides run the same
kernels, so what a layer keeps and its peaks depend only on the orchestration: they must be
equal to the byte. (Biases are not compared: the oracle's TE leaves have none.)
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
from tracemem.oracle import compare  # noqa: E402
from tracemem.oracle import megatron_patches as patches  # noqa: E402
from tracemem.oracle.megatron_spec import TENorm, TracememSpecProvider  # noqa: E402


def _config(cfg, case):
    from megatron.core.transformer.transformer_config import TransformerConfig

    recompute = {}
    if case.recompute == "selective":
        recompute = dict(recompute_granularity="selective", recompute_modules=list(case.modules))
    return TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads,
        kv_channels=cfg.head_dim, ffn_hidden_size=cfg.intermediate_size,
        tensor_model_parallel_size=case.tp, sequence_parallel=case.sp, normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps, qk_layernorm=cfg.qk_norm, add_bias_linear=False,
        add_qkv_bias=False, gated_linear_unit=True, activation_func=F.silu,
        bias_activation_fusion=True, bf16=True, params_dtype=torch.bfloat16,
        perform_initialization=False, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, bias_dropout_fusion=True, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        **recompute)


def _layer_spec(qk_norm):
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )
    backend = TracememSpecProvider()
    qk = TENorm if qk_norm else IdentityOp
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        self_attention=ModuleSpec(
            module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=backend.column_parallel_layer_norm_linear(),
                core_attention=backend.core_attention(),
                linear_proj=backend.row_parallel_linear(), q_layernorm=qk, k_layernorm=qk)),
        self_attn_bda=get_bias_dropout_add, pre_mlp_layernorm=IdentityOp,
        mlp=get_mlp_module_spec_for_backend(backend=backend, num_experts=None,
                                            moe_grouped_gemm=True),
        mlp_bda=get_bias_dropout_add))


def _run_megatron(cfg, case):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    with warnings.catch_warnings(), patches.fake_process_groups(
            world_size=case.world_size, tp=case.tp, ep=1, etp=1), patches.applied():
        warnings.simplefilter("ignore")
        block = TransformerBlockSubmodules(layer_specs=[_layer_spec(cfg.qk_norm)]
                                           * cfg.num_layers, layer_norm=TENorm)
        with torch.device("meta"):
            model = GPTModel(_config(cfg, case), block, vocab_size=cfg.vocab_size,
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


@pytest.mark.parametrize("preset, case", [
    ("llama-tiny", compare.OracleCase(tp=2, sp=True)),
    ("qwen3-tiny", compare.OracleCase()),
    ("qwen3-tiny", compare.OracleCase(tp=2, sp=True, recompute="selective",
                                      modules=("core_attn",))),
], ids=lambda p: p if isinstance(p, str) else p.name)
def test_gqa_layers_keep_and_peak_as_megatron_core_does(preset, case):
    cfg = dataclasses.replace(load_config(preset), num_layers=2, dtype="bfloat16")
    megatron = _run_megatron(cfg, case)
    tracemem = compare._run_tracemem(cfg, case, Balanced())
    assert sorted(megatron) == sorted(tracemem) == [0, 1]
    for layer in (0, 1):
        assert megatron[layer].totals == tracemem[layer].totals
        # the same storages kept (bytes, dtype; Megatron's are [s, b, ...], tracemem's
        # (b, s, ...): with b = 1 the same bytes)
        assert sorted(s[:2] for s in megatron[layer].kept_storages) == \
            sorted(s[:2] for s in tracemem[layer].kept_storages)
    # by hand, qwen3-tiny layer 0 at TP 1 (bf16): linear_qkv's fused input norm 64 and weight
    # (4 + 2 * 2) heads * 32 * 64, q / k layernorms 2 * 32, linear_proj 64 * 128, fc1's fused
    # norm 64 and weight 2 * 128 * 64, fc2 64 * 128
    if preset == "qwen3-tiny" and case.tp == 1:
        by_hand = (64 + 8 * 32 * 64 + 2 * 32 + 128 * 64 + 64 + 2 * 128 * 64 + 128 * 64) * 2
        assert megatron[0].params == by_hand == 98_688
