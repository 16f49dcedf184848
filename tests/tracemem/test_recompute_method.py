"""Megatron's --recompute-method uniform|block with --recompute-num-layers N.

Reference: Megatron-LM megatron/core/transformer/transformer_block.py,
TransformerBlock._checkpointed_forward (per model chunk: uniform checkpoints groups of N
layers, keeping each group's input; block checkpoints the first N layers, one each); bytes by
hand: a layer's input on this rank is (b, s / TP, h) = (2, 32, 64) bf16 = 8,192 B.
"""

import pytest

from tracemem.errors import TracememError
from tracemem.estimator import estimate

TINY = dict(world_size=4, tp=2, sp=True, pp=2, micro_batch_size=2, seq_length=64,
            experts="sequential", num_microbatches=4, rounding=None, kernels="eager")


def test_block_recomputes_the_first_n_layers_of_each_chunk():
    none = estimate("deepseek-tiny", recompute="none", **TINY).ranks[0]
    full = estimate("deepseek-tiny", recompute="full", **TINY).ranks[0]
    block = {n: estimate("deepseek-tiny", recompute="full", recompute_method="block",
                         recompute_num_layers=n, **TINY).ranks[0] for n in (0, 1, 2)}
    # stage 0 holds layers 0 and 1: block 2 is every layer (full), block 0 none of them
    assert block[2].peak_bytes == full.peak_bytes
    assert block[0].peak_bytes == none.peak_bytes
    assert full.activation_bytes < block[1].activation_bytes < none.activation_bytes


def test_uniform_two_keeps_one_input_per_two_layers():
    one = estimate("deepseek-tiny", recompute="full", **TINY).ranks[0]
    two = estimate("deepseek-tiny", recompute="full", recompute_method="uniform",
                   recompute_num_layers=2, **TINY).ranks[0]
    # uniform 1 keeps layers 0 and 1's inputs, uniform 2 only layer 0's: one 8,192 B input
    # fewer per microbatch held, 2 held at the peak (0B0, 1F1B stage 0 of 2)
    assert (one.inflight_microbatches, two.inflight_microbatches) == (2, 2)
    assert one.activation_bytes - two.activation_bytes == 2 * (2 * 32 * 64 * 2)
    # but backward recomputes both layers at once, so the peak is higher
    assert two.peak_bytes > one.peak_bytes


@pytest.mark.parametrize("kwargs, message", [
    (dict(recompute="none", recompute_method="block", recompute_num_layers=1),
     "--recompute-method block --recompute-num-layers 1 applies to --recompute full"),
    (dict(recompute="full", recompute_method="uniform", recompute_num_layers=0),
     "--recompute-num-layers 0 must be a positive integer"),
    (dict(recompute="full", recompute_method="blocks"), "--recompute-method 'blocks' is invalid"),
])
def test_rejected_recompute_methods(kwargs, message):
    with pytest.raises(TracememError, match=message):
        estimate("deepseek-tiny", **kwargs, **TINY)


def test_uniform_groups_keep_a_tp_share_under_distribute_saved_activations():
    """megatron/core/recompute.py ``chunk_runner`` passes ``--distribute-saved-activations`` to
    each group's ``tensor_parallel.checkpoint``: with uniform 2 over layers {0, 1} and {2}
    (deepseek-tiny, 3 layers, TP 2 without SP, b 1, s 16, h 64) each group keeps its input as
    a 1-D [16 x 64 / 2 = 512] bf16 buffer, 1,024 B, instead of [1, 16, 64] = 2,048 B."""
    import torch

    from modeling.common.routing import Balanced
    from modeling.kernels import get_profile
    from modeling.parallel import build_rank
    from modeling.parallel.pp import recv_backward, recv_forward
    from tracemem.oracle.compare import oracle_model_config
    from tracemem.parallel import ParallelConfig
    from tracemem.recompute import apply_recompute_method
    from tracemem.tracer import MemoryTracer

    kept = {}
    for distribute in (False, True):
        cfg = oracle_model_config()
        par = ParallelConfig.create(cfg, world_size=2, tp=2)
        model = build_rank(cfg, par, 0, dtype=torch.bfloat16, kernels=get_profile("megatron-te"))
        for block in model.layers.values():
            block.set_recompute("full", distribute_saved_activations=distribute)
        apply_recompute_method(model, "uniform", 2)
        tracer = MemoryTracer(rounding=None, devices={"meta"})
        tracer.track_external(model)
        with tracer:
            x = recv_forward((1, 16, 64), torch.bfloat16)
            out = x
            for i in range(3):
                out = model.layers[str(i)](out, Balanced())
            end = len(tracer.events) - 1
            kept[distribute] = sorted((i.nbytes, i.shape) for i in tracer.live_at(end)
                                      if i.phase.value == "forward")
            out.backward(recv_backward(tuple(out.shape), torch.bfloat16))
            del out, x
    # the group inputs (the received x, layer 1's output) and the stage's output
    assert kept[False] == [(2048, (1, 16, 64))] * 3
    assert kept[True] == [(1024, (512,)), (1024, (512,)), (2048, (1, 16, 64))]
