"""Megatron's --num-distributed-optimizer-instances N: the distributed optimizer and its DDP
buffers shard over DP x CP / N and EDP / N (Megatron-LM d98e8a6 parallel_state.py
initialize_model_parallel's intra-partial groups; distributed_data_parallel.py hands
intra_dp_cp_group / intra_expt_dp_group to each _ParamAndGradBuffer). Megatron-Core's own
objects agree to the byte in tests/tracemem/test_oracle_megatron.py (two STATIC_CASES); here
the sums and the errors by hand."""

import dataclasses

import pytest
import torch

from modeling import load_config
from modeling.parallel import build_rank
from tracemem.errors import TracememError
from tracemem.parallel import ParallelConfig
from tracemem.static import megatron_buffers, static_memory

# deepseek-tiny with 4 layers, bf16 (the static oracle's model): 299,392 parameter elements
# (tests/tracemem/test_oracle_megatron.py test_the_step_residue_by_hand)
ELEMENTS = 299_392


def _cfg():
    return dataclasses.replace(load_config("deepseek-tiny"), num_layers=4, num_mtp_modules=0,
                               first_k_dense_replace=1, dtype="bfloat16")


def test_the_shard_groups_are_dp_over_n():
    cfg = _cfg()
    par = ParallelConfig.create(cfg, world_size=8, num_distributed_optimizer_instances=2)
    # DP 8 / 2 = 4 for the optimizer (ZeRO 1 rows of SHARDING), EDP 8 / 2 = 4
    assert par.intra_group_size("dp_cp") == par.intra_group_size("edp") == 4
    assert par.shards("optimizer_states", "dense") == par.shards("step_grad_copies",
                                                                 "expert") == 4
    assert par.shards("optimizer_states", "dense") * 2 == par.dp
    one = ParallelConfig.create(cfg, world_size=8)
    assert one.shards("optimizer_states", "dense") == 8


def test_each_instance_holds_every_element_once():
    # 12 B per element (fp32 master + two fp32 moments, Megatron's bf16 recipe) over the
    # ranks of one instance: DP ranks 4..7 with N = 2 (intra indices 0..3), all 8 with N = 1;
    # each element's state is in exactly one rank of an instance, padding holds none
    cfg = _cfg()
    for n, ranks in ((2, range(4, 8)), (2, range(0, 4)), (1, range(0, 8))):
        par = ParallelConfig.create(cfg, world_size=8, num_distributed_optimizer_instances=n)
        total = 0
        for r in ranks:
            model = build_rank(cfg, par, r, dtype=torch.bfloat16, kernels="megatron-te")
            total += static_memory(model, par, r).optimizer_bytes
        assert total == 12 * ELEMENTS, n


def test_buffers_pad_to_the_intra_group():
    # DP 6 / N 2 = 3: each bucket ends at a multiple of lcm(3, 128) = 384 elements, as at DP 3
    cfg = _cfg()
    par = ParallelConfig.create(cfg, world_size=6, num_distributed_optimizer_instances=2)
    model = build_rank(cfg, par, 0, dtype=torch.bfloat16, kernels="megatron-te")
    (buffer,) = megatron_buffers(model, par)
    assert buffer.group == 3 and buffer.padded % 384 == 0
    three = ParallelConfig.create(cfg, world_size=3)
    assert buffer.padded == megatron_buffers(
        build_rank(cfg, three, 0, dtype=torch.bfloat16, kernels="megatron-te"), three)[0].padded


@pytest.mark.parametrize("kwargs, words", [
    (dict(world_size=8, num_distributed_optimizer_instances=3),
     "--num-distributed-optimizer-instances 3 must divide DP x CP (8)"),
    (dict(world_size=8, ep=4, num_distributed_optimizer_instances=4),
     "must divide EDP (2)"),
    (dict(world_size=8, zero=3, num_distributed_optimizer_instances=2),
     "Megatron-FSDP's HSDP"),
    (dict(world_size=8, num_distributed_optimizer_instances=0), "must be a positive integer"),
])
def test_bad_instances_are_one_line_errors(kwargs, words):
    with pytest.raises(TracememError) as err:
        ParallelConfig.create(_cfg(), **kwargs)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_megatron_arguments_and_back():
    from tracemem.frontdoors.megatron import megatron_job, to_megatron_args
    argv = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size",
            "1", "--global-batch-size", "8", "--vocab-size", "256", "--bf16",
            "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]
    job = megatron_job(argv, world_size=8)
    assert job.num_distributed_optimizer_instances == 2
    assert job.parallel.shards("optimizer_states", "dense") == 4
    out = to_megatron_args(job)
    i = out.index("--num-distributed-optimizer-instances")
    assert out[i + 1] == "2"


def test_cli_flag(capsys):
    from tracemem.cli import main
    code = main(["static", "--model", "gpt-tiny", "--world-size", "8",
                 "--num-distributed-optimizer-instances", "3"])
    assert code == 2
    assert "must divide DP x CP (8)" in capsys.readouterr().err


def test_instances_need_the_distributed_optimizer():
    # Megatron-LM d98e8a6 distributed_data_parallel.py: 'Partial DistOpt cannot be used
    # without DistOpt'
    import pytest as _pytest

    from modeling import load_config
    from tracemem.errors import TracememError
    from tracemem.parallel import ParallelConfig

    with _pytest.raises(TracememError, match=r"needs the distributed optimizer"):
        ParallelConfig.create(load_config("llama-tiny"), world_size=8, zero=0,
                              num_distributed_optimizer_instances=2)
