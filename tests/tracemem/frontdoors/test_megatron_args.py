"""Megatron-LM arguments -> Job keywords (tracemem.frontdoors.megatron), field by field.

Reference: Megatron-LM d98e8a6 (NVIDIA/Megatron-LM, 2026-08-22), read by hand:
megatron/training/arguments.py (defaults: LayerNorm, GELU, learned absolute positions, biases,
dropout 0.1, --make-vocab-size-divisible-by 128; validate_args: ffn_hidden_size 4h or
int(4h * 2 / 3 / 64) * 64 with --swiglu, kv_channels h / heads, G = b x DP when
--global-batch-size is absent, SP off at TP 1, ETP defaults to TP, the virtual-pipeline
block), megatron/core/transformer/pipeline_parallel_layer_layout.py (the layout grammar),
megatron/core/transformer/transformer_block.py get_num_layers_to_build (uneven stages),
megatron/core/models/gpt/gpt_layer_specs.py (--moe-layer-freq; MTP follows the last layer),
megatron/core/transformer/moe/moe_utils.py (sigmoid scores renormalised, softmax not),
megatron/core/transformer/moe/moe_layer.py MoELayer.forward (MoE with TP needs SP),
megatron/core/tokenizers/utils/build_tokenizer.py (the vocabulary padded to a multiple of
make_vocab_size_divisible_by x TP), tests/functional_tests/shell_test_utils/_run_training.sh
(how MODEL_ARGS become a command line). The three model_config.yaml files under data/ are
copied unchanged from Megatron-LM's tests/functional_tests/test_cases at that commit (each
names its source). Every expected value below is written out by hand from those sources; M =
G / (b x DP) with DP = world / (TP x CP x PP).
"""

import dataclasses
from pathlib import Path

import pytest

from tracemem.errors import TracememError
from tracemem.frontdoors import (expand_megatron_args, megatron_args_from_yaml,
                                 megatron_flag_changes, megatron_job_kwargs,
                                 megatron_job, parse_megatron_args, to_megatron_args)

DATA = Path(__file__).parent / "data"

# A Megatron GPT job's keywords where its arguments leave Megatron's defaults
BASE_JOB = dict(
    num_microbatches=None, tp=1, sp=False, cp=1, ep=1, etp=1, pp=1, vpp=1, pp_layout=None,
    pp_first_stage_layers=None, pp_last_stage_layers=None,
    account_for_embedding_in_pipeline_split=False, account_for_loss_in_pipeline_split=False,
    zero=0, precision="megatron", plan="megatron", use_precision_aware_optimizer=False,
    main_grads_dtype="fp32", main_params_dtype="fp32", exp_avg_dtype="fp32",
    exp_avg_sq_dtype="fp32", grad_reduce_in_bf16=False, store_param_remainders=True,
    gradient_accumulation_fusion=True, num_distributed_optimizer_instances=1,
    schedule="1f1b", recompute="none",
    recompute_modules=("core_attn",), recompute_method="uniform", recompute_num_layers=1,
    attention="flash", experts="auto", kernels="megatron-te",
    kernel_options={"moe_shared_expert_overlap": False, "gradient_accumulation_fusion": True,
                    "cross_entropy_fusion": "none", "masked_softmax_fusion": True},
    routing="balanced", optimizer="fused", deallocate_pipeline_outputs=True,
    overlap_p2p_comm=True, create_attention_mask_in_dataloader=True, alloc_conf=None,
    cublas_workspace_config=None, distribute_saved_activations=False,
    make_vocab_size_divisible_by=128, origin="megatron")
# ... and of its GPTModel (the dense ModelConfig defaults where Megatron has no say)
BASE_MODEL = dict(
    name="megatron-lm arguments", model_type="gpt", attention="gqa", rms_norm_eps=1e-5,
    tie_word_embeddings=True, dtype="bfloat16", normalization="layernorm",
    position_embedding="learned_absolute", hidden_dropout=0.1, attention_dropout=0.1,
    qk_norm=False, qkv_bias=True, o_bias=True, partial_rotary_factor=1.0, rope_theta=10000.0,
    q_lora_rank=None, kv_lora_rank=None, qk_nope_head_dim=None, qk_rope_head_dim=None,
    v_head_dim=None, mla_latent_norms=True, hidden_act="gelu", gated_mlp=False, mlp_bias=True,
    moe_intermediate_size=0, num_routed_experts=0, num_shared_experts=0,
    num_experts_per_tok=0, first_k_dense_replace=0, moe_layer_freq=1, num_expert_groups=1,
    topk_group=1, scoring_func="softmax", topk_method="greedy", norm_topk_prob=False,
    routed_scaling_factor=1.0, num_mtp_modules=0, router_pre_softmax=True, router_gather=True,
    shared_expert_intermediate_size=0, shared_expert_gate=False, mlp_only_layers=(),
    moe_layer_offset=0)
KERNELS = BASE_JOB["kernel_options"]

GPT2 = ("--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 "
        "--max-position-embeddings 1024 --micro-batch-size 8 --bf16 --tokenizer-type "
        "NullTokenizer --vocab-size 50257 --lr 6e-4 --train-iters 1000 --data-path /data/owt "
        "--save /ckpt --save-interval 1000 --log-interval 10").split()
LLAMA = ("--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
         "--group-query-attention --num-query-groups 8 --kv-channels 128 --swiglu "
         "--normalization RMSNorm --norm-epsilon 1e-5 --position-embedding-type rope "
         "--rotary-base 500000 --disable-bias-linear --untie-embeddings-and-output-weights "
         "--hidden-dropout 0 --attention-dropout 0 --seq-length 8192 "
         "--max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 128 "
         "--tensor-model-parallel-size 4 --sequence-parallel --pipeline-model-parallel-size 2 "
         "--use-distributed-optimizer --recompute-granularity full --recompute-method uniform "
         "--recompute-num-layers 1 --bf16 --tokenizer-type HuggingFaceTokenizer "
         "--tokenizer-model meta-llama/Meta-Llama-3-8B --cross-entropy-loss-fusion "
         "--cross-entropy-fusion-impl native --grad-reduce-in-bf16").split()
DEEPSEEK_TINY = [
    *"--num-layers 6 --hidden-size 256 --num-attention-heads 8 --multi-latent-attention "
     "--q-lora-rank 128 --kv-lora-rank 64 --qk-head-dim 32 --qk-pos-emb-head-dim 16 "
     "--v-head-dim 32 --qk-layernorm --ffn-hidden-size 1024 --swiglu --normalization RMSNorm "
     "--norm-epsilon 1e-6 --position-embedding-type rope --disable-bias-linear "
     "--untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0 "
     "--num-experts 8 --moe-layer-freq".split(), "([0]*1+[1]*5)",
    *"--moe-ffn-hidden-size 128 --moe-shared-expert-intermediate-size 128 --moe-router-topk 2 "
     "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
     "--moe-router-topk-scaling-factor 2.5 --moe-router-num-groups 4 --moe-router-group-topk 2 "
     "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 "
     "--moe-token-dispatcher-type alltoall --moe-grouped-gemm --moe-permute-fusion "
     "--moe-router-dtype fp32 --mtp-num-layers 1 --pipeline-model-parallel-size 2 "
     "--pipeline-model-parallel-layout".split(), "Et|(tt|)*2t,mL",
    *"--expert-model-parallel-size 4 --expert-tensor-parallel-size 1 "
     "--use-distributed-optimizer --seq-length 512 --max-position-embeddings 512 "
     "--micro-batch-size 1 --global-batch-size 16 --bf16 --vocab-size 1024 --tokenizer-type "
     "NullTokenizer --recompute-granularity selective --recompute-modules mla_up_proj "
     "layernorm moe".split()]
