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

Megatron's distributed optimizer (ZeRO 1 with the ``megatron`` orchestration, i.e. the
``megatron-te`` kernels): its parameter and gradient buffers are laid out as Megatron-Core lays
them out (``megatron_buffers``), padding included, and this rank's optimizer state is the
parameter elements inside its shard of each bucket, not ceil(N / DP). Megatron-Core 0.16.1
``distributed/param_and_grad_buffer.py`` ``_ParamAndGradBuffer.__init__``
(``_pad_start_of_param_if_needed``, ``_pad_end_of_bucket_if_needed``); the same rules at
Megatron-LM d98e8a6 in ``optimizer/param_layout.py`` ``pad_param_start`` /
``pad_bucket_end`` called by ``optimizer/distrib_optimizer.py``
``DistributedOptimizer._compute_per_buffer_param_layout``: each parameter starts at a multiple
of 64 elements (walking the parameters in reverse registration order), each bucket ends at a
multiple of lcm(DP, 128), and DP rank r owns elements [r, r + 1) x bucket / DP of every bucket
(``DistributedOptimizer._build_model_gbuf_range``). ``tracemem validate --against
megatron-core`` holds this against Megatron-Core's own ``DistributedDataParallel`` and
``DistributedOptimizer`` (``tracemem.oracle.static_oracle``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import nn

from modeling.parallel.groups import numel_by_kind
from modeling.params import count_by_component
from tracemem.categories import Category
from tracemem.precision import PRECISION_RECIPES, Precision
from tracemem.zero3 import grads_traced, pp_keeps_gathered, pp_resident_bytes, unit_params

__all__ = ["Precision", "PRECISION_RECIPES", "StaticMemory", "static_memory",
           "fused_wgrad_modules", "is_fused_wgrad", "MegatronBuffer", "megatron_buffers",
           "megatron_tensors", "megatron_optimizer_groups"]


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
            (``gathered_param_bytes`` per element, bf16, this rank's TP/EP shard of that
            unit: a decoder layer, MTP module, the embedding or the head;
            ``tracemem.zero3.zero3_units``), else 0.
        by_component: parameter elements held per component (``modeling.params.COMPONENTS``).
        workspaces: the allocations below the dispatcher this rank keeps
            (``tracemem.workspaces.Workspace``; empty when the job names no GPU), not in
            ``total_bytes``: ``workspace_bytes``.
        fp8_bytes: under an FP8 recipe, TE's FP8 weight copies and scaling state kept
            across steps (``fp8_static``); already in ``buffer_bytes``, shown apart.
        unsharded_param_bytes, unsharded_grad_bytes: torchtitan's PP + FSDP2 only
            (``tracemem.zero3.pp_keeps_gathered``): the stage's bf16 unsharded parameters and
            fp32 unsharded gradient accumulators held through the step
            (``tracemem.zero3.pp_resident_bytes``); already in ``param_bytes`` /
            ``grad_bytes``, shown apart; ``zero3_gather_bytes`` is then 0 (nothing is
            gathered per unit).
        host_bytes, host_pinned_bytes: host memory (not in ``total_bytes``) of the optimizer
            offloaded by ``--optimizer-cpu-offload`` (``tracemem.offload.offload_static``),
            all of it and its pinned part; 0 without offload.
        traced_grad_bytes: the part of ``grad_bytes`` the trace makes rather than static
            memory holding it from the start: torchtitan's FSDP2 without PP with
            ``zero_grad(set_to_none=True)`` (``tracemem.zero3.grads_traced``), whose fp32
            sharded gradients are born in the step's first backward
            (``Zero3Gathers._reduce``); in ``total_bytes`` (the step's end), not in a replay's
            floor (``held_grad_bytes``).
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
    host_bytes: int = 0
    host_pinned_bytes: int = 0
    unsharded_param_bytes: int = 0
    unsharded_grad_bytes: int = 0
    fp8_bytes: int = 0
    traced_grad_bytes: int = 0

    @property
    def held_grad_bytes(self) -> int:
        """Gradient bytes held from the start of the step: ``grad_bytes`` less
        ``traced_grad_bytes``."""
        return self.grad_bytes - self.traced_grad_bytes

    @property
    def workspace_bytes(self) -> int:
        return sum(w.nbytes for w in self.workspaces)

    @property
    def total_bytes(self) -> int:
        return (self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.buffer_bytes
                + self.zero3_gather_bytes)


def _shard(elements: int, ways: int) -> int:
    return -(-elements // ways)


# Megatron-Core 0.16.1 distributed/param_and_grad_buffer.py _ParamAndGradBuffer.__init__
# (Megatron-LM d98e8a6 optimizer/param_layout.py): a parameter starts at a multiple of 64
# elements ("128-byte aligned addresses ... since params are >= 16-bit precision"), a bucket
# ends at a multiple of lcm(DP, 128) ("256-byte aligned", and divisible by DP)
PARAM_START_ALIGN = 64
BUCKET_END_ALIGN = 128
# distributed/distributed_data_parallel.py DistributedDataParallel.__init__: the bucket size
# with --overlap-grad-reduce when --ddp-bucket-size is not given, max(40M, 1M x DP) elements
DEFAULT_BUCKET_ELEMENTS = 40_000_000


def _pad(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


@dataclass(frozen=True)
class MegatronBuffer:
    """One of Megatron-Core's ``_ParamAndGradBuffer``s of one model chunk: ``kind`` "dense"
    (reduced over DP x CP) or "expert" (over EDP; only with EP > 1), ``numels`` the elements
    of each parameter tensor Megatron-Core makes, in registration order, ``group`` the size
    of the data-parallel group that shards it, ``bucket_size`` elements per bucket (None: one
    bucket; Megatron's default without ``--overlap-grad-reduce``)."""

    chunk: int
    kind: str
    numels: tuple[int, ...]
    group: int
    bucket_size: int | None = None
    no_decay: tuple[bool, ...] = ()  # per tensor: in Megatron's no-weight-decay group
    own_bucket: tuple[bool, ...] = ()  # per tensor: a shared embedding, in a bucket alone

    def layout(self) -> tuple[int, list[tuple[int, int]], list[tuple[int, int]]]:
        """(padded elements, each parameter's (start, end), each bucket's (start, end)),
        parameters in buffer order (reverse registration order), as
        ``_ParamAndGradBuffer.__init__`` places them with the distributed optimizer; a
        shared embedding (``own_bucket``: ``_does_param_require_new_bucket``) closes the
        bucket before it and its own after it."""
        divisor = math.lcm(self.group, BUCKET_END_ALIGN)
        own = (self.own_bucket or (False,) * len(self.numels))[::-1]
        params, buckets = [], []
        start = bucket_start = end = 0
        for numel, alone in zip(self.numels[::-1], own):
            start = _pad(start, PARAM_START_ALIGN)
            if alone and params and params[-1][1] > bucket_start:  # close the open bucket
                bucket_end = _pad(start, divisor)
                buckets.append((bucket_start, bucket_end))
                start = bucket_start = bucket_end
            end = start + numel
            params.append((start, end))
            if alone or (self.bucket_size is not None
                         and end - bucket_start >= self.bucket_size):
                bucket_end = _pad(end, divisor)
                buckets.append((bucket_start, bucket_end))
                start = bucket_start = bucket_end
            else:
                start = end
        if not buckets or buckets[-1][1] < end:
            buckets.append((bucket_start, _pad(end, divisor)))
        return buckets[-1][1], params, buckets

    @property
    def padded(self) -> int:
        """Elements of the buffer, padding included (``_ParamAndGradBuffer.numel``)."""
        return self.layout()[0]

    def shard_elements(self, rank: int, no_decay: bool | None = None) -> int:
        """Parameter elements in data-parallel rank ``rank``'s shard of every bucket: the
        elements its main parameters and optimizer state hold (optimizer/distrib_optimizer.py
        ``DistributedOptimizer._build_model_gbuf_param_range_map``: each parameter's range
        cut to the rank's range of the bucket; padding holds no state). ``no_decay``: only
        the tensors of that weight-decay group (None: all)."""
        _, params, buckets = self.layout()
        flags = (self.no_decay or (False,) * len(self.numels))[::-1]  # buffer order
        total = 0
        for lo, hi in buckets:
            size = (hi - lo) // self.group
            a, b = lo + rank * size, lo + (rank + 1) * size
            total += sum(max(0, min(b, e) - max(a, s)) for (s, e), flag in zip(params, flags)
                         if s < hi and e > lo and (no_decay is None or flag == no_decay))
        return total


def megatron_tensors(model: nn.Module) -> list[tuple[str, int, str, bool]]:
    """(tracemem parameter path, elements, kind, no weight decay) of each parameter tensor
    Megatron-Core's TE spec makes for the modules of ``model``, in Megatron-Core's
    registration order, one shared tensor once. No weight decay: a 1-D tensor or a bias
    (optimizer/__init__.py ``_get_param_groups``: ``no_wd = name.endswith(".bias") or
    len(param.shape) == 1``). Where Megatron-Core's tensors are not tracemem's:

    - a gated MLP's ``w1`` and ``w3`` are one ``linear_fc1.weight`` ([gate; up], at
      ``w1``'s place; ``transformer/mlp.py`` ``MLP.__init__``: fc1 of 2 x ffn_hidden_size);
    - grouped experts ``(E_local, ...)`` are one ``weight{i}`` per local expert, every fc1
      then every fc2 (``extensions/transformer_engine.py`` ``TEGroupedLinear``:
      ``weight0 .. weight{num_gemms-1}``; ``transformer/moe/experts.py`` ``TEGroupedMLP``
      builds linear_fc1 before linear_fc2);
    - GQA's ``wq``, ``wk``, ``wv`` are one ``linear_qkv`` tensor (weights, and biases, at
      ``wq``'s place; ``transformer/attention.py`` ``SelfAttention.__init__``);
    - the attention's output projection ``wo`` (``linear_proj``) comes first among the
      attention's parameters (``transformer/attention.py`` ``Attention.__init__`` builds
      linear_proj before the subclass builds the projections).
    The norms fused into TE's ``LayerNormLinear`` (``q_norm``, ``kv_norm``, a dense layer's
    ``ffn_norm``) keep their place: TE registers ``layer_norm_weight`` before ``weight``
    (transformer_engine/pytorch/module/layernorm_linear.py ``LayerNormLinear.__init__``).
    ``tracemem validate --against megatron-core`` proves this order for MLA with a dense MLP
    and MoE with a shared expert (DeepSeek-V3's architecture). For GQA the tensors are
    Megatron's, so the buffer's size is exact when the first-registered tensor is (it is the
    only one not followed by an alignment gap), but its input norm, which Megatron-Core fuses
    into ``linear_qkv`` after ``linear_proj``, keeps tracemem's place: the gaps' positions, and
    so a DP rank's shard, are not proven there.
    """
    from modeling.common.moe import GroupedExperts
    from modeling.parallel.groups import group_of

    def fused(siblings: dict, leaves: tuple[str, ...], name: str) -> int:
        return sum(siblings[x]._parameters[name].numel() for x in leaves
                   if x in siblings and siblings[x]._parameters.get(name) is not None)

    seen: set[int] = set()
    out: list[tuple[str, int, str, bool]] = []
    attention_start: dict[str, int] = {}
    for module_name, module in model.named_modules():
        own = [(n, p) for n, p in module._parameters.items() if p is not None]
        prefix = f"{module_name}." if module_name else ""
        parent, _, leaf = module_name.rpartition(".")
        siblings = dict(model.get_submodule(parent).named_children()) if module_name else {}
        for name, p in own:
            if id(p) in seen:
                continue
            seen.add(id(p))
            kind = group_of(p, prefix + name).kind
            if isinstance(module, GroupedExperts):
                if name == "w3":
                    continue
                own_params = dict(module.named_parameters(recurse=False))
                per = p[0].numel() + (own_params["w3"][0].numel()
                                      if name == "w1" and "w3" in own_params else 0)
                out += [(f"{prefix}{name}[{e}]", per, kind, False) for e in range(p.shape[0])]
                continue
            glu = "w1" in siblings and "w2" in siblings and "w3" in siblings
            qkv = "wq" in siblings and "wk" in siblings and "wv" in siblings
            if (glu and leaf == "w3") or (qkv and leaf in ("wk", "wv")):
                continue  # fused into linear_fc1 / linear_qkv at w1's / wq's place
            numel = p.numel()
            if glu and leaf == "w1":
                numel = fused(siblings, ("w1", "w3"), name)
            if qkv and leaf == "wq":
                numel = fused(siblings, ("wq", "wk", "wv"), name)
            is_attention = "wo" in siblings and ("wkv_a" in siblings or qkv)
            if is_attention and parent not in attention_start:
                attention_start[parent] = len(out)
            no_decay = p.ndim == 1 or name == "bias"
            if is_attention and leaf == "wo":  # linear_proj first
                at = attention_start[parent]
                out.insert(at + (name != "weight"), (prefix + name, numel, kind, no_decay))
                continue
            out.append((prefix + name, numel, kind, no_decay))
    return out


def _chunk_of(model: nn.Module, path: str) -> int:
    """The model chunk (VPP) holding parameter ``path``: its decoder layer's chunk; the
    embedding the first, the final norm, head and MTP the last."""
    chunks = getattr(model, "chunks", [[]])
    if path.startswith("layers."):
        layer = int(path.split(".")[1])
        return next(c for c, layers in enumerate(chunks) if layer in layers)
    return 0 if path.startswith(("embed.", "position_embed.")) else len(chunks) - 1


def megatron_buffers(model: nn.Module, par, *, overlap_grad_reduce: bool = False,
                     bucket_size: int | None = None, pp_rank: int = 0) -> list[MegatronBuffer]:
    """The DDP buffers Megatron-Core makes for ``model`` (one rank's chunks) under ``par``:
    per model chunk a dense buffer and, with EP > 1, an expert one (expert parameters are
    ``allreduce=False`` only then: extensions/transformer_engine.py ``TEGroupedLinear``).
    Buckets (distributed_data_parallel.py ``DistributedDataParallel.__init__``): one per
    buffer unless ``overlap_grad_reduce``, then ``bucket_size`` elements (default
    max(40M, 1M x DP x CP): training.py ``resolve_ddp_bucket_size``), except on pipeline
    ranks after the first and on chunks after the first (Megatron-LM training.py
    ``get_model``: ``disable_bucketing=model_chunk_idx > 0``); a shared embedding (PP > 1 with
    tied embeddings or MTP) in a bucket of its own. Each buffer's group is the intra-instance
    group DDP hands it (distributed_data_parallel.py ``DistributedDataParallel.__init__``:
    ``intra_dp_cp_group`` / ``intra_expt_dp_group``, DP x CP / N and EDP / N under
    ``--num-distributed-optimizer-instances`` N: ``ParallelConfig.intra_group_size``)."""
    # models/common/language_module/language_module.py LanguageModule.setup_embeddings_and_
    # output_layer: with PP > 1 and tied embeddings or MTP, the first stage's word embedding
    # (when it is not also the last) and the later stage's copy (the tied head or the MTP
    # embedding) are shared_embedding, each in a bucket of its own
    cfg = getattr(model, "cfg", None)
    pre, post = getattr(model, "pre_process", True), getattr(model, "post_process", True)
    shared = par.pp > 1 and cfg is not None and (
        cfg.tie_word_embeddings or cfg.num_mtp_modules > 0)
    per: dict[tuple[int, str], list[tuple[int, bool, bool]]] = {}
    for path, numel, kind, no_decay in megatron_tensors(model):
        kind = "expert" if kind == "expert" and par.ep > 1 else "dense"
        alone = shared and ((path == "embed.weight" and pre != post) or (
            path == "head.weight" and post and not pre and cfg.tie_word_embeddings))
        per.setdefault((_chunk_of(model, path), kind), []).append((numel, no_decay, alone))
    out = []
    for (chunk, kind), tensors in sorted(per.items()):
        group = par.intra_group_size("edp" if kind == "expert" else "dp_cp")
        size = None
        if overlap_grad_reduce and chunk == 0 and pp_rank == 0:
            size = bucket_size or max(DEFAULT_BUCKET_ELEMENTS, 1_000_000 * par.dp_cp)
        out.append(MegatronBuffer(chunk, kind, tuple(t[0] for t in tensors), group, size,
                                  tuple(t[1] for t in tensors), tuple(t[2] for t in tensors)))
    return out


def _dp_rank(buffer: MegatronBuffer, par, where) -> int:
    """The rank of ``where`` (``RankCoordinates``; None: rank 0) in ``buffer``'s group: EDP
    for the expert buffer, DP x CP (CP varying faster than DP, parallel_state.py) else; its
    intra-instance part under several distributed-optimizer instances (contiguous slices:
    parallel_state.py ``initialize_model_parallel``)."""
    if where is None:
        return 0
    if buffer.kind == "expert":
        return where.edp_rank % buffer.group
    return (where.dp_rank * par.cp + where.cp_rank) % buffer.group


def megatron_optimizer_groups(model: nn.Module, par, rank: int | None = None, *,
                              overlap_grad_reduce: bool = False,
                              bucket_size: int | None = None) -> dict[tuple[str, bool], int]:
    """This rank's parameter elements in each of Megatron-Core's optimizer parameter groups,
    keyed (kind, no weight decay): the distributed optimizer of the dense parameters and
    that of the expert ones (EP > 1) are chained (optimizer/__init__.py
    ``get_megatron_optimizer``), each with a weight-decay and a no-weight-decay group over
    all model chunks (``_get_param_groups``). What a per-group optimizer step holds at once
    (torch's foreach Adam: a temporary per group) is the largest of them."""
    from modeling.parallel.build import coordinates

    where = coordinates(par, rank) if rank is not None else None
    out: dict[tuple[str, bool], int] = {}
    for b in megatron_buffers(model, par, overlap_grad_reduce=overlap_grad_reduce,
                              bucket_size=bucket_size, pp_rank=where.pp_rank if where else 0):
        for no_decay in (False, True):
            n = b.shard_elements(_dp_rank(b, par, where), no_decay)
            if n:
                out[(b.kind, no_decay)] = out.get((b.kind, no_decay), 0) + n
    return out


def fp8_static(model: nn.Module, param_bytes: int) -> tuple[int, int]:
    """FP8 static memory of a rank's model under the megatron-te profile's FP8 recipe: (bytes
    kept beside the parameters, bytes the parameter buffer saves). Each TE weight in an FP8
    layer (every ``Linear`` whose profile has an ``fp8_recipe``, the grouped experts' weights
    per expert; not the output layer, Megatron's non-TE ``ColumnParallelLinear``) keeps:

    - without ``fp8_param_gather``: its FP8 copy, TE's weight workspace
      (``module/base.py`` ``quantize_weight`` with ``cache=True``: Megatron passes
      ``is_first_microbatch``, extensions/transformer_engine.py ``TELinear.forward``, so
      ``_Linear`` caches it in ``_fp8_workspaces`` across microbatches and steps), with both
      usages (``modeling.kernels.fp8.inner_specs`` with role "weight": Hopper per-tensor 2 B
      an element, Blackwell 1 B; MXFP8 and blockwise 2 B and their scales);
    - with ``fp8_param_gather`` (primary FP8 weights, ``fp8_model_init``): the row-wise data
      lives in Megatron's uint8 parameter buffer (``param_and_grad_buffer.py``: ``param_dtype
      = torch.uint8`` for FP8 parameters), 1 B in place of ``param_bytes``; the rest of the
      tensor (Hopper's transpose, made by ``update_usage`` and kept on the parameter;
      blockwise's column-wise data; the scales) beside it. The uint8 buffer's own bucket
      padding is not counted apart (an approximation: under 64 elements a parameter).

    Delayed scaling adds each GEMM's fp32 ``scale`` and ``amax_history`` (``fp8_amax_history_len``
    rows) for 3 forward and 2 backward quantisers (``module/base.py`` ``set_meta_tensor``,
    ``quantization.py`` ``DelayedScalingRecipeState``): 20 x (len + 1) B per GEMM, counting
    a fused ``linear_fc1`` as its two weights (40 B over)."""
    from modeling.common.linear import Linear
    from modeling.common.moe import GroupedExperts
    from modeling.kernels import fp8

    kept = saved = 0
    for module in model.modules():
        k = getattr(module, "kernels", None)
        recipe = getattr(k, "fp8_recipe", "none")
        if recipe == "none":
            continue
        if isinstance(module, Linear):
            shapes = [tuple(module.weight.shape)]
        elif isinstance(module, GroupedExperts):
            shapes = [tuple(w.shape[1:]) for w in (module.w1, getattr(module, "w3", None),
                                                   module.w2) if w is not None
                      for _ in range(w.shape[0])]
        else:
            continue
        gather = k.options["fp8_param_gather"]
        for shape in shapes:
            specs = fp8.inner_specs(recipe, shape, True, True, k.fp8_arch, "weight")
            for name, (dims, dtype) in specs.items():
                if gather and name in ("_data", "_rowwise_data"):
                    saved += (param_bytes - 1) * math.prod(dims)
                    continue
                kept += math.prod(dims) * (4 if dtype.is_floating_point else 1)
            if recipe == "delayed":
                kept += 20 * (k.options["fp8_amax_history_len"] + 1)
    return kept, saved


def static_memory(model: nn.Module, par, rank: int | None = None, *,
                  overlap_grad_reduce: bool = False,
                  bucket_size: int | None = None) -> StaticMemory:
    """``_static_memory`` plus the FP8 weight copies and scaling state (``fp8_static``) in
    ``buffer_bytes`` / ``fp8_bytes`` and, under ``--fp8-param-gather``, the parameter
    buffer's FP8 weights at 1 B an element."""
    from dataclasses import replace

    memory = _static_memory(model, par, rank, overlap_grad_reduce=overlap_grad_reduce,
                            bucket_size=bucket_size)
    kept, saved = fp8_static(model, par.precision_spec.param_bytes)
    if not kept and not saved:
        return memory
    if saved and par.zero == 3:
        from tracemem.errors import TracememError

        raise TracememError("fp8_param_gather (--fp8-param-gather) under ZeRO-3 is not "
                            "modelled yet (FP8 parameters sharded by FSDP)")
    return replace(memory, buffer_bytes=memory.buffer_bytes + kept, fp8_bytes=kept,
                   param_bytes=memory.param_bytes - saved)


def _static_memory(model: nn.Module, par, rank: int | None = None, *,
                   overlap_grad_reduce: bool = False,
                   bucket_size: int | None = None) -> StaticMemory:
    """Static memory of a rank's model (``build_rank``) under ``par`` (a
    ``tracemem.ParallelConfig``: its zero, resolved precision ``precision_spec`` and the
    group sizes that ``tracemem.parallel.SHARDING`` names). Each parameter's group (dense or
    expert) is its declaration (``modeling.parallel.groups.ParamGroup.kind``).

    Under Megatron's distributed optimizer (``par.zero`` 1 and a model with the ``megatron``
    orchestration) the buffers are Megatron-Core's (``megatron_buffers``, padding included;
    ``overlap_grad_reduce`` / ``bucket_size`` are Megatron's ``--overlap-grad-reduce`` /
    ``--ddp-bucket-size``) and the optimizer state is global ``rank``'s shard (None: DP and
    EDP rank 0, the first shard of every bucket).

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

    kernels = getattr(model, "kernels", None)
    if par.zero == 1 and getattr(kernels, "orchestration", None) == "megatron":
        return _megatron_static(model, par, rank, overlap_grad_reduce, bucket_size)

    persistent = model.state_dict(keep_vars=True)
    buffers = sum(b.numel() * b.element_size() for name, b in model.named_buffers()
                  if name in persistent)
    gather = 0
    if par.zero == 3:
        gather = recipe.gathered_param_bytes * max(
            (sum(p.numel() for p in params) for params in unit_params(model).values()),
            default=0)
    resident = (0, 0)
    if pp_keeps_gathered(par):  # torchtitan's PP + FSDP2: gathered through the step
        resident, gather = pp_resident_bytes(model, recipe), 0
    grads = sharded(recipe.grad_bytes, "gradients")
    # torchtitan's FSDP2 without PP, zero_grad(set_to_none=True): the sharded gradients are
    # the trace's (tracemem.zero3.grads_traced)
    traced = grads if grads_traced(par, kernels) else 0
    return StaticMemory(dense, expert, sharded(recipe.param_bytes, "parameters") + resident[0],
                        grads + resident[1],
                        sharded(recipe.optimizer_bytes, "optimizer_states"),
                        buffers, gather, count_by_component(model, buffers=False),
                        unsharded_param_bytes=resident[0], unsharded_grad_bytes=resident[1],
                        traced_grad_bytes=traced)


def _persistent_buffer_bytes(model: nn.Module) -> int:
    persistent = model.state_dict(keep_vars=True)
    return sum(b.numel() * b.element_size() for name, b in model.named_buffers()
               if name in persistent)


def _megatron_static(model: nn.Module, par, rank: int | None, overlap_grad_reduce: bool,
                     bucket_size: int | None) -> StaticMemory:
    """``static_memory`` under Megatron's distributed optimizer: the bf16 parameter buffer
    and the main-grad buffer are the padded ``megatron_buffers`` (distributed_data_parallel.py:
    with the distributed optimizer both ``param_data`` and ``grad_data`` are ``numel``
    elements, parameters re-mapped into the first), the optimizer state (master weights and
    Adam moments, ``precision_spec.optimizer_bytes`` per element) this rank's shard."""
    from modeling.parallel.build import coordinates

    recipe = par.precision_spec
    kinds = numel_by_kind(model)
    where = coordinates(par, rank) if rank is not None else None
    buffers = megatron_buffers(model, par, overlap_grad_reduce=overlap_grad_reduce,
                               bucket_size=bucket_size,
                               pp_rank=where.pp_rank if where else 0)
    padded = sum(b.padded for b in buffers)
    state = sum(b.shard_elements(_dp_rank(b, par, where)) for b in buffers)
    return StaticMemory(kinds["dense"], kinds["expert"], recipe.param_bytes * padded,
                        recipe.grad_bytes * padded, recipe.optimizer_bytes * state,
                        _persistent_buffer_bytes(model), 0,
                        count_by_component(model, buffers=False))
