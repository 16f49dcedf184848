"""ZeRO-3 / FSDP parameter all-gathers as traced events (tracemem.zero3).

Reference: torch 2.13's FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py
pre_forward / post_forward / pre_backward / _backward_prefetch / post_backward, _fsdp_state.py
_lazy_init: the root does not reshard after forward); every byte count by hand from the
deepseek-tiny sizes (h 64, vocab 256, MLA 18,432 + norms 208 per layer, dense MLP 3 x 64 x 128,
MoE: router 8 x 64, shared 3 x 64 x 32, 8 experts 3 x 64 x 32 each), bf16 = 2 B.
"""

import dataclasses
import json

import torch

from modeling import load_config
from modeling.parallel.build import build_rank
from modeling.common.routing import parse_routing
from tracemem import estimate
from tracemem.categories import Category, Phase
from tracemem.cli import main
from tracemem.parallel import ParallelConfig
from tracemem.tracer import MemoryTracer
from tracemem.zero3 import Zero3Gathers

TINY = load_config("deepseek-tiny")
LAYER = 18_432 + 208  # MLA + attn_norm, ffn_norm, q_norm, kv_norm
DENSE_LAYER = LAYER + 3 * 64 * 128  # 43,216
MOE_LAYER = LAYER + 8 * 64 + 3 * 64 * 32 + 8 * 3 * 64 * 32  # 74,448
EMBED = HEAD = 256 * 64
MTP = 64 + 64 + 2 * 64 * 64 + MOE_LAYER + 64  # enorm, hnorm, eh_proj, layer, norm: 82,832
ROOT = 64  # the final norm: the only parameter outside every unit


def _gathers(events, phase):
    return [(e.action, e.nbytes) for e in events
            if e.category is Category.PARAMETER and e.phase is phase]


def test_forward_gathers_each_unit_and_frees_it_after():
    par = ParallelConfig.create(TINY, world_size=2, zero=3)
    model = build_rank(TINY, par, 0, dtype=torch.bfloat16)
    gathers = Zero3Gathers().install(model)
    tracer = MemoryTracer(devices={"meta"})
    tracer.track_external(model)
    with tracer:
        tokens = torch.zeros(1, 8, dtype=torch.long, device="meta")
        loss = model(tokens, tokens, parse_routing("balanced", 0))
        forward = len(tracer.events)
        loss.backward()
        gathers.end_backward()
    # the root first (kept to the end of backward), then embed and 4 layers, each gathered
    # then freed; the head (main loss), kept gathered after its forward (torchtitan's
    # reshard_after_forward=False for the output), through the loss; embed and MTP module
    # (depth 1) gathered and freed; the head's second call (MTP loss) finds it gathered
    units = [EMBED, DENSE_LAYER, DENSE_LAYER, MOE_LAYER, MOE_LAYER]
    want = ([("alloc", 2 * ROOT)] + [(a, 2 * n) for n in units for a in ("alloc", "free")]
            + [("alloc", 2 * HEAD)] + [(a, 2 * n) for n in (EMBED, MTP) for a in ("alloc", "free")])
    assert _gathers(tracer.events[:forward], Phase.FORWARD) == want
    backward = [e for e in tracer.events[forward:] if e.category is Category.PARAMETER]
    # backward gathers every unit again (layers 0-3, MTP, embed), some by prefetch; the head
    # once more (its MTP-loss backward frees it, its main-loss backward gathers it again);
    # everything is freed by the end
    allocs = sorted(e.nbytes for e in backward if e.action == "alloc")
    assert allocs == sorted(2 * n for n in [DENSE_LAYER, DENSE_LAYER, MOE_LAYER, MOE_LAYER,
                                            MTP, EMBED, HEAD])
    alive = sum(e.nbytes if e.action == "alloc" else -e.nbytes
                for e in tracer.events if e.category is Category.PARAMETER
                and e.phase is not Phase.EXTERNAL)
    assert alive == 0


# one stage without MTP and a 4096-token vocabulary, so that the head (4096 x 64) is the
# largest unit and the peak is at the loss
WIDE = dataclasses.replace(TINY, vocab_size=4096, num_mtp_modules=0)


def _rank(**kwargs):
    # the eager kernels, whose loss end (fp32 logits and log-softmax) the expected peak follows
    return estimate(WIDE, world_size=2, micro_batch_size=1, seq_length=16, num_microbatches=2,
                    zero=3, rounding=None, kernels="eager", **kwargs).ranks[0]


def test_estimate_places_the_head_gather_at_the_loss():
    head = 2 * 4096 * 64  # 524,288 B
    with_prefetch, without = _rank(), _rank(zero3_prefetch=False)
    # the peak is in the first backward, at the head: root + head gathered, and FSDP2's
    # backward prefetch adds the unit that ran before the head (layer 3, MoE)
    assert with_prefetch.peak_step == without.peak_step == "0B0"
    assert without.zero3_gather_bytes == 2 * ROOT + head
    assert with_prefetch.zero3_gather_bytes == 2 * ROOT + head + 2 * MOE_LAYER
    assert with_prefetch.peak_bytes > without.peak_bytes
    # static keeps the largest unit as its line item; the estimate does not add it again
    assert without.static.zero3_gather_bytes == head
    largest = without.largest[0]
    assert (largest["bytes"], largest["category"]) == (head, "parameter")


def test_static_reports_the_largest_unit_including_the_head(capsys):
    """Issue 9 item 4: DeepSeek-V2-Lite, world 8, EP 8, ZeRO-3: the head (102,400 x 2048 bf16)
    is the largest unit, not a decoder layer (200,811,520 B)."""
    assert main(["static", "--model", "deepseek-v2-lite", "--world-size", "8", "--ep", "8",
                 "--zero", "3", "--json"]) == 0
    stage = json.loads(capsys.readouterr().out)["stages"][0]
    assert stage["zero3_gather_bytes"] == 102_400 * 2048 * 2 == 419_430_400
