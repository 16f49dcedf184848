"""Transformer Engine's own modules on a GPU against the ``megatron-te`` kernels on meta.

NOT PART OF CI: the GPU half needs a CUDA GPU with Transformer Engine installed (the project's
machines have neither). ``tracemem validate --against megatron-core`` runs Megatron-Core's
orchestration with tracemem's own TE stand-ins on both sides (docs/validation.md), so what
TE itself allocates and keeps is proven only here. Run by hand, on the GPU machine, with the
project installed:

    .venv/bin/python benchmarks/te_layer_check.py [--json OUT] [--backend fused|flash]
    .venv/bin/python benchmarks/te_layer_check.py --meta-only     # tracemem's side only (CPU)

For each case, one TE module of a kind the ``megatron-te`` profile emulates (``modeling/kernels``:
``te_linear`` for ``Linear`` and ``LayerNormLinear``, ``te_rms_norm`` / ``te_layer_norm``,
``te_fused_attention`` / ``te_flash_attention`` for ``DotProductAttention``,
``te_grouped_linear`` for ``GroupedLinear``, ``te_permute`` / ``te_unpermute`` for
``moe_permute_with_probs`` / ``moe_unpermute``, ``te_cross_entropy`` for
``parallel_cross_entropy``), both sides run on the same shapes, bf16, one GPU (TP 1, no
sequence parallelism) and report three byte counts:

- ``kept``: what the forward left allocated besides its output (the saved tensors);
- ``forward peak``: the highest allocation during the forward above what was allocated
  before it;
- ``backward peak``: the same for the backward (the output's gradient allocated before it).

GPU: ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` around each pass, after one
warm-up step (cuBLAS workspaces and TE's lazily made buffers exist by then and are not
counted, as tracemem holds them as static blocks: ``tracemem/workspaces.py``), gradients set to
None between steps. Meta: ``MemoryTracer(rounding=512)`` (the CUDA caching allocator rounds each
block to 512 B: ``c10/cuda/CUDACachingAllocator.cpp`` ``round_size``). A difference is printed
with its sign (GPU minus tracemem); the process exits 1 if any is not 0 (``--tolerance`` bytes
allows some). ``--json`` writes every row.

The cases are small (a few MiB each) and the whole run takes seconds on one GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

import torch
from torch import nn

BF16 = torch.bfloat16
ROUND = 512


@dataclass
class Case:
    """One module kind at one shape (all of this rank's; tokens = b * s)."""

    name: str
    kind: str  # linear | layernorm_linear | rms_norm | layer_norm | attention | grouped_linear
    #            | permute | unpermute | cross_entropy
    b: int = 2
    s: int = 512
    h: int = 1024
    out: int = 2048
    heads: int = 8
    head_dim: int = 128
    experts: int = 4
    topk: int = 2
    vocab: int = 8192
    fuse_wgrad: bool = False
    bias: bool = False


CASES = [
    Case("Linear", "linear"),
    Case("Linear, bias", "linear", bias=True),
    Case("Linear, main_grad fusion", "linear", fuse_wgrad=True),
    Case("LayerNormLinear (RMSNorm)", "layernorm_linear"),
    Case("LayerNormLinear (LayerNorm)", "layernorm_linear_ln"),
    Case("RMSNorm", "rms_norm"),
    Case("LayerNorm", "layer_norm"),
    Case("DotProductAttention, causal", "attention"),
    Case("GroupedLinear, 4 experts", "grouped_linear"),
    Case("GroupedLinear, main_grad fusion", "grouped_linear", fuse_wgrad=True),
    Case("moe_permute_with_probs", "permute"),
    Case("moe_unpermute", "unpermute"),
    Case("parallel_cross_entropy", "cross_entropy"),
]


@dataclass
class Row:
    case: str
    quantity: str
    gpu: int | None
    tracemem: int
    diff: int | None


# ------------------------------------------------------------------------------------------------
# tracemem's side: the megatron-te kernels on meta


def _leaf(*shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)


def _slots(c: Case) -> int:
    return c.b * c.s * c.topk


def _meta_call(c: Case, backend: str):
    """(fn, inputs, externals) of the case on meta, through modeling.kernels."""
    from modeling.kernels import attention, linear, loss, moe, norm

    tokens = c.b * c.s
    if c.kind in ("linear", "layernorm_linear", "layernorm_linear_ln"):
        x = _leaf(c.b, c.s, c.h)
        w = nn.Parameter(torch.empty(c.out, c.h, dtype=BF16, device="meta"))
        biases = [nn.Parameter(torch.empty(c.out, dtype=BF16, device="meta"))] if c.bias else []
        mod = None
        if c.kind == "layernorm_linear":
            mod = nn.RMSNorm(c.h, device="meta", dtype=BF16)
        elif c.kind == "layernorm_linear_ln":
            mod = nn.LayerNorm(c.h, device="meta", dtype=BF16)
        params = [w, *biases, *(mod.parameters() if mod is not None else ())]
        mode = "duplicated"
        return (lambda x: linear.te_linear(x, [w], mode, 1, mod, c.fuse_wgrad, biases)), [x], params
    if c.kind in ("rms_norm", "layer_norm"):
        x = _leaf(c.b, c.s, c.h)
        if c.kind == "rms_norm":
            mod = nn.RMSNorm(c.h, device="meta", dtype=BF16)
            return (lambda x: norm.te_rms_norm(mod, x)), [x], list(mod.parameters())
        mod = nn.LayerNorm(c.h, device="meta", dtype=BF16)
        return (lambda x: norm.te_layer_norm(mod, x)), [x], list(mod.parameters())
    if c.kind == "attention":
        q, k, v = (_leaf(c.b, c.s, c.heads, c.head_dim) for _ in range(3))
        fn = attention.te_flash_attention if backend == "flash" else attention.te_fused_attention
        return fn, [q, k, v], []
    if c.kind == "grouped_linear":
        x = _leaf(_slots(c), c.h)
        ws = [nn.Parameter(torch.empty(c.out, c.h, dtype=BF16, device="meta"))
              for _ in range(c.experts)]
        return (lambda x: moe.te_grouped_linear(x, ws, c.out, c.fuse_wgrad)), [x], ws
    if c.kind == "permute":
        x = _leaf(tokens, c.h)
        probs = _leaf(tokens, c.experts, dtype=torch.float32)

        return (lambda x, probs: moe.te_permute(x, probs, _slots(c))[0]), [x, probs], []
    if c.kind == "unpermute":
        x = _leaf(_slots(c), c.h)
        row_id_map = torch.empty((tokens, 2 * c.experts + 1), dtype=torch.int32, device="meta")
        return (lambda x: moe.te_unpermute(x, row_id_map, tokens)), [x], [row_id_map]
    if c.kind == "cross_entropy":
        logits = _leaf(c.b, c.s, c.vocab)
        return (lambda z: loss.te_cross_entropy(z, None, 1)), [logits], []
    raise ValueError(c.kind)


def meta_side(c: Case, backend: str) -> dict[str, int]:
    """kept, forward peak and backward peak of the case on meta, 512-B blocks."""
    from tracemem import MemoryTracer
    from tracemem.validation.kernel_trace import peak_of

    fn, inputs, externals = _meta_call(c, backend)
    tracer = MemoryTracer(rounding=ROUND)
    tracer.track_external(*inputs, *externals)
    with tracer:
        out = fn(*inputs)
    fwd = [e for e in tracer.events if e.phase.value != "external"]
    out_sid = tracer._live[out.untyped_storage()._cdata].sid
    kept = sum(i.nbytes for i in tracer.live_at("now")
               if i.phase.value == "forward" and i.storage_id != out_sid)
    grad = torch.empty(out.shape, dtype=out.dtype, device="meta")
    tracer.track_external(grad)
    start = len(tracer.events)
    with tracer:
        out.backward(grad)
    bwd = [e for e in tracer.events[start:] if e.phase.value != "external"]
    return {"kept": kept, "forward peak": peak_of(fwd), "backward peak": peak_of(bwd)}


# ------------------------------------------------------------------------------------------------
# the GPU side: Transformer Engine's own modules


def _gpu_call(c: Case):
    """(fn, inputs, params) of the case with TE's modules on cuda:0."""
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch import permutation
    from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy

    dev = "cuda"
    tokens = c.b * c.s
    if c.kind in ("linear", "layernorm_linear", "layernorm_linear_ln"):
        kw = dict(bias=c.bias, params_dtype=BF16, fuse_wgrad_accumulation=c.fuse_wgrad,
                  device=dev)
        if c.kind == "linear":
            mod = te.Linear(c.h, c.out, **kw)
        else:
            mod = te.LayerNormLinear(c.h, c.out, normalization="RMSNorm"
                                     if c.kind == "layernorm_linear" else "LayerNorm", **kw)
        if c.fuse_wgrad:
            mod.weight.main_grad = torch.zeros(mod.weight.shape, dtype=torch.float32, device=dev)
        x = torch.randn(c.s, c.b, c.h, dtype=BF16, device=dev, requires_grad=True)
        return mod, [x], list(mod.parameters())
    if c.kind in ("rms_norm", "layer_norm"):
        mod = (te.RMSNorm if c.kind == "rms_norm" else te.LayerNorm)(
            c.h, params_dtype=BF16, device=dev)
        x = torch.randn(c.s, c.b, c.h, dtype=BF16, device=dev, requires_grad=True)
        return mod, [x], list(mod.parameters())
    if c.kind == "attention":
        mod = te.DotProductAttention(c.heads, c.head_dim, qkv_format="bshd",
                                     attn_mask_type="causal")
        q, k, v = (torch.randn(c.b, c.s, c.heads, c.head_dim, dtype=BF16, device=dev,
                               requires_grad=True) for _ in range(3))
        return mod, [q, k, v], []
    if c.kind == "grouped_linear":
        mod = te.GroupedLinear(c.experts, c.h, c.out, bias=False, params_dtype=BF16,
                               fuse_wgrad_accumulation=c.fuse_wgrad, device=dev)
        params = list(mod.parameters())
        if c.fuse_wgrad:
            for p in params:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=dev)
        x = torch.randn(_slots(c), c.h, dtype=BF16, device=dev, requires_grad=True)
        splits = [_slots(c) // c.experts] * c.experts
        return (lambda x: mod(x, splits)), [x], params
    routing_map = torch.zeros(tokens, c.experts, dtype=torch.bool, device=dev)
    for j in range(c.topk):  # token t goes to experts t % E, (t + 1) % E, ...: balanced
        routing_map[torch.arange(tokens, device=dev),
                    (torch.arange(tokens, device=dev) + j) % c.experts] = True
    if c.kind == "permute":
        x = torch.randn(tokens, c.h, dtype=BF16, device=dev, requires_grad=True)
        probs = torch.rand(tokens, c.experts, dtype=torch.float32, device=dev,
                           requires_grad=True)
        return (lambda x, p: permutation.moe_permute_with_probs(x, p, routing_map,
                                                                _slots(c))[0]), [x, probs], []
    if c.kind == "unpermute":
        with torch.no_grad():
            src = torch.randn(tokens, c.h, dtype=BF16, device=dev)
            _, row_id_map = permutation.moe_permute(src, routing_map, _slots(c))
            del src
        x = torch.randn(_slots(c), c.h, dtype=BF16, device=dev, requires_grad=True)
        return (lambda x: permutation.moe_unpermute(
            x, row_id_map, restore_shape=torch.Size((tokens, c.h)))), [x], []
    if c.kind == "cross_entropy":
        logits = torch.randn(c.s, c.b, c.vocab, dtype=BF16, device=dev, requires_grad=True)
        target = torch.randint(0, c.vocab, (c.s, c.b), device=dev)
        return (lambda z: parallel_cross_entropy(z, target).mean()), [logits], []
    raise ValueError(c.kind)


def _block(nbytes: int) -> int:
    return -(-nbytes // ROUND) * ROUND


def gpu_side(c: Case) -> dict[str, int]:
    """kept, forward peak and backward peak of TE's module on cuda:0, after one warm-up."""
    fn, inputs, params = _gpu_call(c)

    def step():
        out = fn(*inputs)
        grad = torch.ones_like(out)
        out.backward(grad)
        for t in (*inputs, *params):
            t.grad = None

    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(*inputs)
    torch.cuda.synchronize()
    fwd_peak = torch.cuda.max_memory_allocated() - base
    kept = torch.cuda.memory_allocated() - base - _block(out.untyped_storage().nbytes())
    grad = torch.ones_like(out)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.backward(grad)
    torch.cuda.synchronize()
    bwd_peak = torch.cuda.max_memory_allocated() - base
    return {"kept": kept, "forward peak": fwd_peak, "backward peak": bwd_peak}


# ------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--meta-only", action="store_true",
                    help="tracemem's side only (no GPU needed)")
    ap.add_argument("--backend", choices=("fused", "flash"), default="fused",
                    help="TE's attention backend (sets NVTE_FUSED_ATTN / NVTE_FLASH_ATTN)")
    ap.add_argument("--tolerance", type=int, default=0, help="bytes of difference allowed")
    ap.add_argument("--json", help="write every row to this file")
    args = ap.parse_args(argv)
    os.environ["NVTE_FUSED_ATTN"] = "1" if args.backend == "fused" else "0"
    os.environ["NVTE_FLASH_ATTN"] = "1" if args.backend == "flash" else "0"
    if not args.meta_only and not torch.cuda.is_available():
        print("te_layer_check: no CUDA GPU here; use --meta-only for tracemem's side",
              file=sys.stderr)
        return 2
    rows, bad = [], 0
    for c in CASES:
        ours = meta_side(c, args.backend)
        theirs = None if args.meta_only else gpu_side(c)
        for q, v in ours.items():
            g = None if theirs is None else theirs[q]
            d = None if g is None else g - v
            bad += d is not None and abs(d) > args.tolerance
            rows.append(Row(c.name, q, g, v, d))
    from tabulate import tabulate

    print(tabulate([(r.case, r.quantity, "" if r.gpu is None else f"{r.gpu:,}",
                     f"{r.tracemem:,}", "" if r.diff is None else f"{r.diff:+,}") for r in rows],
                   headers=("TE module", "bytes", "GPU", "tracemem", "GPU - tracemem"),
                   colalign=("left", "left", "right", "right", "right")))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "torch": torch.__version__,
                       "rows": [asdict(r) for r in rows]}, f, indent=1)
    if theirs is not None:
        print(f"{bad} of {len(rows)} differ by more than {args.tolerance} B")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
