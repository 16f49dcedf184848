"""Mixture of experts: router (``gate``), routed experts, shared experts.

The forward never reads tensor values: how many token-slots each local expert receives comes
from a routing model (``modeling.common.routing``) as a list of ints. The router's logits, scores,
group scores and top-k still run, with their true shapes, for their memory. On real tensors the
dispatch order is the real one (an argsort of the router's top-k expert ids), so a real run
whose counts are the true histogram of its router computes exactly what an ordinary MoE does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch.utils.checkpoint import checkpoint

from modeling.common import offload
from modeling.common.checkpoint import CheckpointWithoutOutput, megatron_checkpoint
from modeling.common.config import ModelConfig
from modeling.kernels import KernelProfile, get_profile
from modeling.common.linear import Linear
from modeling.kernels import fp8_dispatch
from modeling.kernels.fp8_dispatch import Payload
from modeling.kernels.moe import masked_select
from modeling.common.mlp import MLP, _ACTIVATIONS
from modeling.parallel.collectives import active_tracer, all_gather, all_to_all, reduce_scatter
from modeling.common.router import Gate, RouterSpec
from modeling.common.routing import RoutingModel
from modeling.parallel.groups import declare, declare_module, expert, replicated
from tracemem.errors import TracememError

__all__ = ["Gate", "GroupedExperts", "MoE", "EXPERT_KERNELS"]

EXPERT_KERNELS = ("grouped", "sequential")


class GroupedExperts(nn.Module):
    """All local experts as stacked weights, run with one grouped GEMM each
    (``torch._grouped_mm``; torchtitan's ``GroupedExperts``). Input ``(sum(counts), h)``
    sorted by expert. ``gated`` (default) experts are SwiGLU, ``w2(silu(w1 x) * w3 x)``;
    without it, ``w2(act(w1 x))`` with ``activation`` (``modeling.common.mlp.ACTIVATIONS``:
    Megatron's GELU experts, the default activation of its GPT MoE tests), and no ``w3``."""

    def __init__(self, num_experts: int, dim: int, inter_dim: int,
                 kernels: KernelProfile | None = None, *, gated: bool = True,
                 activation: str = "silu"):
        super().__init__()
        self.kernels = kernels
        self.gated, self.activation = gated, activation
        self.recompute_act = False  # --recompute-modules moe_act (MoE.set_recompute)
        if gated and activation != "silu":
            raise TracememError(f"gated experts run SwiGLU; a gated {activation!r} expert is "
                                f"not modelled")
        # EP-sharded (dim 0: the local experts); ETP splits fc1's output, fc2's input
        fc1, fc2 = expert(tp_dim=1), expert(tp_dim=2)
        self.w1 = declare(nn.Parameter(torch.empty(num_experts, inter_dim, dim)), fc1)
        self.w2 = declare(nn.Parameter(torch.empty(num_experts, dim, inter_dim)), fc2)
        if gated:
            self.w3 = declare(nn.Parameter(torch.empty(num_experts, inter_dim, dim)), fc1)

    def forward(self, x: Tensor, counts: list[int], probs: Tensor | None = None,
                wires: tuple | None = None) -> Tensor:
        """``x`` ``(rows, h)`` sorted by expert, ``counts`` rows per local expert; under a
        Megatron profile ``probs`` ``(rows, 1)`` are applied after the activation (TE
        ``GroupedLinear`` fc1 over [w1; w3] or w1, the activation, fc2)."""
        fc1 = [self.w1, self.w3] if self.gated else [self.w1]
        if self.kernels is not None and self.kernels.orchestration == "megatron":
            return _megatron_experts(self.kernels, x, probs, fc1, [self.w2],
                                     self.gated, self.activation, self.recompute_act, counts,
                                     wires)
        offsets = torch.tensor(_cumsum(counts), dtype=torch.int32, device=x.device)
        if self.recompute_act:  # moe_act: the activation product under CheckpointWithoutOutput
            gate = torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offsets)
            up = (torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offsets)
                  if self.gated else None)
            act = _ACTIVATIONS[self.activation]
            ckpt = CheckpointWithoutOutput()
            h = ckpt.checkpoint(lambda g, u: act(g) if u is None else act(g) * u, gate, up)
            out = torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offsets)
            ckpt.discard_output_and_register_recompute(out)
            return out
        h = _ACTIVATIONS[self.activation](
            torch._grouped_mm(x, self.w1.transpose(-2, -1), offs=offsets))
        if self.gated:
            h = h * torch._grouped_mm(x, self.w3.transpose(-2, -1), offs=offsets)
        return torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offsets)


