"""The MoE families under megatron-te against Megatron-Core's own MoE layer: the router
variants (``moe_router_pre_softmax`` as ``RouterSpec.megatron_pre_softmax`` says), no shared
expert or one behind ``moe_shared_expert_gate``, on grouped-query attention.

Reference: megatron-core 0.16.1 (the `megatron` extra) building a TransformerLayer per layer
from the TE spec (``SelfAttention`` with the fused-norm ``linear_qkv``, ``TENorm`` q / k
layernorms under ``qk_layernorm``, ``TENorm`` pre-MLP norm, ``MoELayer`` with ``TopKRouter``,
``MoEAlltoAllTokenDispatcher``, ``TEGroupedMLP`` and ``SharedExpertMLP``), whose TE leaves are
tracemem's megatron-te kernels (tracemem.oracle.megatron_spec), traced on meta under a fake
process group against tracemem's ``build_rank`` layer by layer (tracemem.oracle.compare), as
tests/modeling/test_gqa_megatron_core.py does for the dense families. The parameters must be
equal and the storages each layer keeps for backward equal but for the dispatcher state that
docs/validation.md's residue lists (``dispatch_preprocess`` holds ``probs`` [T, E] fp32 and
``routing_map`` [T, E] bool on the dispatcher; tests/tracemem/test_oracle_megatron.py). Both
layers are MoE here; biases are not compared (the oracle's TE leaves have none).
"""

import dataclasses
import warnings

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed: "
                                            "pip install 'tracemem[megatron]' (make test does)")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from modeling import load_config  # noqa: E402
from modeling.common.router import RouterSpec  # noqa: E402
from modeling.common.routing import Balanced  # noqa: E402
from tracemem.oracle import compare  # noqa: E402
from tracemem.oracle import megatron_patches as patches  # noqa: E402
from tracemem.oracle.megatron_spec import TENorm, TracememSpecProvider  # noqa: E402

S, E = 16, 8  # compare.OracleCase's sequence; the tiny configs' routed experts


def _config(cfg, case):
    from megatron.core.transformer.transformer_config import TransformerConfig
    spec = RouterSpec.of(cfg)
    return TransformerConfig(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads,
        kv_channels=cfg.head_dim, ffn_hidden_size=cfg.intermediate_size,
        tensor_model_parallel_size=case.tp, sequence_parallel=case.sp,
        expert_model_parallel_size=case.ep, expert_tensor_parallel_size=case.etp,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps, qk_layernorm=cfg.qk_norm, add_bias_linear=False,
        add_qkv_bias=False, gated_linear_unit=True, activation_func=F.silu,
        num_moe_experts=cfg.num_routed_experts, moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_shared_expert_intermediate_size=cfg.shared_experts_width or None,
        moe_shared_expert_gate=cfg.shared_expert_gate,
        moe_router_topk=cfg.num_experts_per_tok,
        moe_router_pre_softmax=spec.megatron_pre_softmax,
        moe_layer_freq=[int(cfg.is_moe_layer(i)) for i in range(cfg.num_layers)],
        moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall",
        moe_router_score_function="softmax", moe_router_dtype="fp32",
        moe_shared_expert_overlap=True, moe_permute_fusion=True, moe_aux_loss_coeff=0.0,
        moe_router_load_balancing_type="none",
        bias_activation_fusion=True, bf16=True, params_dtype=torch.bfloat16,
        perform_initialization=False, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0, bias_dropout_fusion=True, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False)

def _layer_spec(cfg, moe):
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
    backend = TracememSpecProvider()
    qk = TENorm if cfg.qk_norm else IdentityOp
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        self_attention=ModuleSpec(
            module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
            submodules=SelfAttentionSubmodules(
                linear_qkv=backend.column_parallel_layer_norm_linear(),
                core_attention=backend.core_attention(),
                linear_proj=backend.row_parallel_linear(), q_layernorm=qk, k_layernorm=qk)),
        self_attn_bda=get_bias_dropout_add,
        pre_mlp_layernorm=backend.layer_norm() if moe else IdentityOp,
        mlp=get_mlp_module_spec_for_backend(backend=backend,
                                            num_experts=cfg.num_routed_experts if moe else None,
                                            moe_grouped_gemm=True),
        mlp_bda=get_bias_dropout_add))

def _run_megatron(cfg, case, routing):
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    with warnings.catch_warnings(), patches.fake_process_groups(
            world_size=case.world_size, tp=case.tp, ep=case.ep, etp=case.etp), patches.applied():
        warnings.simplefilter("ignore")
        patches.set_routing(routing)
        block = TransformerBlockSubmodules(layer_specs=[_layer_spec(cfg, cfg.is_moe_layer(i))
                                                        for i in range(cfg.num_layers)], layer_norm=TENorm)
        with torch.device("meta"):
            model = GPTModel(_config(cfg, case), block, vocab_size=cfg.vocab_size,
                             max_sequence_length=cfg.max_position_embeddings,
                             pre_process=False, post_process=False,
                             position_embedding_type="rope", rotary_base=int(cfg.rope_theta))
        for module in model.modules():
            if hasattr(module, "token_dispatcher"):
                module.token_dispatcher.tracemem_layer = module.layer_number - 1
        def run(x):
            model.set_input_tensor(x)
            return model(input_ids=None, position_ids=None, attention_mask=None)
        local = case.seq_length // (case.tp if case.sp else 1)
        try:
            return compare._trace(model, run, (local, 1, cfg.hidden_size),
                                  compare._layer_index("decoder.layers."),
                                  compare._layer_index("decoder.layers."))
        finally:
            patches.set_routing(None)


@pytest.mark.parametrize("case", [compare.OracleCase(), compare.OracleCase(tp=2, sp=True, ep=2)],
                         ids=lambda c: c.name)
@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "qwen2-moe-tiny", "mixtral-tiny"])
def test_moe_layers_keep_what_megatron_core_keeps(preset, case):
    cfg = dataclasses.replace(load_config(preset), num_layers=2, dtype="bfloat16",
                              qkv_bias=False, mlp_only_layers=(), moe_layer_offset=0,
                              moe_layer_freq=1)
    megatron = _run_megatron(cfg, case, Balanced())
    result = compare.CaseResult(case)
    result.megatron, result.tracemem = megatron, compare._run_tracemem(cfg, case, Balanced())
    tokens = S // case.tp if case.sp else S
    for layer in (0, 1):
        m, t = result.megatron[layer], result.tracemem[layer]
        assert m.params == t.params  # the shared-expert gate's (1, h) included
        only = result.diff(layer)
        assert sorted((s[0], s[1]) for s in only.only_megatron) == sorted(
            [(tokens * E * 4, "float32"), (tokens * E, "bool")])
        assert not only.only_tracemem
        assert m.kept - t.kept == tokens * E * 5
