"""``tracemem.job.Job``: one validated job; the estimate's stages, each alone (issue 20 items 1,
6).

References: Megatron-LM ``megatron/core/num_microbatches_calculator.py``
(``ConstantNumMicroBatchesCalculator``: M = G / (b x DP), an integer) and
``megatron/core/tokenizers/utils/build_tokenizer.py`` at d98e8a6 (``vocab_size_with_padding``: the vocabulary
rounded up to a multiple of make_vocab_size_divisible_by x TP); the expected values are hand
arithmetic in each test.
"""

import dataclasses

import pytest

import tracemem
from tracemem.errors import TracememError
from tracemem.estimator import (
    TraceCache,
    allocator_row,
    estimate,
    rank_classes,
    replay_class,
    trace_classes,
)
from tracemem.job import Job, padded_vocab_size

TINY = dict(model="deepseek-tiny", world_size=4, micro_batch_size=1, seq_length=16)


def test_microbatches_from_the_global_batch():
    job = Job(**TINY, global_batch_size=8, tp=2, sp=True)  # DP = 4 / 2 = 2
    assert (job.parallel.dp, job.microbatches, job.global_batch) == (2, 4, 8)  # 8 / (1 x 2)
    job = Job(**TINY, num_microbatches=3)  # DP 4: G = 1 x 3 x 4
    assert (job.microbatches, job.global_batch) == (3, 12)
    assert Job(**TINY, num_microbatches=2, global_batch_size=8).microbatches == 2  # agree


@pytest.mark.parametrize("fields, message", [
    ({}, r"give --num-microbatches \(M, per pipeline per step\) or --global-batch-size"),
    ({"global_batch_size": 6}, r"--global-batch-size 6 is not divisible by --micro-batch-size "
                               r"1 x DP 4 = 4 \(Megatron's ConstantNumMicroBatchesCalculator\)"),
    ({"global_batch_size": 8, "num_microbatches": 3},
     r"--num-microbatches 3 disagrees with --global-batch-size 8 / \(--micro-batch-size 1 x "
     r"DP 4\) = 2; give one"),
    ({"num_microbatches": 1, "tp": 3}, r"--tp 3 must divide num_attention_heads \(4\)"),
    ({"num_microbatches": 1, "pp": 3}, r"--world-size 4 is not a multiple of tp\(1\) \* "
                                       r"cp\(1\) \* pp\(3\) = 3"),
    ({"num_microbatches": 1, "recompute": "some"}, r"--recompute 'some' is invalid"),
    # Megatron-Core's own refusal, with its reason (moe_layer.py MoELayer.forward)
    ({"num_microbatches": 1, "tp": 2}, r"--tp > 1 on an MoE model needs --sp \(Megatron-Core "
                                       r"d98e8a6 megatron/core/transformer/moe/moe_layer.py "
                                       r"MoELayer.forward"),
    ({"num_microbatches": 1, "gpu": "GB200", "torch_cublas_default": "2.9"},
     r"--torch-cublas-default '2.9' is invalid; choose one of 2.13, sm90"),
    ({"num_microbatches": 4, "pp": 2, "vpp": 2, "schedule": "interleaved-1f1b",
      "kernels": "megatron-te", "overlap_p2p_comm": False},
     r"--no-overlap-p2p-communication with the interleaved schedule needs --pp above 2 \(here "
     r"2\): Megatron-LM refuses it"),
    ({"num_microbatches": 1, "torch_cublas_default": "sm90"},
     r"--torch-cublas-default sizes PyTorch's cuBLAS workspaces, which are counted with --gpu "
     r"only"),
])
def test_a_bad_job_is_one_line(fields, message):
    with pytest.raises(TracememError, match=message):
        Job(**TINY, **fields)


def test_vocabulary_padded_as_megatron_pads_it():
    # 50,257 (GPT-2) to a multiple of 128 x TP 2 = 256: 196 x 256 = 50,176 < 50,257, so 197 x 256
    assert padded_vocab_size(50257, 128, 2) == 50432
    assert padded_vocab_size(50257, None, 2) == 50257  # a Hugging Face vocabulary as given
    job = Job(**TINY, num_microbatches=1, tp=2, sp=True, make_vocab_size_divisible_by=100)
    # deepseek-tiny's 256 tokens to a multiple of 200: 400; the model as given keeps 256
    assert (job.model.vocab_size, job.config.vocab_size) == (256, 400)