def _megatron_experts(k: KernelProfile, x: Tensor, probs: Tensor, fc1: list[Tensor],
                      fc2: list[Tensor], gated: bool = True, activation: str = "silu",
                      recompute_act: bool = False, counts: list[int] | None = None,
                      wires: tuple | None = None) -> Tensor:
    """Megatron-Core's ``TEGroupedMLP.forward`` (megatron/core/transformer/moe/experts.py at
    Megatron-LM d98e8a6): grouped fc1 ``(rows, 2 * inter)`` (gated) or ``(rows, inter)``,
    the activation with the probabilities ``probs`` ``(rows, 1)``, grouped fc2 ``(rows, h)``.
    Gated: the fused weighted SwiGLU (``weighted_bias_swiglu_impl``). Not gated (GELU): its
    ``bias_act_func`` has no fused kernel for it (with ``bias_activation_fusion`` it raises
    "Only support fusion of swiglu and quick_gelu", so Megatron's GELU MoE runs
    ``--no-bias-gelu-fusion``) and runs ``activation_func(fc1)``, ``* permuted_probs`` (a
    product in the probabilities' dtype: fp32 when they are) and ``.to`` the activations'
    dtype, as torch ops.

    ``recompute_act`` (``--recompute-modules moe_act``): ``bias_act_func`` runs under
    ``CheckpointWithoutOutput`` (its inputs, fc1's output and the probabilities, are kept; its
    output, fc2's input ``(rows, inter)``, is freed once fc2 has saved it and recomputed when
    fc2's output gradient arrives: ``TEGroupedMLP.forward``, ``self.activation_checkpoint``).

    Under FP8 (``k.fp8_recipe``) ``counts`` (rows per local expert) reach the grouped linears,
    which quantise each expert apart, and rows not aligned per expert are padded first
    (``TEGroupedMLP.forward``: ``quantization_padding``, ``k.fp8_pad``) and the output
    unpadded last; with ``recompute_act`` fc2 keeps its bf16 input
    (``set_save_original_input(self.linear_fc2)``). With the megatron-te option
    ``fp8_moe_act_cache`` (DeepSeek-V3's scheme, not Megatron's) the checkpoint keeps fc1's
    output as an FP8 cache instead of bf16 (``_fp8_cache``), dequantised for the recompute.
    ``wires`` (the option ``fp8_dispatch``: ``modeling.kernels.fp8_dispatch``): the payloads
    carrying ``x`` (a placeholder then) into fc1 and the output gradient into fc2; the
    padding moves them."""
    inter, h = fc2[0].shape[-1], fc2[0].shape[-2]
    fp8 = getattr(k, "fp8_recipe", "none") != "none" and counts is not None
    extra = {"counts": counts} if fp8 else {}
    wire_in, wire_grad = wires or (None, None)
    fc1_wire = {} if wire_in is None else {"wire_in": wire_in}
    fc2_wire = {} if wire_grad is None else {"wire_grad": wire_grad}
    unpad = None
    if fp8:
        x, probs, padded = k.fp8_pad(x, probs, counts, wire_in)
        if padded != list(counts):
            unpad, extra = counts, {"counts": padded}
    # fine-grained activation offloading (modeling.common.offload): the expert_fc1 group
    # around fc1, committed on its output releasing fc1's input; the moe_act group around the
    # activation, committed after fc2 releasing fc1's output (experts.py TEGroupedMLP.forward)
    with offload.group("expert_fc1", x) as x:
        hidden = k.grouped_linear(x, fc1, (2 if gated else 1) * inter, **extra, **fc1_wire)
    hidden = offload.commit(hidden, "expert_fc1", [x])
    del x
    if recompute_act and fp8 and k.options.get("fp8_moe_act_cache"):
        ckpt = CheckpointWithoutOutput()
        run = _FP8CachedActivation(k, gated, activation)
        with offload.group("moe_act", hidden) as hidden:
            act = ckpt.checkpoint(run, hidden, probs)
        run.cache_and_drop(hidden)  # the FP8 cache made, fc1's bf16 output freed
        out = k.grouped_linear(act, fc2, h, **extra, save_original_input=True, **fc2_wire)
        ckpt.discard_output_and_register_recompute(out)
    elif recompute_act:
        ckpt = CheckpointWithoutOutput()
        with offload.group("moe_act", hidden) as hidden:
            act = ckpt.checkpoint(lambda y, p: _weighted_activation(k, y, p, gated,
                                                                    activation), hidden, probs)
        out = k.grouped_linear(act, fc2, h, **extra, **fc2_wire, **(
            {"save_original_input": True} if fp8 else {}))
        ckpt.discard_output_and_register_recompute(out)
    else:
        with offload.group("moe_act", hidden) as hidden:
            act = _weighted_activation(k, hidden, probs, gated, activation)
        out = k.grouped_linear(act, fc2, h, **extra, **fc2_wire)
    del act
    out = offload.commit(out, "moe_act", [hidden])
    del hidden
    return out if unpad is None else k.fp8_unpad(out, unpad, wire_grad)


def fp8_cached_swiglu(k: KernelProfile, fc1: Tensor):
    """A shared expert's SwiGLU under the megatron-te option ``fp8_moe_act_cache`` with
    ``moe_act`` recompute and FP8 (DeepSeek-V3, arXiv 2412.19437 3.3.3: the inputs of the
    SwiGLU "in MoE" cached in FP8 and its output recomputed in backward; the shared expert is
    part of the MoE; not Megatron-LM's behaviour, whose moe_act recompute is the routed
    experts' alone): ``fc1`` ``(..., 2 * inter)`` is cached in FP8 (``_fp8_cache``: 1x128
    tiles, fp32 scales) and its bf16 storage freed; the SwiGLU, ``(..., inter)``, runs under
    ``CheckpointWithoutOutput``. Returns ``(checkpoint, output)``: the caller's fc2 keeps the
    output as its bf16 input (``save_original_input``, set by ``MoE.set_recompute``, as
    ``TEGroupedMLP`` sets on the routed experts' fc2 under moe_act recompute) and then calls
    ``checkpoint.discard_output_and_register_recompute(fc2's output)``: the output is dropped
    and recomputed from the dequantised cache when fc2's output gradient arrives."""
    ckpt = CheckpointWithoutOutput()
    run = _FP8CachedActivation(k, True, "silu")
    hidden = ckpt.checkpoint(run, fc1)
    run.cache_and_drop(fc1)  # the FP8 cache made, fc1's bf16 output freed
    return ckpt, hidden


