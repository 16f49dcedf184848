"""What torchtitan 0.3.0 and torch 2.13's FSDP2 need to run on the meta device on a CPU-only
host, for ``tracemem.oracle.torchtitan_oracle``; every patch names what it replaces and why,
and ``applied()`` undoes them all on exit.

- ``torchtitan/distributed/parallel_dims.py`` ``ParallelDims.build_mesh`` makes its mesh with
  ``torchtitan.tools.utils.device_type`` ("cuda" where CUDA is built, else whatever torch
  finds): replaced by "cpu", so ``init_device_mesh`` runs on the fake process group without
  CUDA (``_PARALLEL_DIMS_DEVICE``).
- torch 2.13 ``torch/distributed/fsdp/_fully_shard/_fully_shard.py`` ``fully_shard`` takes its
  device from the mesh (``_fsdp_init._get_device_from_mesh``: ``torch.device(mesh.device_type,
  current_device())``): replaced by ``meta``, so FSDP2 makes its all-gather outputs, unsharded
  parameters and reduce-scatter buffers on meta, where the tracer sees them.
- ``_get_device_handle`` (``torch.distributed.device_mesh``: ``getattr(torch, device_type)``)
  as imported by ``_fsdp_state.py``, ``_fsdp_param_group.py`` and ``_fsdp_collectives.py``:
  for "meta" it is ``None``; replaced by ``torch.cpu`` there (its ``Stream`` / ``Event`` /
  ``current_stream`` do nothing: one stream, the order of the trace).
- ``_fsdp_param_group.py`` ``FSDPParamGroup._validate_no_meta_params`` (lazy init refuses
  parameters left on meta, "FSDP parameters should be materialized from meta device before
  training"): a no-op; the parameters stay on meta, as the whole oracle runs there.
- torch 2.13 ``torch/nn/attention/flex_attention.py`` ``_validate_device`` (flex attention
  refuses meta inputs): a no-op; ``_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG`` set, so the eager
  ``flex_attention`` calls the higher-order op directly instead of wrapping it in
  ``torch.compile(backend="eager")``.
- torchtitan ``torchtitan/models/common/attention.py`` ``FlexAttention._compiled_flex_attn``
  (``torch.compile(flex_attention)``, an Inductor Triton kernel): replaced by the eager
  ``flex_attention``, the same higher-order op (``torch/_higher_order_ops/flex_attention.py``
  ``flex_attention``) under the same autograd Function (``FlexAttentionAutogradOp``, which
  decides what is saved for backward: query, key, value, out, logsumexp).
- The higher-order ops ``flex_attention`` / ``flex_attention_backward`` have no rule for a
  ``TorchDispatchMode`` they do not know: a rule for ``tracemem.tracer.MemoryTracer`` runs
  torch's own fake implementations (``flex_attention_fake_impl``: out ``[B, H, L, Dv]`` in
  the query's dtype, logsumexp and max_scores ``[B, H, L]`` fp32;
  ``flex_attention_backward_fake_tensor_mode``: the query, key and value gradients) under the
  tracer: the outputs the fused kernel writes, without the unfused fallback's ``[B, H, L, L]``
  scores (the compiled kernel has none; its on-chip tiles are not allocations).
- ``torch.nn.functional.rms_norm`` (torchtitan's ``RMSNorm`` is ``nn.RMSNorm``,
  ``torchtitan/models/common/nn_modules.py``): torch 2.13's ``aten::rms_norm`` composite calls
  ``aten::_fused_rms_norm`` for CUDA inputs only and otherwise upcasts and saves fp32 copies;
  ``aten::_fused_rms_norm`` has no meta kernel of its own (it decomposes into the same
  upcasts); replaced by ``_FusedRMSNorm``, the CUDA kernel's allocations: y in the input's
  dtype and rstd ``(..., 1)`` fp32, saving input, weight and rstd (torch 2.13
  ``tools/autograd/derivatives.yaml`` ``_fused_rms_norm``); backward
  (``_fused_rms_norm_backward``) makes the input and weight gradients.
- ``_fsdp_param_group.py`` ``FSDPParamGroup.post_backward`` (the gradient reduce-scatter and
  reshard of one unit): run by ``_fsdp_state.py`` ``FSDPState._root_post_backward_final_callback``
  for a unit whose inputs need no gradient (the embedding: its post-backward hook never
  fires) after autograd's last node, where the tracer finds no module (no module runs, no
  autograd node is current) and would name the root; wrapped so that what it allocates
  outside any module is attributed to the unit's own module (``_module_fqn``), whose work it
  is (``_attribute_post_backward``).
- FSDP2 frees and re-allocates unsharded parameters with ``untyped_storage().resize_``
  (``_fsdp_param.py`` ``free_storage`` / ``alloc_storage``), below the dispatcher: wrapped to
  tell the tracer (``MemoryTracer.storage_resized``), so a reshard is a free in the trace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tracemem.errors import TracememError

__all__ = ["TORCHTITAN_VERSION", "require_torchtitan", "applied", "fake_process_group",
           "causal_block_mask"]

TORCHTITAN_VERSION = "0.3.0"


def require_torchtitan() -> None:
    """Raises: TracememError: torchtitan is missing or not 0.3.0."""
    try:
        import torchtitan  # noqa: F401
        from importlib.metadata import version
        found = version("torchtitan")
    except ImportError as error:
        raise TracememError(f"--against torchtitan needs torchtitan {TORCHTITAN_VERSION} "
                            f"importable ({error})") from None
    if found != TORCHTITAN_VERSION:
        raise TracememError(f"--against torchtitan is pinned to torchtitan "
                            f"{TORCHTITAN_VERSION}; {found} is installed")


class _FusedRMSNorm(torch.autograd.Function):
    """CUDA's ``aten::_fused_rms_norm`` as allocations (module docstring)."""

    @staticmethod
    def forward(ctx, x, weight):
        rstd = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
        y = torch.empty_like(x)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        return torch.empty_like(x), (None if weight is None else torch.empty_like(weight))


