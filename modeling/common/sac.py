"""torchtitan's op-level selective activation checkpointing (``SelectiveAC``), as torchtitan
0.3.0 applies it around each transformer block, with torch's own SAC machinery
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``, ``CheckpointPolicy``), on
meta under the tracer.

torchtitan 0.3.0 ``torchtitan/distributed/activation_checkpoint.py``:

- ``ActivationCheckpointing.apply``: every child of ``model.layers`` is wrapped (one
  checkpoint per transformer block; 0.3.0 has no "checkpoint every N-th block" option:
  ``SelectiveAC.Config`` holds only ``force_recompute_mm_shapes_by_fqns``).
- ``SelectiveAC._wrap_block``: ``ptd_checkpoint_wrapper(module, context_fn=lambda:
  create_selective_checkpoint_contexts(policy), preserve_rng_state=True,
  determinism_check="default", early_stop=False)``, i.e. non-reentrant
  ``torch.utils.checkpoint.checkpoint`` with a fresh policy (fresh counters) per call.
- the policy (``_get_custom_policy.wrapped_policy``): ``aten.mm`` / ``aten.linear`` whose
  right-hand shape ``(in, out)`` is that of a ``force_recompute_mm_shapes_by_fqns`` Linear
  (default ``["moe.router.gate"]``: the router's ``(dim, num_experts)``) are recomputed and
  not counted; every other mm increments a counter and the even-numbered ones (the 2nd, 4th,
  ...) are recomputed; any other op in the save set (``_get_default_save_ops``) is saved;
  everything else is recomputed. A CUDA -> CPU ``_to_copy`` is saved (no such copy runs on
  meta: tracemem's model is value-free).
- the save set (``_get_default_save_ops``): the partitioner's ``compute_intensive_ops``
  (``torch._functorch.partitioners.get_default_op_list``: mm, addmm, bmm, the SDPA flash /
  memory-efficient ops, ``_scaled_mm``, convolution, ...), SDPA's cuDNN / math / overrideable
  ops, ``aten.max.default`` (FP8 amax), FlexAttention, ``aten.linear``, ``aten.topk``, and
  the collectives ``reduce_scatter_tensor`` and ``all_to_all_single`` (not all-gather).
  ``torch._grouped_mm`` (the routed experts) is in none of them: recomputed.

tracemem's collectives are stand-ins (``modeling.parallel.collectives``: a ``clone`` of this
rank's slice, a ``new_empty`` of the received rows), not ``_c10d_functional`` ops: the policy
saves the outputs of the non-view ops a forward reduce-scatter or all-to-all runs
(``collectives.RUNNING``), as torchtitan's save list names ``reduce_scatter_tensor`` and
``all_to_all_single``; an all-gather's are recomputed, as torchtitan's (not in its list).
Context parallelism's collectives (``modeling.kernels.context_parallel``) are not marked:
``tracemem.job.Job`` refuses ``op`` with CP > 1 (``SAC_COLLECTIVES_NOTE``).

Categories: what the policy saves is held by the checkpoint's cache, not by autograd's saved
tensors, so the tracer would count it ``temporary``; the policy gives each saved output the
``activation`` category (``MemoryTracer.tag``), which changes no byte and no lifetime.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from modeling.parallel.collectives import RUNNING
from tracemem.categories import Category
from tracemem.tracer import MemoryTracer

__all__ = ["op_save_ops", "op_sac_policy", "op_checkpoint", "force_recompute_shapes",
           "SAC_COLLECTIVES_NOTE"]

SAC_COLLECTIVES_NOTE = ("context parallelism's K / V collectives are stand-ins the op policy "
                        "cannot see (modeling.kernels.context_parallel)")

_MM_OPS = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)


def _resolve(root: Any, path: str):
    """``root.<path>``, or None when that op is not registered (as torchtitan's
    ``_resolve_ops`` skips it)."""
    try:
        for part in path.split("."):
            root = getattr(root, part)
    except AttributeError:
        return None
    return root


def op_save_ops() -> frozenset:
    """The ops whose outputs torchtitan 0.3.0's ``SelectiveAC`` saves
    (``_get_default_save_ops``, module docstring), as this torch registers them."""
    from torch._functorch.partitioners import get_default_op_list

    ops = {op.default for op in get_default_op_list().compute_intensive_ops}
    aten = torch.ops.aten
    ops.update((aten._scaled_dot_product_cudnn_attention.default,
                aten._scaled_dot_product_attention_math.default,
                aten._scaled_dot_product_fused_attention_overrideable.default,
                aten.max.default, torch._higher_order_ops.flex_attention, aten.linear.default,
                aten.topk.default, torch.ops._c10d_functional.reduce_scatter_tensor.default,
                torch.ops._c10d_functional.all_to_all_single.default))
    for root, path in ((torch._higher_order_ops, "inductor_compiled_code"),
                       (torch.ops, "torch_attn._varlen_attn.default"),
                       (torch.ops, "deepep.dispatch.default"),
                       (torch.ops, "deepep.combine.default"),
                       (torch.ops, "hybridep.dispatch.default"),
                       (torch.ops, "hybridep.combine.default")):
        op = _resolve(root, path)
        if op is not None:
            ops.add(op)
    return frozenset(ops)


def _tracer() -> MemoryTracer | None:
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if isinstance(mode, MemoryTracer):
            return mode
    return None


def _tag_saved(out: Any) -> None:
    tracer = _tracer()
    if tracer is None:
        return
    for t in (out if isinstance(out, (tuple, list)) else (out,)):
        if isinstance(t, Tensor):
            tracer.tag(t, Category.ACTIVATION)


def op_sac_policy(force_recompute_shapes: frozenset[tuple[int, int]] = frozenset(),
                  save_ops: frozenset | None = None) -> Callable[..., CheckpointPolicy]:
    """A fresh policy of torchtitan's ``SelectiveAC`` (``_get_custom_policy``): its own
    forward and recompute mm counters. ``force_recompute_shapes``: right-hand mm shapes
    ``(in, out)`` always recomputed and not counted (the router gate's ``(h, E)``);
    ``save_ops`` default ``op_save_ops()``. In forward each saved output is tagged
    ``activation`` in the active ``MemoryTracer`` (module docstring)."""
    save = op_save_ops() if save_ops is None else save_ops
    counts = {False: 0, True: 0}  # is_recompute -> mm count

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        decision = _decide(ctx, func, args, kwargs)
        if decision is CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
            _tag_saved(getattr(ctx, "op_output", None))
        return decision

    def _decide(ctx, func, args, kwargs) -> CheckpointPolicy:
        if RUNNING and RUNNING[-1] in ("reduce_scatter", "all_to_all") and not any(
                r.alias_info is not None for r in func._schema.returns):
            return CheckpointPolicy.MUST_SAVE  # the collective's output (module docstring)
        if (func == torch.ops.aten._to_copy.default and args[0].device.type != "cpu"
                and str(kwargs.get("device", "")) == "cpu"):
            return CheckpointPolicy.MUST_SAVE  # torchtitan: CUDA -> CPU results saved
        if func in _MM_OPS:
            shape = tuple(args[1].shape)
            if func == torch.ops.aten.linear.default:  # weight (out, in) -> (in, out)
                shape = (shape[1], shape[0])
            if shape in force_recompute_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
            counts[ctx.is_recompute] += 1
        if func in save:
            if func in _MM_OPS and counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE  # every second mm
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def force_recompute_shapes(module: nn.Module) -> frozenset[tuple[int, int]]:
    """The ``(in, out)`` shapes of the router gates under ``module`` (torchtitan's default
    ``force_recompute_mm_shapes_by_fqns = ["moe.router.gate"]``; tracemem's gate is
    ``modeling.common.router.Gate``, weight ``(E, h)``)."""
    from modeling.common.router import Gate

    return frozenset((m.weight.shape[1], m.weight.shape[0]) for m in module.modules()
                     if isinstance(m, Gate))


def op_checkpoint(function: Callable, *args: Any,
                  force_recompute: frozenset[tuple[int, int]] = frozenset()):
    """``function(*args)`` under torchtitan's ``SelectiveAC`` (``_wrap_block``):
    non-reentrant ``torch.utils.checkpoint.checkpoint`` with a fresh ``op_sac_policy`` per
    call, ``early_stop=False`` (the recompute runs the whole block), RNG state preserved."""
    def context_fn():
        return create_selective_checkpoint_contexts(op_sac_policy(force_recompute))

    return checkpoint(function, *args, use_reentrant=False, context_fn=context_fn,
                      preserve_rng_state=True, determinism_check="default", early_stop=False)
