"""Optimizer CPU offload as Megatron-Core does it (``--optimizer-cpu-offload``): which of a
rank's optimizer parameters live on the host, what stays on the device, what each step
stages, and the host memory it needs.

Source: NVIDIA/Megatron-LM d98e8a6.

- ``megatron/training/arguments.py`` ``validate_args``: ``--optimizer-cpu-offload`` needs
  ``--use-precision-aware-optimizer`` ("the hybrid device optimizer reuses the code path of
  this flag"); ``--optimizer-offload-fraction`` defaults to 1.0 there (``OptimizerConfig``'s
  field to 0.0: the argument's default is what a launch script gets).
- ``megatron/core/optimizer/__init__.py`` ``_get_megatron_optimizer_based_on_param_groups``:
  for Adam a ``HybridDeviceOptimizer`` with TE's ``FusedAdam`` on the device and
  ``torch.optim.AdamW(fused=True)`` on the host, ``param_update_in_fp32=True``; nothing of
  ``--exp-avg-dtype`` / ``--exp-avg-sq-dtype`` / ``--main-params-dtype`` reaches it, and for
  Adam ``--use-torch-optimizer-for-cpu-offload`` is overwritten (``gpu_optimizer_cls = Adam``
  after it), so it changes nothing. The hybrid optimizer's ``step`` and hooks use CUDA
  streams: it cannot run on meta, so this module follows its code, and
  ``tests/tracemem/test_offload.py`` holds the parameter order it walks against Megatron-Core's
  own ``DistributedOptimizer`` built on meta.
- ``megatron/core/optimizer/distrib_optimizer.py`` ``DistributedOptimizer.__init__`` and
  ``_build_model_and_main_param_groups``: under the precision-aware path
  (``use_precision_aware_optimizer_no_fp8_or_ds_fp8``, true with CPU offload:
  ``optimizer_config.py`` ``__post_init__``) Megatron keeps no fp32 main shard; the inner
  optimizer's parameters are this DP rank's bf16 shard views of the parameter buffer, group by
  group (``_build_optimizer_group_ranges``: per group, buffer by buffer, bucket by bucket, each
  parameter in buffer order), and the ``HybridDeviceOptimizer`` is rebuilt over them. The dense
  and the expert parameters (EP > 1) have a distributed optimizer each (chained), so each
  applies the fraction to its own parameters. Groups: Megatron's weight-decay group first, the
  no-weight-decay group after it (``_get_param_groups``: keys sorted, no override first).
- ``megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py`` ``HybridDeviceOptimizer
  ._get_sub_optimizer_param_groups``: walking the parameters in that order, a parameter goes to
  the host while the elements offloaded so far are below ``fraction x`` the total (so the one
  that crosses the threshold goes whole); a host parameter is
  ``param.detach().clone().cpu().pin_memory()`` then, being bf16, ``.clone().float()`` pinned
  when ``pin_cpu_params``: an fp32 master on the host. A device parameter gets an fp32 master
  copy on the device (``param_to_fp32_param``). Device optimizer state: TE ``FusedAdam`` over
  the fp32 masters, fp32 moments (its default dtypes): 4 + 8 B per element. Host state:
  AdamW's ``exp_avg`` / ``exp_avg_sq`` (``torch.zeros_like``: fp32, pageable) and a 4 B fp32
  ``step`` per parameter (torch/optim/adam.py ``_init_group``, fused: on the parameter's
  device).
- ``_set_sub_optimizer_grads``: a device parameter's master gets ``grad.to(fp32)`` (the
  main-grad shard itself when it is fp32, a new fp32 copy when it is bf16); a host parameter's
  gradient goes to one pinned fp32 host buffer per parameter, made at the first step
  (``torch.empty(..., pin_memory=pin_cpu_grads)``), with ``copy_(grad, non_blocking=True)``.
  ``_register_param_copy_back_gpu_hook``: after the host step,
  ``gpu_param.data.copy_(param.data, non_blocking=True)`` per host parameter.
- PyTorch (aten/src/ATen/native/cuda/Copy.cu ``copy_kernel_cuda`` /
  ``copy_requires_temporaries``): a non-blocking copy between host and device that converts
  the dtype converts on the device through a temporary: the bf16 parameter's copy-back from the
  fp32 host master makes an fp32 device tensor of the parameter's size
  (``at::empty_like(dst, src dtype)``), and a bf16 main grad's copy to the fp32 host buffer
  converts it on the device first (``src.to(fp32)``). Each is freed when its ``copy_`` returns.
- Pinned host memory (aten/src/ATen/core/CachingHostAllocator.h
  ``CachingHostAllocatorImpl::allocate``): each request is rounded up to a power of two.
- With bf16 main grads those fp32 gradient copies of the device part persist: each master's
  ``.grad`` holds its copy until the next step replaces it, and neither Megatron's
  ``DistributedOptimizer.zero_grad`` (its groups, not the hybrid optimizer's masters) nor
  ``HybridDeviceOptimizer.zero_grad`` (the bf16 parameters' ``decoupled_grad``) clears it:
  4 B per device element of static memory from the second iteration on.

Not counted: the bf16 pinned clone each host parameter passes through when the optimizer is
built (freed then, but kept in the caching host allocator's free list until reused), and the
host's own copies that torch's fused CPU AdamW makes while it steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracemem.errors import TracememError

__all__ = ["OptimizerOffload", "OffloadSplit", "HostMemory", "check_optimizer_offload",
           "hdo_parameters", "offload_split", "host_memory", "offload_static", "pinned_block",
           "host_per_node", "ema_host_bytes",
           "DEVICE_STATE_BYTES", "ADAM_STEP_BYTES"]

# hybrid_optimizer.py: TE FusedAdam over fp32 masters with fp32 exp_avg / exp_avg_sq
DEVICE_STATE_BYTES = 4 + 4 + 4
ADAM_STEP_BYTES = 4  # torch/optim/adam.py: fused AdamW's per-parameter fp32 step tensor


@dataclass(frozen=True)
class OptimizerOffload:
    """Megatron's optimizer CPU offload settings: ``fraction`` (``--optimizer-offload-fraction``,
    0 to 1, of each distributed optimizer's parameter elements), ``pin_cpu_grads`` /
    ``pin_cpu_params`` (``--no-pin-cpu-grads`` / ``--no-pin-cpu-params`` turn them off: the
    host gradient buffers / fp32 masters in pageable memory)."""

    fraction: float = 1.0
    pin_cpu_grads: bool = True
    pin_cpu_params: bool = True


@dataclass(frozen=True)
class OffloadSplit:
    """One rank's optimizer parameters (elements of its DP shard, one entry per parameter
    piece, in ``HybridDeviceOptimizer`` order) split between device and host."""

    device: tuple[int, ...]
    host: tuple[int, ...]

    @property
    def device_elements(self) -> int:
        return sum(self.device)

    @property
    def host_elements(self) -> int:
        return sum(self.host)


@dataclass(frozen=True)
class HostMemory:
    """Host bytes of one rank's offloaded optimizer, as requested: ``master_bytes`` (fp32
    masters), ``grad_bytes`` (fp32 gradient buffers), ``state_bytes`` (AdamW's moments and step
    tensors); as held: ``pinned_bytes`` (each pinned tensor a power-of-two block of the
    caching host allocator) and ``pageable_bytes`` (the rest, as requested)."""

    master_bytes: int = 0
    grad_bytes: int = 0
    state_bytes: int = 0
    pinned_bytes: int = 0
    pageable_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        """Host memory held: pinned blocks (rounded) and pageable memory."""
        return self.pinned_bytes + self.pageable_bytes


def pinned_block(nbytes: int) -> int:
    """The bytes of a pinned host block for a request of ``nbytes``: the next power of two
    (CachingHostAllocator.h ``CachingHostAllocatorImpl::allocate``: ``PowerOf2Ceil``)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def check_optimizer_offload(offload: OptimizerOffload | None, par, optimizer: str,
                            kernels: str) -> None:
    """Raises TracememError: a fraction outside [0, 1], offload without the precision-aware
    optimizer (Megatron's ``validate_args``), under ZeRO 0 / 2 / 3 (the hybrid optimizer over
    Megatron-FSDP's shards is not modelled), with ``--optimizer torch``, or with kernels other
    than megatron-te (the distributed optimizer's layout is Megatron-Core's)."""
    if offload is None:
        return
    f = offload.fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
        raise TracememError(f"--optimizer-offload-fraction {f!r} must be a number from 0 to 1")
    if not par.precision_spec.use_precision_aware_optimizer:
        raise TracememError("--optimizer-cpu-offload needs --use-precision-aware-optimizer "
                            "(Megatron's validate_args: the hybrid device optimizer reuses "
                            "its code path)")
    if par.zero != 1:
        raise TracememError(f"--optimizer-cpu-offload with --zero {par.zero} is not modelled "
                            f"yet: tracemem holds Megatron's distributed optimizer "
                            f"(--zero 1) with the hybrid device optimizer")
    if optimizer != "fused":
        raise TracememError("--optimizer-cpu-offload runs Megatron's hybrid device optimizer "
                            "(TE FusedAdam and torch's AdamW); use --optimizer fused")
    if kernels != "megatron-te":
        raise TracememError(f"--optimizer-cpu-offload needs --kernels megatron-te (the "
                            f"distributed optimizer's parameter layout), not {kernels!r}")


