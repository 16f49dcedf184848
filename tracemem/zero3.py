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

FSDP2's own buffers (``Zero3Gathers(fsdp2_group=N)``, torchtitan's FSDP2 of group size N;
``Zero3Gathers.for_layout``: the ``fsdp2`` precision recipe), from torch 2.13's
``_fsdp_param_group.py`` and ``_fsdp_collectives.py``; without it (Megatron's ZeRO-3 and
Megatron-FSDP) a gather stays one flat buffer of the unit's parameters:
- ``FSDPParamGroup.unshard`` -> ``foreach_all_gather``: the copy-in buffer (the rank's bf16
  shards, dim 0 padded to a multiple of N: ``FSDPParam.padded_sharded_param_size``), the flat
  all-gather output (N times it), then the copy-in freed (``del param_all_gather_inputs``).
- ``wait_for_unshard`` -> ``foreach_all_gather_copy_out``: one unsharded buffer per parameter
  (``FSDPParam.alloc_all_gather_outputs``, in the unit's parameter order), copied out of the flat
  output, which stays alive beside them: in forward until the next unit's
  ``wait_for_unshard`` ends (``comm_ctx.all_gather_state``, "implicit prefetch"; the last is
  freed by the root's ``_post_forward``), in backward until this copy-out ends. So a unit's
  gather holds 2 x its bf16 parameters during copy-out.
- At N = 1 ``unshard`` gathers nothing and ``wait_for_unshard`` copies each parameter from its
  bf16 cast (``FSDPParam.all_gather_inputs``, a copy of the fp32 parameter) into its
  unsharded buffer; the loop variable keeps one cast alive until the next is made.
- torchtitan shards ``[norm, output]`` as one unit (torchtitan 0.3.0
  ``torchtitan/distributed/fsdp.py`` ``apply_fsdp_to_decoder``), so the root's own parameters
  (the final norm) join the unit kept gathered after its forward (the head), gathered when the
  norm runs, not at the root's pre-forward.
- torchtitan's model returns the logits (its loss runs outside the root module:
  ``Trainer._forward_backward_body``), so the root's post-forward, which frees the last
  all-gather output, comes right after the head: placed at the head's post-forward here, where
  tracemem's ``Transformer`` goes on to its loss.

- ``FSDPParamGroup.post_backward`` -> ``foreach_reduce`` (``Zero3Gathers._reduce``): after the
  reshard, the previous unit's reduce-scatter input is released
  (``reduce_scatter_max_input_buffers`` 1), this unit's made (fp32, every unsharded gradient,
  dim 0 padded to N), the bf16 unsharded gradients freed into it (at N > 1 the last one only
  when ``foreach_reduce`` returns: its dim-0 loop variable holds it), then the reduce output,
  the unit's fp32 sharded gradients (one flat buffer of the padded shards); at N = 1 one fp32
  quotient (``reduce_scatter_input / gradient_divide_factor``, torchtitan's factor 1.0). The
  first backward of a step keeps the reduce output as the parameters' gradients
  (``new_sharded_grad`` views, ``Zero3Gathers.sharded_grads``) until ``zero_grad`` frees them
  (``set_to_none=True``: torchtitan's ``training.disable_cuda_graphs``, the torch profile's
  ``zero_grad_set_to_none``); a later backward of the same step adds into them and frees its
  own. torchtitan's default, ``zero_grad(set_to_none=False)`` (trainer.py: ``set_to_none=
  self.config.training.disable_cuda_graphs``), keeps them, zeroed, from one step to the next:
  then they are static memory and every backward adds into them (``grads_kept``,
  ``grads_traced``). The root's final callback, queued on the
  autograd engine at the first pre-backward (``FSDPState._pre_backward`` ->
  ``_register_root_post_backward_final_callback``), runs inside ``backward()``: the
  post-backward of units whose inputs need no gradient (the embedding), then the last input
  released. The estimator replays these gradients as traced (``Segments.transient_grads``
  False) and, when the trace makes the sharded ones, takes them out of the replay's static
  floor (``StaticMemory.traced_grad_bytes``).

