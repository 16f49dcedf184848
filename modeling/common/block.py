"""A decoder layer: ``x + attn(attn_norm(x))``, then ``+ ffn(ffn_norm(x))``. The attention is
MLA or grouped-query (``cfg.attention``); the FFN is the dense MLP, or an MoE in the layers
``cfg.is_moe_layer`` names (DeepSeek-V3 ``Block``; torchtitan's ``TransformerBlock``)."""

from __future__ import annotations

from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from modeling.common.config import ModelConfig
from modeling.common.custom import LayerContext, Replacements, build_replacement
from modeling.kernels import KernelProfile, get_profile
from modeling.common.attention.gqa import GQA
from modeling.common.attention.mla import MLA
from modeling.common.mlp import MLP
from modeling.common.moe import MoE
from modeling.common.norm import make_norm
from modeling.parallel.plans import LocalSizes
from modeling.common.routing import RoutingModel
from tracemem.errors import TracememError

__all__ = ["Block", "RECOMPUTE_MODES", "RECOMPUTE_MODULES"]

RECOMPUTE_MODES = ("none", "selective", "full")
# Megatron-LM's --recompute-modules names (megatron/core/transformer/transformer_config.py):
# core attention, MLA up projections (with RoPE and core attention; MLA only), the RMSNorms,
# the dense MLP, the whole MoE layer.
RECOMPUTE_MODULES = ("core_attn", "mla_up_proj", "layernorm", "mlp", "moe")


