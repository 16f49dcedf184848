"""torchtitan 0.3.0 jobs in (tracemem.frontdoors.torchtitan) and FSDP2's mixed precision
(tracemem.precision ``fsdp2``).

References: the torchtitan 0.3.0 wheel (package registry): torchtitan/models/<family>/
__init__.py (the flavors' sizes), config_registry.py (the registry functions),
torchtitan/config/configs.py (TrainingConfig, ParallelismConfig), torchtitan/distributed/fsdp.py
``apply_fsdp_to_decoder`` (MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over fp32
parameters). Expected values are read from those files and multiplied out by hand in comments.

The torchtitan tests need torchtitan importable and skip otherwise (``pytest.importorskip``).
With torch 2.13.0 (CPU) this pinned set, installed with ``pip install --no-deps``, makes
``torchtitan.config`` and ``torchtitan.models.{llama3,qwen3,deepseek_v3}`` import:
torchtitan==0.3.0 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 shtab==1.13.0
typing_extensions==4.16.0 einops==0.8.2 spmd_types==0.2.3 triton==3.8.0 tensorboard==2.21.0
absl-py==2.5.1 torchdata==0.11.0 tokenizers==0.23.3 datasets==4.7.0 pandas==3.1.1
pyarrow==26.0.1 dill==0.4.1 xxhash==4.1.0 multiprocess==0.70.19 huggingface_hub==0.36.2
tqdm==4.70.1 python-dateutil==4.0.0 pytz==2026.6 tzdata==2026.6 six==1.17.0 httpx==0.28.1
httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1 (protobuf, packaging, requests,
filelock, pyyaml, fsspec, numpy from the project's own set).
"""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest

from tracemem.errors import TracememError
from tracemem.job import Job
from tracemem.static import static_memory


# --- FSDP2's mixed precision, without torchtitan ---------------------------------------------

def _static(job):
    from modeling.parallel.build import build_rank

    return static_memory(build_rank(job.config, job.parallel, 0, kernels=job.profile),
                         job.parallel)


def test_fsdp2_keeps_16_bytes_per_sharded_parameter_on_a_tiny_model():
    # llama-tiny (modeling/families/llama/presets/llama-tiny.json): h 64, 4 heads of 16, 2 KV
    # heads, MLP 128, 4 layers, vocabulary 256, untied head.
    # embedding 256 x 64 = 16,384; head 16,384; per layer q 64x64 4,096 + k 64x32 2,048 +
    # v 2,048 + o 4,096 + MLP 3 x 64 x 128 24,576 + 2 norms 128 = 36,992; x 4 = 147,968;
    # final norm 64: N = 16,384 x 2 + 147,968 + 64 = 180,800. DP 4: 45,200 per rank.
    job = Job(model="llama-tiny", world_size=4, micro_batch_size=1, seq_length=32,
              num_microbatches=1, zero=3, precision="fsdp2", kernels="torch")
    memory = _static(job)
    assert memory.dense_params == 180_800
    assert memory.param_bytes == 4 * 45_200  # fp32 sharded parameters
    assert memory.grad_bytes == 4 * 45_200  # fp32 sharded gradients (reduce_dtype)
    # ... held from the start of the step under torchtitan's default zero_grad(set_to_none=
    # False); with set_to_none (disable_cuda_graphs) made by the first backward (FSDP2's reduce
    # output, tracemem.zero3): then none in the replay's floor
    assert memory.traced_grad_bytes == 0 and memory.held_grad_bytes == memory.grad_bytes
    job = Job(model="llama-tiny", world_size=4, micro_batch_size=1, seq_length=32,
              num_microbatches=1, zero=3, precision="fsdp2", kernels="torch",
              kernel_options={"zero_grad_set_to_none": True})
    freed = _static(job)
    assert freed.traced_grad_bytes == freed.grad_bytes and freed.held_grad_bytes == 0
    assert memory.optimizer_bytes == 8 * 45_200  # AdamW m, v in fp32; no master copy
    assert memory.param_bytes + memory.grad_bytes + memory.optimizer_bytes == 16 * 45_200
    # the bf16 copy of the largest unit while gathered: a decoder layer, 2 x 36,992
    assert memory.zero3_gather_bytes == 2 * 36_992


