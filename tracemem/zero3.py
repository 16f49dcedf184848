"""ZeRO-3 / FSDP parameter all-gathers as traced events.

Under ZeRO-3 a rank holds 1 / (DP x CP) of its dense and 1 / EDP of its expert parameters
(``tracemem.parallel.SHARDING``); each FSDP unit all-gathers its full (TP / EP-local) parameters
before it runs and frees them after. ``Zero3Gathers.install(model)`` puts those gathers into the
rank's trace as real allocations (one flat buffer of the unit's parameter bytes per gather,
tagged ``parameter`` in the active ``MemoryTracer``), so the schedule replay places them.

Units (``zero3_units``): the modules declared units where they are made
(``modeling.parallel.groups.declare_fsdp_unit``; ``modeling``'s ``Transformer`` declares each
decoder layer, each MTP module, the embedding and the output head); the root (the model
itself) holds whatever is left (the final norm). No module or parameter name is matched.

Rules, each from torch 2.13's FSDP2 (``torch/distributed/fsdp/_fully_shard/``):
- ``FSDPParamGroup.pre_forward`` (``_fsdp_param_group.py``): unshard (all-gather) before the
  unit's forward, on every call (the head runs once per loss: main and each MTP depth).
- ``FSDPParamGroup.post_forward``: reshard (free) after the forward: ``reshard_after_forward``
  defaults to True (``fully_shard`` in ``_fully_shard.py``), except for the root, whose
  ``post_forward_mesh_info`` is set to None (``FSDPState._lazy_init`` in ``_fsdp_state.py``:
  "For the root, do not reshard after forward"): its parameters stay gathered until the end of
  backward. The output head is wrapped with ``reshard_after_forward=False`` too, as torchtitan
  does by default (torchtitan/models/llama3/infra/parallelize.py ``apply_fsdp``:
  ``fully_shard([model.norm, model.output], reshard_after_forward=reshard_after_forward_policy
  == "always")``, "do not reshard_after_forward the last layers ... since FSDP would prefetch
  them immediately"): the head stays gathered from its forward, through the loss, to its
  backward. Which units do is declared where they are made (``declare_fsdp_unit(...,
  reshard_after_forward=False)``); ``Zero3Gathers(keep_after_forward=...)`` overrides the set.
- A parameter of two units (a tied embedding and head) belongs to the first that runs, which
  then stays gathered from its forward to the end of backward: torchtitan's one unit of
  ``[tok_embeddings, norm, lm_head]`` with weight tying (``Zero3Gathers.install``).
- ``FSDPState._post_forward`` / ``_register_pre_backward_hook``: a hook on the forward output's
  gradient unshards again before the unit's backward (``FSDPParamGroup.pre_backward``).
- ``FSDPParamGroup._register_post_backward_hook`` (``RegisterPostBackwardFunction`` on inputs
  that need grad): reshard after the unit's backward (``post_backward``); a unit whose inputs
  need no gradient (the embedding) is resharded by the root's final callback at the end of
  backward (``FSDPState._root_post_backward_final_callback``).
- ``FSDPParamGroup._backward_prefetch`` (the default, implicit): at a unit's pre-backward, the
  unit that ran before it in forward (``post_forward_order[index - 1]``) is all-gathered too;
  ``prefetch=False`` turns it off. Explicit forward prefetch
  (``set_modules_to_forward_prefetch``) is not modelled.

Pipeline parallelism with torchtitan's FSDP2 (``pp_keeps_gathered``: ZeRO-3, PP > 1 and the
``fsdp2`` precision recipe): no unit is resharded during the step, so there are no per-unit
gathers to trace; the stage's bf16 unsharded parameters and its fp32 unsharded gradient
accumulators are held from the first microbatch to the last (``pp_resident_bytes``, static
memory). Sources: torchtitan 0.3.0 ``torchtitan/distributed/fsdp.py``
``get_fsdp_reshard_after_forward_policy`` ("default" is ``not pp_enabled``: "For PP, by default
do not reshard after forward to avoid per-microbatch all-gathers"); torch 2.13
``torch/distributed/pipelining/stage.py`` ``backward_maybe_with_nosync``: every microbatch but
the last runs ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)``,
and ``_fsdp_param.py`` ``FSDPParam.to_accumulated_grad_if_needed`` keeps the unsharded gradient
in ``reduce_dtype`` (fp32) as ``unsharded_accumulated_grad`` until the last microbatch's
reduce-scatter (``accumulate_unsharded_grad_if_needed`` adds each later one into it).
Approximation: both are held through the optimizer step too (they are freed at the end of the
last backward), which overstates the step's peak, not the backward's.

Not modelled: FSDP2's per-parameter padding of dim 0 to a multiple of the group size, the
all-gather output buffer that exists alongside the unsharded parameters during copy-out, and
the gradient reduce-scatter buffers (the gradient is counted as Megatron's main grad).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from modeling.parallel.groups import is_fsdp_unit, reshards_after_forward
from tracemem.categories import Category
from tracemem.tracer import MemoryTracer

__all__ = ["zero3_units", "Zero3Gathers", "pp_keeps_gathered", "pp_resident_bytes"]

# FSDP2's reduce_dtype under torchtitan (training.mixed_precision_reduce: only float32)
REDUCE_BYTES = 4


def pp_keeps_gathered(par) -> bool:
    """Whether ``par`` (a ``ParallelConfig``) is torchtitan's PP with FSDP2: ZeRO-3, PP > 1,
    precision ``fsdp2``, where every unit of a stage stays gathered through the step (module
    docstring)."""
    from tracemem.precision import FSDP2_RECIPES

    return par.zero == 3 and par.pp > 1 and par.precision in FSDP2_RECIPES


def pp_resident_bytes(model: nn.Module, recipe) -> tuple[int, int]:
    """``(gathered, accumulated)``: the bytes a stage holds through the step under
    ``pp_keeps_gathered`` (module docstring): every parameter of the rank's model (its TP / EP
    shard, all FSDP units and the root) unsharded at ``recipe.gathered_param_bytes`` (bf16), and
    its unsharded gradient accumulator at ``REDUCE_BYTES`` (fp32) per element."""
    numel = sum(p.numel() for p in model.parameters())
    return recipe.gathered_param_bytes * numel, REDUCE_BYTES * numel


def zero3_units(model: nn.Module) -> dict[str, nn.Module]:
    """The FSDP units of a rank's model, by module path: every module declared a unit
    (``modeling.parallel.groups.declare_fsdp_unit``; in a ``Transformer``: ``embed``,
    ``layers.<i>``, ``head``, ``mtp.<i>``, those present), and ``""`` for the root, which holds
    every parameter not in another unit."""
    units: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if name and is_fsdp_unit(module):
            units[name] = module
    units[""] = model
    return units


def unit_params(model: nn.Module) -> dict[str, list[nn.Parameter]]:
    """Each unit's parameters (the root: those in no other unit), as held by this rank before
    ZeRO sharding: what one all-gather of the unit materialises. A unit declared inside another
    is gathered on its own, not with the outer one (FSDP2's nested ``fully_shard``)."""
    units = zero3_units(model)
    owned: set[int] = set()
    out: dict[str, list[nn.Parameter]] = {}
    for name, unit in units.items():
        if name:
            inner = {id(p) for sub_name, sub in unit.named_modules()
                     if sub_name and is_fsdp_unit(sub) for p in sub.parameters()}
            params = {id(p): p for p in unit.parameters() if id(p) not in inner}
            owned.update(params)
            out[name] = list(params.values())
    out[""] = [p for p in model.parameters() if id(p) not in owned]
    return out


class _PostBackward(torch.autograd.Function):
    """Identity on the unit's inputs whose backward reshards the unit (FSDP2's
    ``RegisterPostBackwardFunction``)."""

    @staticmethod
    def forward(ctx, gathers, name, *inputs):
        ctx.gathers, ctx.name = gathers, name
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.gathers.free(ctx.name)
        return (None, None, *grads)


class Zero3Gathers:
    """The all-gathers of one rank's ZeRO-3 units (see the module docstring).

    ``install(model)`` registers module hooks; ``end_backward()`` is the root's final
    callback (call it after each backward); ``remove()`` drops the hooks. A gathered buffer is
    a flat tensor of the unit's parameter elements, in their dtype (uint8 bytes if mixed), on
    their device, tagged ``parameter``.
    """

    def __init__(self, prefetch: bool = True, keep_after_forward: frozenset[str] | None = None):
        self.prefetch = prefetch
        self.keep_after_forward = keep_after_forward  # None: the units' declarations
        self._sizes: dict[str, tuple[int, torch.dtype]] = {}
        self._gathered: dict[str, Tensor] = {}
        self._order: list[str] = []  # post-forward order of this forward (with multiplicity)
        self._indices: dict[str, list[int]] = {}
        self._device = torch.device("meta")
        self._handles: list = []

    def install(self, model: nn.Module) -> Zero3Gathers:
        units = unit_params(model)
        # a parameter of two units (a tied head and embedding) is one FSDP2 unit, gathered
        # with the first that runs and held from its forward to the end of backward, as
        # torchtitan wraps them (torchtitan 0.3.0 torchtitan/distributed/fsdp.py
        # apply_fsdp_to_decoder: with enable_weight_tying, fully_shard([tok_embeddings, norm,
        # lm_head], reshard_after_forward=policy == "always"), "to avoid duplicate
        # all-gathers"); the later units gather only their other parameters
        owner: dict[int, str] = {}
        for name, params in units.items():
            for p in params:
                owner.setdefault(id(p), name)
        tied = {owner[id(p)] for name, params in units.items() for p in params
                if owner[id(p)] != name}
        for name, params in units.items():
            params = [p for p in params if owner[id(p)] == name]
            dtypes = {p.dtype for p in params}
            if len(dtypes) == 1:
                self._sizes[name] = (sum(p.numel() for p in params), dtypes.pop())
            else:
                self._sizes[name] = (sum(p.numel() * p.element_size() for p in params),
                                     torch.uint8)
        self._device = next(model.parameters()).device
        if self.keep_after_forward is None:
            self.keep_after_forward = frozenset(
                name for name, unit in zero3_units(model).items()
                if name and not reshards_after_forward(unit))
        self.keep_after_forward = frozenset(self.keep_after_forward) | tied
        for name, unit in zero3_units(model).items():
            self._handles.append(unit.register_forward_pre_hook(
                lambda m, args, kwargs, name=name: self._pre_forward(name, args, kwargs),
                with_kwargs=True))
            self._handles.append(unit.register_forward_hook(
                lambda m, args, out, name=name: self._post_forward(name, out)))
        return self

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # the events
    def gather(self, name: str) -> None:
        numel, dtype = self._sizes.get(name, (0, torch.uint8))
        if name in self._gathered or not numel:
            return
        buffer = torch.empty(numel, dtype=dtype, device=self._device)
        mode = _get_current_dispatch_mode()
        if isinstance(mode, MemoryTracer):
            mode.tag(buffer, Category.PARAMETER)
        self._gathered[name] = buffer

    def free(self, name: str) -> None:
        self._gathered.pop(name, None)

    def end_backward(self) -> None:
        """The root's final callback: reshard every unit still gathered."""
        self._gathered.clear()
        self._order.clear()
        self._indices.clear()

    # the hooks
    def _pre_forward(self, name: str, args, kwargs):
        self.gather(name)
        if not name or not torch.is_grad_enabled():
            return None
        need = [i for i, a in enumerate(args) if isinstance(a, Tensor) and a.requires_grad]
        if not need:
            return None
        wrapped = _PostBackward.apply(self, name, *(args[i] for i in need))
        args = list(args)
        for i, tensor in zip(need, wrapped):
            args[i] = tensor
        return tuple(args), kwargs

    def _post_forward(self, name: str, output):
        if not name:
            return None  # the root stays gathered until the end of backward
        if name not in self.keep_after_forward:
            self.free(name)
        self._indices.setdefault(name, []).append(len(self._order))
        self._order.append(name)
        if isinstance(output, Tensor) and output.requires_grad:
            output.register_hook(lambda grad, name=name: self._pre_backward(name))
        return None

    def _pre_backward(self, name: str) -> None:
        self.gather(name)
        indices = self._indices.get(name)
        if self.prefetch and indices:
            index = indices.pop()
            if index > 0:
                self.gather(self._order[index - 1])