class Block(nn.Module):
    """Decoder layer ``layer_id`` (0-based, global: it decides dense vs MoE and the routing
    model's per-layer counts), with the local ``sizes`` of one rank (default unsharded) and
    the ``kernels`` profile (``modeling.kernels``; default eager). Under ``megatron-te`` the
    dense layers fuse the pre-MLP RMSNorm into fc1 (Megatron-Core's TE spec: ``pre_mlp_layernorm``
    is ``IdentityOp`` for dense layers, megatron/core/models/gpt/gpt_layer_specs.py), and
    grouped-query attention fuses the input RMSNorm into ``linear_qkv`` (the same spec's
    ``input_layernorm`` is ``IdentityOp`` beside ``TELayerNormColumnParallelLinear``; MLA's
    spec keeps a separate ``TENorm``). Input and output ``(b, s, h)``. ``replace``
    (``modeling.common.custom``): the user's factories for "attn" and "mlp" (the dense FFN),
    called with a ``LayerContext`` (``rank``: this rank's coordinates, or None)."""

    def __init__(self, layer_id: int, cfg: ModelConfig, attention: str = "flash",
                 experts: str = "grouped", sizes: LocalSizes | None = None,
                 kernels: KernelProfile | None = None, replace: Replacements | None = None,
                 rank=None):
        super().__init__()
        sizes = sizes or LocalSizes.full(cfg)
        self.kernels = kernels = kernels or get_profile("eager")
        self.layer_id = layer_id
        self.hidden_dropout = cfg.hidden_dropout  # after attention and after the FFN
        self.recompute, self.recompute_modules = "none", frozenset()
        replace = replace or {}
        ctx = LayerContext(cfg, layer_id, sizes, kernels, attention, cfg.is_moe_layer(layer_id),
                           rank)
        self.attn_norm = make_norm(cfg, cfg.hidden_size, kernels)
        if "attn" in replace:
            self.attn = build_replacement(replace["attn"], "attn", ctx)
        elif cfg.is_mla:
            self.attn = MLA(cfg, attention, sizes.num_heads, sizes.replicate_q_rope, sizes.sp,
                            sizes.cp, kernels)
        else:
            self.attn = GQA(cfg, attention, sizes.num_heads, sizes.num_kv_heads, sizes.sp,
                            sizes.cp, kernels)
        self.ffn_norm = make_norm(cfg, cfg.hidden_size, kernels)
        if cfg.is_moe_layer(layer_id):
            self.ffn = MoE(cfg, experts, sizes.expert_ids, layer_id, sizes.expert_inter,
                           sizes.shared_inter, sizes.ep, sizes.etp,
                           shared_sp=sizes.sp if sizes.shared_split else 1, kernels=kernels,
                           shared_split=sizes.shared_split, shared_kind=sizes.shared_kind)
        elif "mlp" in replace:
            self.ffn = build_replacement(replace["mlp"], "mlp", ctx)
        else:
            self.ffn = MLP(cfg.hidden_size, sizes.dense_inter, sizes.sp, kernels,
                           activation=cfg.hidden_act, gated=cfg.gated_mlp, bias=cfg.mlp_bias)

    def set_recompute(self, recompute: str, modules: frozenset[str] = frozenset()) -> None:
        """``"none"``; ``"full"``: the whole layer is recomputed in backward (Megatron's
        "uniform" method, one layer per checkpoint); ``"selective"``: the ``modules`` named
        (``RECOMPUTE_MODULES``) are. Uses ``torch.utils.checkpoint``: "full" is reentrant under a
        Megatron kernel profile (megatron/core/tensor_parallel/random.py ``CheckpointFunction``:
        the forward runs under no_grad, backward recomputes the layer whole; held against
        Megatron-Core by ``tracemem validate --against megatron-core``), else non-reentrant.

        Raises:
            TracememError: unknown mode or module; ``mla_up_proj`` for a model without MLA.
        """
        if recompute not in RECOMPUTE_MODES:
            raise TracememError(f"--recompute {recompute!r} is invalid; choose one of "
                                f"{', '.join(RECOMPUTE_MODES)}")
        unknown = set(modules) - set(RECOMPUTE_MODULES)
        if unknown:
            raise TracememError(f"--recompute-modules {', '.join(sorted(unknown))} is invalid; "
                                f"choose from {', '.join(RECOMPUTE_MODULES)}")
        if "mla_up_proj" in modules and recompute == "selective" \
                and not isinstance(self.attn, MLA):
            kind = ("grouped-query attention" if isinstance(self.attn, GQA) else
                    f"attention {type(self.attn).__name__}")
            raise TracememError(
                f"--recompute-modules mla_up_proj applies to MLA (DeepSeek) only; this model has "
                f"{kind}: use core_attn (or layernorm, mlp)")
        self.recompute = recompute
        self.recompute_modules = frozenset(modules) if recompute == "selective" else frozenset()
        self.attn.recompute = self.recompute_modules & {"core_attn", "mla_up_proj"}

    def forward(self, x: Tensor, routing: RoutingModel) -> Tensor:
        if self.recompute == "full":
            # Megatron-Core's tensor_parallel.checkpoint (CheckpointFunction) is reentrant:
            # the forward runs under no_grad, backward recomputes and backpropagates inside
            return checkpoint(self._forward, x, routing,
                              use_reentrant=self.kernels.orchestration == "megatron")
        return self._forward(x, routing)

    def _forward(self, x: Tensor, routing: RoutingModel) -> Tensor:
        # each branch output stays alive through its dropout and residual add (Megatron's
        # attention_output_with_bias / mlp_output_with_bias, held until the bias-dropout-add
        # returns), then goes
        if self.kernels.orchestration == "megatron" and isinstance(self.attn, GQA):
            out = self.attn(x, self.attn_norm)  # norm fused into linear_qkv
        else:
            out = self.attn(self._norm(self.attn_norm, x))
        x = x + self._dropout(out)
        del out
        if self.kernels.orchestration == "megatron" and isinstance(self.ffn, MLP):
            run = lambda x: self.ffn(x, self.ffn_norm)  # noqa: E731  (norm fused into fc1)
            if "mlp" in self.recompute_modules:
                out = checkpoint(run, x, use_reentrant=False)
            else:
                out = run(x)
            return x + self._dropout(out)
        h = self._norm(self.ffn_norm, x)
        if isinstance(self.ffn, MoE):
            run = lambda h: self.ffn(h, routing)  # noqa: E731
        else:
            run = self.ffn
        if ("moe" if isinstance(self.ffn, MoE) else "mlp") in self.recompute_modules:
            out = checkpoint(run, h, use_reentrant=False)
        else:
            out = run(h)
        return x + self._dropout(out)

    def _dropout(self, out: Tensor) -> Tensor:
        """Hidden dropout (``cfg.hidden_dropout``) of an attention or FFN output ``(b, s_local,
        h)`` before its residual add: Megatron-Core's bias-dropout-add (megatron/core/fusions/
        fused_bias_dropout.py ``_bias_dropout_add_func`` via ``get_bias_dropout_add``, called by
        ``TransformerLayer._apply_self_attn_bda_step`` / ``_apply_mlp_bda_step``): ``residual +
        dropout(x)``. The profile's dropout (``modeling.kernels.dropout``); ``out`` itself when
        the probability is 0 or outside training."""
        return self.kernels.dropout(out, self.hidden_dropout, self.training)

    def _norm(self, norm: nn.Module, x: Tensor) -> Tensor:
        if "layernorm" in self.recompute_modules:
            return checkpoint(norm, x, use_reentrant=False)
        return norm(x)