def _fused_rms_norm_as_on_cuda(input, normalized_shape, weight=None, eps=None):
    return _FusedRMSNorm.apply(input, weight)


def _notify_resize(original):
    def resize(tensor):
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        from tracemem.tracer import MemoryTracer
        original(tensor)
        mode = _get_current_dispatch_mode()
        if isinstance(mode, MemoryTracer):
            mode.storage_resized(tensor)
    return resize


def _attribute_post_backward(original):
    def post_backward(self, *args, **kwargs):
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        from tracemem.tracer import MemoryTracer
        mode = _get_current_dispatch_mode()
        start = len(mode.events) if isinstance(mode, MemoryTracer) else None
        try:
            return original(self, *args, **kwargs)
        finally:
            if start is not None and self._module_fqn:
                for event in mode.events[start:]:
                    # the storage's record: the module the tracer found for it ("": none)
                    if event.action == "alloc" and event._storage.module == "":
                        event._storage.module = self._module_fqn
    return post_backward


def _cpu_handle(device_type: str = "cuda"):
    return torch.cpu if device_type in ("meta", "cpu") else getattr(torch, device_type, None)


@contextlib.contextmanager
def applied() -> Iterator[None]:
    """Every patch of the module docstring, undone on exit."""
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives
    import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
    import torch.distributed.fsdp._fully_shard._fsdp_state as state
    import torch.distributed.fsdp._fully_shard._fully_shard as fully
    import torch.nn.functional as F
    import torch.nn.attention.flex_attention as flex
    import torchtitan.distributed.parallel_dims as parallel_dims
    from torch._higher_order_ops.flex_attention import (
        flex_attention as flex_hop, flex_attention_backward as flex_backward_hop,
        flex_attention_backward_fake_tensor_mode, flex_attention_fake_impl)
    from torch.utils._python_dispatch import _pop_mode, _push_mode
    from torchtitan.models.common.attention import FlexAttention

    from tracemem.tracer import MemoryTracer

    def eager_flex(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux,
                   kernel_options):
        return flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                   scale=scale, enable_gqa=enable_gqa, return_aux=return_aux,
                                   kernel_options=kernel_options)

    def under(impl):
        # the HOP dispatch popped the tracer; push it back as a dispatch mode only (its
        # __enter__ / __exit__ would reset its module stack and hooks mid-step)
        def rule(mode, *args, **kwargs):
            _push_mode(mode)
            try:
                return impl(*args, **kwargs)
            finally:
                _pop_mode()
        return rule

    saved = [(parallel_dims, "device_type"), (fully, "_get_device_from_mesh"),
             (state, "_get_device_handle"), (param_group, "_get_device_handle"),
             (collectives, "_get_device_handle"),
             (param_group.FSDPParamGroup, "_validate_no_meta_params"),
             (F, "rms_norm"), (fsdp_param, "alloc_storage"), (fsdp_param, "free_storage"),
             (param_group, "alloc_storage"), (param_group.FSDPParamGroup, "post_backward"),
             (flex, "_validate_device"),
             (flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG")]
    old = [(obj, name, obj.__dict__[name]) for obj, name in saved]
    old_flex = FlexAttention.__dict__["_compiled_flex_attn"]
    try:
        parallel_dims.device_type = "cpu"
        fully._get_device_from_mesh = lambda mesh: torch.device("meta")
        state._get_device_handle = param_group._get_device_handle = \
            collectives._get_device_handle = _cpu_handle
        param_group.FSDPParamGroup._validate_no_meta_params = lambda self: None
        F.rms_norm = _fused_rms_norm_as_on_cuda
        fsdp_param.free_storage = _notify_resize(fsdp_param.free_storage)
        fsdp_param.alloc_storage = _notify_resize(fsdp_param.alloc_storage)
        param_group.alloc_storage = _notify_resize(param_group.alloc_storage)
        param_group.FSDPParamGroup.post_backward = _attribute_post_backward(
            param_group.FSDPParamGroup.post_backward)
        flex._validate_device = lambda *tensors: None
        flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
        FlexAttention._compiled_flex_attn = staticmethod(eager_flex)
        flex_hop.py_impl(MemoryTracer)(under(flex_attention_fake_impl))
        flex_backward_hop.py_impl(MemoryTracer)(
            under(flex_attention_backward_fake_tensor_mode))
        yield
    finally:
        for obj, name, value in old:
            setattr(obj, name, value)
        FlexAttention._compiled_flex_attn = old_flex
        for hop in (flex_hop, flex_backward_hop):
            hop.python_key_table.pop(MemoryTracer, None)
            hop._dispatch_cache.clear()


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """A fake ``torch.distributed`` world (``torch.testing._internal.distributed.fake_pg``
    ``FakeStore``, backend "fake": collectives return without moving data), torn down on
    exit.

    Raises:
        TracememError: a process group is already initialised in this process.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise TracememError("the torchtitan oracle needs its own fake process group; "
                            "torch.distributed is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def causal_block_mask(seq_len: int):
    """A causal ``BlockMask`` for one sequence of ``seq_len`` tokens on meta (torch
    ``create_block_mask``; torchtitan's document mask is causal within documents, one
    document here). Its small int32 block tables are made before the trace (inputs)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q, kv: q >= kv, 1, None, seq_len, seq_len,
                             device="meta")