MIXTRAL = ("--num-layers 4 --hidden-size 512 --ffn-hidden-size 1792 --num-attention-heads 8 "
           "--group-query-attention --num-query-groups 4 --swiglu --normalization RMSNorm "
           "--position-embedding-type rope --rotary-base 1000000 --disable-bias-linear "
           "--untie-embeddings-and-output-weights --hidden-dropout 0.0 --attention-dropout 0.0 "
           "--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss "
           "--moe-aux-loss-coeff 1e-2 --moe-token-dispatcher-type alltoall --moe-grouped-gemm "
           "--moe-permute-fusion --tensor-model-parallel-size 2 --sequence-parallel "
           "--expert-model-parallel-size 4 --expert-tensor-parallel-size 1 --seq-length 4096 "
           "--max-position-embeddings 32768 --micro-batch-size 1 --global-batch-size 64 --bf16 "
           "--vocab-size 32000 --tokenizer-type NullTokenizer --use-distributed-optimizer "
           "--overlap-grad-reduce --overlap-param-gather --recompute-granularity selective "
           "--recompute-modules core_attn moe").split()
FSDP = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 "
        "--max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 32 --bf16 "
        "--vocab-size 1000 --tokenizer-type NullTokenizer --use-megatron-fsdp "
        "--data-parallel-sharding-strategy optim_grads --ckpt-format fsdp_dtensor "
        "--use-distributed-optimizer --use-precision-aware-optimizer --exp-avg-dtype bf16 "
        "--exp-avg-sq-dtype bf16 --untie-embeddings-and-output-weights").split()
ACCOUNTED = ("--num-layers 14 --hidden-size 256 --num-attention-heads 4 "
             "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 2 "
             "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split "
             "--seq-length 512 --max-position-embeddings 512 --micro-batch-size 1 "
             "--global-batch-size 8 --bf16 --vocab-size 5000 --tokenizer-type NullTokenizer "
             "--swiglu --position-embedding-type rope --rotary-percent 0.5 --normalization "
             "RMSNorm --disable-bias-linear").split()
CONTEXT = ("--num-layers 2 --hidden-size 512 --num-attention-heads 8 --squared-relu "
           "--qk-layernorm --position-embedding-type none --context-parallel-size 2 "
           "--cp-comm-type allgather --tensor-model-parallel-size 2 --sequence-parallel "
           "--seq-length 4096 --max-position-embeddings 4096 --micro-batch-size 1 --bf16 "
           "--tokenizer-type NullTokenizer --vocab-size 32000 --padded-vocab-size 32768 "
           "--hidden-dropout 0.0 --attention-dropout 0.0").split()
UNEVEN_VPP = ("--num-layers 12 --hidden-size 256 --num-attention-heads 4 "
              "--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 "
              "--decoder-first-pipeline-num-layers 2 --decoder-last-pipeline-num-layers 2 "
              "--seq-length 256 --max-position-embeddings 256 --micro-batch-size 1 "
              "--global-batch-size 4 --bf16 --vocab-size 1000 --tokenizer-type "
              "NullTokenizer").split()
QKV_BIAS = ("--num-layers 2 --hidden-size 128 --num-attention-heads 2 --disable-bias-linear "
            "--add-qkv-bias --recompute-activations --seq-length 128 --max-position-embeddings "
            "128 --micro-batch-size 2 --bf16 --tokenizer-type NullTokenizer --vocab-size 1000 "
            "--padded-vocab-size 1024 --decrease-batch-size-if-needed --global-batch-size "
            "7").split()

DEEPSEEK_ROUTER = dict(  # sigmoid, expert bias, group-limited (the DeepSeek-V3 recipe)
    scoring_func="sigmoid", norm_topk_prob=True, router_pre_softmax=True, router_gather=True,
    topk_method="noaux_tc")

