"""``tracemem inventory``: every tensor a decoder layer (or the embedding / loss end) keeps
from its forward to its backward under a kernel profile: module, what saved it, shape, dtype,
bytes and the source the saving kernel mirrors.

One microbatch's forward of the rank that holds the layer runs under a ``MemoryTracer`` on the
meta device; the storages born in that forward and still alive after it are the inventory. Each
is matched to the autograd Nodes that saved it by walking the graph from the output (a
built-in Node's ``_saved_*`` attributes, a custom Function's ``saved_tensors``), and a Node
names its source: ``modeling.kernels``' Functions cite the Megatron-Core / Transformer Engine
function they mirror (``KERNEL_SOURCES``); built-in Nodes are PyTorch's autograd formulas
(``tools/autograd/derivatives.yaml`` at torch 2.13).

Bytes are exact (no allocator rounding). Module paths follow the tracer: a kernel called from
inside a module's forward belongs to that module.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from modeling import ModelConfig, load_config
from modeling.kernels import get_profile
from modeling.parallel.build import build_rank
from modeling.parallel.pp import recv_forward
from modeling.common.routing import Balanced
from tracemem.categories import Phase
from tracemem.errors import TracememError
from tracemem.parallel import ParallelConfig
from tracemem.tracer import MemoryTracer

__all__ = ["KERNEL_SOURCES", "InventoryRow", "Inventory", "get_inventory", "format_inventory"]

_TE = "TransformerEngine d0067d0 transformer_engine/pytorch/"
_MC = "Megatron-LM d98e8a6 megatron/core/"
# autograd Node name -> the source its kernel mirrors (modeling.kernels' Functions)
KERNEL_SOURCES = {
    "_RMSNormBackward": _TE + "ops/basic/rmsnorm.py RMSNorm.op_forward (megatron-te); "
                            "torch 2.13 aten _fused_rms_norm (torch)",
    "_LayerNormBackward": _TE + "ops/basic/layer_norm.py LayerNorm.op_forward (layernorm_fwd)",
    "_BiasGeLUBackward": _MC + "fusions/fused_bias_gelu.py GeLUFunction",
    "_SquaredReLUBackward": _MC + "activations.py squared_relu (jit_fuser: torch.compile)",
    "_TELinearBackward": _TE + "module/linear.py _Linear / module/layernorm_linear.py "
                               "_LayerNormLinear",
    "_TEFusedAttentionBackward": _TE + "attention/dot_product_attention/backends.py "
                                      "FusedAttnFunc",
    "_SwiGLUBackward": _MC + "fusions/fused_bias_swiglu.py SwiGLUFunction",
    "_WeightedSwiGLUBackward": _MC + "fusions/fused_bias_swiglu.py WeightedSwiGLUFunction",
    "_RouterGatingLinearBackward": _MC + "transformer/moe/moe_utils.py "
                                         "RouterGatingLinearFunction",
    "_PermuteBackward": _TE + "permutation.py moe_permute_mask_map_forward",
    "_SortChunksBackward": _TE + "permutation.py moe_sort_chunks_by_index",
    "_UnpermuteBackward": _TE + "permutation.py moe_unpermute_mask_map_forward",
    "_GroupedLinearBackward": _TE + "module/grouped_linear.py _GroupedLinear",
    # FP8 (modeling.kernels.fp8): uint8 data and fp32 / E8M0 scales of the quantised input
    "_TEFp8LinearBackward": _TE + "module/linear.py _linear_forward_impl / "
                                  "module/layernorm_linear.py _LayerNormLinear under FP8 "
                                  "(tensor/*.py quantizers' inner_tensor_specs)",
    "_Fp8GroupedLinearBackward": _TE + "module/grouped_linear.py _GroupedLinear under FP8 "
                                       "(csrc/extensions/cast.cpp split_quantize)",
    "_TECrossEntropyBackward": _TE + "cross_entropy.py CrossEntropyFunction",
    "_VocabParallelCrossEntropyBackward": _MC + "tensor_parallel/cross_entropy.py "
                                                "_VocabParallelCrossEntropy",
    "_FusedVocabParallelCrossEntropyBackward": _MC + "fusions/fused_cross_entropy.py "
                                                     "_VocabParallelCrossEntropy (torch.compile)",
    "_ScaledUpperTriangMaskedSoftmaxBackward": _MC + "fusions/fused_softmax.py "
                                                     "ScaledUpperTriangMaskedSoftmax (Apex kernel)",
    "_TEScaledMaskedSoftmaxBackward": _TE + "attention/dot_product_attention/softmax.py "
                                            "scaled_masked_softmax_forward",
}


def _source(node_name: str) -> str:
    if node_name.startswith("GeneratedBackwardFor_"):  # a torch.library custom op's autograd
        return ("its torch.library register_autograd setup_context (torch 2.13 "
                "torch/_library/autograd.py)")
    return KERNEL_SOURCES.get(node_name,
                              f"torch 2.13 autograd formula of {node_name} (derivatives.yaml)")


@dataclass(frozen=True)
class InventoryRow:
    """One storage kept from forward to backward.

    Attributes:
        module: the module that made it; saved_by: the autograd Nodes that saved it
            (empty: alive for another reason, e.g. the stage output); op: the aten op that
            made it; shape, dtype, nbytes: of the storage; source: what the first saving
            Node's kernel mirrors.
    """

    module: str
    saved_by: tuple[str, ...]
    op: str | None
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    source: str


@dataclass(frozen=True)
class Inventory:
    """The inventory of one part (``"layer N"``, ``"embedding"``, ``"loss"``) under one
    profile; ``total_bytes`` is the sum of ``rows``."""

    model: str
    kernels: str
    part: str
    settings: dict
    rows: list[InventoryRow] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(row.nbytes for row in self.rows)


def _walk(root) -> Iterator:
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        yield node
        stack.extend(n for n, _ in node.next_functions)


def _saved_storages(node) -> list[int]:
    """Storage keys of the tensors ``node`` saved for backward."""
    tensors: list[Tensor] = []
    if hasattr(node, "saved_tensors"):  # a custom autograd Function
        try:
            tensors += list(node.saved_tensors)
        except RuntimeError:  # already freed
            pass
    for name in dir(node):
        if name.startswith("_saved_"):
            try:
                value = getattr(node, name)
            except RuntimeError:
                continue
            if isinstance(value, Tensor):
                tensors.append(value)
            elif isinstance(value, (list, tuple)):
                tensors += [v for v in value if isinstance(v, Tensor)]
    return [t.untyped_storage()._cdata for t in tensors if t is not None]


def _part_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "layers":
        return f"layer {parts[1]}"
    if parts[0] == "mtp" and len(parts) > 1:
        return f"mtp {parts[1]}"  # (bare "mtp": MTPBlock's concatenation, the loss's input)
    if parts[0] in ("embed", "position_embed"):  # word and learned position embeddings
        return "embedding"
    return "loss"  # final norm, head, loss (and top-level glue)


def get_inventory(model: str | ModelConfig, *, world_size: int, micro_batch_size: int,
                  seq_length: int, part: str = "layer 0", kernels: str = "megatron-te",
                  kernel_options: dict | None = None, attention: str = "flash",
                  experts: str = "auto", replace=None, **layout) -> Inventory:
    """The inventory of ``part`` ("layer N" with N a global decoder layer, "mtp K",
    "embedding" or "loss") on the first rank of the pipeline stage that holds it.

    Args:
        model, world_size, layout: as ``tracemem.estimate`` (``ParallelConfig.create``).
        micro_batch_size, seq_length: b and s (tokens).
        kernels, kernel_options: the profile (``modeling.kernels``).
        replace: the user's own layers, as ``tracemem.estimate``'s
            (``modeling.common.custom.resolve_replacements``).

    Raises:
        TracememError: invalid inputs, or a part this model does not have.
    """
    cfg = model if isinstance(model, ModelConfig) else load_config(model)
    par = ParallelConfig.create(cfg, world_size=world_size, **layout)
    profile = get_profile(kernels, **(kernel_options or {}))
    for flag, value in (("--micro-batch-size", micro_batch_size), ("--seq-length", seq_length)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise TracememError(f"{flag} {value!r} must be a positive integer")
    split = par.cp * (par.tp if par.sp else 1)
    if seq_length % split:
        raise TracememError(f"--seq-length {seq_length} must be a multiple of cp * sp = {split}")
    kind, _, number = part.partition(" ")
    if kind == "layer" and number.isdigit() and int(number) < cfg.num_layers:
        stage = next(p for p in range(par.pp)
                     if any(int(number) in chunk for chunk in par.layers_of_stage(p)))
    elif kind == "mtp" and number.isdigit() and int(number) < cfg.num_mtp_modules \
            or part == "loss":
        stage = par.pp - 1
    elif part == "embedding":
        stage = 0
    else:
        raise TracememError(
            f"--part {part!r} is invalid; use 'layer N' (0 <= N < {cfg.num_layers}), "
            + (f"'mtp K' (0 <= K < {cfg.num_mtp_modules}), " if cfg.num_mtp_modules else "")
            + "'embedding' or 'loss'")
    rank = stage * (par.world_size // par.pp)
    net = build_rank(cfg, par, rank, attention=attention, experts=experts,
                     dtype=torch.bfloat16, kernels=profile, replace=replace)
    if kind == "layer":
        chunk = next(c for c, layers in enumerate(par.layers_of_stage(stage))
                     if int(number) in layers)
    else:  # the embedding runs in the first chunk, the loss end and MTP in the last
        chunk = 0 if part == "embedding" else len(net.chunks) - 1
    seq = seq_length // par.cp
    local = seq // (par.tp if par.sp else 1)
    tracer = MemoryTracer(rounding=None, devices={"meta"})
    tracer.track_external(net)
    with tracer:
        labels = torch.zeros(micro_batch_size, seq, dtype=torch.long, device="meta")
        first = chunk == 0 and net.pre_process
        inputs = (torch.zeros(micro_batch_size, seq, dtype=torch.long, device="meta") if first
                  else recv_forward((micro_batch_size, local, cfg.hidden_size),
                                    torch.bfloat16))
        output = net(inputs, labels, Balanced(), chunk)
    saved: dict[int, list[str]] = {}
    for node in _walk(output.grad_fn):
        for key in _saved_storages(node):
            names = saved.setdefault(key, [])
            if node.name() not in names:
                names.append(node.name())
    rows = []
    live_keys = {rec.sid: key for key, rec in tracer._live.items()}
    for info in sorted(tracer.live_at("now"), key=lambda i: i.storage_id):
        if info.phase is not Phase.FORWARD or _part_of(info.module) != part:
            continue
        by = tuple(saved.get(live_keys.get(info.storage_id), ()))
        rows.append(InventoryRow(info.module, by, info.op, info.shape,
                                 str(info.dtype).removeprefix("torch."), info.nbytes,
                                 _source(by[0]) if by else "-"))
    del output, inputs, labels
    settings = {"world_size": world_size, "micro_batch_size": micro_batch_size,
                "seq_length": seq_length, "rank": rank, "pp_stage": stage,
                "kernel_options": dict(profile.options),
                **{k: getattr(par, k) for k in ("tp", "sp", "cp", "ep", "etp", "pp")}}
    return Inventory(cfg.name, profile.name, part, settings, rows)


def format_inventory(inventories: list[Inventory], wide: bool = False) -> str:
    """One table per inventory (bytes exact), then the totals side by side. The default
    tables fit 100 columns; ``wide`` adds each tensor's source (``KERNEL_SOURCES``)."""
    from tabulate import tabulate

    out = []
    for inv in inventories:
        s = inv.settings
        head = (f"{inv.model}, {inv.part}, --kernels {inv.kernels}: tensors kept from forward "
                f"to backward on rank {s['rank']} (TP {s['tp']}{' + SP' if s['sp'] else ''}, "
                f"CP {s['cp']}, EP {s['ep']}, ETP {s['etp']}, PP {s['pp']}), "
                f"b={s['micro_batch_size']}, s={s['seq_length']}")
        rows = [[r.module, ", ".join(r.saved_by) or "-", "x".join(map(str, r.shape)) or "scalar",
                 r.dtype, f"{r.nbytes:,}"] + ([r.source] if wide else []) for r in inv.rows]
        table = tabulate(
            rows, headers=["module", "saved by", "shape", "dtype", "bytes"]
            + (["source"] if wide else []), disable_numparse=True,
            colalign=("left", "left", "left", "left", "right") + (("left",) if wide else ()),
            maxcolwidths=[None, 34, None, None, None, 60] if wide else [32, 26, None, None,
                                                                        None])
        if not wide:
            table += "\n(--wide adds each tensor's source: the kernel whose saving it mirrors)"
        out.append(f"{head}\n\n{table}\n\ntotal: {inv.total_bytes:,} B "
                   f"({inv.total_bytes / 2**30:.3f} GiB = 2^30 B, "
                   f"{inv.total_bytes / 1e9:.3f} GB = 10^9 B)")
    if len(inventories) > 1:
        out.append("totals: " + ", ".join(f"{inv.kernels} {inv.total_bytes:,} B"
                                          for inv in inventories))
    return "\n\n".join(out)