def _fp8_cache(k: KernelProfile, hidden: Tensor):
    """DeepSeek-V3's FP8 cache of the SwiGLU input (arXiv 2412.19437 3.3.3: "we cache the
    inputs of the SwiGLU operator and recompute its output in the backward pass. These
    activations are also stored in FP8 with our fine-grained quantization method"; 3.3.2:
    1x128 tiles, a scaling factor per tile): ``hidden`` ``(rows, 2f)`` quantised row-wise by
    the job's FP8 recipe (``fp8.quantize``, role "input": under blockwise the uint8 data and
    one fp32 scale per 1x128 tile, TE ``Float8BlockQuantizer``'s layout)."""
    from modeling.kernels import fp8

    return fp8.quantize(hidden, k.fp8_recipe, k.options["fp8_arch"], rowwise=True,
                        columnwise=False)


class _Dequantized(torch.autograd.Function):
    """The dequantised SwiGLU input of the recompute: a new bf16 tensor of the dropped input's
    shape (``placeholder``, 0 bytes, kept by the checkpoint so the gradient reaches fc1), made
    from the FP8 cache; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, placeholder: Tensor, *cache: Tensor) -> Tensor:
        ctx.num_cache = len(cache)
        return placeholder.new_empty(placeholder.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (grad, *[None] * ctx.num_cache)


class _FP8CachedActivation:
    """The run function of the checkpointed activation under ``fp8_moe_act_cache``: in
    forward the weighted activation of fc1's bf16 output; ``cache_and_drop`` then makes the FP8
    cache (``_fp8_cache``) and frees the bf16 output's storage (the checkpoint keeps the tensor,
    0 bytes, as ``CheckpointWithoutOutput`` does with its outputs); the recompute in backward
    runs on the input dequantised from the cache (``_Dequantized``), and the cache dies with
    this function once the checkpoint has recomputed."""

    def __init__(self, k: KernelProfile, gated: bool, activation: str) -> None:
        self.k, self.gated, self.activation = k, gated, activation
        self.cache: list[Tensor] | None = None

    def __call__(self, y: Tensor, probs: Tensor | None = None) -> Tensor:
        if self.cache is not None:  # the recompute
            y = _Dequantized.apply(y, *self.cache)
        if probs is None:  # the shared expert's SwiGLU (modeling.common.mlp): no weighting
            return self.k.swiglu(y)
        return _weighted_activation(self.k, y, probs, self.gated, self.activation)

    def cache_and_drop(self, hidden: Tensor) -> None:
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        from modeling.common.checkpoint import _tell_tracer
        from tracemem.categories import Category
        from tracemem.tracer import MemoryTracer

        self.cache = _fp8_cache(self.k, hidden).tensors
        mode = _get_current_dispatch_mode()
        if isinstance(mode, MemoryTracer):  # kept for backward, as a saved tensor would be
            for t in self.cache:
                mode.tag(t, Category.ACTIVATION)
        hidden.untyped_storage().resize_(0)
        _tell_tracer((hidden,))


def _weighted_activation(k: KernelProfile, hidden: Tensor, probs: Tensor, gated: bool,
                         activation: str) -> Tensor:
    """The experts' activation with the probabilities ``probs`` ``(rows, 1)`` applied
    (``TEGroupedMLP.forward``'s ``bias_act_func``, ``MLP.forward`` with ``per_token_scale``):
    the fused weighted SwiGLU when gated, else ``activation_func(hidden) * probs`` cast back
    to ``hidden``'s dtype (``hidden`` ``(rows, f)``; it dies with the caller's reference)."""
    if gated:
        return k.weighted_swiglu(hidden, probs)
    dtype = hidden.dtype
    return (_ACTIVATIONS[activation](hidden) * probs).to(dtype)


def _cumsum(counts: list[int]) -> list[int]:
    out, total = [], 0
    for c in counts:
        total += c
        out.append(total)
    return out


class MoE(nn.Module):
    """Router + routed experts + shared experts.

    Args:
        cfg: the model config.
        experts: ``"grouped"`` (one grouped GEMM over the local experts; needs bfloat16) or
            ``"sequential"`` (one ``MLP`` per expert, ``experts.{i}``).
        expert_ids: the routed experts held here, a contiguous range (EP shards them);
            default all. With a subset, only this rank's own token-slots routed to those
            experts are computed (the dispatch of other ranks' tokens is expert parallelism's).

        layer_id: the global layer number, passed to the routing model.
        expert_inter, shared_inter: the widths held of each routed expert (ETP shards it) and
            of the shared experts (TP shards them); default the config's.
        ep, etp: expert- and expert-tensor-parallel degrees. With EP the token-slots go out
            and come back through all-to-alls; this rank's experts receive EP times the slots
            its own tokens send them (every EP peer is assumed to route like this rank). With
            ETP the received tokens are all-gathered over the ETP group before the experts and
            reduce-scattered after.
        shared_sp: the shared experts' sequence-parallel degree (they are TP-split and gather
            the sequence), 1 when they are replicated.
        shared_split, shared_kind: the shared experts are split over TP (else replicated),
            and their ZeRO group ("dense": DP x CP; "expert": EDP, arXiv 2502.07846's plan).
        kernels: the ``modeling.kernels`` profile. Under ``megatron-te`` the forward is
            Megatron-Core's ``MoELayer`` with the alltoall dispatcher (megatron/core/
            transformer/moe/moe_layer.py, token_dispatcher.py ``MoEAlltoAllTokenDispatcher``,
            experts.py ``TEGroupedMLP``, Megatron-LM d98e8a6): fp32 router logits, dense
            probabilities scattered from the top-k, TE's fused permute, all-to-all of tokens
            and probabilities, chunk sort, grouped fc1, weighted SwiGLU (the probabilities
            applied there), grouped fc2, chunk unsort, all-to-all, unpermute; the shared
            experts as ``SharedExpertMLP`` (with ``moe_shared_expert_overlap`` as the profile
            says).
        router: the router (``modeling.common.router.RouterSpec``); default the config's.
        shared_expert_gate: Qwen2-MoE's gate on the shared experts' output: a ``Linear(h,
            1)`` (``shared_expert_gate``, no bias, replicated over TP) and a sigmoid, the
            shared output times ``sigmoid(x @ w^T)`` per token (Hugging Face
            ``Qwen2MoeSparseMoeBlock.forward``; Megatron-Core ``SharedExpertMLP.forward``
            with ``gate=True``, ``--moe-shared-expert-gate``: ``F.linear`` on the local
            input, ``sigmoid``, ``output * gate_score``; with ``--moe-shared-expert-overlap``
            the score is computed first, in ``pre_forward_comm``; megatron/core/transformer/
            moe/shared_experts.py at Megatron-LM d98e8a6). Needs shared experts. Default
            the config's ``shared_expert_gate``.

    The input is this rank's tokens ``(b, s_local, h)`` (sequence-parallel: the router and the
    dispatch see local tokens only, as Megatron-Core's MoE layer does).

    ``forward(x, routing)``: ``x`` ``(b, s, h)``; ``routing`` says how many token-slots each
    expert receives (asked after the router has run, so a routing model that observes real
    router outputs can answer); the local experts' counts sum to the b * s * top_k slots when
    all experts are local.
    """

    def __init__(self, cfg: ModelConfig, experts: str = "grouped",
                 expert_ids: range | None = None, layer_id: int = 0,
                 expert_inter: int | None = None, shared_inter: int | None = None,
                 ep: int = 1, etp: int = 1, shared_sp: int = 1,
                 kernels: KernelProfile | None = None, shared_split: bool = True,
                 shared_kind: str = "dense", router: RouterSpec | None = None,
                 shared_expert_gate: bool | None = None):
        super().__init__()
        self.kernels = kernels or get_profile("eager")
        if experts not in EXPERT_KERNELS:
            raise TracememError(f"--experts {experts!r} is invalid; choose one of "
                                f"{', '.join(EXPERT_KERNELS)}")
        self.cfg = cfg
        self.layer_id = layer_id
        self.ep, self.etp = ep, etp
        self.expert_ids = expert_ids or range(cfg.num_routed_experts)
        n, h = len(self.expert_ids), cfg.hidden_size
        inter = expert_inter or cfg.moe_intermediate_size
        shared = cfg.shared_experts_width if shared_inter is None else shared_inter
        self.gate = Gate(cfg, router)
        if experts == "grouped":
            self.experts = GroupedExperts(n, h, inter, self.kernels, gated=cfg.gated_mlp,
                                          activation=cfg.hidden_act)
        else:
            self.experts = nn.ModuleList(MLP(h, inter, component="routed_experts",
                                             kind="expert", ep=True, gated=cfg.gated_mlp,
                                             activation=cfg.hidden_act) for _ in range(n))
        overlap = (self.kernels.orchestration == "megatron"
                   and self.kernels.options["moe_shared_expert_overlap"])
        if shared and overlap and not cfg.gated_mlp:
            raise TracememError("shared experts without SwiGLU under "
                                "--moe-shared-expert-overlap are not modelled")
        self.shared_experts = (MLP(h, shared, shared_sp, self.kernels, overlap,
                                   component="shared_experts", kind=shared_kind,
                                   split=shared_split, gated=cfg.gated_mlp,
                                   activation=cfg.hidden_act)
                               if shared else None)
        if shared_expert_gate is None:
            shared_expert_gate = cfg.shared_expert_gate
        if shared_expert_gate and not shared:
            raise TracememError("a shared-expert gate needs shared experts (their width is 0)")
        self.recompute_shared = False  # --recompute-modules shared_experts (set_recompute)
        self.shared_expert_gate = None
        if shared_expert_gate:  # Megatron's gate_weight: replicated over TP, with the shared
            self.shared_expert_gate = declare_module(Linear(h, 1),  # experts' ZeRO group
                                                     replicated("shared_experts", shared_kind))
        self._gate_first = overlap

    def forward(self, x: Tensor, routing: RoutingModel) -> Tensor:
        if self.kernels.orchestration == "megatron":
            return self._forward_megatron(x, routing)
        shape = x.shape
        x = x.view(-1, shape[-1])  # (T, h)
        k = self.cfg.num_experts_per_tok
        weights, ids = self.gate(x)  # (T, k) each
        all_counts = routing.counts(x.shape[0], k, self.cfg.num_routed_experts, self.layer_id,
                                    expert_ids=ids)
        counts = [all_counts[e] for e in self.expert_ids]
        order = ids.view(-1).argsort(stable=True)  # token-slots sorted by expert, (T * k,)
        if self.ep == 1 and len(counts) < len(all_counts):  # only the slots of local experts
            first = sum(all_counts[:self.expert_ids.start])
            order = order.narrow(0, first, sum(counts))
        token = order // k  # the token of each sorted slot
        routed_in = x.index_select(0, token)  # (slots, h), grouped by expert
        if self.ep > 1:  # dispatch: every EP peer is assumed to route as this rank does
            counts = [c * self.ep for c in counts]
            routed_in = all_to_all(routed_in, sum(counts))
        if self.etp > 1:  # tokens of the whole ETP group go through each expert shard
            counts = [c * self.etp for c in counts]
            routed_in = all_gather(routed_in, self.etp, dim=0)
        if isinstance(self.experts, GroupedExperts):
            routed_out = self.experts(routed_in, counts)
        else:
            routed_out = torch.cat([expert(chunk) for expert, chunk in
                                    zip(self.experts, routed_in.split(counts))])
        routed_out = reduce_scatter(routed_out, self.etp, dim=0)
        if self.ep > 1:  # combine: the reverse all-to-all brings this rank's slots back
            routed_out = all_to_all(routed_out, order.shape[0])
        routed_out = routed_out * weights.view(-1).index_select(0, order).unsqueeze(-1)
        y = torch.zeros_like(x).index_add(0, token, routed_out).view(shape)  # combine
        if self.shared_experts is not None:
            y = y + self._shared(x.view(shape))
        return y

    def set_recompute(self, modules: frozenset[str]) -> None:
        """Selective recompute inside the layer (``Block.set_recompute``): ``moe_act``, the
        routed experts' activation (``CheckpointWithoutOutput``, ``_megatron_experts``);
        ``shared_experts``, the shared experts whole (Megatron's reentrant
        ``tensor_parallel.checkpoint``, moe_layer.py ``MoELayer.shared_experts_compute``; under
        another profile ``torch.utils.checkpoint``). Under the megatron-te option
        ``fp8_moe_act_cache`` (DeepSeek-V3's scheme), ``moe_act`` also caches a SwiGLU shared
        expert's SwiGLU input in FP8 (``fp8_cached_swiglu``, with or without
        ``--moe-shared-expert-overlap``), unless the shared experts are recomputed whole.

        Raises:
            TracememError: ``moe_act`` with sequential experts, ``shared_experts`` with
                ``moe_shared_expert_overlap`` (TransformerConfig.__post_init__'s messages).
        """
        grouped = isinstance(self.experts, GroupedExperts)
        if "moe_act" in modules and not grouped:
            raise TracememError("moe_act in recompute_modules is only supported with "
                                "moe_grouped_gemm (--experts grouped)")
        if "shared_experts" in modules and self.shared_experts is not None \
                and self.shared_experts.shared_overlap:
            raise TracememError("shared_experts recompute cannot work with "
                                "--moe-shared-expert-overlap. (Megatron's rule: add "
                                "--no-moe-shared-expert-overlap)")
        if grouped:
            self.experts.recompute_act = "moe_act" in modules
        self.recompute_shared = "shared_experts" in modules
        shared = self.shared_experts
        if shared is not None and shared.swiglu:
            # DeepSeek-V3's FP8 cache of the SwiGLU input "in MoE" (arXiv 2412.19437 3.3.3)
            # covers the shared expert too (not Megatron's: its moe_act is TEGroupedMLP's
            # alone); fc2 then keeps its recomputed bf16 input, as the routed experts' does
            cache = ("moe_act" in modules and not self.recompute_shared
                     and bool(shared.kernels.options.get("fp8_moe_act_cache")))
            shared.fp8_act_cache = cache
            if cache:
                shared.w2.save_original_input = True

    def offload_experts(self) -> bool:
        """Whether the routed experts start the ``expert_fc1`` and ``moe_act`` offloading
        groups: grouped experts under a Megatron profile (``TEGroupedMLP``)."""
        k = self.experts.kernels if isinstance(self.experts, GroupedExperts) else None
        return k is not None and k.orchestration == "megatron"

    def _shared(self, x: Tensor) -> Tensor:
        """The shared experts on ``x`` ``(b, s_local, h)`` (``_shared_experts``), recomputed
        in backward under ``shared_experts`` recompute."""
        if not self.recompute_shared:
            return self._shared_experts(x)
        if self.kernels.orchestration == "megatron":
            return megatron_checkpoint(self._shared_experts, None, x)
        return checkpoint(self._shared_experts, x, use_reentrant=False)

    def _shared_experts(self, x: Tensor) -> Tensor:
        """The shared experts on ``x`` ``(b, s_local, h)``, times the sigmoid gate if any
        (computed before the experts under Megatron's shared-expert overlap, else after)."""
        if self.shared_expert_gate is None:
            return self.shared_experts(x)
        weight = self.shared_expert_gate.weight  # (1, h)
        if self._gate_first:
            score = torch.sigmoid(F.linear(x, weight))  # (b, s_local, 1)
            return self.shared_experts(x) * score
        out = self.shared_experts(x)
        return out * torch.sigmoid(F.linear(x, weight))

    def _local_counts(self, x: Tensor, ids: Tensor, routing: RoutingModel) -> list[int]:
        """Token-slots each local expert computes (after EP / ETP), from the routing model."""
        all_counts = routing.counts(x.shape[0], self.cfg.num_experts_per_tok,
                                    self.cfg.num_routed_experts, self.layer_id, expert_ids=ids)
        return [all_counts[e] * self.ep * self.etp for e in self.expert_ids]


    def _forward_megatron(self, x: Tensor, routing: RoutingModel) -> Tensor:
        """Megatron-Core's ``MoELayer`` with ``MoEAlltoAllTokenDispatcher`` (megatron/core/
        transformer/moe/token_dispatcher.py at Megatron-LM d98e8a6): ``dispatch_preprocess``
        gathers the shared experts' input and permutes, and keeps the probabilities, the
        routing map and the row-id map as the dispatcher's attributes until the layer's next
        forward (``_keep_on_dispatcher``);
        ``token_dispatch`` all-to-alls the tokens, runs the shared experts' fc1 and
        activation, all-to-alls the probabilities; ``dispatch_postprocess`` gathers over
        expert TP and sorts the chunks; the experts; ``combine_preprocess`` unsorts, then
        reduce-scatters over expert TP in the probabilities' dtype (fp32) and casts back;
        ``token_combine`` all-to-alls back and runs the shared experts' fc2 and their
        reduce-scatter; ``combine_postprocess`` unpermutes and adds the shared output in place.
        The shared experts' Nodes get the sequence numbers ``SharedExpertMLP`` gives them
        (``set_tensor_grad_fn_sequence_sr``: their backward runs first)."""
        k, cfg = self.kernels, self.cfg
        shape = x.shape
        shared = self.shared_experts
        overlap = shared is not None and shared.shared_overlap
        # MoELayer.shared_experts_compute: without the overlap the shared experts run first
        # and their output lives through the routed experts (postprocess adds it)
        shared_out = self._shared(x) if shared is not None and not overlap else None
        if k.options["moe_token_dispatcher"] == "allgather":
            return self._forward_megatron_allgather(x, routing, shared_out)
        x = x.view(-1, shape[-1])  # (T, h)
        tokens, top_k = x.shape[0], cfg.num_experts_per_tok
        probs, routing_map, ids = self.gate.route_megatron(x, k)  # (T, E) each
        counts = self._local_counts(x, ids, routing)  # token-slots of each local expert
        rows = sum(counts)
        del ids  # the router's top-k indices die with TopKRouter.routing (saved if needed)
        slots = tokens * top_k if self.ep > 1 or len(self.expert_ids) == cfg.num_routed_experts \
            else rows
        if overlap:  # SharedExpertMLP.pre_forward_comm: the gate's score (--moe-shared-
            # expert-gate), then the gather (or copy_to_tensor_model_parallel_region)
            if self.shared_expert_gate is not None:
                gate_score = torch.sigmoid(F.linear(x.view(shape),
                                                    self.shared_expert_gate.weight))
            shared_in = _mark_first(_collective(all_gather, x.view(shape), shared.sp, 1))
        # The variables below live as long as their namesakes in MoELayer.forward's
        # custom_forward (transformer/moe/moe_layer.py): the permuted tokens and the tokens
        # received by the all-to-all until the layer's output is made.
        # the option fp8_dispatch: the tokens leave and the output gradient arrives in FP8
        wires = (Payload(), Payload()) if k.options.get("fp8_dispatch") else None
        if wires is not None:  # quantised, then permuted: hidden_states is a placeholder
            hidden_states, permuted_probs, row_id_map = fp8_dispatch.permute(
                x, probs, slots, routing_map.shape[1], wires[0])
        else:
            hidden_states, permuted_probs, row_id_map = k.permute(x, probs, slots,  # (slots,
                                                                  routing_map)  # h)
        # dispatch_preprocess: self.probs, self.routing_map and (from permute) self.reversed_
        # local_input_permutation_mapping, kept on the dispatcher until the layer's next forward
        self._keep_on_dispatcher(probs=probs, routing_map=routing_map, row_id_map=row_id_map)
        del routing_map
        # token_dispatch: all-to-all of the tokens (an identity Node at EP 1, as Megatron's)
        if wires is not None:  # the payload's all-to-all (EP > 1: Job checks)
            dispatched, _ = fp8_dispatch.hop(hidden_states, rows // self.etp, "a2a", wires[0])
        else:
            dispatched = _collective(all_to_all, hidden_states, self.ep, rows // self.etp)
        if overlap:  # linear_fc1_forward_and_act, ordered after the tokens' all-to-all
            fc1_out = shared.w1(shared_in, fused=(shared.w3,))
            del shared_in
            shared_ckpt = None
            if shared.fp8_act_cache and getattr(shared.kernels, "fp8_recipe", "none") != "none":
                shared_ckpt, shared_h = fp8_cached_swiglu(shared.kernels, fc1_out)
            else:
                shared_h = shared.kernels.swiglu(fc1_out)
            del fc1_out
            if dispatched.grad_fn is not None:
                shared_h.grad_fn._set_sequence_nr(dispatched.grad_fn._sequence_nr() - 1)
            shared_h = _BackwardStreamWait.apply(shared_h)
        # and of the probabilities (custom_forward rebinds `probs`: the permuted ones go)
        permuted_probs = _collective(all_to_all, permuted_probs, self.ep, rows // self.etp)
        out = self._routed_experts_megatron(dispatched, permuted_probs, probs.dtype, x.dtype,
                                            counts, wires)
        if wires is not None:  # token_combine in bf16; its backward moves the FP8 gradient
            out, _ = fp8_dispatch.hop(out, slots, "a2a", bwd=wires[1])
        else:
            out = _collective(all_to_all, out, self.ep, slots)  # token_combine
        if overlap:  # linear_fc2_forward, post_forward_comm (or reduce_from_tensor_model_...)
            _mark_first(out)
            fc2_out = shared.w2(shared_h)
            if shared_ckpt is not None:  # the SwiGLU's output dropped, recomputed in backward
                shared_ckpt.discard_output_and_register_recompute(fc2_out)
            shared_out = _mark_first(_collective(reduce_scatter, fc2_out, shared.sp, 1))
            del shared_h, fc2_out
        if wires is not None:  # in backward the gradient is quantised and permuted here
            y = fp8_dispatch.unpermute(out, row_id_map, tokens, wires[1]).view(shape)
        else:
            y = k.unpermute(out, row_id_map, tokens).view(shape)  # (b, s_local, h)
        if overlap:
            if self.shared_expert_gate is not None:  # get_output
                shared_out = shared_out * gate_score
            y += shared_out  # combine_postprocess: output += shared_expert_output
        elif shared_out is not None:
            y = y + shared_out  # MoELayer.postprocess
        return y

    def _forward_megatron_allgather(self, x: Tensor, routing: RoutingModel,
                                    shared_out: Tensor | None) -> Tensor:
        """Megatron-Core's ``MoELayer`` with ``MoEAllGatherTokenDispatcher`` (``--moe-token-
        dispatcher-type allgather``, Megatron's default; megatron/core/transformer/moe/
        token_dispatcher.py at Megatron-LM d98e8a6). ``token_dispatch``: over the ETP x EP
        group, the routing map (under ``no_grad``), the dense probabilities and the tokens are
        all-gathered (``gather_from_sequence_parallel_region``; the tokens into Megatron's
        global memory buffer, ``use_global_buffer=True``, which ``tracemem.workspaces``
        counts as persistent while the trace sees the gather as a transient);
        ``dispatch_postprocess``: the local experts' columns of the map and of the
        probabilities (``.contiguous()`` copies), ``permute`` of the gathered tokens with the
        local map, the local probabilities ``masked_select``-ed in expert order; the experts;
        ``combine_preprocess``: ``unpermute`` to the gathered ``(T x ETP x EP, h)``;
        ``token_combine``: a reduce-scatter in the probabilities' dtype, cast back;
        ``postprocess`` adds the shared experts' output (computed first). ``x`` ``(b,
        s_local, h)``; returns the same shape. The dispatcher's ``local_map``, ``local_probs``
        (after the ``masked_select``) and permutation map stay its attributes until the
        layer's next forward (``_keep_on_dispatcher``)."""
        k = self.kernels
        shape = x.shape
        x = x.view(-1, shape[-1])  # (T, h)
        probs, routing_map, ids = self.gate.route_megatron(x, k)  # (T, E) each
        counts = self._local_counts(x, ids, routing)  # token-slots of each local expert
        rows = sum(counts)
        del ids
        group = self.etp * self.ep  # tp_ep_group: expert TP x EP
        hidden = x
        if group > 1:
            with torch.no_grad():
                routing_map = all_gather(routing_map, group, dim=0)  # (T * group, E)
            probs = all_gather(probs, group, dim=0)
            hidden = all_gather(x, group, dim=0)  # (T * group, h)
        gathered = hidden.shape[0]
        first, stop = self.expert_ids.start, self.expert_ids.stop
        local_map = routing_map[:, first:stop].contiguous()  # (T * group, E_local) bool
        local_probs = probs[:, first:stop].contiguous()
        del routing_map, probs
        permuted, _, mapping = k.permute(hidden, None, rows, local_map)  # (rows, h)
        del hidden
        local_probs = masked_select(local_probs.T.contiguous(), local_map.T.contiguous(),
                                    rows)  # (rows,)
        # dispatch_postprocess: self.local_map, self.local_probs and self.reversed_local_
        # input_permutation_mapping, kept on the dispatcher until the layer's next forward
        self._keep_on_dispatcher(local_map=local_map, local_probs=local_probs,
                                 mapping=mapping)
        probs_col = local_probs.unsqueeze(-1)
        out = self._experts_megatron(permuted, probs_col, counts)  # (rows, h)
        del permuted, probs_col
        out = k.unpermute(out, mapping, gathered)  # (T * group, h)
        del mapping, local_map
        if group > 1:  # token_combine
            out = reduce_scatter(out.to(local_probs.dtype), group, dim=0).to(x.dtype)
        y = out.view(shape)
        if shared_out is not None:
            y = y + shared_out
        return y

    def _keep_on_dispatcher(self, **state: Tensor) -> None:
        """The tensors Megatron-Core's token dispatcher keeps as attributes from this forward
        until the layer's next one replaces them (megatron-core 0.16.1 transformer/moe/
        token_dispatcher.py: ``MoEAlltoAllTokenDispatcher.dispatch_preprocess``, and
        ``MoEAllGatherTokenDispatcher.dispatch_postprocess``), across microbatches: marked
        for the tracer (``MemoryTracer.retain``, one slot per layer and attribute), whose
        schedule replay holds each until the slot's next storage is made. Held against
        Megatron-Core's schedules in ``tracemem.oracle.schedule_oracle``."""
        tracer = active_tracer()
        if tracer is not None:
            for name, tensor in state.items():
                tracer.retain(tensor, f"moe{self.layer_id}.dispatcher.{name}")

    def _routed_experts_megatron(self, tokens: Tensor, probs: Tensor, probs_dtype, dtype,
                                 counts: list[int], wires: tuple | None = None) -> Tensor:
        """``MoELayer.routed_experts_compute``: ``dispatch_postprocess`` (gather over expert
        TP, chunk sort), the experts, ``combine_preprocess`` (chunk unsort, then the expert-TP
        reduce-scatter in ``probs_dtype``, cast back to ``dtype``). ``tokens`` ``(rows /
        ETP, h)`` received; returns ``(rows / ETP, h)``. ``wires``: the option
        ``fp8_dispatch``'s payloads, which the sort and the unsort move."""
        k = self.kernels
        if self.etp > 1:  # dispatch_postprocess: gather over the expert-TP group
            tokens = all_gather(tokens, self.etp, dim=0)
            probs = all_gather(probs, self.etp, dim=0)
        several = len(self.expert_ids) > 1
        if several and wires is not None:  # sort the received payload by local expert
            tokens, probs = fp8_dispatch.hop(tokens, tokens.shape[0], "sort", wires[0],
                                             probs=probs)
        elif several:  # sort the received chunks by local expert
            tokens, probs = k.sort_chunks(tokens, probs)
        probs_col = probs.unsqueeze(-1)  # (rows, 1)
        expert_output = self._experts_megatron(tokens, probs_col, counts, wires)  # (rows, h)
        # dispatched_input and permuted_probs stay bound in routed_experts_compute through
        # combine_preprocess (the unsort, fp32 cast and reduce-scatter): it matters where
        # nothing saved them, in the no_grad forward of full or moe recompute
        out = expert_output
        if several and wires is not None:  # combine_preprocess: unsort (in backward the
            out, _ = fp8_dispatch.hop(out, out.shape[0], "sort", bwd=wires[1])  # payload)
        elif several:  # combine_preprocess: unsort
            out, _ = k.sort_chunks(out)
        if self.etp > 1:  # reduce-scatter in the probabilities' dtype
            out = reduce_scatter(out.to(probs_dtype), self.etp, dim=0).to(dtype)
        return out


    def _experts_megatron(self, tokens: Tensor, probs_col: Tensor, counts: list[int],
                          wires: tuple | None = None) -> Tensor:
        """The local experts on ``tokens`` ``(rows, h)`` sorted by expert, ``counts`` rows
        each, probabilities ``probs_col`` ``(rows, 1)``: ``TEGroupedMLP`` (grouped experts)
        or Megatron's ``SequentialMLP`` (``--moe-grouped-gemm`` off; megatron/core/
        transformer/moe/experts.py at Megatron-LM d98e8a6): one expert: its ``MLP`` on all
        rows; several: ``torch.split`` by count (views), each expert's ``MLP`` (megatron/core/
        transformer/mlp.py ``MLP.forward`` with ``per_token_scale``: TE fc1, the activation
        with the probabilities as in ``TEGroupedMLP``, TE fc2; experts' linears do no TP
        communication, ``explicit_expert_comm``) and ``torch.cat`` of their outputs, a new
        ``(rows, h)`` buffer (the per-expert outputs die with it: ``CatBackward0`` keeps
        sizes)."""
        if isinstance(self.experts, GroupedExperts):  # counts: each expert quantised apart
            return self.experts(tokens, counts, probs_col, wires)
        if wires is not None:
            raise TracememError("kernel option fp8_dispatch feeds the grouped experts' fc1; "
                                "these experts are sequential (--experts grouped)")
        gated, act = self.cfg.gated_mlp, self.cfg.hidden_act
        k = self.kernels

        def run(expert, x, p):
            fc1 = [expert.w1.weight, expert.w3.weight] if gated else [expert.w1.weight]
            hidden = _weighted_activation(k, k.linear(x, fc1, "duplicated", 1), p, gated, act)
            return k.linear(hidden, [expert.w2.weight], "duplicated", 1)
        if len(self.experts) == 1:
            return run(self.experts[0], tokens, probs_col)
        outs = [run(e, x, p) for e, x, p in zip(self.experts, tokens.split(counts),
                                                probs_col.split(counts))]
        out = torch.cat(outs, dim=0)
        del outs
        return out


class _Identity(torch.autograd.Function):
    """Megatron-Core's collectives over a group of one (tensor_parallel/mappings.py: the
    ``_AllToAll``, ``_GatherFromSequenceParallelRegion``, ``_CopyToModelParallelRegion`` ...
    Functions return their input): an autograd Node that allocates nothing."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


class _BackwardStreamWait(_Identity):
    """Megatron-Core's ``_BackwardStreamWait`` (transformer/moe/shared_experts.py): an
    identity whose backward waits for the shared experts' stream; a Node, no memory."""


def _collective(op, t: Tensor, world: int, arg: int) -> Tensor:
    """``op(t, world, arg)`` (``all_gather`` / ``reduce_scatter`` along ``arg``) or
    ``op(t, arg)`` (``all_to_all`` to ``arg`` rows) over ``world`` ranks; an identity Node
    when ``world`` is 1, as Megatron-Core's collectives are."""
    if world == 1:
        return _Identity.apply(t)
    return op(t, arg) if op is all_to_all else op(t, world, arg)


def _mark_first(t: Tensor) -> Tensor:
    """``set_tensor_grad_fn_sequence_sr(t, torch.iinfo(torch.int).max)``: the autograd engine
    runs ``t``'s Node as soon as it is ready, before Nodes made earlier."""
    if t.grad_fn is not None:
        t.grad_fn._set_sequence_nr(torch.iinfo(torch.int).max)
    return t