# (id, argv or a YAML file, megatron_job_kwargs keywords, Job fields, ModelConfig fields)
CASES = [
    ("yaml-mla-moe-mtp", "mla_moe_mtp_memory_speed.yaml",
     dict(world_size=16, vocab_size=50257),
     # DP = 16 / (2 x 1 x 2) = 4; M = 32 / (4 x 4) = 2
     dict(world_size=16, micro_batch_size=4, seq_length=4096, global_batch_size=32, tp=2,
          sp=True, pp=2, vpp=4, ep=4, etp=1, zero=1, schedule="interleaved-1f1b",
          attention="unfused", experts="grouped",
          kernel_options=KERNELS | {"cross_entropy_fusion": "native",
                                    # the yaml's --moe-permute-fusion, --moe-token-
                                    # dispatcher-type alltoall, --moe-router-dtype fp32
                                    "moe_permute_fusion": True,
                                    "moe_token_dispatcher": "alltoall",
                                    "moe_router_dtype": "fp32"},
          alloc_conf="expandable_segments:True", make_vocab_size_divisible_by=3232),
     dict(vocab_size=50257, hidden_size=1024, intermediate_size=4096, num_layers=16,
          num_attention_heads=32, num_key_value_heads=32, attention="mla", rms_norm_eps=1e-6,
          max_position_embeddings=4096, tie_word_embeddings=False, normalization="rmsnorm",
          position_embedding="rope", hidden_dropout=0.0, attention_dropout=0.0, head_dim=None,
          qkv_bias=False, o_bias=False, mlp_bias=False, q_lora_rank=1536, kv_lora_rank=512,
          qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, hidden_act="silu",
          gated_mlp=True, moe_intermediate_size=1024, num_routed_experts=32,
          num_shared_experts=1, shared_expert_intermediate_size=1024, num_experts_per_tok=4,
          first_k_dense_replace=1, num_expert_groups=4, topk_group=2,
          routed_scaling_factor=2.0, num_mtp_modules=1, **DEEPSEEK_ROUTER)),
    ("yaml-gpt-7b", "gpt3_7b_memory_speed.yaml", dict(world_size=8),
     # 32 layers / PP 4 = 8 per rank / 1 per virtual stage: VPP 8; DP 2, M = 8 / 2 = 4
     dict(world_size=8, micro_batch_size=1, seq_length=8192, global_batch_size=8, pp=4, vpp=8,
          zero=1, schedule="interleaved-1f1b", gradient_accumulation_fusion=False,
          kernel_options=KERNELS | {"gradient_accumulation_fusion": False},
          cublas_workspace_config=":4096:8"),  # the yaml's ENV_VARS
     dict(vocab_size=131073, hidden_size=4096, intermediate_size=16384, num_layers=32,
          num_attention_heads=32, num_key_value_heads=8, head_dim=128,
          max_position_embeddings=8192, tie_word_embeddings=False)),
    ("yaml-gpt-uneven", "gpt3_uneven_pipeline.yaml", dict(world_size=8, vocab_size=50257),
     dict(world_size=8, micro_batch_size=4, seq_length=1024, global_batch_size=32, pp=4,
          pp_first_stage_layers=2, pp_last_stage_layers=2, attention="unfused",
          gradient_accumulation_fusion=False,
          kernel_options=KERNELS | {"gradient_accumulation_fusion": False},
          cublas_workspace_config=":4096:8"),
     dict(vocab_size=50257, hidden_size=512, intermediate_size=2048, num_layers=12,
          num_attention_heads=8, num_key_value_heads=8, head_dim=64,
          max_position_embeddings=1024, tie_word_embeddings=False)),
    ("gpt2-small", GPT2, dict(world_size=64),
     # no --global-batch-size: G = b x DP, one microbatch
     dict(world_size=64, micro_batch_size=8, seq_length=1024, global_batch_size=None,
          num_microbatches=1),
     dict(vocab_size=50257, hidden_size=768, intermediate_size=3072, num_layers=12,
          num_attention_heads=12, num_key_value_heads=12, head_dim=64,
          max_position_embeddings=1024)),
    ("llama-3-8b", LLAMA, dict(world_size=64, vocab_size=128256),
     # DP = 64 / (4 x 2) = 8; M = 128 / 8 = 16
     dict(world_size=64, micro_batch_size=1, seq_length=8192, global_batch_size=128, tp=4,
          sp=True, pp=2, zero=1, recompute="full", grad_reduce_in_bf16=True,
          kernel_options=KERNELS | {"cross_entropy_fusion": "native"}),
     dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
          num_attention_heads=32, num_key_value_heads=8, head_dim=128,
          max_position_embeddings=8192, tie_word_embeddings=False, normalization="rmsnorm",
          position_embedding="rope", rope_theta=500000.0, hidden_dropout=0.0,
          attention_dropout=0.0, qkv_bias=False, o_bias=False, mlp_bias=False,
          hidden_act="silu", gated_mlp=True)),
    ("deepseek-tiny-layout", DEEPSEEK_TINY, dict(world_size=8),
     # "Et|(tt|)*2t,mL": [E t] [t t] [t t] [t m L] on PP 2: VPP 2; DP 4, M = 16 / 4 = 4
     dict(world_size=8, micro_batch_size=1, seq_length=512, global_batch_size=16, pp=2,
          vpp=2, pp_layout=(1, 2, 2, 1), ep=4, etp=1, zero=1, schedule="interleaved-1f1b",
          recompute="selective", recompute_modules=("mla_up_proj", "layernorm", "moe"),
          experts="grouped", kernel_options=KERNELS | {
              "moe_permute_fusion": True, "moe_token_dispatcher": "alltoall",
              "moe_router_dtype": "fp32"}),
     dict(vocab_size=1024, hidden_size=256, intermediate_size=1024, num_layers=6,
          num_attention_heads=8, num_key_value_heads=8, attention="mla", rms_norm_eps=1e-6,
          max_position_embeddings=512, tie_word_embeddings=False, normalization="rmsnorm",
          position_embedding="rope", hidden_dropout=0.0, attention_dropout=0.0, head_dim=None,
          qkv_bias=False, o_bias=False, mlp_bias=False, q_lora_rank=128, kv_lora_rank=64,
          qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, hidden_act="silu",
          gated_mlp=True, moe_intermediate_size=128, num_routed_experts=8,
          num_shared_experts=1, shared_expert_intermediate_size=128, num_experts_per_tok=2,
          first_k_dense_replace=1, num_expert_groups=4, topk_group=2,
          routed_scaling_factor=2.5, num_mtp_modules=1, **DEEPSEEK_ROUTER)),
    ("mixtral-style", MIXTRAL, dict(world_size=16),
     # DP = 16 / 2 = 8, M = 64 / 8 = 8; softmax after the top-k (no --moe-router-pre-softmax)
     dict(world_size=16, micro_batch_size=1, seq_length=4096, global_batch_size=64, tp=2,
          sp=True, ep=4, etp=1, zero=1, recompute="selective",
          recompute_modules=("core_attn", "moe"), experts="grouped",
          # no --moe-router-dtype: the router's logits in the activations' dtype
          kernel_options=KERNELS | {"moe_permute_fusion": True,
                                    "moe_token_dispatcher": "alltoall",
                                    "moe_router_dtype": "input"}),
     dict(vocab_size=32000, hidden_size=512, intermediate_size=1792, num_layers=4,
          num_attention_heads=8, num_key_value_heads=4, head_dim=64,
          max_position_embeddings=32768, tie_word_embeddings=False, normalization="rmsnorm",
          position_embedding="rope", rope_theta=1000000.0, hidden_dropout=0.0,
          attention_dropout=0.0, qkv_bias=False, o_bias=False, mlp_bias=False,
          hidden_act="silu", gated_mlp=True, moe_intermediate_size=1792, num_routed_experts=8,
          num_experts_per_tok=2, router_pre_softmax=False, router_gather=False,
          routed_scaling_factor=None)),
    ("megatron-fsdp", FSDP, dict(world_size=8),
     # DP 8, M = 32 / (2 x 8) = 2; optim_grads is ZeRO-2
     dict(world_size=8, micro_batch_size=2, seq_length=256, global_batch_size=32, zero=2,
          use_precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"),
     dict(vocab_size=1000, hidden_size=256, intermediate_size=1024, num_layers=4,
          num_attention_heads=4, num_key_value_heads=4, head_dim=64,
          max_position_embeddings=256, tie_word_embeddings=False)),
    ("accounted-vpp", ACCOUNTED, dict(world_size=4),
     # (14 + 2) / PP 4 = 4 per rank / 2 per virtual stage: VPP 2; DP 1, M 8;
     # SwiGLU width int(4 x 256 x 2 / 3 / 64) x 64 = 10 x 64 = 640
     dict(world_size=4, micro_batch_size=1, seq_length=512, global_batch_size=8, pp=4, vpp=2,
          account_for_embedding_in_pipeline_split=True,
          account_for_loss_in_pipeline_split=True, schedule="interleaved-1f1b"),
     dict(vocab_size=5000, hidden_size=256, intermediate_size=640, num_layers=14,
          num_attention_heads=4, num_key_value_heads=4, head_dim=64,
          max_position_embeddings=512, normalization="rmsnorm", position_embedding="rope",
          partial_rotary_factor=0.5, qkv_bias=False, o_bias=False, mlp_bias=False,
          hidden_act="silu", gated_mlp=True)),
    ("context-parallel", CONTEXT, dict(world_size=8),
     # DP = 8 / (2 x 2) = 2; --padded-vocab-size is used as given (no padding)
     dict(world_size=8, micro_batch_size=1, seq_length=4096, global_batch_size=None,
          num_microbatches=1, tp=2, sp=True, cp=2, make_vocab_size_divisible_by=None),
     dict(vocab_size=32768, hidden_size=512, intermediate_size=2048, num_layers=2,
          num_attention_heads=8, num_key_value_heads=8, head_dim=64,
          max_position_embeddings=4096, position_embedding="none", qk_norm=True,
          hidden_act="squared_relu", hidden_dropout=0.0, attention_dropout=0.0)),
    ("uneven-vpp", UNEVEN_VPP, dict(world_size=4),
     # ranks hold 2, (12 - 4) / 2 = 4, 4, 2 layers, halved per virtual stage, in virtual-stage
     # order v = chunk x PP + rank: 1 2 2 1 | 1 2 2 1
     dict(world_size=4, micro_batch_size=1, seq_length=256, global_batch_size=4, pp=4, vpp=2,
          pp_layout=(1, 2, 2, 1, 1, 2, 2, 1), schedule="interleaved-1f1b"),
     dict(vocab_size=1000, hidden_size=256, intermediate_size=1024, num_layers=12,
          num_attention_heads=4, num_key_value_heads=4, head_dim=64,
          max_position_embeddings=256)),
    ("qkv-bias-selective", QKV_BIAS, dict(world_size=2),
     # G 7 rounded down to a multiple of b x DP = 4: 4, M = 1
     dict(world_size=2, micro_batch_size=2, seq_length=128, global_batch_size=4,
          recompute="selective", make_vocab_size_divisible_by=None),
     dict(vocab_size=1024, hidden_size=128, intermediate_size=512, num_layers=2,
          num_attention_heads=2, num_key_value_heads=2, head_dim=64,
          max_position_embeddings=128, qkv_bias=True, o_bias=False, mlp_bias=False)),
]


def _argv_env(source):
    if isinstance(source, str):
        return megatron_args_from_yaml(DATA / source)
    return list(source), {}


def _kwargs(case):
    _, source, call, _, _ = case
    argv, env = _argv_env(source)
    return argv, megatron_job_kwargs(argv, env=env, **call)


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_megatron_arguments_give_these_job_keywords_field_by_field(case):
    _, _, _, job, model = case
    argv, kwargs = _kwargs(case)
    expected = BASE_JOB | job
    got = {key: value for key, value in kwargs.items() if key not in ("model", "megatron_args")}
    assert got == expected
    assert kwargs["megatron_args"] == tuple(argv)
    assert dataclasses.asdict(kwargs["model"]) == BASE_MODEL | model


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_the_keywords_make_a_valid_job(case):
    from tracemem.job import Job

    _, kwargs = _kwargs(case)
    job = Job(**kwargs)
    assert job.origin == "megatron"
    if kwargs["global_batch_size"] is not None:
        assert job.global_batch == kwargs["global_batch_size"]


