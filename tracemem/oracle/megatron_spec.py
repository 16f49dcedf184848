"""A Megatron-Core layer spec whose leaf modules are tracemem's ``megatron-te`` kernels.

The orchestration is Megatron-Core 0.16.1's own (``GPTModel``, ``TransformerBlock``,
``TransformerLayer``, ``MLASelfAttention``, ``MLP``, ``MoELayer`` with ``TopKRouter``,
``MoEAlltoAllTokenDispatcher``, ``TEGroupedMLP``, ``SharedExpertMLP``); where the TE spec
(``models/gpt/gpt_layer_specs.py`` ``get_gpt_layer_with_transformer_engine_spec`` with
``multi_latent_attention=True``, ``qk_layernorm=True``, and ``TESpecProvider`` in
``extensions/transformer_engine_spec_provider.py``) puts a Transformer Engine module, this spec
puts a leaf with the same constructor signature and return convention (``(out, bias)``) whose
forward is a ``modeling.kernels`` Function:

| TE module (Megatron's wrapper) | leaf here | kernel |
|---|---|---|
| ``TENorm`` (RMSNorm) | ``TENorm`` | ``modeling.kernels.norm.te_rms_norm`` |
| ``TELinear`` (duplicated) / ``TEColumnParallelLinear`` / ``TERowParallelLinear`` | ``TELinear``, ``TEColumnParallelLinear``, ``TERowParallelLinear`` | ``modeling.kernels.linear.te_linear`` |
| ``TELayerNormColumnParallelLinear`` | ``TELayerNormColumnParallelLinear`` | ``te_linear`` with the fused RMSNorm |
| ``TEDotProductAttention`` (fused backend) | ``TEDotProductAttention`` | ``modeling.kernels.attention.te_fused_attention`` |
| ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear`` | the same names | ``modeling.kernels.moe.te_grouped_linear`` |

Megatron-Core's activations are ``[s, b, h]``; the kernels take ``(b, s, h)``. A leaf hands a
linear kernel the transposed view and transposes its output back: with micro-batch size 1 (the
only one the oracle runs) both views are of the same storage and the bytes are the kernel's.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import Tensor, nn

from modeling.kernels import attention as te_attention
from modeling.kernels import linear as te_linear_mod
from modeling.kernels import moe as te_moe
from modeling.kernels import norm as te_norm

__all__ = ["TENorm", "TELinear", "TEColumnParallelLinear", "TERowParallelLinear",
           "TELayerNormColumnParallelLinear", "TEDotProductAttention",
           "TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear",
           "TracememSpecProvider", "decoder_layer_specs", "gpt_model_chunk", "FUSE_WGRAD"]

# Megatron's --gradient-accumulation-fusion for every leaf (the megatron-te profile's option)
FUSE_WGRAD = {"value": True}


def _group_size(tp_group, is_expert: bool) -> int:
    if tp_group is not None:
        return tp_group.size()
    from megatron.core import parallel_state
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_world_size()
    return parallel_state.get_tensor_model_parallel_world_size()


class TENorm(nn.Module):
    """TE ``RMSNorm`` (Megatron ``extensions/transformer_engine.py`` ``TENorm``): weight
    ``(hidden_size,)`` in ``params_dtype``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=config.params_dtype))

    def forward(self, x: Tensor) -> Tensor:
        return te_norm.te_rms_norm(self, x)


def _bsh(x: Tensor) -> Tensor:
    return x.transpose(0, 1)  # [s, b, h] -> (b, s, h): a view


class TELinear(nn.Module):
    """TE ``Linear`` with Megatron's ``TELinear`` signature; ``parallel_mode`` "column",
    "row" or "duplicated" / None (no TP communication). Weight ``(out / TP, in)`` (column),
    ``(out, in / TP)`` (row) or ``(out, in)``. Forward ``[s_local, b, in]`` ->
    ``([s, b, out / TP] or [s_local, b, out], None)``."""

    def __init__(self, input_size: int, output_size: int, *, parallel_mode, config,
                 init_method=None, bias: bool = False, skip_bias_add: bool = False,
                 skip_weight_param_allocation: bool = False, tp_comm_buffer_name=None,
                 is_expert: bool = False, symmetric_ar_type=None, tp_group=None, **kwargs):
        super().__init__()
        if bias:
            raise ValueError("the oracle's TE leaves have no bias (add_bias_linear=False)")
        self.config = config
        self.parallel_mode = None if parallel_mode == "duplicated" else parallel_mode
        self.tp_size = 1 if self.parallel_mode is None else _group_size(tp_group, is_expert)
        out_size = output_size // self.tp_size if self.parallel_mode == "column" else output_size
        in_size = input_size // self.tp_size if self.parallel_mode == "row" else input_size
        self.weight = nn.Parameter(torch.empty(out_size, in_size, dtype=config.params_dtype))

    def _mode_sp(self) -> tuple[str, int]:
        mode = self.parallel_mode or "duplicated"
        sp = self.tp_size if self.config.sequence_parallel and mode != "duplicated" else 1
        return mode, sp

    def forward(self, x: Tensor, *args, **kwargs):
        mode, sp = self._mode_sp()
        out = te_linear_mod.te_linear(_bsh(x), [self.weight], mode, sp, None,
                                      FUSE_WGRAD["value"])
        return out.transpose(0, 1), None


