"""A decoder layer: ``x + attn(attn_norm(x))``, then ``+ ffn(ffn_norm(x))``. The attention is
MLA or grouped-query (``cfg.attention``); the FFN is the dense MLP, or an MoE in the layers
``cfg.is_moe_layer`` names (DeepSeek-V3 ``Block``; torchtitan's ``TransformerBlock``)."""

from __future__ import annotations

from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from modeling.common import offload
from modeling.common.checkpoint import CheckpointWithoutOutput, megatron_checkpoint
from modeling.common.config import ModelConfig
from modeling.common.custom import LayerContext, Replacements, build_replacement
from modeling.kernels import KernelProfile, get_profile
from modeling.common.attention.gqa import GQA
from modeling.common.attention.mla import MLA
from modeling.common.linear import Linear
from modeling.common.mlp import MLP
from modeling.common.moe import MoE
from modeling.common.norm import make_norm
from modeling.common.sac import force_recompute_shapes, op_checkpoint
from modeling.parallel.plans import LocalSizes
from modeling.common.routing import RoutingModel
from tracemem.errors import TracememError

__all__ = ["Block", "RECOMPUTE_MODES", "RECOMPUTE_MODULES"]

RECOMPUTE_MODES = ("none", "selective", "full")
# Megatron-LM's --recompute-modules names (megatron/core/transformer/transformer_config.py
# recompute_modules, TransformerConfig.__post_init__'s allowed_modules at d98e8a6): core
# attention, MLA up projections and RoPE (MLA only), the input and pre-MLP norms, the dense MLP,
# the whole MoE layer, the routed experts' activation (grouped experts only), the shared
# experts. Megatron's others (gdn_norm_out, gdp_in_proj, gdp_qkv, mhc) recompute parts of layers
# tracemem does not model (gated delta net / product, mHC); its front door refuses them by name.
# "op" (alone, not a Megatron name: its front door refuses it): torchtitan's SelectiveAC, the
# op-level policy around the whole block (modeling.common.sac), under the eager orchestration
RECOMPUTE_MODULES = ("core_attn", "mla_up_proj", "layernorm", "mlp", "moe", "moe_act",
                     "shared_experts", "op")


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
        self.tp, self.sp = sizes.tp, sizes.sp  # --distribute-saved-activations: over TP
        self.distribute: tuple[int, int] | None = None
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
        # Megatron's set_save_original_input on linear_proj (attention.py Attention.__init__)
        # and the shared experts' linear_fc1 (shared_experts.py, unless they are recomputed:
        # set_recompute); the profile honours it under FP8 recipes other than delayed
        if isinstance(getattr(self.attn, "wo", None), Linear):  # "e5m6": DeepSeek-V3's cache
            e5m6 = kernels is not None and kernels.options.get("e5m6_attention_output")
            self.attn.wo.save_original_input = "e5m6" if e5m6 else True
        self._mark_shared_fc1(True)

    def _mark_shared_fc1(self, save_original: bool | str) -> None:
        shared = getattr(self.ffn, "shared_experts", None) if isinstance(self.ffn, MoE) else None
        if shared is not None and isinstance(getattr(shared, "w1", None), Linear):
            shared.w1.save_original_input = save_original

    def set_recompute(self, recompute: str, modules: frozenset[str] = frozenset(),
                      distribute_saved_activations: bool = False) -> None:
        """``"none"``; ``"full"``: the whole layer is recomputed in backward (Megatron's
        "uniform" method, one layer per checkpoint); ``"selective"``: the ``modules`` named
        (``RECOMPUTE_MODULES``) are.

        Under a Megatron kernel profile each uses Megatron-Core's own mechanism
        (``modeling.common.checkpoint``, Megatron-LM d98e8a6): full, ``core_attn``, ``mlp``,
        ``moe`` and ``shared_experts`` the reentrant ``tensor_parallel.checkpoint``
        (``CheckpointFunction``: no_grad forward keeping the inputs, recompute and backward in
        its backward); ``layernorm``, ``moe_act`` and ``mla_up_proj`` ``CheckpointWithoutOutput``
        (outputs freed once their consumer has saved them, recomputed by a gradient hook on
        the consumer's output). ``layernorm`` recomputes the norms Megatron's TE spec keeps
        apart: MLA's input norm and the MoE layers' pre-MLP norm (the dense MLP's and
        grouped-query attention's are fused into fc1 / linear_qkv, ``IdentityOp`` in the spec,
        transformer_layer.py ``__init__`` skips them). Under the eager and torch profiles:
        ``torch.utils.checkpoint`` (non-reentrant), the PyTorch way; ``moe_act`` there
        recomputes the SwiGLU product as ``CheckpointWithoutOutput`` does.

        ``"op"`` (alone; eager and torch profiles): torchtitan 0.3.0's ``SelectiveAC``, its
        op-level policy around the whole layer (``modeling.common.sac.op_checkpoint``).

        ``distribute_saved_activations`` (full only, Megatron's ``--distribute-saved-
        activations``): the checkpoint keeps 1/TP of the layer's input (``megatron_checkpoint``).

        Raises:
            TracememError: unknown mode or module; ``mla_up_proj`` for a model without MLA;
                ``moe_act`` with sequential experts; ``shared_experts`` with
                ``moe_shared_expert_overlap``; ``distribute_saved_activations`` without full
                recompute, with sequence parallelism or outside a Megatron profile (each
                with Megatron's message where it has one).
        """
        if recompute not in RECOMPUTE_MODES:
            raise TracememError(f"--recompute {recompute!r} is invalid; choose one of "
                                f"{', '.join(RECOMPUTE_MODES)}")
        unknown = set(modules) - set(RECOMPUTE_MODULES)
        if unknown:
            raise TracememError(f"--recompute-modules {', '.join(sorted(unknown))} is invalid; "
                                f"choose from {', '.join(RECOMPUTE_MODULES)}")
        selective = frozenset(modules) if recompute == "selective" else frozenset()
        if "op" in selective:  # torchtitan's SelectiveAC (modeling.common.sac)
            if len(selective) > 1:
                raise TracememError(f"--recompute-modules op (torchtitan's op-level policy, "
                                    f"around the whole layer) cannot be combined with "
                                    f"{', '.join(sorted(selective - {'op'}))}")
            if self.kernels.orchestration == "megatron":
                raise TracememError(f"--recompute-modules op is torchtitan's SelectiveAC and "
                                    f"needs --kernels torch (or eager), not --kernels "
                                    f"{self.kernels.name}")
        if "mla_up_proj" in selective and not isinstance(self.attn, MLA):
            kind = ("grouped-query attention" if isinstance(self.attn, GQA) else
                    f"attention {type(self.attn).__name__}")
            raise TracememError(
                f"--recompute-modules mla_up_proj applies to MLA (DeepSeek) only; this model has "
                f"{kind}: use core_attn (or layernorm, mlp)")
        if isinstance(self.ffn, MoE):  # TransformerConfig.__post_init__'s checks
            self.ffn.set_recompute(selective)
            # set_for_recompute_pre_mlp_layernorm (moe_layer.py): under any FP8 recipe
            self._mark_shared_fc1("shared_experts" not in selective and (
                "recompute" if "layernorm" in selective else True))
        if isinstance(self.attn, MLA):  # set_for_recompute_input_layernorm
            # (multi_latent_attention.py): the down projections read the recomputed norm
            for name in ("wq_a", "wkv_a"):
                if isinstance(getattr(self.attn, name, None), Linear):
                    getattr(self.attn, name).save_original_input = (
                        "recompute" if "layernorm" in selective else False)
        megatron = self.kernels.orchestration == "megatron"
        if distribute_saved_activations:
            if recompute != "full":
                raise TracememError(f"--distribute-saved-activations applies to --recompute "
                                    f"full (Megatron's full-recompute checkpoint), not "
                                    f"--recompute {recompute}")
            if self.sp > 1:  # TransformerConfig.__post_init__
                raise TracememError("Megatron-LM refuses this job: distribute_saved_"
                                    "activations: True must be false when sequence parallel "
                                    "is enabled: True (megatron/core/transformer/"
                                    "transformer_config.py TransformerConfig.__post_init__); "
                                    "drop --sp or --distribute-saved-activations")
            if not megatron:
                raise TracememError(f"--distribute-saved-activations is Megatron's checkpoint "
                                    f"and needs --kernels megatron-te, not --kernels "
                                    f"{self.kernels.name}")
        self.recompute = recompute
        self.recompute_modules = selective
        self.distribute = (self.tp, 0) if distribute_saved_activations else None
        self.attn.recompute = self.recompute_modules & {"core_attn", "mla_up_proj"}

    def forward(self, x: Tensor, routing: RoutingModel) -> Tensor:
        if self.recompute == "full":
            if self.kernels.orchestration == "megatron":
                # Megatron-Core's tensor_parallel.checkpoint (CheckpointFunction), reentrant
                return megatron_checkpoint(self._forward, self.distribute, x, routing)
            return checkpoint(self._forward, x, routing, use_reentrant=False)
        if "op" in self.recompute_modules:  # torchtitan's SelectiveAC._wrap_block
            return op_checkpoint(self._forward, x, routing,
                                 force_recompute=force_recompute_shapes(self))
        return self._forward(x, routing)

    def _forward(self, x: Tensor, routing: RoutingModel) -> Tensor:
        # each branch output stays alive through its dropout and residual add (Megatron's
        # attention_output_with_bias / mlp_output_with_bias, held until the bias-dropout-add
        # returns), then goes. Fine-grained activation offloading (modeling.common.offload):
        # the attn_norm / mlp_norm groups start at the norm and commit after the residual add,
        # releasing the residual (transformer_layer.py _forward_attention / _forward_mlp)
        megatron = self.kernels.orchestration == "megatron"
        fused_attn_norm = megatron and isinstance(self.attn, GQA)  # IdentityOp, no group
        with offload.group("attn_norm", x, not fused_attn_norm) as x:
            if not fused_attn_norm:
                normed, ckpt = self._norm(self.attn_norm, x)
        if fused_attn_norm:
            out = self.attn(x, self.attn_norm)  # norm fused into linear_qkv
        else:
            out = self.attn(normed)
            del normed
            if ckpt is not None:  # transformer_layer.py _forward_attention
                ckpt.discard_output_and_register_recompute(out)
        residual = x
        x = offload.commit(x + self._dropout(out), "attn_norm", [residual], not fused_attn_norm)
        del out, residual
        if megatron and isinstance(self.ffn, MLP):  # pre_mlp_layernorm IdentityOp: no group
            run = lambda x: self.ffn(x, self.ffn_norm)  # noqa: E731  (norm fused into fc1)
            if "mlp" in self.recompute_modules:  # transformer_layer.py _run_mlp
                out = megatron_checkpoint(run, None, x)
            else:
                out = run(x)
            return x + self._dropout(out)
        with offload.group("mlp_norm", x) as x:
            h, ckpt = self._norm(self.ffn_norm, x)
        if isinstance(self.ffn, MoE):
            run = lambda h: self.ffn(h, routing)  # noqa: E731
        else:
            run = self.ffn
        if ("moe" if isinstance(self.ffn, MoE) else "mlp") in self.recompute_modules:
            # moe_layer.py MoELayer.forward / transformer_layer.py _run_mlp
            out = (megatron_checkpoint(run, None, h) if megatron
                   else checkpoint(run, h, use_reentrant=False))
        else:
            out = run(h)
        if ckpt is not None:  # transformer_layer.py _apply_mlp_bda_step
            ckpt.discard_output_and_register_recompute(out)
        return offload.commit(x + self._dropout(out), "mlp_norm", [x])

    def offload_groups(self, modules: frozenset[str] | set[str]) -> list[str]:
        """The fine-grained offloading groups this layer's forward starts, in order, for the
        ``--offload-modules`` ``modules`` (``modeling.common.offload``): ``attn_norm``; under
        Megatron's attention (MLA or grouped-query) ``qkv_linear``, ``core_attn`` (unless
        core attention is recomputed: ``_checkpointed_attention_forward`` has no group) and
        ``attn_proj``; ``mlp_norm``; in an MoE layer with grouped experts under a Megatron
        profile ``expert_fc1`` and ``moe_act`` (``TEGroupedMLP``). Megatron skips a norm that
        is an ``IdentityOp`` (transformer_layer.py ``offload_attn_norm`` /
        ``offload_mlp_norm``): fused into ``linear_qkv`` (grouped-query attention) or into
        the dense MLP's fc1."""
        megatron = self.kernels.orchestration == "megatron"
        # offload_attn_norm / offload_mlp_norm: not for an IdentityOp norm (fused into
        # linear_qkv under grouped-query attention, into fc1 in a dense layer)
        names = [] if megatron and isinstance(self.attn, GQA) else ["attn_norm"]
        if megatron and isinstance(self.attn, (MLA, GQA)):
            names += ["qkv_linear"] + (["core_attn"] if "core_attn" not in self.attn.recompute
                                       else []) + ["attn_proj"]
        if not (megatron and isinstance(self.ffn, MLP)):
            names.append("mlp_norm")
        if isinstance(self.ffn, MoE) and self.ffn.offload_experts():
            names += ["expert_fc1", "moe_act"]
        return [n for n in names if n in modules]

    def _dropout(self, out: Tensor) -> Tensor:
        """Hidden dropout (``cfg.hidden_dropout``) of an attention or FFN output ``(b, s_local,
        h)`` before its residual add: Megatron-Core's bias-dropout-add (megatron/core/fusions/
        fused_bias_dropout.py ``_bias_dropout_add_func`` via ``get_bias_dropout_add``, called by
        ``TransformerLayer._apply_self_attn_bda_step`` / ``_apply_mlp_bda_step``): ``residual +
        dropout(x)``. The profile's dropout (``modeling.kernels.dropout``); ``out`` itself when
        the probability is 0 or outside training."""
        return self.kernels.dropout(out, self.hidden_dropout, self.training)

    def _norm(self, norm: nn.Module, x: Tensor
              ) -> tuple[Tensor, CheckpointWithoutOutput | None]:
        """``norm(x)`` and, under ``layernorm`` recompute with a Megatron profile, the
        ``CheckpointWithoutOutput`` whose output the caller discards once the consumer has run
        (transformer_layer.py ``_run_input_layernorm`` / ``_forward_pre_mlp_layernorm``);
        under another profile ``torch.utils.checkpoint`` (non-reentrant: the norm's output is
        kept by its consumer, its statistics recomputed)."""
        if "layernorm" not in self.recompute_modules:
            return norm(x), None
        if self.kernels.orchestration == "megatron":
            ckpt = CheckpointWithoutOutput()
            return ckpt.checkpoint(norm, x), ckpt
        return checkpoint(norm, x, use_reentrant=False), None
