"""Parameter groups, declared where a parameter is made.

Every parameter (and persistent buffer) a model builds carries a ``ParamGroup``: whether it
belongs to the dense or the expert group (which data-parallel group ZeRO and the distributed
optimizer shard it over: ``tracemem.parallel.SHARDING``), which of its dimensions TP (dense) or
ETP (expert) splits, whether EP shards it (it is one of this rank's E / EP routed experts), and
the component it is counted under (``modeling.params``). Static memory, ZeRO sharding, the
optimizer step, ZeRO-3 units and parameter counts read these declarations; nothing downstream
matches module or parameter names, so a renamed module is sharded and counted as before.

The declaration mirrors Megatron-Core's own parameter attributes (NVIDIA/Megatron-LM d98e8a6):
- ``megatron/core/tensor_parallel/layers.py`` ``set_tensor_model_parallel_attributes``:
  ``tensor_model_parallel`` and ``partition_dim`` (0 for ``ColumnParallelLinear``'s and
  ``VocabParallelEmbedding``'s weight, 1 for ``RowParallelLinear``'s), set where
  ``ColumnParallelLinear.__init__`` / ``RowParallelLinear.__init__`` make the weight; here
  ``tp_dim`` (None: replicated over TP / ETP, Megatron's ``tensor_model_parallel=False``).
- the same ``__init__`` s: ``setattr(self.weight, "allreduce", not use_expert_pgs)``, with
  ``is_expert=True`` passed by ``megatron/core/transformer/moe/experts.py``
  ``TEGroupedMLP.__init__`` for the routed experts' ``linear_fc1`` / ``linear_fc2``;
  ``megatron/core/optimizer/__init__.py`` ``_get_param_groups`` and
  ``megatron/core/distributed/param_and_grad_buffer.py`` ``group_params_for_buffers`` read
  ``not getattr(param, 'allreduce', True)`` as "expert parallel": optimizer state and grad
  buffers over the expert data-parallel group (EDP). Here ``kind`` "expert"
  (``allreduce=False``) or "dense".

A ZeRO-3 / FSDP unit is declared on its module where the module is made
(``declare_fsdp_unit``; ``tracemem.zero3``), as torchtitan's ``apply_fsdp`` wraps the modules
it names (torchtitan/models/llama3/infra/parallelize.py).

A user's own layer (``modeling.common.custom``) declares its parameters with ``declare``; an
undeclared parameter stops static memory, ZeRO and counting with a one-line
``TracememError`` that names it and shows the call (``group_of``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from torch import Tensor, nn

from tracemem.errors import TracememError

__all__ = ["ParamGroup", "KINDS", "declare", "declare_module", "set_component", "group_of",
           "declared_tensors", "declare_fsdp_unit", "is_fsdp_unit", "reshards_after_forward",
           "replicated", "column", "row", "expert", "numel_by_kind", "ATTRIBUTE"]

KINDS = ("dense", "expert")
ATTRIBUTE = "tracemem_group"  # the attribute a declared tensor carries
_UNIT_ATTRIBUTE = "tracemem_fsdp_unit"


@dataclass(frozen=True)
class ParamGroup:
    """How one parameter is sharded and counted.

    Attributes:
        component: what ``modeling.params`` counts it under (``modeling.params.COMPONENTS``,
            e.g. "attention", "norms", "routed_experts"; another name adds a component).
        kind: "dense" (ZeRO shards it over DP x CP) or "expert" (over EDP); Megatron's
            ``allreduce`` True / False.
        tp_dim: the dimension TP (dense) or ETP (expert) splits, or None: replicated over that
            group; Megatron's ``partition_dim`` (``tensor_model_parallel`` when not None).
        ep: one of this rank's E / EP routed experts (a stack of them along dim 0 when the
            tensor is a grouped weight ``(E / EP, ...)``); needs ``kind`` "expert".

    Raises:
        TracememError: an unknown kind, ``ep`` with kind "dense", a negative ``tp_dim``, or
            an empty component.
    """

    component: str
    kind: str = "dense"
    tp_dim: int | None = None
    ep: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise TracememError(f"ParamGroup kind {self.kind!r} is invalid; choose one of "
                                f"{', '.join(KINDS)}")
        if self.ep and self.kind != "expert":
            raise TracememError("ParamGroup(ep=True) needs kind='expert' (EP-sharded experts "
                                "are sharded by ZeRO over EDP)")
        if self.tp_dim is not None and (isinstance(self.tp_dim, bool)
                                        or not isinstance(self.tp_dim, int) or self.tp_dim < 0):
            raise TracememError(f"ParamGroup tp_dim {self.tp_dim!r} must be None (replicated) "
                                f"or a non-negative dimension")
        if not isinstance(self.component, str) or not self.component:
            raise TracememError(f"ParamGroup component {self.component!r} must be a name such "
                                f"as 'attention'")


def replicated(component: str, kind: str = "dense") -> ParamGroup:
    """Replicated over TP (Megatron's ``parallel_mode='duplicated'``, norms, the router)."""
    return ParamGroup(component, kind)


def column(component: str, kind: str = "dense") -> ParamGroup:
    """A column-parallel weight ``(out / TP, in)``: TP splits dim 0."""
    return ParamGroup(component, kind, tp_dim=0)


def row(component: str, kind: str = "dense") -> ParamGroup:
    """A row-parallel weight ``(out, in / TP)``: TP splits dim 1."""
    return ParamGroup(component, kind, tp_dim=1)


def expert(component: str = "routed_experts", tp_dim: int | None = None) -> ParamGroup:
    """A routed expert's weight (or a stack of them): EP-sharded, ETP splits ``tp_dim``."""
    return ParamGroup(component, "expert", tp_dim, ep=True)


def declare(tensor: Tensor, group: ParamGroup) -> Tensor:
    """Attach ``group`` to ``tensor`` (a parameter or persistent buffer) and return it, as
    Megatron-Core's ``set_tensor_model_parallel_attributes`` does. The declaration is a
    Python attribute of the tensor object: it survives ``param.data = ...`` (dtype casts) and
    ``Module.to`` on parameters; a buffer replaced by ``Module.to`` loses it (declare buffers
    after moving, or build on the target device, as ``modeling`` does)."""
    if not isinstance(group, ParamGroup):
        raise TracememError(f"declare takes a modeling.parallel.groups.ParamGroup, not "
                            f"{type(group).__name__}")
    setattr(tensor, ATTRIBUTE, group)
    return tensor


def declare_module(module: nn.Module, group: ParamGroup, *,
                   bias: ParamGroup | None = None) -> nn.Module:
    """Declare ``module``'s own parameters (not its children's) and persistent buffers
    ``group``; a parameter named ``bias`` gets ``bias`` if given (a row-parallel layer's bias
    is replicated: Megatron's ``RowParallelLinear``). Returns ``module``."""
    persistent = set(module._buffers) - module._non_persistent_buffers_set
    for name, tensor in [*module._parameters.items(),
                         *((n, b) for n, b in module._buffers.items() if n in persistent)]:
        if tensor is not None:
            declare(tensor, bias if name == "bias" and bias is not None else group)
    return module


def set_component(module: nn.Module, component: str) -> None:
    """Re-declare every declared parameter and persistent buffer under ``module`` with
    ``component``, their other fields kept (an MTP module counts its whole decoder layer as
    "mtp_layer")."""
    for _, _, tensor, group in declared_tensors(module, buffers=True, strict=False):
        if group is not None:
            declare(tensor, dataclasses.replace(group, component=component))


def _how_to_declare(name: str, tensor: Tensor) -> str:
    return (f"parameter {name!r} {tuple(tensor.shape)} declares no group; declare it where "
            f"it is made, e.g. modeling.parallel.groups.declare(param, ParamGroup("
            f"'attention', kind='dense', tp_dim=0)) (kind 'dense' or 'expert', tp_dim the dim "
            f"TP splits or None; docs/modified-architectures.md)")


def group_of(tensor: Tensor, name: str = "") -> ParamGroup:
    """The declared group of ``tensor`` (``name``: its path, for the error).

    Raises:
        TracememError: ``tensor`` declares none (one line: the name, shape and the call).
    """
    group = getattr(tensor, ATTRIBUTE, None)
    if group is None:
        raise TracememError(_how_to_declare(name, tensor))
    return group


def declared_tensors(model: nn.Module, buffers: bool = False, strict: bool = True
                     ) -> Iterator[tuple[str, str, Tensor, ParamGroup | None]]:
    """``(module path, tensor name, tensor, group)`` for every parameter of ``model`` (and
    every persistent buffer with ``buffers``), a shared tensor (a tied head) once, under its
    first module. A persistent buffer without a declaration of its own takes its module's
    parameters' group (the router's correction bias: the router's).

    Raises:
        TracememError: with ``strict``, a tensor that declares no group (``group_of``).
    """
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        own = [(n, p) for n, p in module._parameters.items() if p is not None]
        fallback = next((getattr(p, ATTRIBUTE) for _, p in own if hasattr(p, ATTRIBUTE)), None)
        if buffers:
            own += [(n, b) for n, b in module._buffers.items()
                    if b is not None and n not in module._non_persistent_buffers_set]
        for name, tensor in own:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            path = f"{module_name}.{name}" if module_name else name
            group = getattr(tensor, ATTRIBUTE, None)
            if group is None and not isinstance(tensor, nn.Parameter):
                group = fallback
            if group is None and strict:
                raise TracememError(_how_to_declare(path, tensor))
            yield module_name, name, tensor, group


def declare_fsdp_unit(module: nn.Module, reshard_after_forward: bool = True) -> nn.Module:
    """Mark ``module`` as one ZeRO-3 / FSDP unit (``tracemem.zero3``: all-gathered before its
    forward and backward, freed after); ``reshard_after_forward=False`` keeps it gathered from
    its forward to its backward (FSDP2's ``fully_shard(..., reshard_after_forward=False)``, as
    torchtitan wraps the output head). Returns ``module``."""
    setattr(module, _UNIT_ATTRIBUTE, "reshard" if reshard_after_forward else "keep")
    return module


def is_fsdp_unit(module: nn.Module) -> bool:
    """Whether ``declare_fsdp_unit`` marked ``module``."""
    return bool(getattr(module, _UNIT_ATTRIBUTE, False))


def reshards_after_forward(module: nn.Module) -> bool:
    """Whether the unit ``module`` is freed after its forward (``declare_fsdp_unit``)."""
    return getattr(module, _UNIT_ATTRIBUTE, False) != "keep"


def numel_by_kind(model: nn.Module) -> dict[str, int]:
    """Parameter elements of ``model`` by ``kind`` ("dense", "expert"), shared ones once.

    Raises:
        TracememError: a parameter that declares no group.
    """
    totals = dict.fromkeys(KINDS, 0)
    for _, _, tensor, group in declared_tensors(model):
        totals[group.kind] += tensor.numel()
    return totals