class TEColumnParallelLinear(TELinear):
    """Megatron ``TEColumnParallelLinear`` (``parallel_mode="column"``)."""

    def __init__(self, input_size, output_size, *, config, init_method=None,
                 gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
                 skip_weight_param_allocation=False, tp_comm_buffer_name=None, tp_group=None,
                 stride=1, **kwargs):
        if gather_output:
            raise ValueError("Transformer Engine linear layers do not support gather_output")
        super().__init__(input_size, output_size, parallel_mode="column", config=config,
                         bias=bias, is_expert=is_expert, tp_group=tp_group)


class TERowParallelLinear(TELinear):
    """Megatron ``TERowParallelLinear`` (``parallel_mode="row"``)."""

    def __init__(self, input_size, output_size, *, config, init_method=None, bias=False,
                 input_is_parallel=True, skip_bias_add=False, is_expert=False,
                 tp_comm_buffer_name=None, tp_group=None, **kwargs):
        super().__init__(input_size, output_size, parallel_mode="row", config=config,
                         bias=bias, is_expert=is_expert, tp_group=tp_group)


class TELayerNormColumnParallelLinear(TELinear):
    """Megatron ``TELayerNormColumnParallelLinear``: TE ``LayerNormLinear`` (an RMSNorm fused
    in front of a column-parallel linear); weights ``layer_norm_weight`` ``(in,)`` and
    ``weight`` ``(out / TP, in)``."""

    def __init__(self, input_size, output_size, *, config, init_method=None,
                 gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
                 skip_weight_param_allocation=False, tp_comm_buffer_name=None, tp_group=None,
                 stride=1, **kwargs):
        super().__init__(input_size, output_size, parallel_mode="column", config=config,
                         bias=bias, is_expert=is_expert, tp_group=tp_group)
        self.layer_norm_weight = nn.Parameter(torch.empty(input_size,
                                                          dtype=config.params_dtype))
        # TE registers layer_norm_weight before weight (transformer_engine/pytorch/module/
        # layernorm_linear.py LayerNormLinear.__init__): the order of Megatron-Core's DDP
        # buffers, whose alignment gaps and shards follow registration order
        self._parameters["weight"] = self._parameters.pop("weight")

    def forward(self, x: Tensor, *args, **kwargs):
        mode, sp = self._mode_sp()
        norm = SimpleNamespace(weight=self.layer_norm_weight)
        out = te_linear_mod.te_linear(_bsh(x), [self.weight], mode, sp, norm,
                                      FUSE_WGRAD["value"])
        return out.transpose(0, 1), None


class TEDotProductAttention(nn.Module):
    """TE ``DotProductAttention`` with the fused (cuDNN) backend, Megatron's
    ``TEDotProductAttention`` signature. Forward ``[s, b, n, d]`` q, k, v ->
    ``[s, b, n * d_v]``."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 attention_dropout=None, softmax_scale=None, k_channels=None, v_channels=None,
                 num_splits=None, cp_comm_type="p2p", pg_collection=None, **kwargs):
        super().__init__()
        self.config = config

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None, num_splits=None, **kwargs):
        # the kernel is layout-blind: [s, b, n, d] in, [s, b, n, d_v] -> [s, b, n * d_v] out
        return te_attention.te_fused_attention(query, key, value)


class _TEGroupedLinear(nn.Module):
    """TE ``GroupedLinear`` (Megatron ``TEGroupedLinear``): one weight per local expert,
    ``weight{i}`` ``(out / ETP, in)`` (column) or ``(out, in / ETP)`` (row). Forward
    ``(rows, in)``, ``m_splits`` -> ``((rows, out_local), None)``; the expert-TP
    communication is the dispatcher's."""

    mode = "column"

    def __init__(self, num_gemms, input_size, output_size, *, config, init_method=None,
                 bias=False, skip_bias_add=False, is_expert=True, tp_comm_buffer_name=None,
                 pg_collection=None, **kwargs):
        super().__init__()
        if bias:
            raise ValueError("the oracle's TE leaves have no bias (add_bias_linear=False)")
        etp = pg_collection.expt_tp.size() if pg_collection is not None else \
            _group_size(None, True)
        out_size = output_size // etp if self.mode == "column" else output_size
        in_size = input_size // etp if self.mode == "row" else input_size
        self.out_features = out_size
        self.num_gemms = num_gemms
        for i in range(num_gemms):
            self.register_parameter(f"weight{i}", nn.Parameter(
                torch.empty(out_size, in_size, dtype=config.params_dtype)))
            # extensions/transformer_engine.py TEGroupedLinear.__init__: reduced over the
            # expert data-parallel group (their own DDP buffer) only with EP > 1, else with
            # the dense parameters (DistributedDataParallel.__init__ reads ``allreduce``)
            setattr(getattr(self, f"weight{i}"), "allreduce",
                    not config.expert_model_parallel_size > 1)

    def forward(self, x: Tensor, m_splits):
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        return te_moe.te_grouped_linear(x, weights, self.out_features,
                                        FUSE_WGRAD["value"]), None


