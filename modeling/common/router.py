"""The MoE router (``gate``): scores, top-k, the weights of the chosen experts; and the
Qwen2-MoE shared-expert gate.

``RouterSpec`` says which router a family runs; ``Gate`` runs it. The variants:

- score function: ``softmax`` or ``sigmoid``;
- where the softmax goes (``pre_softmax``): over all E logits before the top-k (DeepSeek-V2's
  ``MoEGate``, Hugging Face ``Qwen3MoeSparseMoeBlock.forward`` / ``Qwen2MoeSparseMoeBlock.
  forward``: softmax, topk, optional renormalisation), or over the k chosen logits after it
  (Mixtral: mistral-inference ``moe.py`` ``MoeLayer.forward``: ``topk`` of the gate logits,
  then ``softmax`` of those k in fp32);
- renormalising the top-k weights to sum to 1 (``norm_topk_prob``);
- group-limited top-k (DeepSeek-V2 ``group_limited_greedy``: groups ranked by their best score;
  V3 ``noaux_tc``: by the sum of their two best, with a per-expert correction bias that only
  picks experts);
- a routed scaling factor, or none (``scaling_factor`` None: no multiply is run, as in the Qwen
  and Mixtral references).

Under a Megatron kernel profile the router is Megatron-Core's ``TopKRouter`` (megatron/core/
transformer/moe/router.py ``TopKRouter.routing``, moe_utils.py
``topk_routing_with_score_function``, Megatron-LM d98e8a6): fp32 logits from
``RouterGatingLinearFunction``; softmax with ``use_pre_softmax``: softmax, topk; without:
topk of the logits, softmax of the k; sigmoid: sigmoid, (bias) topk, gather, renormalise
(``topk > 1``); then ``probs * scaling_factor`` when one is set. Megatron has no
renormalisation for softmax scores, so a softmax router that renormalises runs as
``use_pre_softmax=False`` (the same weights: softmax over the chosen logits), which is how
Megatron's Qwen3-MoE and Mixtral recipes set it (``--moe-router-pre-softmax`` off); one that
does not (DeepSeek-V2, Qwen1.5-MoE) runs as ``use_pre_softmax=True``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from modeling.kernels import KernelProfile
from modeling.parallel.groups import declare_module, replicated
from tracemem.errors import TracememError

__all__ = ["RouterSpec", "Gate", "SCORING_FUNCS"]

SCORING_FUNCS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class RouterSpec:
    """Which router runs (see the module docstring).

    Attributes:
        num_experts: routed experts E (the gate weight is ``(E, h)``).
        top_k: experts per token k.
        scoring_func: "softmax" or "sigmoid".
        pre_softmax: softmax over all E logits before the top-k (True) or over the k chosen
            logits after it (False; softmax only).
        norm_topk_prob: renormalise the k weights to sum to 1 (a softmax over the chosen
            logits sums to 1 already, so it is not run there).
        num_expert_groups, topk_group: group-limited top-k when ``group_limited`` (tokens
            keep the best ``topk_group`` of ``num_expert_groups`` groups).
        group_limited: whether groups limit the top-k.
        correction_bias: V3's per-expert bias buffer ``e_score_correction_bias`` (fp32,
            ``(E,)``) added to the scores to pick experts; groups then rank by their two best.
        scaling_factor: multiplier on the weights, or None for no multiply.
        gather: the weights are the scores gathered at the chosen ids (DeepSeek-V3's
            reference ``Gate.forward``, inference/model.py, for every DeepSeek router), not
            ``topk``'s own values (Hugging Face Qwen-MoE, Mixtral); ``gather`` saves its whole
            ``(T, E)`` input for backward. Bias-corrected or group-limited selection always
            gathers (the selection scores are not the weights).
        sinkhorn: Megatron's Sinkhorn load balancing (``--moe-router-load-balancing-type
            sinkhorn``; ``Gate.route_megatron``), Megatron profiles only.

    Raises:
        TracememError: an unknown score function, k above E, groups that do not divide E.
    """

    num_experts: int
    top_k: int
    scoring_func: str = "softmax"
    pre_softmax: bool = True
    norm_topk_prob: bool = False
    num_expert_groups: int = 1
    topk_group: int = 1
    group_limited: bool = False
    correction_bias: bool = False
    scaling_factor: float | None = None
    gather: bool = False
    sinkhorn: bool = False

    def __post_init__(self) -> None:
        if self.scoring_func not in SCORING_FUNCS:
            raise TracememError(f"router scoring_func={self.scoring_func!r} is invalid; it "
                                f"must be one of {', '.join(SCORING_FUNCS)}")
        if not 0 < self.top_k <= self.num_experts:
            raise TracememError(f"router top_k={self.top_k} is invalid; it must be in 1.."
                                f"{self.num_experts} (the routed experts)")
        if self.group_limited and (self.num_experts % self.num_expert_groups
                                   or self.topk_group > self.num_expert_groups):
            raise TracememError(f"router groups {self.num_expert_groups} (keeping "
                                f"{self.topk_group}) do not divide {self.num_experts} experts")

    @classmethod
    def of(cls, cfg) -> RouterSpec:
        """The router a ``ModelConfig`` states (its scoring_func, router_pre_softmax,
        norm_topk_prob, topk_method, n_group, topk_group, routed_scaling_factor,
        router_gather)."""
        return cls(num_experts=cfg.num_routed_experts, top_k=cfg.num_experts_per_tok,
                   scoring_func=cfg.scoring_func,
                   pre_softmax=cfg.router_pre_softmax,
                   norm_topk_prob=cfg.norm_topk_prob,
                   num_expert_groups=cfg.num_expert_groups, topk_group=cfg.topk_group,
                   group_limited=cfg.topk_method not in ("greedy", "sinkhorn")
                   and cfg.num_expert_groups > 1,
                   correction_bias=cfg.has_correction_bias,
                   scaling_factor=cfg.routed_scaling_factor, gather=cfg.router_gather,
                   sinkhorn=cfg.topk_method == "sinkhorn")

    @property
    def megatron_pre_softmax(self) -> bool:
        """Megatron's ``use_pre_softmax`` for this softmax router (module docstring)."""
        return self.pre_softmax and not self.norm_topk_prob


