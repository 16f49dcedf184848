"""The last stage with MTP under the megatron orchestration runs in Megatron-Core's order
(modeling.common.model.Transformer._megatron_mtp_loss).

Reference: Megatron-LM d98e8a6 (and megatron-core 0.16.1, the oracle's) megatron/core/models/
gpt/gpt_model.py GPTModel._postprocess: self.mtp(...) before the output layer;
transformer/multi_token_prediction.py MultiTokenPredictionBlock.forward (torch.cat of the
decoder's and each MTP layer's hidden states) and process_mtp_loss (each depth's output layer
and loss, MTPLossAutoScaler on the main hidden states, then the main output layer and loss).
deepseek-tiny: h 64, vocabulary 256, one MTP module; b 1, s 16, one rank, bf16.
"""

import torch

from modeling import load_config
from modeling.common.routing import Balanced
from modeling.kernels import get_profile
from modeling.parallel import build_rank
from tracemem.categories import Category
from tracemem.parallel import ParallelConfig
from tracemem.tracer import MemoryTracer


def _trace():
    cfg = load_config("deepseek-tiny")
    par = ParallelConfig.create(cfg, world_size=1)
    model = build_rank(cfg, par, 0, dtype=torch.bfloat16,
                       kernels=get_profile("megatron-te", cross_entropy_fusion="none"))
    tracer = MemoryTracer(rounding=None, devices={"meta"})
    tracer.track_external(model)
    tokens = torch.zeros(1, 16, dtype=torch.long, device="meta")
    with tracer:
        loss = model(tokens, tokens, Balanced())
        forward = len(tracer.events)
        loss.backward()
    return tracer.events, forward


def _first(events, prefix, start=0, end=None):
    return next(e.index for e in events[start:end] if e.action == "alloc" and e.module
                and e.module.startswith(prefix) and e.category is not Category.PARAMETER)


def test_mtp_runs_before_the_output_layer_and_the_main_loss_backward_first():
    events, forward = _trace()
    # forward: the MTP layer, then the concatenation of the decoder's and the MTP layer's
    # hidden states, (2 x 1, 16, 64) bf16 = 4,096 B, kept for both output layers' backward;
    # only then the output layer (the MTP depth's, then the main one)
    mtp, head = _first(events, "mtp.0.block", 0, forward), _first(events, "head", 0, forward)
    cat = next(e for e in events[:forward] if e.action == "alloc" and e.op == "aten::cat"
               and tuple(e.shape) == (2, 16, 64))  # not the MTP layer's [enorm; hnorm]
    assert cat.nbytes == 2 * 16 * 64 * 2
    assert mtp < cat.index < head
    assert cat.category is Category.ACTIVATION
    # the two losses' kept fp32 logits copies (16, 1, 256) x 4 B = 16,384 B each (Megatron's
    # vocab_parallel_cross_entropy): the main one (made last) freed first in backward, and
    # both before the MTP layer's backward begins, as is the concatenation
    kept = [e for e in events[:forward] if e.action == "alloc" and e.nbytes == 16 * 256 * 4
            and e.category is Category.ACTIVATION]
    assert len(kept) == 2
    freed = {e.storage_id: e.index for e in events[forward:] if e.action == "free"}
    mtp_backward = _first(events, "mtp.0.block", forward)
    assert freed[kept[1].storage_id] < freed[kept[0].storage_id] < mtp_backward
    assert freed[cat.storage_id] < mtp_backward