def test_megatron_recipe_under_zero3_is_still_18_bytes():
    job = Job(model="llama-tiny", world_size=4, micro_batch_size=1, seq_length=32,
              num_microbatches=1, zero=3, kernels="torch")
    memory = _static(job)
    # bf16 params 2 + fp32 main grads 4 + fp32 master and m, v 12 = 18 B per sharded param
    assert memory.param_bytes + memory.grad_bytes + memory.optimizer_bytes == 18 * 45_200
    assert memory.zero3_gather_bytes == 2 * 36_992


def test_pp_with_fsdp2_holds_each_stage_unsharded_on_a_tiny_model():
    # llama-tiny (above) on 4 GPUs, PP 2, DP 2: stage 0 holds the embedding 16,384 and layers
    # 0-1, 2 x 36,992: 90,368 parameters, 45,184 per DP shard. Under PP every FSDP2 unit stays
    # gathered (bf16, 2 B) with an fp32 unsharded gradient accumulator (4 B) through the step
    # (tracemem.zero3 module docstring: torchtitan's default policy, torch's pipelining nosync)
    job = Job(model="llama-tiny", world_size=4, pp=2, micro_batch_size=1, seq_length=32,
              num_microbatches=2, zero=3, precision="fsdp2", kernels="torch")
    memory = _static(job)
    assert memory.dense_params == 90_368
    assert (memory.unsharded_param_bytes, memory.unsharded_grad_bytes) == (2 * 90_368,
                                                                           4 * 90_368)
    assert memory.param_bytes == 4 * 45_184 + 2 * 90_368
    assert memory.grad_bytes == 4 * 45_184 + 4 * 90_368
    assert memory.optimizer_bytes == 8 * 45_184
    assert memory.zero3_gather_bytes == 0
    # Megatron's recipe under PP keeps ZeRO-3's per-unit gathers (a layer, bf16)
    megatron = _static(Job(model="llama-tiny", world_size=4, pp=2, micro_batch_size=1,
                           seq_length=32, num_microbatches=2, zero=3, kernels="torch"))
    assert megatron.unsharded_param_bytes == 0 and megatron.zero3_gather_bytes == 2 * 36_992


def test_a_tied_embedding_and_head_are_one_unit_gathered_once():
    # qwen2-tiny (modeling/families/qwen/presets/qwen2-tiny.json): vocabulary 256 x h 64,
    # tie_word_embeddings true. torchtitan wraps [tok_embeddings, norm, lm_head] as one FSDP2
    # unit (fsdp.py apply_fsdp_to_decoder, enable_weight_tying) that does not reshard after
    # forward: the shared 256 x 64 weight is gathered once (bf16: 32,768 B) at the
    # embedding's forward and held to the end of backward; the head gathers nothing more
    import torch

    from modeling.common.routing import parse_routing
    from modeling.parallel.build import build_rank
    from tracemem.categories import Category, Phase
    from tracemem.tracer import MemoryTracer
    from tracemem.zero3 import Zero3Gathers

    job = Job(model="qwen2-tiny", world_size=2, micro_batch_size=1, seq_length=8,
              num_microbatches=1, zero=3, precision="fsdp2", kernels="torch")
    model = build_rank(job.config, job.parallel, 0, dtype=torch.bfloat16,
                       kernels=job.profile)
    gathers = Zero3Gathers().install(model)
    tracer = MemoryTracer(devices={"meta"})
    tracer.track_external(model)
    with tracer:
        tokens = torch.zeros(1, 8, dtype=torch.long, device="meta")
        model(tokens, tokens, parse_routing("balanced", 0)).backward()
        before_end = [(e.action, e.nbytes) for e in tracer.events
                      if e.category is Category.PARAMETER and e.phase is not Phase.EXTERNAL
                      and e.nbytes == 2 * 256 * 64]
        gathers.end_backward()
    assert before_end == [("alloc", 2 * 256 * 64)]  # once, and alive until end_backward


