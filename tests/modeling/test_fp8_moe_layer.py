"""The routed experts of Megatron's MoE layer under FP8, through the layer (not the expert
kernels alone): each local expert's rows are quantised apart, as ``TEGroupedMLP.forward``
passes ``tokens_per_expert`` to TE's ``GroupedLinear`` (megatron/core/transformer/moe/
experts.py at Megatron-LM d98e8a6; TE d0067d0 ``module/grouped_linear.py``
``_GroupedLinear.forward``: ``_split_quantize`` by ``m_splits``).

deepseek-tiny's MoE without shared experts: h 64, expert width f 32, 8 experts all local (EP
1), top-2, balanced routing, T = 64 tokens: 128 slots, 16 per expert (a multiple of 16: no FP8
padding). Blockwise FP8 on Hopper (sm90), bulk allocation (cast.cpp
``bulk_allocate_fp8_blockwise_tensors``: every expert's data at 256-byte offsets, then every
expert's scales at 16-byte offsets, plus 256 bytes of pad), saved column-wise only:
- fc1's input, per expert (h, 16) uint8 = 1,024 B and 1x128 column-wise scales (ceil(16 /
  128), roundup(64, 4)) = (1, 64) fp32 = 256 B: 8 x 1,024 + 8 x 256 + 256 = 10,496 B;
- fc2's input, per expert (f, 16) = 512 B and (1, 32) fp32 = 128 B: 8 x 512 + 8 x 128 + 256
  = 5,376 B.
Before this was fixed, the layer passed no counts and the grouped linears quantised nothing.
"""

import dataclasses

import torch

from modeling.common.moe import MoE
from modeling.common.routing import Balanced
from modeling.kernels import get_profile
from modeling.registry import load_config
from tracemem import MemoryTracer

BF16 = torch.bfloat16


def test_the_layer_quantises_each_experts_rows_for_the_grouped_linears():
    cfg = dataclasses.replace(load_config("deepseek-tiny"), num_shared_experts=0)
    k = get_profile("megatron-te", fp8_recipe="blockwise", fp8_format="e4m3", fp8_arch="sm90")
    with torch.device("meta"):
        moe = MoE(cfg, "grouped", kernels=k).to(BF16)
    x = torch.empty(1, 64, 64, dtype=BF16, device="meta", requires_grad=True)
    tracer = MemoryTracer(rounding=None, devices={"meta"})
    tracer.track_external(x, moe)
    with tracer:
        y = moe(x, Balanced())
        kept = sorted(i.nbytes for i in tracer.live_at(len(tracer.events) - 1)
                      if i.dtype == torch.uint8)
        y.sum().backward()
    assert kept == [5_376, 10_496]