class TEColumnParallelGroupedLinear(_TEGroupedLinear):
    mode = "column"


class TERowParallelGroupedLinear(_TEGroupedLinear):
    mode = "row"


class TracememSpecProvider:
    """Megatron-Core's ``BackendSpecProvider`` (``models/backends.py``) with the leaves above,
    answering as ``TESpecProvider`` does (fused layernorm-linear, TE grouped MLP)."""

    def linear(self):
        return TELinear

    def column_parallel_linear(self):
        return TEColumnParallelLinear

    def row_parallel_linear(self):
        return TERowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self):
        return TELayerNormColumnParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False):
        return TENorm

    def core_attention(self):
        return TEDotProductAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool):
        from megatron.core.transformer.mlp import MLPSubmodules
        from megatron.core.transformer.moe.experts import TEGroupedMLP
        return TEGroupedMLP, MLPSubmodules(linear_fc1=TEColumnParallelGroupedLinear,
                                           linear_fc2=TERowParallelGroupedLinear)

    def activation_func(self):
        return None


def _layer_spec(backend: TracememSpecProvider, num_experts: int | None):
    """``get_gpt_layer_with_transformer_engine_spec(num_experts, moe_grouped_gemm=True,
    qk_layernorm=True, multi_latent_attention=True)`` at megatron-core 0.16.1, with ``backend``
    in place of ``TESpecProvider``."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.multi_latent_attention import (
        MLASelfAttention,
        MLASelfAttentionSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    mlp = get_mlp_module_spec_for_backend(backend=backend, num_experts=num_experts,
                                          moe_grouped_gemm=True)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=backend.layer_norm(),
            self_attention=ModuleSpec(
                module=MLASelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=MLASelfAttentionSubmodules(
                    linear_q_proj=backend.column_parallel_linear(),
                    linear_q_down_proj=backend.linear(),
                    linear_q_up_proj=backend.column_parallel_layer_norm_linear(),
                    linear_kv_down_proj=backend.linear(),
                    linear_kv_up_proj=backend.column_parallel_layer_norm_linear(),
                    core_attention=backend.core_attention(),
                    linear_proj=backend.row_parallel_linear(),
                    q_layernorm=IdentityOp,
                    kv_layernorm=IdentityOp,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=backend.layer_norm() if num_experts else IdentityOp,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def decoder_layer_specs(config, vp_stage: int | None = None):
    """The block spec of ``config`` (a ``MLATransformerConfig``): a dense layer spec where
    ``config.moe_layer_freq`` has 0 and an MoE layer spec where it has 1, as
    ``get_gpt_decoder_layer_specs`` builds them, cut to this pipeline rank's (and
    ``vp_stage``'s) layers as ``get_gpt_decoder_block_spec`` cuts them
    (``models/gpt/gpt_layer_specs.py``: ``get_transformer_layer_offset``,
    ``get_num_layers_to_build``)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    backend = TracememSpecProvider()
    dense, moe = _layer_spec(backend, None), _layer_spec(backend, config.num_moe_experts)
    layers = [moe if f else dense for f in config.moe_layer_freq]
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    layers = layers[offset:offset + get_num_layers_to_build(config, vp_stage=vp_stage)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=TENorm)


def gpt_model_chunk(config, cfg, vp: int, vpp: int, **kwargs):
    """This pipeline rank's ``GPTModel`` for virtual stage ``vp`` of ``vpp``, built on meta
    as megatron/training/training.py ``get_model`` builds each chunk (``pre_process`` /
    ``post_process`` from ``parallel_state.is_pipeline_first_stage`` / ``_last_stage`` with
    ``ignore_virtual=False``; ``vp_stage`` None without VPP), with ``decoder_layer_specs``,
    ``cfg``'s vocabulary and positions, no position embedding (MLA's RoPE is its own) and
    ``kwargs`` passed on; each MoE dispatcher told its global layer (the oracle's routing
    model reads it)."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    vp_stage = vp if vpp > 1 else None
    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    with torch.device("meta"):
        chunk = GPTModel(config, decoder_layer_specs(config, vp_stage),
                         vocab_size=cfg.vocab_size,
                         max_sequence_length=cfg.max_position_embeddings,
                         pre_process=pre, post_process=post, position_embedding_type="none",
                         vp_stage=vp_stage, **kwargs)
    for module in chunk.modules():
        if hasattr(module, "token_dispatcher"):
            module.token_dispatcher.tracemem_layer = module.layer_number - 1
    return chunk
