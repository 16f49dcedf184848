"""DeepSeek-V3's FP8 cache of the routed experts' SwiGLU input (arXiv 2412.19437 3.3.3: the
SwiGLU's inputs cached in FP8 with the fine-grained quantisation, its output recomputed in
backward): the megatron-te option ``fp8_moe_act_cache`` under ``moe_act`` recompute and the
blockwise recipe, by hand.

One local expert, 512 rows, h 64, f 32 (fc1 out 2f = 64), bf16 2 B, on Hopper (sm90):
- Megatron's moe_act (the option off): the checkpoint keeps fc1's output, 512 x 64 x 2 =
  65,536 B bf16; fc1 keeps its FP8 input (the grouped linear's one split-quantised buffer,
  34,048 B, the same either way) and the experts' output (512, 64) bf16 is alive;
- the option on: the checkpoint keeps the FP8 cache instead: 512 x 64 uint8 = 32,768 B and
  row-wise scales (ceil(64 / 128), roundup(512, 4)) = (1, 512) fp32 = 2,048 B: 34,816 B,
  30,720 B less than the bf16 copy.
"""

import pytest
import torch

from modeling.common.moe import _megatron_experts
from modeling.kernels import get_profile
from tracemem.errors import TracememError
from tracemem.job import Job
from tracemem.tracer import MemoryTracer, Phase


def _kept(cache: bool):
    k = get_profile("megatron-te", fp8_recipe="blockwise", fp8_format="e4m3",
                    fp8_moe_act_cache=cache, fp8_arch="sm90")
    fc1 = [torch.empty(64, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)]
    fc2 = [torch.empty(64, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)]
    x = torch.empty(512, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.empty(512, 1, device="meta", dtype=torch.float32, requires_grad=True)
    tracer = MemoryTracer(rounding=None, devices={"meta"})
    tracer.track_external(fc1, fc2, x, probs)
    with tracer:
        out = _megatron_experts(k, x, probs, fc1, fc2, recompute_act=True, counts=[512])
        kept = sorted((i.nbytes, str(i.dtype).removeprefix("torch."), tuple(i.shape))
                      for i in tracer.live_at(len(tracer.events) - 1)
                      if i.phase is not Phase.EXTERNAL)
        out.sum().backward()  # the recompute runs from the cache
    return kept


def test_the_swiglu_input_is_cached_in_fp8_instead_of_bf16():
    out = (65_536, "bfloat16", (512, 64))  # the experts' output (rows, h)
    fc1_input = (34_048, "uint8", (34_048,))
    assert _kept(False) == sorted([fc1_input, (65_536, "bfloat16", (512, 64)), out])
    assert _kept(True) == sorted([fc1_input, (2_048, "float32", (1, 512)),
                                  (32_768, "uint8", (512, 64)), out])
    assert sum(n for n, *_ in _kept(False)) - sum(n for n, *_ in _kept(True)) \
        == 65_536 - (32_768 + 2_048) == 30_720


@pytest.mark.parametrize("extra, message", [
    (dict(kernel_options={"fp8_moe_act_cache": True}, recompute="selective",
          recompute_modules=("moe_act",)),
     "kernel option fp8_moe_act_cache (DeepSeek-V3's FP8 cache of the SwiGLU input) needs "
     "FP8: give --fp8-format (and --fp8-recipe)"),
    (dict(kernel_options={"fp8_moe_act_cache": True, "fp8_recipe": "blockwise"}),
     "kernel option fp8_moe_act_cache caches moe_act's input in FP8: give --recompute "
     "selective --recompute-modules moe_act"),
])
def test_the_option_alone_is_refused(extra, message):
    with pytest.raises(TracememError) as error:
        Job.create("deepseek-tiny", world_size=8, ep=8, micro_batch_size=1, seq_length=64,
                   num_microbatches=1, gpu="H100", **extra)
    assert str(error.value) == message
