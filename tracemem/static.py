"""Static memory of one rank: parameters, gradients and optimizer states, by parameter group
(dense vs expert), under a ZeRO stage and a precision recipe (``tracemem.precision``: bytes per
element of parameters, main grads, master weights and Adam moments, in Megatron's flags).

Counts come from the rank's real module (``modeling.parallel.build_rank`` on the meta device);
only the bytes per element and the ZeRO divisors are conventions, each cited below.

ZeRO (Rajbhandari et al. 2020, arXiv 1910.02054): stage 1 shards optimizer states, stage 2 also
gradients, stage 3 also parameters; which group shards each quantity (dense: DP x CP, expert:
EDP) is the table ``tracemem.parallel.SHARDING``, each row cited to Megatron-Core; which group
a parameter is in is its own declaration (``modeling.parallel.groups``: made where the module
makes the parameter, as Megatron-Core's ``allreduce`` attribute is), never its name.
A sharded count is rounded up (ceil) to whole elements per rank. Under ZeRO-3 each FSDP unit
(decoder layer, MTP module, embedding, head; ``tracemem.zero3``) is all-gathered before use:
``zero3_gather_bytes`` is the largest single unit's gathered parameters, the least a ZeRO-3 rank
needs on top of its shards. ``tracemem.estimate`` does not add it: it traces every gather
(before each unit's forward and backward, freed after) and the replay places them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from modeling.parallel.groups import numel_by_kind
from modeling.params import count_by_component
from tracemem.categories import Category
from tracemem.precision import PRECISION_RECIPES, Precision
from tracemem.zero3 import unit_params

__all__ = ["Precision", "PRECISION_RECIPES", "StaticMemory", "static_memory",
           "fused_wgrad_modules", "is_fused_wgrad"]


def is_fused_wgrad(event, fused: dict[str, set[tuple[int, ...]]]) -> bool:
    """Whether a backward ``MemoryEvent`` is a weight gradient that gradient-accumulation
    fusion never materialises: a ``gradient`` storage of a fused module, or a ``temporary`` one
    of that module with one of its weights' shapes (the partial gradient of a weight used twice,
    such as the head under MTP, held until autograd sums it)."""
    shapes = fused.get(event.module)
    if shapes is None:
        return False
    return event.category is Category.GRADIENT or (
        event.category is Category.TEMPORARY and tuple(event.shape) in shapes)


def fused_wgrad_modules(model: nn.Module) -> dict[str, set[tuple[int, ...]]]:
    """Module paths whose weight gradients ``--gradient-accumulation-fusion`` writes straight
    into the main grad: every linear layer (Megatron's ``ColumnParallelLinear`` /
    ``RowParallelLinear`` and TE's ``Linear``, including the output head) and the grouped
    experts (TE ``GroupedLinear``, ``fuse_wgrad_accumulation``). Not the embedding, the norms
    or the router, whose gradients autograd makes as usual. Values: the weights' shapes."""
    from modeling.common.moe import GroupedExperts

    return {name: {tuple(p.shape) for p in module.parameters(recurse=False)}
            for name, module in model.named_modules()
            if isinstance(module, (nn.Linear, GroupedExperts))}


@dataclass(frozen=True)
class StaticMemory:
    """Static bytes of one rank. Element counts are of parameters this rank holds (its TP /
    EP / ETP shard) before ZeRO; bytes are after ZeRO sharding.

    Attributes:
        dense_params, expert_params: parameter elements held, by ZeRO group (DP x CP vs EDP).
        param_bytes, grad_bytes, optimizer_bytes: after ZeRO.
        buffer_bytes: persistent buffers (the router's correction bias), never sharded.
        zero3_gather_bytes: ZeRO-3 only: the largest FSDP unit's parameters all-gathered
            (param_bytes per element, this rank's TP/EP shard of that unit: a decoder layer,
            MTP module, the embedding or the head; ``tracemem.zero3.zero3_units``), else 0.
        by_component: parameter elements held per component (``modeling.params.COMPONENTS``).
        workspaces: the allocations below the dispatcher this rank keeps
            (``tracemem.workspaces.Workspace``; empty when the job names no GPU), not in
            ``total_bytes``: ``workspace_bytes``.
    """

    dense_params: int
    expert_params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    buffer_bytes: int
    zero3_gather_bytes: int
    by_component: dict[str, int] = field(default_factory=dict)
    workspaces: tuple = ()

    @property
    def workspace_bytes(self) -> int:
        return sum(w.nbytes for w in self.workspaces)

    @property
    def total_bytes(self) -> int:
        return (self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.buffer_bytes
                + self.zero3_gather_bytes)


def _shard(elements: int, ways: int) -> int:
    return -(-elements // ways)


def static_memory(model: nn.Module, par) -> StaticMemory:
    """Static memory of a rank's model (``build_rank``) under ``par`` (a
    ``tracemem.ParallelConfig``: its zero, resolved precision ``precision_spec`` and the
    group sizes that ``tracemem.parallel.SHARDING`` names). Each parameter's group (dense or
    expert) is its declaration (``modeling.parallel.groups.ParamGroup.kind``).

    Raises:
        TracememError: a parameter that declares no group (the message names it and shows
            ``modeling.parallel.groups.declare``).
    """
    recipe = par.precision_spec
    kinds = numel_by_kind(model)
    dense, expert = kinds["dense"], kinds["expert"]

    def sharded(bytes_per: int, quantity: str) -> int:
        return bytes_per * (_shard(dense, par.shards(quantity, "dense"))
                            + _shard(expert, par.shards(quantity, "expert")))

    persistent = model.state_dict(keep_vars=True)
    buffers = sum(b.numel() * b.element_size() for name, b in model.named_buffers()
                  if name in persistent)
    gather = 0
    if par.zero == 3:
        gather = recipe.param_bytes * max(
            (sum(p.numel() for p in params) for params in unit_params(model).values()),
            default=0)
    return StaticMemory(dense, expert, sharded(recipe.param_bytes, "parameters"),
                        sharded(recipe.grad_bytes, "gradients"),
                        sharded(recipe.optimizer_bytes, "optimizer_states"),
                        buffers, gather, count_by_component(model, buffers=False))