def test_the_vocabulary_pads_to_a_multiple_of_divisible_by_times_tp():
    # build_tokenizer.py vocab_size_with_padding: ceil(V / (divisible_by x TP)) x it
    from tracemem.job import Job

    _, kwargs = _kwargs(CASES[1])  # 131073, divisible by 128, TP 1
    assert Job(**kwargs).config.vocab_size == 131200  # 1025 x 128
    _, kwargs = _kwargs(CASES[0])  # 50257, 3232 x TP 2 = 6464
    assert Job(**kwargs).config.vocab_size == 51712  # 8 x 6464
    _, kwargs = _kwargs(CASES[4])  # 128256, 128 x TP 4 = 512
    assert Job(**kwargs).config.vocab_size == 128512  # 251 x 512


def test_the_microbatches_follow_from_the_global_batch():
    from tracemem.job import Job

    expected = {"yaml-mla-moe-mtp": 2, "yaml-gpt-7b": 4, "yaml-gpt-uneven": 4, "gpt2-small": 1,
                "llama-3-8b": 16, "deepseek-tiny-layout": 4, "mixtral-style": 8,
                "megatron-fsdp": 2, "accounted-vpp": 8, "context-parallel": 1,
                "uneven-vpp": 4, "qkv-bias-selective": 1}
    for case in CASES:
        _, kwargs = _kwargs(case)
        assert Job(**kwargs).microbatches == expected[case[0]], case[0]


def test_an_argument_file_holds_several_arguments_to_a_line_with_quotes_and_comments(tmp_path):
    inner = tmp_path / "parallel.args"
    inner.write_text("# parallel sizes\n--tensor-model-parallel-size 4 --sequence-parallel\n"
                     "--pipeline-model-parallel-size 2   # two stages\n")
    outer = tmp_path / "llama.args"
    lines = [" ".join(LLAMA[:20]), f"@{inner}", "# the rest",
             " ".join(f"'{t}'" for t in LLAMA[20:])]
    outer.write_text("\n".join(lines) + "\n")
    argv = ["--log-interval", "1", f"@{outer}"]
    expanded = expand_megatron_args(argv)
    assert expanded == ["--log-interval", "1", *LLAMA[:20], "--tensor-model-parallel-size", "4",
                        "--sequence-parallel", "--pipeline-model-parallel-size", "2",
                        *LLAMA[20:]]
    kwargs = megatron_job_kwargs(argv, world_size=64, vocab_size=128256)
    _, direct = _kwargs(CASES[4])
    assert kwargs["megatron_args"] == tuple(expanded)
    assert {k: v for k, v in kwargs.items() if k != "megatron_args"} == \
        {k: v for k, v in direct.items() if k != "megatron_args"}


def test_a_missing_argument_file_is_one_line():
    with pytest.raises(TracememError, match=r"^@/no/such\.args: no such Megatron-LM argument "
                                            r"file$"):
        expand_megatron_args(["--bf16", "@/no/such.args"])


def test_model_config_yaml_becomes_the_runners_command_line():
    # _run_training.sh: true -> the bare flag; [a b] -> two values; (..) one quoted value
    argv, env = megatron_args_from_yaml(DATA / "mla_moe_mtp_memory_speed.yaml")
    assert argv[:4] == ["--distributed-timeout-minutes", "60", "--tensor-model-parallel-size",
                        "2"]
    assert "--use-distributed-optimizer" in argv and "true" not in argv
    assert argv[argv.index("--moe-layer-freq") + 1] == "([0]*1+[1]*15)"
    assert argv[argv.index("--norm-epsilon") + 1] == "1e-6"  # as written, not a float
    assert argv[argv.index("--lr-warmup-fraction") + 1] == ".01"
    assert argv[argv.index("--save") + 1] == "${CHECKPOINT_SAVE_PATH}"
    assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
                   "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                   "NCCL_NVLS_ENABLE": "0", "PYTHONWARNINGS": "ignore",
                   "NCCL_DEBUG": "VERSION"}


def test_a_bracketed_yaml_value_is_split_and_false_leaves_the_flag_out(tmp_path):
    path = tmp_path / "model_config.yaml"
    path.write_text("MODEL_ARGS:\n  --recompute-granularity: selective\n"
                    '  --recompute-modules: "[layernorm mlp]"\n  --swiglu: false\n'
                    "  --bf16: true\n  --tokenizer-model: ''\n")
    assert megatron_args_from_yaml(path) == (
        ["--recompute-granularity", "selective", "--recompute-modules", "layernorm", "mlp",
         "--bf16"], {})


def test_parse_keeps_megatrons_defaults():
    ns = parse_megatron_args(["--num-layers", "2"])
    assert (ns.num_layers, ns.hidden_dropout, ns.make_vocab_size_divisible_by,
            ns.attention_backend, ns.moe_token_dispatcher_type, ns.normalization,
            ns.position_embedding_type, ns.add_bias_linear) == (
        2, 0.1, 128, "auto", "allgather", "LayerNorm", "learned_absolute", True)


# ---- refusals -------------------------------------------------------------------------------

def _tiny(*extra, moe=False):
    base = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 "
            "--max-position-embeddings 256 --micro-batch-size 1 --bf16 --vocab-size 1000 "
            "--tokenizer-type NullTokenizer").split()
    if moe:
        base += ("--num-experts 4 --swiglu --disable-bias-linear --moe-grouped-gemm "
                 "--moe-permute-fusion --moe-token-dispatcher-type alltoall").split()
    return base + list(extra)


def test_a_refused_flag_is_refused_by_name_with_what_is_missing():
    with pytest.raises(TracememError, match=r"--softmax-type off-by-one: not modelled "
                                            r"yet: off-by-one and learnable softmax"):
        megatron_job_kwargs(_tiny("--softmax-type", "off-by-one"), world_size=1)


