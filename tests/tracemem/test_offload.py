"""Optimizer CPU offload (``--optimizer-cpu-offload``, tracemem.offload) on gpt-tiny, by hand.

References (NVIDIA/Megatron-LM d98e8a6): megatron/core/optimizer/cpu_offloading/
hybrid_optimizer.py ``HybridDeviceOptimizer`` (``_get_sub_optimizer_param_groups``: a
parameter goes to the host while the elements offloaded so far are below fraction x total; host
parameters get a pinned fp32 master, a pinned fp32 gradient buffer and AdamW's fp32 moments and
4 B step; device parameters an fp32 master and TE FusedAdam's fp32 moments: 12 B per element);
megatron/core/optimizer/distrib_optimizer.py (the order: weight-decay group first, buffer order
= reverse registration order); PyTorch's Copy.cu (the fp32 device temporary of each host
parameter's copy-back) and CachingHostAllocator.h (pinned blocks rounded to a power of two).

gpt-tiny (modeling/families/gpt/presets/gpt-tiny.json): h 64, 4 layers, FFN 4h = 256, vocab 256,
128 positions, tied embeddings, biases. Megatron's tensors per layer: linear_qkv 192 x 64 =
12,288 (+ bias 192, + its fused LayerNorm 64 + 64), linear_proj 64 x 64 = 4,096 (+ 64), fc1
256 x 64 = 16,384 (+ 256, + its LayerNorm 64 + 64), fc2 64 x 256 = 16,384 (+ 64): 49,984
elements, 12 tensors; the 2-D weights 49,152. The model: 4 x 49,984 + word embedding 256 x 64 =
16,384 + positions 128 x 64 = 8,192 + final LayerNorm 128 = 224,640 elements in 52 tensors
(every tensor a multiple of 64 elements: no alignment gaps). World 1: DP 1, one bucket, the
shard is every tensor whole.
"""

import json

import pytest

from tracemem import Job, estimate
from tracemem.errors import TracememError
from tracemem.estimator import TraceCache, rank_classes, trace_classes
from tracemem.offload import host_per_node, offload_split, pinned_block

ELEMENTS = 224_640
CACHE = TraceCache()  # the forward / backward trace is shared; only the step differs


def _job(**kw):
    base = dict(model="gpt-tiny", world_size=1, micro_batch_size=1, seq_length=16,
                num_microbatches=1, zero=1, use_precision_aware_optimizer=True, rounding=None)
    return Job(**(base | kw))


def _rank(**kw):
    return estimate(_job(**kw), trace_cache=CACHE).ranks[0]


def test_without_offload_the_precision_aware_state_is_on_the_device():
    r = _rank()
    # precision-aware FusedAdam: int16 remainders 2 B + fp32 m, v 8 B = 10 B per element
    assert r.optimizer_state_bytes == 10 * ELEMENTS == 2_246_400
    assert (r.host_bytes, r.host_pinned_bytes) == (0, 0)


def test_half_offloaded_goes_parameter_by_parameter_in_the_optimizers_order():
    r = _rank(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)
    # threshold 0.5 x 224,640 = 112,320; the weight-decay group in reverse registration order:
    # layer 3's four weights (49,152), layer 2's (98,304 < 112,320), layer 1's fc2 weight
    # (16,384: 114,688, crossing the threshold, goes whole); then nothing more
    host = 2 * 49_152 + 16_384
    assert host == 114_688
    device = ELEMENTS - host  # 109,952
    assert r.optimizer_state_bytes == 12 * device == 1_319_424  # fp32 master + m + v
    # pinned: fp32 master and fp32 grad per host tensor, each a power-of-two block: five
    # 16,384-element weights 65,536 B, two qkv 12,288 -> 49,152 B -> 65,536 B, two proj
    # 4,096 -> 16,384 B; 491,520 B per kind, two kinds
    pinned = 2 * (5 * 65_536 + 2 * 65_536 + 2 * 16_384)
    assert r.host_pinned_bytes == pinned == 983_040
    # pageable: AdamW's fp32 m, v (8 B per element) and a 4 B step per tensor (9 tensors)
    assert r.host_bytes == pinned + 8 * host + 4 * 9 == 1_900_580
    # the parameters and the main grads stay on the device as they were
    assert (r.parameter_bytes, r.gradient_bytes) == (2 * ELEMENTS, 4 * ELEMENTS)


def test_everything_offloaded_leaves_no_optimizer_state_on_the_device():
    r = _rank(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0)
    assert r.optimizer_state_bytes == 0
    # pinned blocks of 4 B x elements, per layer: qkv 49,152 -> 65,536, its bias 768 -> 1,024,
    # proj 16,384, fc1 65,536, fc1 bias 1,024 -> 1,024, fc2 65,536; 64-element tensors (proj
    # and fc2 biases, four LayerNorm vectors) 256 each: 216,576 per layer; word embedding
    # 65,536, positions 32,768, final LayerNorm 2 x 256
    per_kind = 4 * (65_536 + 1_024 + 16_384 + 65_536 + 1_024 + 65_536 + 6 * 256) \
        + 65_536 + 32_768 + 512
    assert per_kind == 965_120
    assert r.host_pinned_bytes == 2 * per_kind
    assert r.host_bytes == 2 * per_kind + 8 * ELEMENTS + 4 * 52 == 3_727_568