def _pieces(buffer, dp_rank: int) -> list[tuple[bool, int]]:
    """(no weight decay, elements) of each parameter piece in ``dp_rank``'s shard of
    ``buffer`` (``tracemem.static.MegatronBuffer``), bucket by bucket, parameters in buffer
    order (distrib_optimizer.py ``_build_model_gbuf_param_range_map``: only the parameters
    the rank's range of the bucket cuts)."""
    _, params, buckets = buffer.layout()
    flags = (buffer.no_decay or (False,) * len(buffer.numels))[::-1]  # buffer order
    out = []
    for lo, hi in buckets:
        size = (hi - lo) // buffer.group
        a, b = lo + dp_rank * size, lo + (dp_rank + 1) * size
        for (s, e), flag in zip(params, flags):
            if s < hi and e > lo:
                n = max(0, min(b, e) - max(a, s))
                if n:
                    out.append((flag, n))
    return out


def hdo_parameters(model, par, rank: int | None = None, *, overlap_grad_reduce: bool = False,
                   bucket_size: int | None = None) -> dict[str, list[int]]:
    """Per distributed optimizer ("dense"; "expert" with EP > 1) the elements of each of
    its parameters on ``rank`` (None: DP and EDP rank 0), in the order its
    ``HybridDeviceOptimizer`` walks them: the weight-decay group, then the no-weight-decay
    group, each buffer by buffer (model chunks in order), bucket by bucket, parameters in
    buffer order (module docstring); ``overlap_grad_reduce`` / ``bucket_size``: the buckets
    (``tracemem.static.megatron_buffers``). ``tracemem validate --against megatron-core``'s
    static oracle builds the same optimizer: its parameters' sizes, in order, are these on
    the layouts of ``tests/tracemem/test_offload.py``."""
    from modeling.parallel.build import coordinates
    from tracemem.static import _dp_rank, megatron_buffers

    where = coordinates(par, rank) if rank is not None else None
    buffers = megatron_buffers(model, par, overlap_grad_reduce=overlap_grad_reduce,
                               bucket_size=bucket_size, pp_rank=where.pp_rank if where else 0)
    out: dict[str, list[int]] = {}
    for kind in ("dense", "expert"):
        mine = [b for b in buffers if b.kind == kind]
        pieces = [_pieces(b, _dp_rank(b, par, where)) for b in mine]
        order = [n for no_decay in (False, True) for ps in pieces
                 for flag, n in ps if flag == no_decay]
        if order:
            out[kind] = order
    return out


