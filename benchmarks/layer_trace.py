"""Seconds to trace one DeepSeek-V3 MoE layer (attention + MoE) forward + backward on the meta
device at b=1, s=4096, with 32 local experts (a rank's share under EP=8), grouped GEMM vs one
Linear per expert; and seconds and memory to build the whole V3 model on meta.

    .venv/bin/python benchmarks/layer_trace.py
"""

from __future__ import annotations

import os
import resource
import time

import torch

from modeling.common.block import Block
from modeling import load_config
from modeling.common.model import build_model
from modeling.common.moe import MoE
from modeling.common.routing import Balanced
from tracemem import MemoryTracer


def rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def trace_layer(experts: str) -> tuple[float, float, int, int]:
    cfg = load_config("deepseek-v3")
    start = time.perf_counter()
    with torch.device("meta"):
        block = Block(3, cfg, attention="flash", experts=experts)
        block.ffn = MoE(cfg, experts, expert_ids=range(32), layer_id=3)
    block.to(torch.bfloat16)
    built = time.perf_counter() - start
    x = torch.empty(1, 4096, cfg.hidden_size, device="meta", dtype=torch.bfloat16,
                    requires_grad=True)
    tracer = MemoryTracer()
    tracer.track_external(block, x)
    start = time.perf_counter()
    with tracer:
        block(x, Balanced()).float().square().mean().backward()
    return built, time.perf_counter() - start, len(tracer.events), tracer.peak_bytes


def main() -> None:
    print(f"torch {torch.__version__}")
    print("one V3 MoE layer (layer 3), b=1, s=4096, 32 of 256 experts local, balanced routing, "
          "flash attention, bf16")
    results = {}
    for experts in ("grouped", "sequential"):
        trace_layer(experts)  # warm-up
        results[experts] = trace_layer(experts)
        built, traced, events, peak = results[experts]
        print(f"  {experts:10s} build {built:6.2f} s   trace fwd+bwd {traced:6.2f} s   "
              f"{events:5d} events   peak {peak / 2**30:.3f} GiB")
    print(f"  sequential / grouped trace time: "
          f"{results['sequential'][1] / results['grouped'][1]:.2f}x")

    cfg = load_config("deepseek-v3")
    for experts in ("grouped", "sequential"):
        before = rss_mib()
        start = time.perf_counter()
        model = build_model(cfg, "meta", experts=experts)
        seconds = time.perf_counter() - start
        print(f"whole V3 (61 layers + MTP) on meta, experts={experts}: {seconds:.2f} s, "
              f"RSS +{rss_mib() - before:.0f} MiB")
        del model


if __name__ == "__main__":
    main()