def test_unpinned_host_memory_is_as_requested():
    r = _rank(optimizer_cpu_offload=True, pin_cpu_grads=False, pin_cpu_params=False)
    assert r.host_pinned_bytes == 0
    assert r.host_bytes == 16 * ELEMENTS + 4 * 52  # master, grad, m, v at 4 B; steps


def _step_peak_above_start(job) -> tuple[int, int]:
    """(the optimizer step's own peak above what was alive before it, its largest block)."""
    [traced] = trace_classes(job, rank_classes(job), CACHE)
    events = traced.segments.events[(0, "O", 0)]
    alive = peak = largest = 0
    for e in events:
        alive += e.nbytes if e.action == "alloc" else -e.nbytes
        peak = max(peak, alive)
        largest = max(largest, e.nbytes if e.action == "alloc" else 0)
    return peak, largest


def test_the_copy_back_stages_one_fp32_tensor_at_a_time_on_the_device():
    # fp32 main grads: the D2H copy needs no temporary; each host master's copy back into its
    # bf16 parameter converts through an fp32 device tensor of its size, freed before the next:
    # the largest is a 16,384-element weight, 65,536 B
    assert _step_peak_above_start(_job(optimizer_cpu_offload=True)) == (65_536, 65_536)


def test_bf16_main_grads_keep_the_device_parts_fp32_grad_copies():
    # --grad-reduce-in-bf16: each device master's .grad = grad.to(fp32) persists until the next
    # step replaces it (4 B x 109,952 device elements at fraction 0.5, static); in the step
    # each new copy is made before the old one goes, each host grad is converted on the device
    # before its copy to the host, as is each copy-back: one fp32 tensor at a time, the
    # largest a 16,384-element weight (65,536 B) on either side
    job = _job(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5,
               grad_reduce_in_bf16=True)
    assert _step_peak_above_start(job) == (65_536, 65_536)
    r = estimate(job, trace_cache=CACHE).ranks[0]
    assert r.optimizer_state_bytes == (12 + 4) * 109_952


def test_the_fraction_applies_per_optimizer_and_crosses_whole():
    split = offload_split({"dense": [10, 10, 10, 10], "expert": [6, 2]}, 0.5)
    # dense: 0 < 20, 10 < 20, then 20 is not < 20; expert: 0 < 4 takes the 6 whole
    assert split.host == (10, 10, 6) and split.device == (10, 10, 2)
    assert offload_split({"dense": [10]}, 0.0).host == ()


def test_pinned_blocks_round_to_powers_of_two():
    assert [pinned_block(n) for n in (0, 1, 4096, 4097, 49_152)] == [0, 1, 4096, 8192, 65_536]


def test_host_memory_per_node_sums_the_ranks_each_node_holds():
    # 16 ranks, PP 2: stage 0 ranks 0-7 at 100 B, stage 1 ranks 8-15 at 10 B; nodes of 3
    # ranks: node 2 holds 6, 7 (stage 0) and 8 (stage 1): 210; node 0 holds 0-2: 300, the most
    assert host_per_node(16, 2, {0: 100, 1: 10}, 3) == 300
    assert host_per_node(16, 2, {0: 10, 1: 100}, 3) == 300  # node 3: ranks 9-11
    assert host_per_node(16, 2, {0: 1, 1: 100}, 16) == 8 * 1 + 8 * 100


@pytest.mark.parametrize("kw, match", [
    (dict(use_precision_aware_optimizer=False), "needs --use-precision-aware-optimizer"),
    (dict(optimizer_offload_fraction=1.5), "must be a number from 0 to 1"),
    (dict(optimizer_offload_fraction="half"), "must be a number from 0 to 1"),
    (dict(kernels="eager"), "needs --kernels megatron-te"),
    (dict(pin_cpu_grads="no"), "pin_cpu_grads 'no' is invalid"),
    (dict(ranks_per_node=0), "--ranks-per-node 0 must be a positive integer"),
])
def test_offload_refuses_what_megatron_or_tracemem_cannot_run(kw, match):
    with pytest.raises(TracememError, match=match):
        _job(optimizer_cpu_offload=True, **kw)


@pytest.mark.parametrize("kw, flag", [
    (dict(optimizer_offload_fraction=0.5), "--optimizer-offload-fraction"),
    (dict(pin_cpu_grads=False), "--no-pin-cpu-grads"),
    (dict(pin_cpu_params=False), "--no-pin-cpu-params"),
])
def test_an_offload_flag_without_the_offload_is_refused(kw, flag):
    # alone it would change nothing (Megatron reads them only with --optimizer-cpu-offload)
    with pytest.raises(TracememError, match=f"^{flag} needs --optimizer-cpu-offload$"):
        _job(**kw)