def offload_split(parameters: dict[str, list[int]], fraction: float) -> OffloadSplit:
    """Which parameters go to the host: per optimizer, in order, each while the elements
    offloaded so far are below ``fraction`` x that optimizer's total
    (``_get_sub_optimizer_param_groups``: ``offload_params_numel < offload_threshold``)."""
    device, host = [], []
    for numels in parameters.values():
        threshold = sum(numels) * fraction
        done = 0
        for n in numels:
            if done < threshold:
                host.append(n)
                done += n
            else:
                device.append(n)
    return OffloadSplit(tuple(device), tuple(host))


def host_memory(split: OffloadSplit, offload: OptimizerOffload) -> HostMemory:
    """The host bytes of ``split``'s host parameters under ``offload``'s pinning."""
    masters = [4 * n for n in split.host]  # fp32 masters; the gradient buffers alike
    blocks = sum(pinned_block(b) for b in masters)
    state = sum(8 * n + ADAM_STEP_BYTES for n in split.host)
    pinned = blocks * (offload.pin_cpu_params + offload.pin_cpu_grads)
    pageable = state + sum(masters) * ((not offload.pin_cpu_params)
                                       + (not offload.pin_cpu_grads))
    return HostMemory(sum(masters), sum(masters), state, pinned, pageable)