def test_the_p2p_overlap_is_honoured_in_the_interleaved_schedule():
    # Megatron-LM's default (arguments.py: --no-overlap-p2p-communication, store_false)
    vpp = ("--num-layers", "8", "--pipeline-model-parallel-size", "4",
           "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "4")
    on = megatron_job_kwargs(_tiny(*vpp), world_size=4)
    off = megatron_job_kwargs(_tiny(*vpp, "--no-overlap-p2p-communication"), world_size=4)
    assert (on["schedule"], on["vpp"], on["overlap_p2p_comm"]) == ("interleaved-1f1b", 2, True)
    assert off["overlap_p2p_comm"] is False
    # the estimator's pipeline tensors of the last rank: the steady step's backward holds the
    # next forward's received input with the overlap, [s, b, h] = 256 x 1 x 256 bf16 more
    from tracemem.estimator import _interleaved_refs
    from tracemem.job import Job

    refs = {flag: _interleaved_refs(Job(**kwargs), 3) for flag, kwargs in (("on", on),
                                                                            ("off", off))}
    step = next(s for s in refs["on"] if "B" in s)  # the first backward (steady)
    assert (sum(n for _, n in refs["on"][step]) - sum(n for _, n in refs["off"][step])
            == 256 * 1 * 256 * 2)


def test_te_cpu_offloading_is_honoured_and_its_v1_path_refused():
    kwargs = megatron_job_kwargs(_tiny("--cpu-offloading-num-layers", "2",
                                       "--cpu-offloading-retain-pinned-cpu-buffers"),
                                 world_size=1)
    assert kwargs["cpu_offloading_num_layers"] == 2
    assert "cpu_offloading_num_layers" not in megatron_job_kwargs(_tiny(), world_size=1)
    # TE's v1 path: refused by the Job whoever sets N (the job's flag or one over it), and
    # not refused when N is 0 in the end
    v1 = {"NVTE_CPU_OFFLOAD_V1": "1"}
    with pytest.raises(TracememError, match=r"^--cpu-offloading-num-layers with "
                                            r"NVTE_CPU_OFFLOAD_V1=1 is not modelled"):
        megatron_job(_tiny("--cpu-offloading-num-layers", "2"), world_size=1, env=v1)
    with pytest.raises(TracememError, match=r"NVTE_CPU_OFFLOAD_V1=1 is not modelled"):
        megatron_job(_tiny(), world_size=1, env=v1, cpu_offloading_num_layers=2)
    assert megatron_job(_tiny("--cpu-offloading-num-layers", "2"), world_size=1, env=v1,
                        cpu_offloading_num_layers=0).cpu_offloading_num_layers == 0
    # and the job's Megatron arguments keep it
    from tracemem.frontdoors.megatron import to_megatron_args

    args = to_megatron_args(megatron_job(_tiny("--cpu-offloading-num-layers", "2"),
                                         world_size=1))
    assert args[args.index("--cpu-offloading-num-layers") + 1] == "2"
    # Megatron's TransformerConfig refusals, from the Job
    with pytest.raises(TracememError, match=r"with --pipeline-model-parallel-size 2: "
                                            r"currently there is no support for pipeline"):
        megatron_job(_tiny("--cpu-offloading-num-layers", "2",
                           "--pipeline-model-parallel-size", "2"), world_size=2)
    with pytest.raises(TracememError, match=r"only for layers less than 4"):
        megatron_job(_tiny("--cpu-offloading-num-layers", "4"), world_size=1)
    with pytest.raises(TracememError, match=r"with --recompute-granularity full: CPU "
                                            r"offloading does not work"):
        megatron_job(_tiny("--cpu-offloading-num-layers", "2", "--recompute-granularity",
                           "full", "--recompute-method", "uniform", "--recompute-num-layers",
                           "1"), world_size=1)


def test_every_refused_flag_of_a_job_is_named_in_one_line():
    with pytest.raises(TracememError) as error:
        megatron_job_kwargs(_tiny("--fp4-format", "e2m1", "--fp4-param-gather",
                                  "--tp-comm-overlap"), world_size=1)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("tracemem refuses these Megatron-LM arguments: --fp4-format "
                              "e2m1: not modelled yet: FP4 (NVFP4) training")
    assert "--fp4-param-gather: not modelled yet: FP4 parameters" in message
    assert "--tp-comm-overlap: not modelled yet: TE's userbuffers" in message


def test_a_refused_flag_given_at_megatrons_default_is_accepted():
    kwargs = megatron_job_kwargs(_tiny("--softmax-type", "vanilla"), world_size=1)
    assert kwargs["world_size"] == 1


def test_an_unknown_flag_is_one_line_with_the_closest_known_one():
    with pytest.raises(TracememError, match=r"^unknown Megatron-LM argument --num-layer \(not "
                                            r"in megatron/training/arguments.py at d98e8a6\); "
                                            r"did you mean --num-layers\?$"):
        megatron_job_kwargs(["--num-layer", "4"], world_size=1)
    # a shortened flag (Megatron's parser: allow_abbrev=False) names the flags it begins,
    # where difflib's closest (--test-mode) is not one of them
    with pytest.raises(TracememError, match=r"^unknown Megatron-LM argument --tensor-model "
                                            r"\(Megatron-LM takes no abbreviations\); did you "
                                            r"mean --tensor-model-parallel-size\?$"):
        megatron_job_kwargs(["--tensor-model", "4"], world_size=1)
    # the shortest three of those it begins, and their count
    with pytest.raises(TracememError, match=r"did you mean --moe-router-topk, "
                                            r"--moe-router-dtype, --moe-router-fusion "
                                            r"\(21 in all\)\?$"):
        megatron_job_kwargs(["--moe-rou", "4"], world_size=1)


def test_the_jobs_refusal_names_megatrons_flags():
    # a Job's refusal names --tp; a job of Megatron arguments says the argument given
    with pytest.raises(TracememError, match=r"^--tensor-model-parallel-size 3 must divide "
                                            r"num_attention_heads \(4\)"):
        megatron_job(_tiny() + ["--tensor-model-parallel-size", "3"], world_size=3)
    # tracemem's own --tp over the job keeps its name
    with pytest.raises(TracememError, match=r"^--tp 3 must divide num_attention_heads"):
        megatron_job(_tiny(), world_size=3, tp=3)


def test_a_missing_vocabulary_names_the_flag():
    argv = [a for a in _tiny() if a not in ("--vocab-size", "1000")]
    with pytest.raises(TracememError, match=r"must be specified.*; give --vocab-size V \(the "
                                            r"tokenizer's vocabulary before padding\)$"):
        megatron_job_kwargs(argv, world_size=1)


def test_a_missing_world_size_names_the_flag():
    with pytest.raises(TracememError, match=r"takes the world size from its launcher .* give "
                                            r"it with --world-size"):
        megatron_job_kwargs(_tiny())


def test_the_world_size_can_come_from_the_launchers_environment():
    assert megatron_job_kwargs(_tiny(), env={"WORLD_SIZE": "4"})["world_size"] == 4


def test_a_tokenizer_file_needs_the_vocabulary_size():
    argv = [a for a in _tiny() if a not in ("--vocab-size", "1000", "--tokenizer-type",
                                            "NullTokenizer")]
    with pytest.raises(TracememError, match=r"reads the vocabulary from a tokenizer file "
                                            r"\(--vocab-file /data/vocab.json\).* give its "
                                            r"size with --vocab-size"):
        megatron_job_kwargs(argv + ["--vocab-file", "/data/vocab.json", "--tokenizer-type",
                                    "GPT2BPETokenizer"], world_size=1)


def test_moe_with_tensor_parallelism_needs_sequence_parallelism_as_megatron_says():
    with pytest.raises(TracememError, match=r"Megatron-LM refuses this job: During training, "
                                            r"performance may degrade if MoE and tensor "
                                            r"parallelism are enabled without also enabling "
                                            r"sequence parallelism.*moe_layer.py "
                                            r"MoELayer.forward"):
        megatron_job_kwargs(_tiny("--tensor-model-parallel-size", "2",
                                  "--expert-tensor-parallel-size", "1",
                                  "--expert-model-parallel-size", "2", moe=True), world_size=4)


@pytest.mark.parametrize("layout, pp, match", [
    ("Etx|L", 1, r"invalid layer character 'x'"),
    ("tE|ttt|L", 1, r"the embedding E must come first, once"),
    ("Ett|tt|L", 2, r"3 virtual stages do not divide by --pipeline-model-parallel-size 2"),
    ("|Etttt|L", 1, r"the embedding is in virtual stage 1; not modelled yet"),
    ("Etttt|L|", 1, r"the loss is in virtual stage 1 of 3; not modelled yet"),
    ("Et*4|m|L", 1, r"MTP layers outside the last virtual stage \(a standalone MTP stage\); "
                    r"not modelled yet"),
    ("Et*4,m,L,m", 1, r"the loss L must come last, once"),
])
def test_a_bad_layout_string_is_refused(layout, pp, match):
    argv = _tiny("--pipeline-model-parallel-size", str(pp), "--pipeline-model-parallel-layout",
                 layout, "--position-embedding-type", "rope", "--mtp-num-layers",
                 str(layout.count("m")))
    with pytest.raises(TracememError, match=match):
        megatron_job_kwargs(argv, world_size=pp)


def test_deepseek_v3s_layout_with_a_standalone_mtp_stage_is_refused():
    # Megatron-Core accepts it (pipeline_parallel_layer_layout.py's docstring example): 32
    # virtual stages, MTP alone in the 31st; tracemem builds MTP with the loss
    argv = _tiny("--num-layers", "61", "--pipeline-model-parallel-size", "16",
                 "--pipeline-model-parallel-layout", "Et*3|(tt|)*29,m|L",
                 "--position-embedding-type", "rope", "--mtp-num-layers", "1")
    with pytest.raises(TracememError, match=r"--pipeline-model-parallel-layout "
                                            r"'Et\*3\|\(tt\|\)\*29,m\|L': MTP layers outside "
                                            r"the last virtual stage"):
        megatron_job_kwargs(argv, world_size=16)


def test_a_layout_with_too_few_decoder_layers_quotes_megatrons_check():
    with pytest.raises(TracememError, match=r"holds 3 decoder layers \(t\); --num-layers is 4 "
                                            r"\(Megatron-Core validate_layer_layout\)"):
        megatron_job_kwargs(_tiny("--pipeline-model-parallel-layout", "Ett|tL"), world_size=1)


def test_the_flex_dispatcher_of_a_release_test_is_refused():
    argv, env = megatron_args_from_yaml(DATA / "deepseekv3_proxy_flex.yaml")
    with pytest.raises(TracememError, match=r"not modelled yet: --moe-token-dispatcher-type "
                                            r"flex"):
        megatron_job_kwargs(argv, env=env, world_size=64, vocab_size=256000)


def test_megatrons_moe_defaults_become_kernel_options():
    # Megatron's defaults: --moe-token-dispatcher-type allgather, no --moe-permute-fusion,
    # no --moe-router-dtype (arguments.py at d98e8a6)
    argv = [a for a in _tiny(moe=True) if a not in ("--moe-token-dispatcher-type", "alltoall",
                                                    "--moe-permute-fusion")]
    options = megatron_job_kwargs(argv, world_size=1)["kernel_options"]
    assert (options["moe_token_dispatcher"], options["moe_permute_fusion"],
            options["moe_router_dtype"]) == ("allgather", False, "input")


def test_megatrons_gelu_moe_and_sinkhorn_routing_give_the_model():
    argv = [a for a in _tiny(moe=True) if a != "--swiglu"] + [
        "--moe-router-load-balancing-type", "sinkhorn", "--moe-router-topk", "1"]
    model = megatron_job_kwargs(argv, world_size=1)["model"]
    assert (model.hidden_act, model.gated_mlp, model.topk_method) == ("gelu", False,
                                                                       "sinkhorn")
    with pytest.raises(TracememError, match=r"Sinkhorn routing does not support aux loss"):
        megatron_job_kwargs(argv + ["--moe-aux-loss-coeff", "0.01"], world_size=1)


def test_an_attention_backend_environment_that_megatron_rejects():
    with pytest.raises(TracememError, match=r"NVTE_FUSED_ATTN set to 0, but expected 1 for "
                                            r"attention backend type auto.*language_module.py"):
        megatron_job_kwargs(_tiny(), env={"NVTE_FUSED_ATTN": "0"}, world_size=1)
    kwargs = megatron_job_kwargs(_tiny("--attention-backend", "unfused"),
                                 env={"NVTE_FUSED_ATTN": "0", "NVTE_FLASH_ATTN": "0",
                                      "NVTE_UNFUSED_ATTN": "1"}, world_size=1)
    assert kwargs["attention"] == "unfused"


def test_an_unknown_environment_variable_is_refused_by_name():
    with pytest.raises(TracememError, match=r"ENV_VARS: MY_SETTING=1: an environment variable "
                                            r"tracemem does not know"):
        megatron_job_kwargs(_tiny(), env={"MY_SETTING": "1", "NCCL_IB_SL": "1"}, world_size=1)


def test_fp32_and_fp16_training_are_refused():
    with pytest.raises(TracememError, match=r"neither --bf16 nor --fp16.*add --bf16"):
        megatron_job_kwargs([a for a in _tiny() if a != "--bf16"], world_size=1)
    with pytest.raises(TracememError, match=r"--fp16: not modelled yet: fp16 training"):
        megatron_job_kwargs([a if a != "--bf16" else "--fp16" for a in _tiny()], world_size=1)


@pytest.mark.parametrize("extra, match", [
    (["--recompute-granularity", "full"],
     r'Using recompute_granularity: full so recompute_method must be "block" or "uniform"'),
    (["--recompute-granularity", "selective", "--recompute-method", "uniform"],
     r"recompute method is not yet supported for selective recomputing granularity"),
    (["--recompute-granularity", "selective", "--recompute-modules", "gdn_norm_out"],
     r"not modelled yet: --recompute-modules gdn_norm_out"),
    (["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"],
     r"mla_up_proj in recompute_modules is only supported with multi_latent_attention"),
    (["--pipeline-model-parallel-size", "4", "--num-layers-per-virtual-pipeline-stage", "1",
      "--decoder-first-pipeline-num-layers", "1"],
     r"please use --num-virtual-stages-per-pipeline-rank"),
    (["--num-virtual-stages-per-pipeline-rank", "2"],
     r"When interleaved schedule is used, pipeline-model-parallel size should be greater than "
     r"1"),
    (["--overlap-param-gather"], r"--overlap-param-gather only supported with distributed "
                                 r"optimizer"),
    (["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"],
     r"Transformer Engine cross entropy loss fusion is disabled due to stability issues"),
    (["--mtp-num-layers", "1"], r"Multi-Token Prediction \(MTP\) is not supported with "
                                r"learned_absolute position embedding type"),
    (["--seq-length", "512"], r"max_position_embeddings \(256\) must be greater than or "
                              r"equal to seq_length \(512\)"),
    (["--multi-latent-attention", "--group-query-attention"],
     r"Group query attention is mutually exclusive with multi latent attention"),
    (["--transformer-impl", "local"], r"not modelled yet: --transformer-impl local"),
    (["--batch-size", "4"], r"--batch-size argument is no longer valid"),
])
def test_megatrons_own_checks_refuse_with_megatrons_words(extra, match):
    world = 4 if "4" in extra else 1
    with pytest.raises(TracememError, match=match):
        megatron_job_kwargs(_tiny(*extra), world_size=world)


def test_mla_without_qk_layernorm_has_no_latent_norms():
    # gpt_layer_specs.py: without --qk-layernorm MLA's q_layernorm / kv_layernorm are
    # IdentityOp (tests/modeling/test_mla_variants.py has the bytes)
    cfg = megatron_job_kwargs(_tiny("--multi-latent-attention", "--disable-bias-linear"),
                              world_size=1)["model"]
    assert (cfg.attention, cfg.mla_latent_norms, cfg.o_bias) == ("mla", False, False)


# ---- answers in Megatron's terms ------------------------------------------------------------

@pytest.mark.parametrize("case", [c for c in CASES if not isinstance(c[1], str)],
                         ids=[c[0] for c in CASES if not isinstance(c[1], str)])
def test_to_megatron_args_inverts_the_honoured_arguments(case):
    _, kwargs = _kwargs(case)
    fresh = {k: v for k, v in kwargs.items() if k != "megatron_args"}
    argv = to_megatron_args(fresh)
    again = megatron_job_kwargs(argv, world_size=kwargs["world_size"])
    assert {k: v for k, v in again.items() if k != "megatron_args"} == \
        {k: v for k, v in fresh.items() if k != "megatron_args"} | {"global_batch_size":
                                                                    again["global_batch_size"],
                                                                    "num_microbatches":
                                                                    again["num_microbatches"]}


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_an_unchanged_megatron_job_prints_its_own_arguments(case):
    from tracemem.job import Job

    argv, kwargs = _kwargs(case)
    assert to_megatron_args(Job(**kwargs)) == argv


def test_to_megatron_args_of_a_megatron_job_keeps_its_arguments_and_replaces_a_change():
    from tracemem.job import Job

    _, kwargs = _kwargs(CASES[2])  # the uneven-pipeline YAML, PP 4 with first / last 2
    job = Job(**kwargs)
    assert to_megatron_args(job) == list(job.megatron_args)
    changed = to_megatron_args(job.with_changes(recompute="full", zero=1))
    assert changed[:len(changed) - 7] == list(job.megatron_args)
    assert changed[-7:] == ["--recompute-granularity", "full", "--recompute-method", "uniform",
                            "--recompute-num-layers", "1", "--use-distributed-optimizer"]


# FP8 arguments -> what to_megatron_args writes back: --fp8-format and --fp8-recipe always, the
# others where they leave Megatron's defaults (arguments.py: --fp8-recipe delayed,
# --fp8-amax-history-len 1, --num-layers-at-start-in-bf16 / --num-layers-at-end-in-bf16 1)
FP8_ROUND_TRIPS = {
    "--fp8-format hybrid": "--fp8-format hybrid --fp8-recipe delayed",
    "--fp8-format e4m3 --fp8-amax-history-len 16 --first-last-layers-bf16 "
    "--num-layers-at-end-in-bf16 2": "--fp8-format e4m3 --fp8-recipe delayed "
    "--fp8-amax-history-len 16 --first-last-layers-bf16 --num-layers-at-end-in-bf16 2",
    "--fp8-format e4m3 --fp8-recipe blockwise --fp8-param-gather --first-last-layers-bf16 "
    "--num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 1": "--fp8-format e4m3 "
    "--fp8-recipe blockwise --fp8-param-gather --first-last-layers-bf16 "
    "--num-layers-at-start-in-bf16 0",
}
_FP8_FLAGS = {"--fp8-format", "--fp8-recipe", "--fp8-param-gather", "--fp8-amax-history-len",
              "--first-last-layers-bf16", "--num-layers-at-start-in-bf16",
              "--num-layers-at-end-in-bf16"}


def _fp8_tokens(argv):
    """The FP8 arguments of ``argv``, in order."""
    out, keep = [], False
    for token in argv:
        if token.startswith("--"):
            keep = token in _FP8_FLAGS
        if keep:
            out.append(token)
    return out


@pytest.mark.parametrize("fp8", FP8_ROUND_TRIPS)
def test_to_megatron_args_writes_the_fp8_arguments_back(fp8):
    # G stated (b 1 x DP 2): without it to_megatron_args writes the G it means
    kwargs = megatron_job_kwargs(_tiny(*fp8.split(), "--use-distributed-optimizer",
                                       "--global-batch-size", "2"), world_size=2)
    fresh = {k: v for k, v in kwargs.items() if k != "megatron_args"}
    argv = to_megatron_args(fresh)
    assert _fp8_tokens(argv) == FP8_ROUND_TRIPS[fp8].split()
    again = megatron_job_kwargs(argv, world_size=2)
    assert {k: v for k, v in again.items() if k != "megatron_args"} == fresh


@pytest.mark.parametrize("options, fp8", [
    ({"fp8_recipe": "tensorwise"}, "--fp8-format hybrid --fp8-recipe tensorwise"),
    ({"fp8_recipe": "delayed", "fp8_format": "e4m3", "fp8_amax_history_len": 1024,
      "fp8_layers_at_start_in_bf16": 1, "fp8_layers_at_end_in_bf16": 1},
     "--fp8-format e4m3 --fp8-recipe delayed --fp8-amax-history-len 1024 "
     "--first-last-layers-bf16"),
    ({"fp8_recipe": "blockwise", "fp8_param_gather": True, "fp8_layers_at_end_in_bf16": 2},
     "--fp8-format hybrid --fp8-recipe blockwise --fp8-param-gather --first-last-layers-bf16 "
     "--num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 2"),
], ids=["tensorwise", "delayed-bf16-ends", "blockwise-param-gather"])
def test_a_python_fp8_job_printed_as_megatron_arguments_reads_back_to_its_kernels(options, fp8):
    # the kernel options not given take MEGATRON_TE_OPTIONS' defaults (fp8_format hybrid, no
    # bf16 layers); Megatron's loss flags state only native or none
    from tracemem.job import Job

    job = Job(model="deepseek-tiny", world_size=2, micro_batch_size=1, seq_length=64,
              num_microbatches=2, zero=1,
              kernel_options={"cross_entropy_fusion": "none", **options})
    argv = to_megatron_args(job)
    assert _fp8_tokens(argv) == fp8.split()
    again = megatron_job(argv, world_size=2)
    assert again.profile.options == job.profile.options


def test_a_changed_fp8_recipe_replaces_the_fp8_arguments_of_a_megatron_job():
    from tracemem.job import Job

    job = Job(**megatron_job_kwargs(_tiny("--fp8-format", "e4m3", "--fp8-amax-history-len",
                                          "16"), world_size=1))
    changed = to_megatron_args(job.with_changes(
        kernel_options=dict(job.kernel_options) | {"fp8_recipe": "tensorwise"}))
    assert changed == _tiny() + ["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise",
                                 "--fp8-amax-history-len", "16"]
    assert megatron_flag_changes({"kernel_options": {"fp8_recipe": "mxfp8"}}) == \
        "--fp8-format hybrid --fp8-recipe mxfp8"
    bf16 = {k: v for k, v in job.kernel_options.items() if not k.startswith("fp8_")}
    assert megatron_flag_changes({"kernel_options": bf16}, job) == \
        "drop --fp8-format --fp8-recipe --fp8-amax-history-len"


def test_an_fp8_option_without_an_fp8_recipe_has_no_megatron_argument():
    with pytest.raises(TracememError, match=r"^kernel_options fp8_format 'e4m3' without an "
                                            r"fp8_recipe \(Megatron-LM runs FP8 only with "
                                            r"--fp8-format\) has no Megatron-LM argument$"):
        to_megatron_args({"model": "deepseek-tiny", "micro_batch_size": 1, "seq_length": 64,
                          "kernel_options": {"cross_entropy_fusion": "none",
                                             "fp8_format": "e4m3"}})


def test_megatron_flag_changes_in_megatrons_terms():
    assert megatron_flag_changes({"recompute": "full"}) == (
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    assert megatron_flag_changes({"pp": 32}) == "--pipeline-model-parallel-size 32"
    assert megatron_flag_changes({"recompute": "selective",
                                  "recompute_modules": ("core_attn", "mlp")}) == (
        "--recompute-granularity selective --recompute-modules core_attn mlp")


def test_megatron_flag_changes_against_a_job():
    from tracemem.job import Job

    _, kwargs = _kwargs(CASES[4])  # llama-3-8b: TP 4, PP 2, ZeRO 1, full recompute, G 128
    job = Job(**kwargs)
    assert megatron_flag_changes({"zero": 0}, job) == "drop --use-distributed-optimizer"
    assert megatron_flag_changes({"micro_batch_size": 2}, job) == "--micro-batch-size 2"
    assert megatron_flag_changes({"recompute": "none"}, job) == (
        "drop --recompute-granularity --recompute-method --recompute-num-layers")
    assert megatron_flag_changes({"pp": 4, "pp_first_stage_layers": 5,
                                  "pp_last_stage_layers": 9}, job) == (
        "--pipeline-model-parallel-size 4 --decoder-first-pipeline-num-layers 5 "
        "--decoder-last-pipeline-num-layers 9")


def test_megatron_flag_changes_names_only_the_flags_that_change():
    from tracemem.job import Job

    _, kwargs = _kwargs(CASES[8])  # accounted-vpp: PP 4, 2 layers per virtual stage
    job = Job(**kwargs)
    # the account-for flags stay; VPP goes with PP 2 -> (14 + 2) / 2 = 8 per rank
    assert megatron_flag_changes({"pp": 2, "vpp": 1, "schedule": "1f1b"}, job) == (
        "--pipeline-model-parallel-size 2 drop --num-virtual-stages-per-pipeline-rank")
    _, kwargs = _kwargs(CASES[4])  # llama-3-8b: G 128 over DP 8, M 16
    assert megatron_flag_changes({"num_microbatches": 8}, Job(**kwargs)) == (
        "--global-batch-size 64")
    with pytest.raises(TracememError, match=r"needs the job"):
        megatron_flag_changes({"num_microbatches": 8})


def test_megatron_flag_changes_refuses_a_field_megatron_cannot_state():
    with pytest.raises(TracememError, match=r"schedule 'dualpipev' with vpp 1 .* has no "
                                            r"Megatron-LM argument"):
        megatron_flag_changes({"schedule": "dualpipev"})
    with pytest.raises(TracememError, match=r"'pipeline' is not a Job field"):
        megatron_flag_changes({"pipeline": 2})


# ---- the three tables -----------------------------------------------------------------------

def test_every_argument_of_the_pinned_arguments_py_is_in_exactly_one_table():
    from tracemem.frontdoors.megatron_args import megatron_arguments
    from tracemem.frontdoors.megatron_tables import HONOURED, NEUTRAL, PIN, REFUSED

    arguments = megatron_arguments()
    assert PIN == "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
    assert len(arguments) == 840  # add_megatron_arguments at d98e8a6, kitchen's two included
    tables = {"HONOURED": HONOURED, "NEUTRAL": NEUTRAL, "REFUSED": REFUSED}
    for argument in arguments:
        homes = [name for name, table in tables.items() if argument.flag in table]
        assert len(homes) == 1, (argument.flag, homes)
    flags = {argument.flag for argument in arguments}
    for name, table in tables.items():
        assert set(table) <= flags, (name, sorted(set(table) - flags))
    # from (116, 590, 134): FP8 (--fp8-format, --fp8-recipe, --fp8-param-gather,
    # --fp8-amax-history-len, --first-last-layers-bf16, --num-layers-at-start / end-in-bf16)
    # neutral -> honoured; optimizer offload (--optimizer-cpu-offload, --optimizer-offload-
    # fraction, --no-pin-cpu-grads, --no-pin-cpu-params, --overlap-cpu-optimizer-d2h-h2d) honoured;
    # --num-distributed-optimizer-instances refused -> honoured; --rotary-interleaved refused ->
    # neutral; fine-grained activation offloading (--fine-grained-activation-offloading refused,
    # --offload-modules, --min-offloaded-tensor-size neutral) honoured, d98e8a6's four knobs
    # of it neutral -> refused
    # --cpu-offloading-num-layers refused -> honoured (TE CPU offloading)
    assert (len(HONOURED), len(NEUTRAL), len(REFUSED)) == (133, 574, 133)


def test_the_tables_keep_megatrons_order():
    from tracemem.frontdoors.megatron_args import megatron_arguments
    from tracemem.frontdoors.megatron_tables import HONOURED, NEUTRAL, REFUSED

    order = [argument.flag for argument in megatron_arguments()]
    for table in (HONOURED, NEUTRAL, REFUSED):
        assert list(table) == [flag for flag in order if flag in table]


def test_each_refusal_says_what_is_missing_or_quotes_megatron():
    from tracemem.frontdoors.megatron import REFUSED_WHEN
    from tracemem.frontdoors.megatron_tables import ENV_REFUSED, REFUSED

    for flag, reason in REFUSED.items():
        assert reason.startswith(("not modelled yet: ", "Megatron refuses it: ")), flag
    assert set(REFUSED_WHEN) <= set(REFUSED)
    for name, reason in ENV_REFUSED.items():
        assert reason.startswith("not modelled yet: "), name


def test_every_approximation_says_when_it_applies():
    from tracemem.frontdoors.megatron import APPROXIMATIONS_WHEN
    from tracemem.frontdoors.megatron_tables import HONOURED

    approximated = {flag for flag, text in HONOURED.items() if "approximation: " in text}
    assert approximated == set(APPROXIMATIONS_WHEN)


def test_the_environment_tables_are_disjoint():
    from tracemem.frontdoors.megatron_tables import (ENV_HONOURED, ENV_NEUTRAL,
                                                     ENV_NEUTRAL_PREFIXES, ENV_REFUSED)

    names = [*ENV_HONOURED, *ENV_NEUTRAL, *ENV_REFUSED]
    assert len(names) == len(set(names))
    assert not [n for n in names if n.startswith(tuple(ENV_NEUTRAL_PREFIXES))]


def test_the_approximations_of_a_job_are_listed():
    from tracemem.frontdoors import megatron_approximations

    argv, env = megatron_args_from_yaml(DATA / "mla_moe_mtp_memory_speed.yaml")
    notes = megatron_approximations(argv, env=env)
    assert [note.split(":", 1)[0] for note in notes] == [
        "--overlap-grad-reduce", "--overlap-param-gather",
        "--moe-router-load-balancing-type",
        "--log-num-zeros-in-grad", "NVTE_ALLOW_NONDETERMINISTIC_ALGO"]
    # the dataloader's attention mask and the p2p overlap are traced now, with or without
    # their "--no-" flags
    assert megatron_approximations(_tiny()) == []
    assert megatron_approximations(_tiny("--no-create-attention-mask-in-dataloader")) == []


# ---- the models the arguments build ---------------------------------------------------------

@pytest.mark.parametrize("extra, counts", [
    # LayerNorm (weight + bias), GELU MLP with biases, learned positions, tied head; h 64,
    # 4 heads, ffn 4h = 256, V 1000, 128 positions, 2 layers:
    # embedding 1000 x 64 + 128 x 64 = 72,192; attention per layer qkv 64 x 192 + 192 and
    # proj 64 x 64 + 64 = 16,640; norms 2 x 128 per layer + 128 final; MLP per layer
    # fc1 64 x 256 + 256 and fc2 256 x 64 + 64 = 33,088
    ([], dict(embedding=72192, attention=33280, norms=640, dense_mlp=66176, output_head=0)),
    # the same, untied: the head 1000 x 64
    (["--untie-embeddings-and-output-weights"],
     dict(embedding=72192, attention=33280, norms=640, dense_mlp=66176, output_head=64000)),
    # SwiGLU (ffn int(4 x 64 x 2 / 3 / 64) x 64 = 128), RoPE, GQA 2 groups of head 16, RMSNorm,
    # no biases, untied: qkv 64 x (64 + 2 x 2 x 16), proj 64 x 64; fc1 64 x 2 x 128,
    # fc2 128 x 64; norms 64 each
    (["--swiglu", "--position-embedding-type", "rope", "--group-query-attention",
      "--num-query-groups", "2", "--normalization", "RMSNorm", "--disable-bias-linear",
      "--untie-embeddings-and-output-weights"],
     dict(embedding=64000, attention=24576, norms=320, dense_mlp=49152, output_head=64000)),
])
def test_megatron_gpt_shapes_have_their_parameter_counts_by_hand(extra, counts):
    from modeling import build_model
    from modeling.params import count_by_component

    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
            "--max-position-embeddings 128 --micro-batch-size 1 --bf16 --vocab-size 1000 "
            "--tokenizer-type NullTokenizer").split() + extra
    cfg = megatron_job_kwargs(argv, world_size=1)["model"]
    got = count_by_component(build_model(cfg, "meta"), buffers=False)
    assert {k: v for k, v in got.items() if v or k in counts} == counts


def test_distribute_saved_activations_is_honoured_with_megatrons_checks():
    full = ["--tensor-model-parallel-size", "2", "--recompute-granularity", "full",
            "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    kwargs = megatron_job_kwargs(_tiny(*full, "--distribute-saved-activations"), world_size=2)
    assert kwargs["distribute_saved_activations"] and kwargs["recompute"] == "full"
    assert "--distribute-saved-activations" in to_megatron_args(kwargs)
    # validate_args: full recompute only, TP > 1 only
    with pytest.raises(TracememError, match="only application to full recompute"):
        megatron_job_kwargs(_tiny("--tensor-model-parallel-size", "2",
                                  "--distribute-saved-activations"), world_size=2)
    with pytest.raises(TracememError, match="only across tensor model parallel groups"):
        megatron_job_kwargs(_tiny(*full[2:], "--distribute-saved-activations"), world_size=1)


def test_a_new_tp_moves_a_moe_jobs_default_etp():
    # validate_args: without --expert-tensor-parallel-size, ETP = TP; a TP given beside the
    # arguments changes it too, an ETP the arguments state stays
    argv = _tiny("--tensor-model-parallel-size", "2", "--sequence-parallel",
                 "--expert-model-parallel-size", "2", moe=True)
    job = megatron_job(argv, world_size=8, tp=4)
    assert (job.tp, job.etp) == (4, 4)
    job = megatron_job(argv + ["--expert-tensor-parallel-size", "1"], world_size=8, tp=4)
    assert (job.tp, job.etp) == (4, 1)
    assert megatron_job(_tiny("--tensor-model-parallel-size", "2"), world_size=8,
                        tp=4).etp == 1  # dense: no expert TP


def test_a_folder_given_as_the_yaml_is_named_as_one(tmp_path):
    # the third fresh-user trial: it leaked "IsADirectoryError: [Errno 21] ..."
    with pytest.raises(TracememError, match=r"^.+ is a folder; give the model_config.yaml file "
                                            r"in it$"):
        megatron_args_from_yaml(tmp_path)
