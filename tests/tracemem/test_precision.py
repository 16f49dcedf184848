"""Precision recipes in Megatron's flags (tracemem.precision).

Reference: Megatron-LM d98e8a6, megatron/training/arguments.py (--use-precision-aware-optimizer,
--main-grads-dtype, --main-params-dtype, --exp-avg-dtype, --exp-avg-sq-dtype,
--grad-reduce-in-bf16, validate_args' accumulate_allreduce_grads_in_fp32),
megatron/core/optimizer/optimizer_config.py (OptimizerConfig: store_param_remainders default
True, dtypes other than fp32 only with the precision-aware optimizer), optimizer/__init__.py
(the precision-aware optimizer only with the distributed optimizer), TransformerEngine
fused_adam.py (remainders only with fp32 master weights); bytes per element by hand.
"""

import json

import pytest

from modeling import load_config
from modeling.parallel.build import build_rank
from tracemem import estimate
from tracemem.cli import main
from tracemem.errors import TracememError
from tracemem.parallel import ParallelConfig
from tracemem.precision import PRECISION_RECIPES, resolve_precision
from tracemem.static import static_memory

TINY = load_config("deepseek-tiny")
# deepseek-tiny, world 16 = CP 2 x PP 2 x DP 4, EP 2 x ETP 2 x EDP 2; rank 8 (the last stage)
# holds 117,104 dense and 36,864 expert elements (tests/tracemem/test_static.py derives them)
DENSE, EXPERT = 117_104, 36_864
SHARD = -(-DENSE // 8) + EXPERT // 2  # 14,638 + 18,432 over DP x CP 8 and EDP 2


def stage1(**flags):
    par = ParallelConfig.create(TINY, world_size=16, cp=2, pp=2, ep=2, etp=2, **flags)
    return static_memory(build_rank(TINY, par, 8), par)


def test_issue_example_bf16_grads_bf16_moments_int16_remainder():
    """Precision-aware optimizer, bf16 main grads, bf16 moments, fp32 master weights kept as
    int16 remainders: 2 B of main grad and 2 + 2 + 2 = 6 B of optimizer state per element."""
    memory = stage1(zero=1, use_precision_aware_optimizer=True, main_grads_dtype="bf16",
                    exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")
    assert memory.param_bytes == 2 * (DENSE + EXPERT)
    assert memory.grad_bytes == 2 * (DENSE + EXPERT)
    assert memory.optimizer_bytes == (2 + 2 + 2) * SHARD == 198_420
    # without the remainders the fp32 master weights take 4 B: 8 B of state
    memory = stage1(zero=1, use_precision_aware_optimizer=True, main_grads_dtype="bf16",
                    exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16", store_param_remainders=False)
    assert memory.optimizer_bytes == (4 + 2 + 2) * SHARD


@pytest.mark.parametrize("flags, grad, optimizer", [
    ({}, 4, 4 + 4 + 4),  # Megatron's defaults
    ({"grad_reduce_in_bf16": True}, 2, 12),  # bf16 grad buffer, fp32 master + moments
    ({"use_precision_aware_optimizer": True}, 4, 2 + 4 + 4),  # remainders on by default
    ({"use_precision_aware_optimizer": True, "main_params_dtype": "fp16"}, 4, 2 + 4 + 4),
    ({"use_precision_aware_optimizer": True, "main_params_dtype": "fp16",
      "exp_avg_dtype": "fp8", "exp_avg_sq_dtype": "fp16"}, 4, 2 + 1 + 2),
    ({"use_precision_aware_optimizer": True, "store_param_remainders": False}, 4, 12),
])
def test_each_field_sets_its_bytes(flags, grad, optimizer):
    spec = resolve_precision("megatron", 1, **flags)
    assert (spec.param_bytes, spec.grad_bytes, spec.optimizer_bytes) == (2, grad, optimizer)


def test_named_recipes_are_shorthands_for_the_fields():
    for name in ("paper-2502.07846", "deepseek-v3"):  # fp32 master + grads, bf16 moments
        spec = PRECISION_RECIPES[name]
        assert (spec.use_precision_aware_optimizer, spec.main_grads_dtype,
                spec.main_params_dtype, spec.exp_avg_dtype, spec.exp_avg_sq_dtype,
                spec.store_param_remainders) == (True, "fp32", "fp32", "bf16", "bf16", False)
        assert (spec.param_bytes, spec.grad_bytes, spec.optimizer_bytes) == (2, 4, 4 + 2 + 2)
    assert PRECISION_RECIPES["megatron"] == resolve_precision("megatron", 0)
    assert PRECISION_RECIPES["megatron"].optimizer_bytes == 12
    # a flag overrides the recipe's field
    assert resolve_precision("deepseek-v3", 1, store_param_remainders=True).optimizer_bytes == 6


@pytest.mark.parametrize("kwargs, message", [
    (dict(exp_avg_dtype="bf16"), "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
    (dict(main_grads_dtype="bf16"), "--main-grads-dtype bf16 needs --use-precision-aware"),
    (dict(use_precision_aware_optimizer=True, zero=0),
     "--use-precision-aware-optimizer needs Megatron's distributed optimizer: use --zero 1"),
    (dict(precision="deepseek-v3", zero=0), r"\(--precision deepseek-v3 uses it\)"),
    (dict(use_precision_aware_optimizer=True, exp_avg_dtype="int4"),
     "--exp-avg-dtype 'int4' is invalid; choose one of fp32, fp16, bf16, fp8"),
    (dict(use_precision_aware_optimizer=True, main_params_dtype="bf16"),
     "--main-params-dtype 'bf16' is invalid; choose one of fp32, fp16"),
    (dict(grad_reduce_in_bf16="yes"), "--grad-reduce-in-bf16 'yes' must be True or False"),
])
def test_megatron_constraints_are_one_line_errors(kwargs, message):
    with pytest.raises(TracememError, match=message):
        ParallelConfig.create(TINY, world_size=2, **kwargs)


def test_cli_flags_reach_static(capsys):
    assert main(["static", "--model", "deepseek-tiny", "--world-size", "16", "--cp", "2",
                 "--pp", "2", "--ep", "2", "--etp", "2", "--use-precision-aware-optimizer",
                 "--main-grads-dtype", "bf16", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype",
                 "bf16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    spec = result["parallel"]["precision_spec"]
    assert (spec["grad_bytes"], spec["master_bytes"], spec["optimizer_bytes"]) == (2, 2, 6)
    assert result["stages"][1]["optimizer_bytes"] == 6 * SHARD
    assert main(["static", "--model", "deepseek-tiny", "--world-size", "2",
                 "--exp-avg-dtype", "bf16"]) == 2
    assert "needs --use-precision-aware-optimizer" in capsys.readouterr().err


def test_gradient_accumulation_fusion_drops_the_transient_weight_gradients():
    def rank(fusion):
        return estimate(TINY, world_size=1, micro_batch_size=1, seq_length=16,
                        num_microbatches=1, rounding=None, kernels="eager",
                        gradient_accumulation_fusion=fusion).ranks[0]
    plain, fused = rank(False), rank(True)
    # without fusion the peak holds an expert weight gradient (8 x 64 x 32 bf16) on its way
    # into the main grad, and the head's partial gradient (256 x 64 bf16, used twice under MTP)
    held = {(s["category"], tuple(s["shape"])) for s in plain.largest}
    assert ("gradient", (8, 64, 32)) in held and ("temporary", (256, 64)) in held
    assert plain.gradient_bytes - plain.static.grad_bytes == 2 * 8 * 64 * 32
    assert fused.gradient_bytes == fused.static.grad_bytes  # none in flight
    assert fused.peak_bytes < plain.peak_bytes


def test_gradient_accumulation_fusion_is_the_megatron_te_kernel_option():
    def peak(**kwargs):
        return estimate(TINY, world_size=1, micro_batch_size=1, seq_length=16,
                        num_microbatches=1, rounding=None, **kwargs).ranks[0].peak_bytes
    # megatron-te fuses by default: the flag set on, or the kernel option, change nothing
    assert peak() == peak(gradient_accumulation_fusion=True) == \
        peak(kernel_options={"gradient_accumulation_fusion": True})
    assert peak(gradient_accumulation_fusion=False) == \
        peak(kernel_options={"gradient_accumulation_fusion": False})
    with pytest.raises(TracememError, match="disagree; give one"):
        peak(gradient_accumulation_fusion=False,
             kernel_options={"gradient_accumulation_fusion": True})