def offload_static(static, model, par, offload: OptimizerOffload, rank: int | None = None):
    """``static`` (``tracemem.static.StaticMemory`` of ``model`` under Megatron's
    distributed optimizer) with the optimizer CPU offload applied: the device optimizer state
    is ``DEVICE_STATE_BYTES`` per device element (the fp32 masters and moments of TE's
    FusedAdam, whatever the precision recipe's moment dtypes), with bf16 main grads 4 B more
    (the masters' persisting fp32 gradient copies, module docstring); the host memory
    ``host_memory``'s. Parameters and main grads stay on the device as they were."""
    from dataclasses import replace

    split = offload_split(hdo_parameters(model, par, rank), offload.fraction)
    host = host_memory(split, offload)
    per = DEVICE_STATE_BYTES + (4 if par.precision_spec.grad_bytes == 2 else 0)
    return replace(static, optimizer_bytes=per * split.device_elements,
                   host_bytes=host.total_bytes, host_pinned_bytes=host.pinned_bytes)


def ema_host_bytes(model) -> int:
    """The host bytes of DeepSeek-V3's EMA of the weights (arXiv 2412.19437 section 3.2.3,
    "Exponential Moving Average in CPU": "stored in CPU memory and updated asynchronously
    after each training step"; 0 device bytes). The paper gives neither dtype nor sharding;
    assumed: fp32 (4 B), one value per parameter element of the rank's ``model`` (its TP / EP
    / PP-local parameters, not sharded over DP), in pageable memory. A parameter shared by two
    modules (a tied head) counts once."""
    return 4 * sum(p.numel() for p in model.parameters())


def host_per_node(world_size: int, pp: int, per_stage: dict[int, int],
                  ranks_per_node: int) -> int:
    """The most host bytes any node needs: node k holds global ranks [k x R, (k + 1) x R)
    (R = ``ranks_per_node``; torchrun's and SLURM's order: global rank = node rank x local
    world size + local rank), stage s holds ranks [s x W / PP, (s + 1) x W / PP) (Megatron's
    rank order, PP slowest), each rank of stage s ``per_stage[s]`` bytes. Only the nodes at
    each stage's two ends and one inside it are summed: every other node is one of those."""
    per = world_size // pp
    nodes = -(-world_size // ranks_per_node)

    def node_bytes(k: int) -> int:
        lo, hi = k * ranks_per_node, min((k + 1) * ranks_per_node, world_size)
        total = 0
        for s in range(lo // per, (hi - 1) // per + 1):
            a, b = max(lo, s * per), min(hi, (s + 1) * per)
            total += (b - a) * per_stage.get(s, 0)
        return total

    candidates = set()
    for s in range(pp):
        first, last = s * per // ranks_per_node, ((s + 1) * per - 1) // ranks_per_node
        candidates |= {first, last, min(first + 1, nodes - 1)}
    return max((node_bytes(k) for k in candidates), default=0)
