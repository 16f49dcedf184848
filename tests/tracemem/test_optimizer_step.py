"""The whole iteration: the optimizer step after the schedule (tracemem.optimizer_step) and the
phase that holds the peak.

Reference: Megatron-LM d98e8a6 megatron/core/optimizer/distrib_optimizer.py
``_copy_model_grads_to_main_grads`` (``shard_model_grad.float()``: a new fp32 copy only when
the grad buffer is bf16; a view under the precision-aware optimizer), TE FusedAdam (one
multi_tensor_adam launch, no temporaries), torch 2.13 torch/optim/adam.py
``_multi_tensor_adam`` (``torch._foreach_sqrt`` copies the second moments); bytes by hand.
"""

import json

import pytest

from modeling import load_config
from tracemem import estimate
from tracemem.cli import main
from tracemem.errors import TracememError

TINY = load_config("deepseek-tiny")
# deepseek-tiny on one GPU: 102,816 elements on the first half (embedding, 2 dense layers),
# 100,720 dense on the second (2 MoE layers' dense parts, norm, head, MTP without a second
# embedding) and 3 MoE layers x 8 experts x 3 x 64 x 32 = 147,456 expert elements
N = 102_816 + 100_720 + 147_456  # 350,992
BIAS = 3 * 8 * 4  # the 3 MoE layers' fp32 router correction biases (buffers)
STATIC = (2 + 4 + 12) * N + BIAS  # megatron recipe, ZeRO-1 over DP 1


def rank(**kwargs):
    return estimate(TINY, world_size=1, micro_batch_size=1, seq_length=16, num_microbatches=1,
                    rounding=None, kernels="eager", **kwargs).ranks[0]


def test_fused_adam_with_an_fp32_grad_buffer_allocates_nothing():
    r = rank()
    assert r.static.total_bytes == STATIC == 6_317_952
    assert r.peak_phase == "backward" and r.peak_step == "0B0"


def test_bf16_grad_buffer_makes_fp32_grad_copies_at_the_step():
    r = rank(grad_reduce_in_bf16=True)
    static = (2 + 2 + 12) * N + BIAS
    assert r.static.total_bytes == static
    # every master shard gets an fp32 copy of its bf16 gradient: 4 B per element
    assert (r.peak_phase, r.peak_step) == ("optimizer", "optimizer")
    assert r.peak_bytes == static + 4 * N == 7_019_936
    assert r.temporary_bytes == 4 * N


def test_torch_foreach_adam_copies_the_second_moments():
    r = rank(optimizer="torch")
    assert r.peak_phase == "optimizer"
    assert r.peak_bytes == STATIC + 4 * N  # torch._foreach_sqrt(exp_avg_sqs), fp32
    r = rank(optimizer="torch", grad_reduce_in_bf16=True)
    assert r.peak_bytes == (2 + 2 + 12) * N + BIAS + 4 * N + 4 * N


def test_precision_aware_optimizer_reads_the_bf16_buffer_in_place():
    r = rank(use_precision_aware_optimizer=True, main_grads_dtype="bf16", exp_avg_dtype="bf16",
             exp_avg_sq_dtype="bf16")
    assert r.static.total_bytes == (2 + 2 + 6) * N + BIAS
    assert r.peak_phase == "backward"  # decoupled_grad is a view: the step adds nothing


def test_optimizer_errors_and_json(capsys):
    with pytest.raises(TracememError, match="--optimizer 'sgd' is invalid"):
        rank(optimizer="sgd")
    with pytest.raises(TracememError, match="--optimizer torch cannot run"):
        rank(optimizer="torch", use_precision_aware_optimizer=True)
    assert main(["estimate", "--model", "deepseek-tiny", "--world-size", "1",
                 "--micro-batch-size", "1", "--seq-length", "16", "--num-microbatches", "1",
                 "--kernels", "eager", "--rounding", "0", "--grad-reduce-in-bf16",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ranks"][0]["peak_phase"] == "optimizer"
    assert result["ranks"][0]["peak_bytes"] == 7_019_936