def test_the_megatron_front_door_honours_the_offload_flags():
    from tracemem.frontdoors import megatron_job
    from tracemem.frontdoors.megatron import to_megatron_args

    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "16", "--max-position-embeddings", "128", "--micro-batch-size", "1",
            "--bf16", "--use-distributed-optimizer", "--use-precision-aware-optimizer",
            "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5",
            "--no-pin-cpu-grads", "--use-torch-optimizer-for-cpu-offload",
            "--overlap-cpu-optimizer-d2h-h2d"]
    job = megatron_job(argv, world_size=1, vocab_size=256)
    assert job.optimizer_offload.fraction == 0.5
    assert (job.pin_cpu_grads, job.pin_cpu_params) == (False, True)
    args = to_megatron_args(job.with_changes(optimizer_offload_fraction=0.25))
    assert args[args.index("--optimizer-offload-fraction") + 1] == "0.25"
    assert "--no-pin-cpu-grads" in args


def test_the_hybrid_optimizers_order_is_megatron_cores_distributed_optimizers(monkeypatch):
    # Megatron-Core 0.16.1's own DistributedOptimizer built on meta (the static oracle's
    # _megatron: DDP + get_megatron_optimizer on deepseek-tiny, 4 layers): the inner
    # optimizer's parameters, group by group, are what HybridDeviceOptimizer walks
    # (distrib_optimizer.py DistributedOptimizer.__init__ rebuilds it over them); here the
    # dense optimizer and the expert one (TP 2 + SP, EP 2, ETP 2, global rank 5)
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: "
                        "pip install -e '.[megatron]'")
    import torch
    import megatron.core.optimizer as megatron_optimizer

    from modeling.parallel import build_rank
    from tracemem.offload import hdo_parameters
    from tracemem.oracle import static_oracle
    from tracemem.oracle.compare import oracle_model_config

    made = []
    build = megatron_optimizer.get_megatron_optimizer
    monkeypatch.setattr(megatron_optimizer, "get_megatron_optimizer",
                        lambda *a, **k: made.append(build(*a, **k)) or made[-1])
    case = static_oracle.StaticCase(world_size=8, tp=2, sp=True, ep=2, etp=2, rank=5)
    cfg = oracle_model_config(4)
    static_oracle._megatron(case, cfg)
    theirs = [[p.numel() for g in o.optimizer.param_groups for p in g["params"]]
              for o in made[0].chained_optimizers]
    par = static_oracle._layout(case, cfg)
    model = build_rank(cfg, par, case.rank, dtype=torch.bfloat16, kernels="megatron-te")
    ours = hdo_parameters(model, par, case.rank)
    assert [ours["dense"], ours["expert"]] == theirs


def test_the_json_and_the_verdict_say_the_host_memory():
    from tracemem.report import format_estimate, format_host_memory, get_estimate

    result = estimate(_job(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5),
                      trace_cache=CACHE)
    data = get_estimate(result)
    # world 1: the one rank is the one node (of up to 8 ranks)
    assert data["host"] == {"ranks_per_node": 8, "world_size": 1, "per_rank_bytes": 1_900_580,
                            "pinned_per_rank_bytes": 983_040, "per_node_bytes": 1_900_580,
                            "pinned_per_node_bytes": 983_040,
                            "offload_flags": ["--optimizer-cpu-offload"]}
    assert data["ranks"][0]["host_bytes"] == 1_900_580
    line = format_host_memory(data["verdict"], "B")
    assert line == ("Host memory (optimizer and activation offload, EMA): 1,900,580 B per rank "
                    "at most "
                    "(983,040 B pinned), 1,900,580 B on its one node (1 rank of a node of 8) "
                    "(983,040 B pinned).")
    assert line in format_estimate(result, units="B")
    assert format_host_memory(get_estimate(estimate(_job(), trace_cache=CACHE))["verdict"]) \
        is None  # nothing on the host: no line


def test_tracemem_static_of_a_megatron_job_counts_the_offload(capsys):
    # the same model as gpt-tiny through Megatron's arguments (224,640 elements: the
    # figures of test_half_offloaded_...)
    from tracemem.cli import main

    argv = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
            "--max-position-embeddings 128 --micro-batch-size 1 --bf16 "
            "--use-distributed-optimizer --use-precision-aware-optimizer "
            "--optimizer-cpu-offload --optimizer-offload-fraction 0.5 --vocab-size 256 "
            "--tokenizer-type NullTokenizer").split()
    assert main(["static", "--world-size", "1", "--json", "--megatron-args", *argv]) == 0
    [stage] = json.loads(capsys.readouterr().out)["stages"]
    assert stage["optimizer_bytes"] == 12 * 109_952
    assert (stage["host_bytes"], stage["host_pinned_bytes"]) == (1_900_580, 983_040)
