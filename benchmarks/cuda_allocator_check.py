"""Real CUDA allocator vs tracemem's simulator, on the same small training steps.

NOT PART OF CI: it needs a CUDA GPU (the project's machines have none). Run it by hand on a
CUDA machine with the project installed:

    .venv/bin/python benchmarks/cuda_allocator_check.py [--steps 3] [--layers 4] [--seq 1024]

For each allocator setting (default, expandable_segments:True, max_split_size_mb:64,
roundup_power2_divisions:4, garbage_collection_threshold with a memory fraction) it starts a
fresh process with ``PYTORCH_ALLOC_CONF`` set, runs ``--steps`` training steps of the demo
transformer (tracemem/examples.py: embedding, eager-attention blocks, head, cross-entropy,
Adam with ``foreach=False``) for real on ``cuda:0`` with the allocator's history recorded
(``torch.cuda.memory._record_memory_history``), and reports:

- real: ``torch.cuda.max_memory_allocated()`` / ``max_memory_reserved()`` and the number of
  ``cudaMalloc`` calls;
- "requests": the real run's own request stream (every ``alloc`` / ``free_completed`` of the
  recorded trace, in order, with the requested sizes) replayed through
  ``tracemem.memory.CachingAllocatorSimulator`` with the same setting: this checks the
  allocator model alone, and should match the real peaks to the byte;
- "traced": the same steps traced on the meta device by ``MemoryTracer`` (exact bytes),
  replayed through the simulator: this is what ``tracemem estimate`` does; differences are
  allocations the tracer cannot see (cuBLAS workspaces, kernels' scratch) and kernel choices
  that differ between meta and CUDA.

The process exits with status 1 if a "requests" replay differs from the real peaks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CONFS = ["", "expandable_segments:True", "max_split_size_mb:64", "roundup_power2_divisions:4",
         "garbage_collection_threshold:0.6,per_process_memory_fraction:0.9"]


def _demo(device: str, args):
    import torch

    from tracemem.examples import DTYPES, DemoConfig, DemoTransformer

    cfg = DemoConfig(num_layers=args.layers, hidden_size=args.hidden,
                     num_attention_heads=args.heads, seq_length=args.seq,
                     micro_batch_size=args.batch, vocab_size=args.vocab, dtype="bfloat16")
    with torch.device(device):
        model = DemoTransformer(cfg).to(DTYPES[cfg.dtype])
        tokens = torch.zeros(cfg.micro_batch_size, cfg.seq_length, dtype=torch.long)
        labels = torch.zeros(cfg.micro_batch_size * cfg.seq_length, dtype=torch.long)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, foreach=False)
    return cfg, model, tokens, labels, optimizer


def _step(cfg, model, tokens, labels, optimizer) -> None:
    import torch.nn.functional as F

    logits = model(tokens)
    F.cross_entropy(logits.view(-1, cfg.vocab_size).float(), labels).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del logits


def child(args) -> dict:
    import torch

    from tracemem.memory import AllocatorReplay, CachingAllocatorSimulator
    from tracemem.tracer import MemoryTracer

    conf = os.environ.get("PYTORCH_ALLOC_CONF", "")
    fraction = None
    if "per_process_memory_fraction" in conf:
        fraction = float(conf.split("per_process_memory_fraction:")[1].split(",")[0])
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.memory._record_memory_history(max_entries=10**7)
    parts = _demo("cuda", args)
    for _ in range(args.steps):
        _step(*parts)
    torch.cuda.synchronize()
    real = {"allocated": torch.cuda.max_memory_allocated(),
            "reserved": torch.cuda.max_memory_reserved(),
            "segments": torch.cuda.memory_stats().get("num_device_alloc", -1)}
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)

    # the real request stream through the simulator
    sim = CachingAllocatorSimulator(conf, capacity=total, device_total=total)
    live = {}
    for n, e in enumerate(snap["device_traces"][0]):
        if e["action"] == "alloc":
            live[e["addr"]] = n
            sim.malloc(n, e["size"])
        elif e["action"] == "free_completed" and e["addr"] in live:
            sim.free(live.pop(e["addr"]))
    requests = sim.stats()

    # the same steps traced on meta
    cfg, model, tokens, labels, optimizer = _demo("meta", args)
    tracer = MemoryTracer(rounding=None, devices={"meta"})
    tracer.track_external(model, optimizer, tokens, labels)
    for _ in range(args.steps):
        with tracer:
            _step(cfg, model, tokens, labels, optimizer)
    replay = AllocatorReplay(conf, capacity=total, device_total=total)
    for e in tracer.events:  # externals first, then the steps, in order
        if e.action == "alloc":
            replay.alloc(e.storage_id, e.nbytes, e.category.value)
        elif e.storage_id in replay.sim.live:
            replay.free(e.storage_id)
    traced_sim = replay.sim
    traced = traced_sim.stats()
    return {"conf": conf or "default", "fraction": fraction, "real": real,
            "requests": {"allocated": requests.allocated_peak,
                         "reserved": requests.reserved_peak,
                         "segments": requests.num_device_alloc},
            "traced": {"allocated": traced.allocated_peak, "reserved": traced.reserved_peak,
                       "segments": traced.num_device_alloc},
            "torch": torch.__version__, "device": torch.cuda.get_device_name(0)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("cuda_allocator_check.py needs a CUDA GPU; it is not part of CI (see its "
              "docstring)", file=sys.stderr)
        return 2
    failed = False
    mib = 2**20
    print("| setting | real alloc MiB | requests sim | traced sim | real reserved MiB | "
          "requests sim | traced sim | cudaMallocs real / requests / traced |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for conf in CONFS:
        env = dict(os.environ, PYTORCH_ALLOC_CONF=conf)
        out = subprocess.run([sys.executable, __file__, "--child"] + sys.argv[1:], env=env,
                             capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        real, req, tr = r["real"], r["requests"], r["traced"]
        failed |= (real["allocated"], real["reserved"]) != (req["allocated"], req["reserved"])
        print(f"| {r['conf']} | {real['allocated'] / mib:,.2f} | {req['allocated'] / mib:,.2f} "
              f"| {tr['allocated'] / mib:,.2f} | {real['reserved'] / mib:,.2f} | "
              f"{req['reserved'] / mib:,.2f} | {tr['reserved'] / mib:,.2f} | "
              f"{real['segments']} / {req['segments']} / {tr['segments']} |")
    print(f"torch {r['torch']} on {r['device']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