HSDP (``replicas`` > 1: torchtitan's ``data_parallel_replicate_degree``, the layout's
``num_distributed_optimizer_instances`` under ZeRO 3): FSDP2 shards within a replica
(``fsdp2_group`` is DP x CP / replicas) and all-reduces each reduce output in place across the
replicas (``foreach_reduce``'s HSDP branch); the unit's ``_all_reduce_state`` holds that
output until the end of backward (``FSDPParamGroup.finalize_backward``), which costs nothing
in a step's first backward (it is the gradient) and keeps each later backward's reduce
outputs to its end.

Not modelled: without ``fsdp2_group`` the gradient reduce-scatter (counted as Megatron's main
grad), FSDP2's padding and all-gather output; with it, the expert parameters' own FSDP mesh
(every unit is padded and reduced over the dense group). Megatron-FSDP's communication units
(Megatron-LM febd25e3fb, ``megatron/core/distributed/fsdp/src/megatron_fsdp/``), read but not
traced (the Megatron front door names it as an approximation of ``--use-megatron-fsdp``):
``MegatronFSDP.__init__`` sets ``suggested_communication_unit_size`` to max(1e9, 2 x the mean
TransformerLayer's parameter count) elements; ``AllGatherPipeline.all_gather_params`` prefetches
whole units ahead until half of that is gathered beyond the unit asked for (so every layer of a
small model at once), and ``GradReducePipeline.wait_for_previous_grad_reduce`` frees a unit's
unsharded gradient bucket (``param.get_main_grad()``, the main-grad dtype) only once the queue
passes the full size or at the end of each backward (``_root_post_backward`` -> ``reset``).
Here one unit is gathered at a time (one more prefetched in backward) and the gradient is the
sharded main grad only. Neither reaches a peak at the loss (the units are released after their
forward and the queue is empty before the first layer's backward), where the Megatron-CI cases
peak (docs/validation.md). Unreconciled: ``DistributedOptimizer.step_with_ready_grads`` calls
``start_param_sync``, which without ``--overlap-param-gather`` gathers every bucket after the
step, yet the measured memory after the step matches static memory without them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from modeling.parallel.groups import is_fsdp_unit, reshards_after_forward
from tracemem.categories import Category
from tracemem.tracer import MemoryTracer

__all__ = ["zero3_units", "Zero3Gathers", "pp_keeps_gathered", "pp_resident_bytes",
           "fsdp2_group", "grads_traced"]

# FSDP2's reduce_dtype under torchtitan (training.mixed_precision_reduce: only float32)
REDUCE_DTYPE = torch.float32
REDUCE_BYTES = REDUCE_DTYPE.itemsize


def pp_keeps_gathered(par) -> bool:
    """Whether ``par`` (a ``ParallelConfig``) is torchtitan's PP with FSDP2: ZeRO-3, PP > 1,
    precision ``fsdp2``, where every unit of a stage stays gathered through the step (module
    docstring)."""
    from tracemem.precision import FSDP2_RECIPES

    return par.zero == 3 and par.pp > 1 and par.precision in FSDP2_RECIPES


def fsdp2_group(par) -> int | None:
    """The FSDP2 shard group size of ``par`` (a ``ParallelConfig``) under torchtitan's FSDP2:
    ZeRO-3 with the ``fsdp2`` precision recipe, dense parameters sharded over DP x CP
    (``tracemem.parallel.SHARDING``); None otherwise (Megatron's ZeRO-3 and Megatron-FSDP)."""
    from tracemem.precision import FSDP2_RECIPES

    if par.zero != 3 or par.precision not in FSDP2_RECIPES:
        return None
    return par.shards("parameters", "dense")  # within a replica under HSDP


def grads_traced(par, kernels) -> bool:
    """Whether FSDP2's fp32 sharded gradients are the trace's, made by each step's first
    backward (``Zero3Gathers._reduce``), rather than static memory held from the start: the
    ``fsdp2`` recipe's ZeRO-3 without PP, with ``kernels`` (a profile) freeing them between
    steps (``zero_grad_set_to_none``: torchtitan's ``training.disable_cuda_graphs``; its
    default keeps them, zeroed)."""
    return (fsdp2_group(par) is not None and not pp_keeps_gathered(par)
            and bool(getattr(kernels, "zero_grad_set_to_none", False)))


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
        ctx.gathers.post_backward(ctx.name)
        return (None, None, *grads)


class Zero3Gathers:
    """The all-gathers of one rank's ZeRO-3 units (see the module docstring).

    ``install(model)`` registers module hooks; ``end_backward()`` is the root's final
    callback (call it after each backward); ``remove()`` drops the hooks. A gathered buffer is
    a flat tensor of the unit's parameter elements, in their dtype (uint8 bytes if mixed), on
    their device, tagged ``parameter``. With ``fsdp2_group`` (``for_layout``: the ``fsdp2``
    recipe) FSDP2's own buffers instead (module docstring): the copy-in and the flat
    all-gather output tagged ``comm_buffer``, one ``parameter`` buffer per parameter, the
    world-size-1 casts ``temporary``. Approximation: with a tied embedding and head
    torchtitan's unit is ``[tok_embeddings, norm, lm_head]``; here the norm joins the head and
    the shared weight stays the embedding's.
    """

    def __init__(self, prefetch: bool = True, keep_after_forward: frozenset[str] | None = None,
                 fsdp2_group: int | None = None, replicas: int = 1,
                 grads_kept: bool = False):
        self.prefetch = prefetch
        self.keep_after_forward = keep_after_forward  # None: the units' declarations
        # FSDP2's own buffers over a shard group of this size (module docstring); None: one
        # flat buffer per gather
        self.fsdp2_group = fsdp2_group
        # HSDP (torchtitan's data_parallel_replicate_degree): the reduce output is also
        # all-reduced across this many replicas, and held until the end of backward
        self.replicas = replicas
        self._all_reduce_held: dict[str, Tensor] = {}
        # zero_grad(set_to_none=False) (torchtitan's default): the sharded gradients exist
        # from an earlier step (static memory), so every backward's reduce output is added
        # into them and freed
        self.grads_kept = grads_kept
        self._params: dict[str, list[nn.Parameter]] = {}
        self._pending: dict[str, Tensor | None] = {}  # all-gathered, not yet copied out
        self._deferred: Tensor | None = None  # forward's last all-gather output
        self._joined: set[str] = set()  # units the root's parameters joined (torchtitan)
        self._sizes: dict[str, tuple[int, torch.dtype]] = {}
        self._gathered: dict[str, Tensor | list[Tensor]] = {}
        self._order: list[str] = []  # post-forward order of this forward (with multiplicity)
        self._indices: dict[str, list[int]] = {}
        self._device = torch.device("meta")
        self._handles: list = []
        self._forward = False  # in a unit's pre-forward (FSDP2's TrainingState.FORWARD)
        self._reduce_input: Tensor | None = None  # the last reduce-scatter input (fsdp2)
        self._callback_queued = False  # fsdp2: end_backward queued on the autograd engine
        # fsdp2: each unit's fp32 sharded gradients (FSDP2's reduce output), made by the
        # first backward of a step that reduces it, dropped by zero_grad
        self.sharded_grads: dict[str, Tensor] = {}

    @classmethod
    def for_layout(cls, par, prefetch: bool = True, kernels=None) -> Zero3Gathers:
        """The gathers of layout ``par`` (a ``ParallelConfig``): FSDP2's own buffers under the
        ``fsdp2`` recipe (``fsdp2_group``), one flat buffer per gather otherwise; with the
        sharded gradients kept between steps unless ``kernels`` (the model's profile) says
        ``zero_grad_set_to_none`` (``grads_traced``)."""
        group = fsdp2_group(par)
        return cls(prefetch, fsdp2_group=group,
                   replicas=par.num_distributed_optimizer_instances if group else 1,
                   grads_kept=group is not None and not grads_traced(par, kernels))

    def install(self, model: nn.Module) -> Zero3Gathers:
        units = unit_params(model)
        joined_modules: list[nn.Module] = []
        if self.fsdp2_group is not None:
            units, joined_modules = self._join_root(model, units)
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
            self._params[name] = params
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
        for module in joined_modules:  # torchtitan's [norm, output]: gathered at the norm
            name = next(iter(self._joined))
            self._handles.append(module.register_forward_pre_hook(
                lambda m, args, kwargs, name=name: self._pre_forward(name, args, kwargs),
                with_kwargs=True))
        return self

    def _join_root(self, model: nn.Module, units: dict[str, list[nn.Parameter]]):
        """torchtitan's ``fully_shard([norm, output])`` (module docstring): the root's own
        parameters, first, join the unit declared kept after its forward (the head), when
        there is exactly one; returns the units and the modules holding the joined
        parameters (their pre-forward gathers that unit)."""
        keep = [name for name, unit in zero3_units(model).items()
                if name and not reshards_after_forward(unit)]
        if len(keep) != 1 or not units[""]:
            return units, []
        ids = {id(p) for p in units[""]}
        modules = [m for m in model.modules()
                   if any(id(p) in ids for p in m.parameters(recurse=False))]
        units = dict(units)
        units[keep[0]] = [*units[""], *units[keep[0]]]
        units[""] = []
        self._joined = {keep[0]}
        return units, modules

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # the events
    def gather(self, name: str) -> None:
        if self.fsdp2_group is not None:
            self._unshard(name)
            self._wait_for_unshard(name)
            return
        numel, dtype = self._sizes.get(name, (0, torch.uint8))
        if name in self._gathered or not numel:
            return
        buffer = torch.empty(numel, dtype=dtype, device=self._device)
        mode = _get_current_dispatch_mode()
        if isinstance(mode, MemoryTracer):
            mode.tag(buffer, Category.PARAMETER)
        self._gathered[name] = buffer

    def _empty(self, numel: int, dtype: torch.dtype, category: Category,
               module: str | None = None) -> Tensor:
        buffer = torch.empty(numel, dtype=dtype, device=self._device)
        mode = _get_current_dispatch_mode()
        if isinstance(mode, MemoryTracer):
            mode.tag(buffer, category, module)
        return buffer

    def _padded_shard(self, p: Tensor) -> int:
        """Elements of ``p``'s FSDP2 shard: dim 0 padded to a multiple of the group
        (``FSDPParam._init_sharded_param``: ``padded_sharded_param_size``)."""
        n = self.fsdp2_group
        rows = p.shape[0] if p.dim() else 1
        return -(-rows // n) * (p.numel() // max(rows, 1))

    def _unshard(self, name: str) -> None:
        """``FSDPParamGroup.unshard``: the all-gather issued (module docstring)."""
        params = self._params.get(name, ())
        if not params or name in self._gathered or name in self._pending:
            return
        if self.fsdp2_group == 1:  # world size 1: nothing gathered, wait_for_unshard copies
            self._pending[name] = None
            return
        _, dtype = self._sizes[name]
        numel = sum(self._padded_shard(p) * (p.element_size() if dtype is torch.uint8 else 1)
                    for p in params)
        copy_in = self._empty(numel, dtype, Category.COMM_BUFFER)
        output = self._empty(numel * self.fsdp2_group, dtype, Category.COMM_BUFFER)
        del copy_in  # foreach_all_gather: del param_all_gather_inputs
        self._pending[name] = output

    def _wait_for_unshard(self, name: str) -> None:
        """``FSDPParamGroup.wait_for_unshard``: the copy-out into one buffer per parameter
        (module docstring)."""
        if name not in self._pending:
            return
        output = self._pending.pop(name)
        params = self._params[name]
        buffers = []
        if self.fsdp2_group == 1:
            cast = None
            for p in params:  # all_gather_input = fsdp_param.all_gather_inputs[0]
                cast = self._empty(p.numel(), p.dtype, Category.TEMPORARY)  # noqa: F841
                buffers.append(self._empty(p.numel(), p.dtype, Category.PARAMETER))
            del cast
        else:
            buffers = [self._empty(self._padded_shard(p) * self.fsdp2_group, p.dtype,
                                   Category.PARAMETER) for p in params]
        previous = None
        if output is not None and self._forward:
            # implicit prefetch: kept until the next unit's copy-out has ended
            previous, self._deferred = self._deferred, output
        del output, previous
        self._gathered[name] = buffers

    def free(self, name: str) -> None:
        self._gathered.pop(name, None)

    def post_backward(self, name: str) -> None:
        """``FSDPParamGroup.post_backward``: reshard the unit, then with ``fsdp2_group``
        reduce its gradients (``_reduce``)."""
        self.free(name)
        if self.fsdp2_group is not None:
            self._reduce(name)

    def _reduce(self, name: str) -> None:
        """FSDP2's gradient reduce-scatter of unit ``name`` (torch 2.13
        ``FSDPParamGroup.post_backward`` and ``_fsdp_collectives.py`` ``foreach_reduce``):
        the previous unit's reduce-scatter input is released first
        (``comm_ctx.reduce_scatter_states``, ``reduce_scatter_max_input_buffers`` 1), then
        this unit's is made (``reduce_scatter_comm.allocate``: every unsharded gradient, dim 0
        padded to a multiple of the group, in ``reduce_dtype``: fp32), the bf16 unsharded
        gradients copied in (``foreach_reduce_scatter_copy_in``) and freed
        (``unsharded_grads.clear()``, after ``unsharded_param.grad = None``; at world size > 1
        the last only after the reduce output is made), then the reduce output, the fp32
        sharded gradients (``new_sharded_grad``, views of it): kept in ``sharded_grads`` by the
        step's first backward, added into and freed by a later one. The input is held until
        the next unit's reduce or the root's final callback."""
        params = [p for p in self._params.get(name, ()) if p.grad is not None]
        if not params:
            return
        self._reduce_input = None
        numel = sum(self._padded_shard(p) * self.fsdp2_group for p in params)
        self._reduce_input = self._empty(numel, REDUCE_DTYPE, Category.COMM_BUFFER, name)
        # unsharded_grads.clear() frees them after the copy-in; at world size > 1 the loop
        # variable of foreach_reduce's dim-0 check (``for i, (fsdp_param, unsharded_grad) in
        # enumerate(zip(fsdp_params, unsharded_grads))``) still holds the last parameter's
        # until foreach_reduce returns, after the reduce output is made
        last = params[-1].grad if self.fsdp2_group > 1 else None
        for p in params:
            p.grad = None
        # reduce_output: the fp32 sharded gradients of the unit, one flat buffer of the
        # padded shards (reduce_scatter_output_numel), made on the reduce-scatter stream
        output = self._empty(numel // self.fsdp2_group, REDUCE_DTYPE, Category.GRADIENT, name)
        if self.fsdp2_group == 1:
            # world size 1: reduce_output.copy_(reduce_scatter_input / gradient_divide_factor),
            # the factor 1.0 (torchtitan 0.3.0 torchtitan/distributed/fsdp.py
            # disable_fsdp_gradient_division, called by apply_fsdp_to_decoder): one fp32
            # quotient of every gradient, freed after the copy
            quotient = self._empty(numel, REDUCE_DTYPE, Category.TEMPORARY, name)
            del quotient
        del last
        if self.grads_kept or name in self.sharded_grads:
            # a later backward of the step: sharded_param.grad._local_tensor +=
            # new_sharded_grad, in place; reduce_output is freed when foreach_reduce returns,
            # unless HSDP all-reduced it: then the unit's _all_reduce_state holds it
            # (all_reduce_input = reduce_output, "keeps the buffer off the caching
            # allocator's free list") until finalize_backward at the end of backward
            if self.replicas > 1:
                self._all_reduce_held[name] = output
            del output
        else:
            # the first: sharded_param.grad = to_sharded_dtensor(new_sharded_grad), views of
            # reduce_output, held until zero_grad (zero_grad)
            self.sharded_grads[name] = output

    def zero_grad(self) -> None:
        """The optimizer's ``zero_grad`` (set_to_none, at the start of torchtitan's
        ``train_step``): the sharded gradients are dropped, so the next backward that reduces
        a unit makes them again."""
        self.sharded_grads.clear()

    def end_backward(self) -> None:
        """The root's final callback: with ``fsdp2_group`` the units whose post-backward did
        not run (inputs that need no gradient: the embedding) reduce their gradients
        (``FSDPState._root_post_backward_final_callback``), and the last reduce-scatter input
        is released; then every unit still gathered is resharded."""
        self._callback_queued = False
        if self.fsdp2_group is not None:
            for name, params in self._params.items():  # post_backward: reshard, then reduce
                if any(p.grad is not None for p in params):
                    self.post_backward(name)
            self._reduce_input = None  # reduce_scatter_states.clear()
            self._all_reduce_held.clear()  # FSDPParamGroup.finalize_backward
        self._gathered.clear()
        self._pending.clear()
        self._deferred = None
        self._order.clear()
        self._indices.clear()

    # the hooks
    def _pre_forward(self, name: str, args, kwargs):
        gathered = name in self._gathered
        self._forward = True
        self.gather(name)
        self._forward = False
        if gathered and name in self._joined:
            return None  # the norm's pre-forward gathered the unit and wraps its inputs
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
        if self.fsdp2_group is not None and (not name or name in self._joined):
            self._deferred = None  # the root's _post_forward frees the last all-gather output
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
        if self.fsdp2_group is not None and not self._callback_queued:
            # FSDPState._pre_backward -> _register_root_post_backward_final_callback: the
            # root's final callback is queued on the autograd engine, so it runs inside the
            # backward call, before the engine frees what the graph task holds (the loss's
            # seed gradient)
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
        self.gather(name)
        indices = self._indices.get(name)
        if self.prefetch and indices:
            index = indices.pop()
            if index > 0:
                if self.fsdp2_group is None:
                    self.gather(self._order[index - 1])
                else:  # _backward_prefetch: the all-gather issued, copied out at its use
                    self._unshard(self._order[index - 1])
