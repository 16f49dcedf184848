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
    return _kept_after(lambda: _megatron_experts(k, x, probs, fc1, fc2, recompute_act=True,
                                                 counts=[512]), fc1, fc2, x, probs)


def _kept_after(forward, *external):
    """(bytes, dtype, shape) of every storage alive after ``forward()`` under the tracer
    (``external``: the inputs and weights, not counted), then its backward run (the
    recompute from the cache)."""
    tracer = MemoryTracer(rounding=None, devices={"meta"})
    tracer.track_external(*external)
    with tracer:
        out = forward()
        kept = sorted((i.nbytes, str(i.dtype).removeprefix("torch."), tuple(i.shape))
                      for i in tracer.live_at(len(tracer.events) - 1)
                      if i.phase is not Phase.EXTERNAL)
        out.sum().backward()
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


def _shared_kept(cache: bool):
    from modeling.common.mlp import MLP

    k = get_profile("megatron-te", fp8_recipe="blockwise", fp8_format="e4m3",
                    fp8_moe_act_cache=cache, fp8_arch="sm90")
    mlp = MLP(64, 32, 1, k, component="shared_experts").to(device="meta",
                                                            dtype=torch.bfloat16)
    mlp.fp8_act_cache = cache  # as MoE.set_recompute sets it under moe_act
    mlp.w2.save_original_input = cache
    x = torch.empty(1, 512, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
    return _kept_after(lambda: mlp(x), *mlp.parameters(), x)


def test_the_shared_experts_swiglu_input_is_cached_too():
    # 3.3.3 caches the SwiGLU inputs "in MoE": the shared expert's as well. T 512 tokens, h 64,
    # f 32 (fc1 out 2f = 64), blockwise FP8 on sm90. Either way fc1 keeps its column-wise FP8
    # input (h, T) 64 x 512 = 32,768 B and its 128-tile scales (ceil(512 / 128), 64) fp32 =
    # 1,024 B, and the output (1, 512, 64) bf16 65,536 B is alive.
    common = [(32_768, "uint8", (64, 1, 512)), (1_024, "float32", (4, 64)),
              (65_536, "bfloat16", (1, 512, 64))]
    # without the cache: the SwiGLU keeps fc1's bf16 output, 65,536 B, and fc2 the column-wise
    # FP8 copy of its input (f, T) 32 x 512 = 16,384 B with scales (4, 32) fp32 = 512 B
    assert _shared_kept(False) == sorted(common + [
        (65_536, "bfloat16", (1, 512, 64)), (16_384, "uint8", (32, 1, 512)),
        (512, "float32", (4, 32))])
    # with it: the FP8 cache, 512 x 64 uint8 = 32,768 B and row-wise scales (1, roundup(512,
    # 4)) fp32 = 2,048 B; fc2's bf16 input is the checkpoint's output, discarded (0 B)
    assert _shared_kept(True) == sorted(common + [
        (32_768, "uint8", (1, 512, 64)), (2_048, "float32", (1, 512))])
    assert sum(n for n, *_ in _shared_kept(False)) - sum(n for n, *_ in _shared_kept(True)) \
        == 65_536 + 16_384 + 512 - 32_768 - 2_048 == 47_616


def test_moe_act_with_the_option_sets_the_shared_experts_cache():
    from modeling import load_config
    from modeling.common.moe import MoE

    cfg = load_config("deepseek-tiny")
    for option, modules, overlap, cached in (
            (True, {"moe_act"}, True, True), (True, {"moe_act"}, False, True),
            (False, {"moe_act"}, True, False), (True, {"moe_act", "shared_experts"}, False,
                                                False)):
        k = get_profile("megatron-te", fp8_recipe="blockwise", fp8_format="e4m3",
                        fp8_moe_act_cache=option, fp8_arch="sm90",
                        moe_shared_expert_overlap=overlap)
        with torch.device("meta"):
            moe = MoE(cfg, kernels=k)
        moe.set_recompute(frozenset(modules))
        assert moe.shared_experts.fp8_act_cache is cached
        assert moe.shared_experts.w2.save_original_input is cached