class Gate(nn.Module):
    """The router: weight ``(E, h)`` (no bias), and for V3's routing the correction-bias
    buffer (no gradient, no optimizer state).

    ``forward(x, kernels)``: ``x`` ``(T, h)``; returns the weights ``(T, k)`` (in ``x``'s
    dtype; fp32 under a Megatron profile, which keeps probabilities in fp32) and the expert
    ids ``(T, k)`` int64.

    Args:
        cfg: a ``ModelConfig`` (its hidden size, and the router via ``RouterSpec.of``).
        spec: the router, when not the config's.
    """

    def __init__(self, cfg, spec: RouterSpec | None = None):
        super().__init__()
        self.spec = spec = spec or RouterSpec.of(cfg)
        self.weight = nn.Parameter(torch.empty(spec.num_experts, cfg.hidden_size))
        if spec.correction_bias:
            self.register_buffer("e_score_correction_bias",
                                 torch.zeros(spec.num_experts, dtype=torch.float32))
        # Megatron-Core's TopKRouter: weight and expert bias replicated, dense (allreduce)
        declare_module(self, replicated("router"))

    def forward(self, x: Tensor, kernels: KernelProfile | None = None) -> tuple[Tensor, Tensor]:
        megatron = kernels is not None and kernels.orchestration == "megatron"
        if self.spec.sinkhorn:
            raise TracememError("Sinkhorn routing (Megatron's --moe-router-load-balancing-type "
                                "sinkhorn) runs under the megatron-te kernel profile only")
        if megatron:
            logits = kernels.router_logits(x, self.weight)  # (T, E) fp32
        else:
            logits = F.linear(x, self.weight)  # (T, E)
        spec = self.spec
        post = spec.scoring_func == "softmax" and not (
            spec.megatron_pre_softmax if megatron else spec.pre_softmax)
        if post:  # top-k of the logits, then the softmax of the k
            scores = logits
        elif spec.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1, dtype=torch.float32)
        # One function, as the references are: every intermediate lives to its end (and the
        # locals are made in the order that keeps DeepSeek's frees at the end as they were).
        if spec.gather or spec.correction_bias or spec.group_limited:
            original = scores  # select with the bias and groups, weigh with unbiased scores
            if spec.correction_bias:
                scores = scores + self.e_score_correction_bias
            if spec.group_limited:
                grouped = scores.view(x.shape[0], spec.num_expert_groups, -1)  # (T, G, E / G)
                if spec.correction_bias:
                    group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # (T, G)
                else:
                    group_scores = grouped.amax(dim=-1)
                keep = group_scores.topk(spec.topk_group, dim=-1)[1]  # (T, topk_group)
                mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
                scores = grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(1)
            ids = scores.topk(spec.top_k, dim=-1)[1]  # (T, k)
            weights = original.gather(1, ids)
        else:  # the references' plain topk
            weights, ids = scores.topk(spec.top_k, dim=-1)  # (T, k) each
        if post:
            weights = weights.softmax(dim=-1, dtype=torch.float32)
        # Megatron renormalises sigmoid scores (topk > 1) and never softmax ones
        elif (spec.scoring_func == "sigmoid" and spec.top_k > 1) if megatron \
                else spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if spec.scaling_factor is not None:
            if megatron:
                return weights * spec.scaling_factor, ids  # Megatron keeps probs in fp32
            return (weights * spec.scaling_factor).type_as(x), ids
        return (weights if megatron else weights.type_as(x)), ids

    def route_megatron(self, x: Tensor, kernels: KernelProfile) -> tuple[Tensor, Tensor, Tensor]:
        """Megatron-Core's ``TopKRouter.routing`` for ``x`` ``(T, h)`` as its MoE layer runs it:
        the fp32 router GEMM, then ``topk_routing_with_score_function`` op for op (megatron/
        core/transformer/moe/moe_utils.py at Megatron-LM d98e8a6, the same at megatron-core
        0.16.1): softmax scores before (``use_pre_softmax``) or after the top-k, or sigmoid
        scores, the correction bias for the choice only, ``group_limited_topk`` (group score:
        the sum of the top ``k / groups`` scores; a 0/1 group mask; masked scores), sigmoid
        scores normalised by their sum (k > 1), the scaling factor, and the dense ``probs``
        ``(T, E)`` fp32 and ``routing_map`` ``(T, E)`` bool scattered from the top-k. Returns
        ``probs``, ``routing_map`` and the top-k ids ``(T, k)`` int64 (held against
        megatron-core by ``tracemem validate --against megatron-core``)."""
        spec = self.spec
        logits = kernels.router_logits(x, self.weight)  # (T, E), the router dtype
        if spec.sinkhorn:
            return self._megatron_sinkhorn(logits)
        if spec.scoring_func == "softmax":
            if spec.megatron_pre_softmax:
                scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
                probs, ids = self._megatron_topk(scores)
            else:
                scores, ids = self._megatron_topk(logits)
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).type_as(logits)
        else:
            scores = torch.sigmoid(logits.float()).type_as(logits)
            if spec.correction_bias:
                _, ids = self._megatron_topk(scores + self.e_score_correction_bias)
                scores = torch.gather(scores, dim=1, index=ids).type_as(logits)
            else:
                scores, ids = self._megatron_topk(scores)
            probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20) \
                if spec.top_k > 1 else scores
        if spec.scaling_factor:
            probs = probs * spec.scaling_factor
        routing_probs = torch.zeros_like(logits).scatter(1, ids, probs)
        routing_map = torch.zeros_like(logits).int().scatter(1, ids, 1).bool()
        return routing_probs, routing_map, ids

    def _megatron_sinkhorn(self, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``TopKRouter.sinkhorn_load_balancing`` in training (megatron/core/transformer/moe/
        router.py at Megatron-LM d98e8a6): under ``no_grad`` the top-k of ``sinkhorn(logits
        in fp32)`` (moe_utils.py ``sinkhorn``), then the activation of the logits (sigmoid for
        k = 1, else an fp32 softmax cast back), the 0/1 map scattered from the top-k, and
        ``probs = activation * map`` (``(T, E)``, which saves the bool map). Sinkhorn's loop
        runs until its error is below a tolerance, a count that depends on the values; every
        iteration allocates the same ``(T, E)`` and ``(T,)`` / ``(E,)`` temporaries and drops
        the previous ones, so one iteration here has the loop's memory (its peak is the
        same)."""
        top_k = self.spec.top_k
        with torch.no_grad():
            cost = torch.exp(logits.to(dtype=torch.float32))  # (T, E)
            d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
            d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
            d1_old, eps = d1, 0.00000001
            d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
            d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
            error = torch.mean(torch.abs(d1_old - d1))  # the loop's test (one iteration)
            norm_logits = d1 * cost * d0.unsqueeze(1)
            del cost, d0, d1, d1_old, error
            _, ids = torch.topk(norm_logits, k=top_k, dim=1)
            del norm_logits
        if top_k == 1:
            activated = torch.sigmoid(logits)
        else:
            activated = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
        routing_map = torch.zeros_like(activated).int().scatter(1, ids, 1).bool()
        return activated * routing_map, routing_map, ids

    def _megatron_topk(self, scores: Tensor) -> tuple[Tensor, Tensor]:
        """``topk_routing_with_score_function``'s ``compute_topk``: ``group_limited_topk``
        with expert groups, else ``torch.topk``."""
        spec = self.spec
        if not spec.group_limited:
            return torch.topk(scores, k=spec.top_k, dim=-1)
        tokens, groups = scores.shape[0], spec.num_expert_groups
        group_scores = scores.view(tokens, groups, -1).topk(
            spec.top_k // spec.topk_group, dim=-1)[0].sum(dim=-1)  # (T, G)
        group_idx = torch.topk(group_scores, k=spec.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(
            tokens, groups, spec.num_experts // groups).reshape(tokens, -1)
        masked = scores.masked_fill(~score_mask.bool(), float("-inf"))
        return torch.topk(masked, k=spec.top_k, dim=-1)