@pytest.mark.parametrize("fields, match", [
    ({"zero": 1}, "fsdp2 is FSDP2's mixed precision .*use --zero 3"),
    ({"zero": 3, "main_grads_dtype": "bf16"},
     "--main-grads-dtype is a Megatron-LM precision flag; it does not apply to --precision "
     "fsdp2"),
])
def test_fsdp2_refuses_what_is_not_fsdp2(fields, match):
    with pytest.raises(TracememError, match=match):
        Job(model="llama-tiny", world_size=4, micro_batch_size=1, seq_length=32,
            num_microbatches=1, precision="fsdp2", **fields)


# --- torchtitan 0.3.0 configs ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tt():
    pytest.importorskip("torchtitan")
    pytest.importorskip("torchtitan.models.llama3.config_registry")
    from tracemem.frontdoors import torchtitan as front

    return front


def _config(module: str, function: str, ac: str = "none"):
    """The registry function's ``Trainer.Config``, its loss the plain cross entropy (as
    ``llama3_debugmodel_ce_loss`` sets it) and its activation checkpointing None or FullAC
    (the registries' defaults, ChunkedLossWrapper and SelectiveAC, are tested apart)."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.distributed.activation_checkpoint import FullAC

    config = getattr(importlib.import_module(f"torchtitan.models.{module}.config_registry"),
                     function)()
    config.loss = CrossEntropyLoss.Config(global_vocab_size=config.model_spec.model.vocab_size)
    config.activation_checkpoint = FullAC.Config() if ac == "full" else None
    return config


_COMMON = {"cp": 1, "etp": 1, "pp": 1, "zero": 3, "precision": "fsdp2", "kernels": "torch",
           "attention": "flash", "optimizer": "fused"}
_NONE = {"recompute": "none"}
_FULL = {"recompute": "full", "recompute_method": "uniform", "recompute_num_layers": 1}

# (module, function, activation checkpointing, world size, expected Job keywords, expected
# model fields), each value read from the torchtitan 0.3.0 source named in the comment
TABLE = [
    # llama3/config_registry.py llama3_debugmodel_ce_loss: TrainingConfig(local_batch_size=8,
    # seq_len=2048), global -1 -> 8 x DP 8 = 64. llama3/__init__.py _debugmodel: dim 256,
    # n_heads 16, n_layers 6, vocab 2048, FFN compute_ffn_hidden_dim(256, multiple_of=256):
    # int(2 x 4 x 256 / 3) = 682 -> 768; head_dim 256 / 16 = 16, no n_kv_heads: 16
    ("llama3", "llama3_debugmodel_ce_loss", "none", 8,
     {"micro_batch_size": 8, "seq_length": 2048, "global_batch_size": 64, "tp": 1,
      "sp": False, "ep": 1, **_NONE},
     {"model_type": "llama", "vocab_size": 2048, "hidden_size": 256,
      "intermediate_size": 768, "num_layers": 6, "num_attention_heads": 16,
      "num_key_value_heads": 16, "head_dim": 16, "qk_norm": False,
      "tie_word_embeddings": False}),
    # llama3_8b: local_batch_size 1, seq_len 8192; _8b: dim 4096, 32 heads, 8 KV heads,
    # 32 layers, vocab 128,256, FFN compute_ffn_hidden_dim(4096, 1024, 1.3):
    # int(2 x 16384 / 3) = 10922, x 1.3 = 14198 -> 14336; TP 2 from the command line's
    # --parallelism.tensor_parallel_degree (here set on the object), SP on by default:
    # dp_shard -1 = 16 / 2 = 8, G = 1 x 8
    ("llama3", "llama3_8b", "full", 16,
     {"micro_batch_size": 1, "seq_length": 8192, "global_batch_size": 8, "tp": 2,
      "sp": True, "ep": 1, **_FULL},
     {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
      "intermediate_size": 14336, "num_layers": 32, "num_attention_heads": 32,
      "num_key_value_heads": 8, "head_dim": 128}),
    # qwen3/config_registry.py qwen3_debugmodel: TrainingConfig(local_batch_size=8,
    # seq_len=2048) (its defaults); qwen3/__init__.py _debugmodel: dim 256, head_dim 128,
    # 8 layers, vocab 2048, 16 heads, 8 KV heads, hidden_dim 3072, qk-norm,
    # enable_weight_tying=True
    ("qwen3", "qwen3_debugmodel", "full", 4,
     {"micro_batch_size": 8, "seq_length": 2048, "global_batch_size": 32, "tp": 1,
      "sp": False, "ep": 1, **_FULL},
     {"model_type": "qwen3", "vocab_size": 2048, "hidden_size": 256,
      "intermediate_size": 3072, "num_layers": 8, "num_attention_heads": 16,
      "num_key_value_heads": 8, "head_dim": 128, "qk_norm": True,
      "tie_word_embeddings": True}),
    # qwen3_debugmodel_non_fused_qkv: qwen3_debugmodel with model_registry(
    # "debugmodel_non_fused_qkv"): _build_qwen3_layers(fuse_qkv=False, ...), QKVLinear's wq,
    # wk, wv apart (models/common/attention.py): the torch profile's fused_qkv off; n_kv from
    # wkv's 8 x 128 = 1,024 outputs / head_dim 128
    ("qwen3", "qwen3_debugmodel_non_fused_qkv", "full", 4,
     {"micro_batch_size": 8, "seq_length": 2048, "global_batch_size": 32, "tp": 1,
      "sp": False, "ep": 1, "kernel_options": {"fused_qkv": False}, **_FULL},
     {"model_type": "qwen3", "vocab_size": 2048, "hidden_size": 256,
      "intermediate_size": 3072, "num_layers": 8, "num_attention_heads": 16,
      "num_key_value_heads": 8, "head_dim": 128, "qk_norm": True}),
    # qwen3_moe_debug: local_batch_size 4, seq_len 4096, expert_parallel_degree 1 (here 2);
    # _debugmodel_moe: dim 256, head_dim 128, 8 layers (all MoE), 16 / 8 heads,
    # moe_hidden_dim 768, 64 experts, top_k 8, route_norm True
    ("qwen3", "qwen3_moe_debug", "none", 4,
     {"micro_batch_size": 4, "seq_length": 4096, "global_batch_size": 16, "tp": 1,
      "sp": False, "ep": 2, **_NONE},
     {"model_type": "qwen3_moe", "vocab_size": 2048, "hidden_size": 256, "num_layers": 8,
      "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
      "moe_intermediate_size": 768, "num_routed_experts": 64, "num_experts_per_tok": 8,
      "norm_topk_prob": True, "mlp_only_layers": ()}),
    # deepseek_v3/config_registry.py deepseek_v3_debugmodel: local_batch_size 8, seq_len
    # 2048 (defaults); deepseek_v3/__init__.py _debugmodel: dim 256, 6 layers, vocab 2048,
    # 16 heads, q_lora_rank 0 (full-rank wq), kv_lora_rank 512, qk_nope 128, qk_rope 64,
    # v 128, dense_hidden_dim 1024, moe_hidden_dim 256, 8 experts, 2 shared (one FFN of
    # 2 x 256 = 512), 1 dense layer, router top_k 3, softmax; load_balance_coeff set:
    # torchtitan's expert_bias, DeepSeek's noaux_tc correction bias
    ("deepseek_v3", "deepseek_v3_debugmodel", "full", 2,
     {"micro_batch_size": 8, "seq_length": 2048, "global_batch_size": 16, "tp": 1,
      "sp": False, "ep": 1, **_FULL},
     {"model_type": "deepseek_v3", "vocab_size": 2048, "hidden_size": 256,
      "intermediate_size": 1024, "num_layers": 6, "num_attention_heads": 16,
      "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
      "qk_rope_head_dim": 64, "v_head_dim": 128, "moe_intermediate_size": 256,
      "num_routed_experts": 8, "num_shared_experts": 2, "num_experts_per_tok": 3,
      "first_k_dense_replace": 1, "scoring_func": "softmax", "topk_method": "noaux_tc"}),
]


@pytest.mark.parametrize("module, function, ac, world, expected, model", TABLE,
                         ids=[row[1] for row in TABLE])
def test_registry_configs_give_these_jobs(tt, module, function, ac, world, expected, model):
    config = _config(module, function, ac)
    if function == "llama3_8b":
        config.parallelism.tensor_parallel_degree = 2
    if function == "qwen3_moe_debug":
        config.parallelism.expert_parallel_degree = 2
    kwargs = tt.torchtitan_job_kwargs(config, world_size=world)
    cfg = kwargs.pop("model")
    assert kwargs == {"world_size": world, **_COMMON, **expected}
    assert {name: getattr(cfg, name) for name in model} == model
    job = tt.torchtitan_job(config, world_size=world)
    assert job.origin == "torchtitan" and job.parallel.zero == 3
    # M = G / (b x DP): one accumulation step per optimizer step by torchtitan's default
    assert job.microbatches == 1


def test_hsdp_shards_within_a_replica(tt):
    # --parallelism.data_parallel_replicate_degree 2 on 8 GPUs: dp_shard -1 = 8 / 2 = 4
    # (ParallelDims), the batch over replicate x shard = 8 (local 8 -> G 64); FSDP2 shards over
    # the 4 ranks of a replica (llama3/parallelize.py: the ["dp_replicate", "fsdp"] mesh), so
    # the debug model's 6,163,712 parameters are 1,540,928 a rank, 16 B each
    from tracemem.zero3 import Zero3Gathers, fsdp2_group

    config = _config("llama3", "llama3_debugmodel_ce_loss")
    config.parallelism.data_parallel_replicate_degree = 2
    kwargs = tt.torchtitan_job_kwargs(config, world_size=8)
    assert kwargs["num_distributed_optimizer_instances"] == 2
    assert (kwargs["micro_batch_size"], kwargs["global_batch_size"]) == (8, 64)
    job = tt.torchtitan_job(config, world_size=8)
    assert job.parallel.dp == 8 and job.microbatches == 1
    memory = _static(job)
    assert (memory.param_bytes, memory.grad_bytes, memory.optimizer_bytes) == (
        4 * 1_540_928, 4 * 1_540_928, 8 * 1_540_928)
    assert fsdp2_group(job.parallel) == 4
    gathers = Zero3Gathers.for_layout(job.parallel)
    assert (gathers.fsdp2_group, gathers.replicas) == (4, 2)


def test_debug_model_static_memory_is_fsdp2s_16_bytes(tt):
    # llama3 debugmodel (shapes above): embedding 2048 x 256 = 524,288, head 524,288; per
    # layer wqkv 256 x 768 196,608 + wo 65,536 + w1, w2, w3 3 x 196,608 + 2 norms 512 =
    # 852,480, x 6 = 5,114,880; final norm 256: N = 6,163,712; DP 8: 770,464 per rank
    job = tt.torchtitan_job(_config("llama3", "llama3_debugmodel_ce_loss"), world_size=8)
    memory = _static(job)
    assert memory.dense_params == 6_163_712
    assert (memory.param_bytes, memory.grad_bytes, memory.optimizer_bytes) == (
        4 * 770_464, 4 * 770_464, 8 * 770_464)
    assert memory.zero3_gather_bytes == 2 * 852_480  # one layer's bf16 copy


def test_every_field_of_the_pinned_config_classes_is_in_a_table(tt):
    config = _config("llama3", "llama3_debugmodel_ce_loss")
    known = set(tt.HONOURED) | set(tt.NEUTRAL) | set(tt.REFUSED) | set(tt.REFUSED_WHEN)
    missing = []
    for top in dataclasses.fields(config):
        section = getattr(config, top.name)
        if top.name in known or f"{top.name}.*" in known:
            if top.name in ("activation_checkpoint", "loss", "model_spec") or \
                    not dataclasses.is_dataclass(section) or f"{top.name}.*" in known:
                continue
        if not dataclasses.is_dataclass(section):
            missing.append(top.name)
            continue
        missing += [f"{top.name}.{f.name}" for f in dataclasses.fields(section)
                    if f"{top.name}.{f.name}" not in known]
    assert missing == []


def _refused(tt, config, match, world=8):
    with pytest.raises(TracememError, match=match):
        tt.torchtitan_job_kwargs(config, world_size=world)


def test_registry_defaults_selective_ac_and_chunked_loss_are_honoured(tt):
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    # as shipped: activation_checkpoint SelectiveAC.Config() (force_recompute_mm_shapes_by_fqns
    # ["moe.router.gate"]), loss ChunkedLossWrapper.Config(num_chunks=8) around
    # CrossEntropyLoss (llama3/config_registry.py llama3_debugmodel; components/loss.py)
    kwargs = tt.torchtitan_job_kwargs(llama3_debugmodel(), world_size=8)
    assert kwargs["recompute"] == "selective" and kwargs["recompute_modules"] == ("op",)
    assert kwargs["kernel_options"] == {"loss_chunks": 8}
    job = Job(**kwargs)
    assert job.profile.loss_chunks == 8


def test_selective_ac_options_other_than_the_router_gate_are_refused(tt):
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.activation_checkpoint.force_recompute_mm_shapes_by_fqns = ["attention.wq"]
    _refused(tt, config, r"force_recompute_mm_shapes_by_fqns \['attention.wq'\]: not "
                         r"modelled yet")
    from torchtitan.components.loss import MSELoss

    config = llama3_debugmodel()
    config.loss.loss_fn = MSELoss.Config()
    _refused(tt, config, r"--loss.loss_fn MSELoss inside ChunkedLossWrapper")


@pytest.mark.parametrize("section, name, value, match", [
    ("compile", "enable", True, r"--compile.enable True: torch.compile: AOTAutograd's"),
    ("parallelism", "pipeline_parallel_schedule", "ZBVZeroBubble",
     r"pipeline_parallel_schedule ZBVZeroBubble: not modelled yet"),
    ("parallelism", "context_parallel_degree", 2, r"context_parallel_degree 2"),
    ("parallelism", "fsdp_reshard_after_forward", "never", r"never: every block kept"),
    ("training", "dtype", "bfloat16", r"--training.dtype 'bfloat16': not modelled yet"),
    ("training", "enable_cpu_offload", True, r"CPUOffloadPolicy"),
])
def test_fields_that_change_memory_are_refused_by_name(tt, section, name, value, match):
    config = _config("llama3", "llama3_debugmodel_ce_loss")
    setattr(getattr(config, section), name, value)
    if name == "pipeline_parallel_schedule":
        config.parallelism.pipeline_parallel_degree = 2
    _refused(tt, config, match)


def test_pp_with_fsdp2_keeps_the_stage_unsharded_through_the_step(tt):
    # llama3_debugmodel_ce_loss on 4 GPUs, PP 2 (so DP 2), 1F1B, local batch 4 in pipeline
    # microbatches of 1: M = 4. torchtitan's split (_generate_llm_fqn_per_model_part(2, 6, 1,
    # 1)): 8 effective layers, 4 a stage: stage 0 tok_embeddings + layers 0-2, stage 1
    # layers 3-5 + norm + lm_head: pp_layout (3, 3).
    config = _config("llama3", "llama3_debugmodel_ce_loss")
    config.parallelism.pipeline_parallel_degree = 2
    config.parallelism.pipeline_parallel_schedule = "1F1B"
    config.training.local_batch_size = 4
    kwargs = tt.torchtitan_job_kwargs(config, world_size=4)
    assert {k: kwargs[k] for k in ("pp", "vpp", "pp_layout", "schedule", "micro_batch_size",
                                   "num_microbatches", "global_batch_size")} == {
        "pp": 2, "vpp": 1, "pp_layout": (3, 3), "schedule": "1f1b", "micro_batch_size": 1,
        "num_microbatches": 4, "global_batch_size": None}
    job = tt.torchtitan_job(config, world_size=4)
    memory = _static(job)  # stage 0 (rank 0)
    # stage 0: embedding 524,288 + 3 layers x 852,480 = 3,081,728 parameters; DP 2 shards
    # 1,540,864. Held through the step: the fp32 shards (4 B) and their fp32 sharded
    # gradients (4 B), plus every unit unsharded in bf16 (2 B x 3,081,728) and its fp32
    # unsharded gradient accumulator (4 B x 3,081,728); nothing gathered per unit
    assert memory.dense_params == 3_081_728
    assert memory.unsharded_param_bytes == 2 * 3_081_728
    assert memory.unsharded_grad_bytes == 4 * 3_081_728
    assert memory.param_bytes == 4 * 1_540_864 + 2 * 3_081_728
    assert memory.grad_bytes == 4 * 1_540_864 + 4 * 3_081_728
    assert memory.optimizer_bytes == 8 * 1_540_864
    assert memory.zero3_gather_bytes == 0


def test_a_converted_linear_is_refused_by_its_class(tt):
    from torchtitan.models.common.linear import Linear

    class Float8Linear:  # stands for torchao's converted linear config (needs torchao)
        @dataclasses.dataclass(kw_only=True)
        class Config(Linear.Config):
            pass

    Float8Linear.Config.__qualname__ = "Float8Linear.Config"
    config = _config("llama3", "llama3_debugmodel_ce_loss")
    wo = config.model_spec.model.layers[0].attention.wo
    config.model_spec.model.layers[0].attention.wo = Float8Linear.Config(
        in_features=wo.in_features, out_features=wo.out_features, bias=False)
    _refused(tt, config, r"model.layers\[0\].attention.wo is a Float8Linear.Config")


def test_degrees_must_fill_the_world(tt):
    config = _config("llama3", "llama3_debugmodel_ce_loss")
    config.parallelism.tensor_parallel_degree = 3
    _refused(tt, config, r"dp_replicate\(1\) \* tp\(3\) \* cp\(1\) \* pp\(1\) = 3 does not "
                         r"divide world_size\(8\)")


def test_cli_static_reads_a_torchtitan_job(tt, capsys):
    from tracemem.cli import main

    code = main(["static", "--world-size", "8", "--json", "--torchtitan-module", "llama3",
                 "--torchtitan-config", "llama3_debugmodel_ce_loss",
                 "--training.local-batch-size", "2", "activation-checkpoint:none"])
    out = capsys.readouterr().out
    assert code == 0
    stage = json.loads(out)["stages"][0]
    # the debug model's 770,464 parameters per rank (above), 16 B each
    assert stage["param_bytes"] + stage["grad_bytes"] + stage["optimizer_bytes"] == \
        16 * 770_464


@pytest.mark.parametrize("name, value, match", [
    ("data_parallel_replicate_degree", 0, r"data_parallel_replicate_degree 0: torchtitan "
                                          r"requires >= 1"),
    ("data_parallel_replicate_degree", -1, r"requires >= 1"),
    ("tensor_parallel_degree", 0, r"tensor_parallel_degree 0: torchtitan requires >= 1"),
    ("data_parallel_shard_degree", 0, r"requires -1 or >= 1"),
])
def test_degrees_below_one_are_refused_as_torchtitan_does(tt, name, value, match):
    # torchtitan 0.3.0 distributed/parallel_dims.py ParallelDims._validate
    config = _config("llama3", "llama3_debugmodel_ce_loss")
    setattr(config.parallelism, name, value)
    _refused(tt, config, match)


def test_an_unknown_config_function_names_the_closest_in_one_short_line(tt):
    from tracemem.frontdoors.torchtitan import torchtitan_config

    with pytest.raises(TracememError) as info:
        torchtitan_config("llama3", "llama3_debugmode")
    message = str(info.value)
    # torchtitan lists every public name of the registry module; the error keeps the closest
    assert "closest: llama3_debugmodel," in message and "names in the registry)" in message
    assert "'cast'" not in message and "\n" not in message and len(message) < 300


def test_a_parallel_degree_over_a_torchtitan_job_is_torchtitans_flag(tt, capsys):
    # tracemem's --tp would keep the global batch and leave SP off; torchtitan's own flag
    # gives TP with sequence parallelism and the local batch per DP rank
    from tracemem.cli import main

    code = main(["estimate", "--world-size", "8", "--tp", "2", "--torchtitan-module",
                 "llama3", "--torchtitan-config", "llama3_debugmodel_ce_loss"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "give torchtitan's own --parallelism.tensor_parallel_degree" in err