def test_a_changed_job_is_validated_again():
    job = Job(**TINY, num_microbatches=1)
    assert dataclasses.replace(job, recompute="full").recompute == "full"
    with pytest.raises(TracememError, match=r"--tp 3 must divide num_attention_heads \(4\)"):
        dataclasses.replace(job, tp=3)
    with pytest.raises(TracememError, match=r"unknown job keyword 'recompte'; did you mean "
                                            r"'recompute'\?"):
        job.with_changes(recompte="full")


def test_a_kernel_option_given_as_a_job_keyword_is_named_as_one():
    # estimate("deepseek-v3", ..., fp8_recipe="blockwise") used to get "did you mean 'recipe'?"
    with pytest.raises(TracememError) as error:
        Job(**TINY, num_microbatches=1).with_changes(fp8_recipe="blockwise")
    assert str(error.value) == ("'fp8_recipe' is a kernel option, not a job keyword: give "
                                "kernel_options={'fp8_recipe': ...}")


def test_old_keyword_names_are_refused_with_the_new_one():
    with pytest.raises(TracememError, match=r"keyword 'schedule_name' is now 'schedule' \(the "
                                            r"CLI's --schedule\)"):
        tracemem.estimate("deepseek-tiny", world_size=1, micro_batch_size=1, seq_length=16,
                          num_microbatches=1, schedule_name="1f1b")
    job = Job(**TINY, num_microbatches=1)
    with pytest.raises(TracememError, match=r"estimate\(job, tp=...\): change a Job with "
                                            r"dataclasses.replace"):
        estimate(job, tp=2)


def test_the_estimate_carries_its_job_and_its_stages_run_alone():
    job = Job(**TINY, num_microbatches=2, pp=2)  # 4 layers: 2 per stage; DP 2
    result = estimate(job)
    assert result.job is job and result.parallel is job.parallel
    classes = rank_classes(job)
    # one class per pipeline stage under balanced routing; rank = stage x (4 / 2)
    assert [(c.stage, c.rank, c.layers, c.ep_rank) for c in classes] == [
        (0, 0, (0, 1), None), (1, 2, (2, 3), None)]
    traced = trace_classes(job, classes, TraceCache())
    # 1F1B with PP 2, M 2: stage 0 runs F0 F1 B0 B1, stage 1 F0 B0 F1 B1, then the optimizer
    assert [str(s) for s in traced[0].steps] == ["0F0", "0F1", "0B0", "0B1", "0O0"]
    assert [str(s) for s in traced[1].steps] == ["1F0", "1B0", "1F1", "1B1", "1O0"]
    for one, rank in zip(traced, result.ranks):
        assert replay_class(job, one).peak_bytes == rank.peak_bytes
        assert allocator_row(job, one).reserved_peak_bytes == rank.reserved_peak_bytes


def test_an_integer_of_another_library_is_taken_as_the_int_it_stands_for():
    # a sweep's numpy integers (operator.index): the same Job as Python ints; a numpy float or
    # bool is still refused by the field's own rule
    import numpy as np

    mine = Job.create("llama-tiny", world_size=np.int64(2), tp=np.int32(2),
                      micro_batch_size=np.int64(1), seq_length=np.int64(64),
                      num_microbatches=np.int64(2))
    assert mine == Job.create("llama-tiny", world_size=2, tp=2, micro_batch_size=1,
                              seq_length=64, num_microbatches=2)
    assert type(mine.tp) is int and type(mine.seq_length) is int
    for bad in (np.float64(2.0), np.bool_(True)):
        with pytest.raises(TracememError, match="--tp .* must be a positive integer"):
            Job.create("llama-tiny", world_size=2, tp=bad, micro_batch_size=1, seq_length=64,
                       num_microbatches=2)
    # in a layout's list too, and a numpy bool where a switch goes
    staged = Job.create("llama-tiny", world_size=4, tp=np.int64(2), sp=np.bool_(True),
                        pp=2, pp_layout=[np.int64(2), np.int64(2)], micro_batch_size=1,
                        seq_length=64, num_microbatches=2)
    assert staged.sp is True and staged.parallel.pp_layout == (2, 2)
    assert all(type(n) is int for n in staged.pp_layout)
