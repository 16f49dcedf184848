"""The three tables of the Megatron-LM front door: every argument that Megatron-LM's
``megatron/training/arguments.py`` registers at the pinned commit (``PIN``; the arguments
themselves, with their groups, dests, actions and defaults, are data:
``data/megatron_arguments_d98e8a6.json``) is in exactly one of

- ``HONOURED``: flag -> the ``Job`` field(s) or ``ModelConfig`` field(s) it sets. An entry
  that starts "approximation:" sets no field: what it changes is stated, with its size, where
  tracemem does not trace it (STYLE.md: each approximation written down where it is made).
- ``NEUTRAL``: flag -> why it does not change a training step's device memory.
- ``REFUSED``: flag -> what is missing ("not modelled yet: ...") or Megatron's own reason.
  Refused only when given with a value other than Megatron's default
  (``tracemem.frontdoors.megatron.REFUSED_WHEN`` narrows a few to the case that changes
  memory, each entry saying when it has no effect); an honoured flag can still refuse one of
  its values (``--moe-token-dispatcher-type flex``), by name, where it is translated.

The tables keep ``arguments.py``'s order: one block per ``_add_*_args`` function, in the order
``add_megatron_arguments`` calls them, and inside a block the order the function registers its
arguments (``_add_network_size_args`` first generates every ``TransformerConfig`` field with
``ArgumentGroupFactory``, then registers its "network size" group), so a reader finds a flag
where Megatron keeps it. ``tests/tracemem/frontdoors/test_megatron_args.py`` checks that every
argument of the JSON is in exactly one table, and in this order.

Environment variables (a functional test's ``ENV_VARS``) have their own three tables
(``ENV_HONOURED``, ``ENV_NEUTRAL`` with ``ENV_NEUTRAL_PREFIXES``, ``ENV_REFUSED``); an unknown
name is refused.
"""

from __future__ import annotations

__all__ = ["PIN", "PIN_DATE", "ARGUMENTS_FILE", "HONOURED", "NEUTRAL", "REFUSED",
           "ENV_HONOURED", "ENV_NEUTRAL", "ENV_NEUTRAL_PREFIXES", "ENV_REFUSED"]

PIN = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"  # NVIDIA/Megatron-LM, 2026-08-22
PIN_DATE = "2026-08-22"
ARGUMENTS_FILE = "megatron_arguments_d98e8a6.json"

# reasons shared by many flags
_LOG = "logging and reporting (host side, scalars)"
_PATH = "a path or name"
_CKPT = "checkpointing: runs between training steps"
_LR = "learning-rate / weight-decay schedule values"
_INIT = "initial parameter values, not shapes"
_INFER = "inference only: a pretrain_gpt.py training step never runs it"
_RL = "RL only: no effect without --perform-rl-step (refused)"
_DATA = "the data pipeline on the host (which tokens, not how many)"
_TIMEOUT = "timeouts and fault handling of the job (host side)"
_VISION = "vision models only: pretrain_gpt.py does not read it"
_ICT = "ICT / REALM / BERT retrieval models only: pretrain_gpt.py does not read it"
_ROPE_VALUES = "RoPE frequency values: the same tensors and shapes"
_HARNESS = "Megatron-LM's CI harness setting"
_LOCAL_ATTN = ("read only by Megatron-Core's local DotProductAttention (--attention-backend "
               "local / --transformer-impl local, refused); Transformer Engine's attention "
               "ignores it")


def _only(flag: str) -> str:
    return f"no effect without {flag} (refused)"


HONOURED: dict[str, str] = {
    # _add_network_size_args: TransformerConfig fields (ArgumentGroupFactory)
    "--tensor-model-parallel-size": "tp; the vocabulary pads to a multiple of "
                                    "--make-vocab-size-divisible-by x TP",
    "--pipeline-model-parallel-size": "pp",
    "--sequence-parallel": "sp (Megatron turns it off when TP is 1: validate_args)",
    "--context-parallel-size": "cp; CP attention per --cp-comm-type (default p2p: TE's "
                               "ring attention)",
    "--expert-model-parallel-size": "ep",
    "--expert-tensor-parallel-size": "etp (Megatron's default: TP; 1 for a dense model)",
    "--bf16": "model dtype bfloat16 and precision 'megatron' (bf16 parameters, fp32 main "
              "grads and Adam states)",
    "--deterministic-mode": "approximation: deterministic kernels of the same inputs and "
                            "outputs; their workspaces are below the dispatcher, as for "
                            "every kernel; Megatron refuses it with --cross-entropy-loss-fusion",
    "--cross-entropy-loss-fusion": "kernel_options cross_entropy_fusion 'native' (with "
                                   "--cross-entropy-fusion-impl); without it 'none', the "
                                   "unfused vocab_parallel_cross_entropy",
    "--cross-entropy-fusion-impl": "kernel_options cross_entropy_fusion 'native'; 'te' is "
                                   "refused by Megatron's validate_args",
    "--cpu-offloading-num-layers": "cpu_offloading_num_layers: Transformer Engine's CPU "
                                   "offloading of the first N decoder layers "
                                   "(transformer_engine/pytorch/cpu_offload.py "
                                   "DefaultOffloadSynchronizer; modeling.common.cpu_offload): "
                                   "their saved tensors of >= 256 Ki elements to pinned host "
                                   "copies, released on the device before layer L-N+j's "
                                   "forward, reloaded before layer L-1-N+j's backward; the "
                                   "host copies in host memory; with NVTE_CPU_OFFLOAD_V1=1 "
                                   "refused; N <= 0 is off, as in Megatron",
    "--num-layers": "model num_layers",
    "--mtp-num-layers": "model num_mtp_modules",
    "--account-for-embedding-in-pipeline-split": "account_for_embedding_in_pipeline_split",
    "--account-for-loss-in-pipeline-split": "account_for_loss_in_pipeline_split",
    "--hidden-size": "model hidden_size",
    "--num-attention-heads": "model num_attention_heads",
    "--attention-backend": "attention 'flash' (TE's DotProductAttention) and kernel_options "
                           "attention_backend: fused (cuDNN: output and softmax statistics), "
                           "flash (TE's FlashAttention over flash-attn 2: bshd copies of q, "
                           "k, v, a separate output copy, mha_bwd's fp32 scratch), auto (TE's "
                           "choice, resolved from the job's --gpu: fused on sm90+, and fused "
                           "on sm80 or no --gpu, flash-attn's presence not being known); "
                           "unfused -> attention 'unfused' (the [b, heads, s, s] scores, "
                           "softmax and dropout kept); local needs --spec local (refused)",
    "--num-query-groups": "model num_key_value_heads (with --group-query-attention)",
    "--ffn-hidden-size": "model intermediate_size (default 4h; with --swiglu "
                         "int(8h / 3 / 64) * 64: validate_args)",
    "--kv-channels": "model head_dim (default hidden_size / num_attention_heads)",
    "--hidden-dropout": "model hidden_dropout (Megatron's default 0.1)",
    "--attention-dropout": "model attention_dropout (Megatron's default 0.1)",
    "--norm-epsilon": "model rms_norm_eps (the epsilon of every norm)",
    "--apply-layernorm-1p": "model normalization unchanged: TE's zero-centred gamma has the "
                            "same weight, bias and saved tensors",
    "--disable-bias-linear": "model qkv_bias, o_bias, mlp_bias False (default: all True; "
                             "MLA: linear_proj's bias is its only one)",
    "--add-qkv-bias": "model qkv_bias",
    "--normalization": "model normalization 'layernorm' / 'rmsnorm'",
    "--qk-layernorm": "model qk_norm (GQA); with MLA mla_latent_norms: its q / kv latent "
                      "norms (absent: none, gpt_layer_specs.py IdentityOp)",
    "--multi-latent-attention": "model attention 'mla'",
    "--recompute-granularity": "recompute 'full' / 'selective' (absent: 'none')",
    "--recompute-method": "recompute_method",
    "--recompute-num-layers": "recompute_num_layers",
    "--distribute-saved-activations": "distribute_saved_activations (full recompute: each "
                                      "checkpoint keeps 1 / TP of its input, gathered back in "
                                      "backward; modeling.common.checkpoint)",
    "--recompute-modules": "recompute_modules (core_attn, mla_up_proj, layernorm, mlp, moe, "
                           "moe_act, shared_experts; gdn_norm_out, gdp_in_proj, gdp_qkv, mhc "
                           "refused by name)",
    "--fp8-format": "kernel_options fp8_recipe (with --fp8-recipe) and fp8_format: TE's FP8 "
                    "linears (modeling.kernels.fp8); e4m3 and hybrid change no byte",
    "--fp8-recipe": "kernel_options fp8_recipe delayed / tensorwise / mxfp8 (Blackwell "
                    "only) / blockwise; custom refused by name",
    "--fp8-amax-history-len": "kernel_options fp8_amax_history_len: delayed scaling's fp32 "
                              "amax history per GEMM (tracemem.static.fp8_static)",
    "--first-last-layers-bf16": "kernel_options fp8_layers_at_start_in_bf16 / _end_: those "
                                "layers run without FP8",
    "--num-layers-at-start-in-bf16": "kernel_options fp8_layers_at_start_in_bf16 (with "
                                     "--first-last-layers-bf16)",
    "--num-layers-at-end-in-bf16": "kernel_options fp8_layers_at_end_in_bf16 (with "
                                   "--first-last-layers-bf16)",
    "--moe-shared-expert-intermediate-size": "model num_shared_experts 1 and "
                                             "shared_expert_intermediate_size (the total "
                                             "width)",
    "--moe-shared-expert-gate": "model shared_expert_gate",
    "--moe-shared-expert-overlap": "kernel_options moe_shared_expert_overlap",
    "--moe-ffn-hidden-size": "model moe_intermediate_size (default --ffn-hidden-size)",
    "--moe-router-topk": "model num_experts_per_tok",
    "--moe-router-num-groups": "model num_expert_groups (group-limited top-k)",
    "--moe-router-group-topk": "model topk_group",
    "--moe-router-pre-softmax": "model router_pre_softmax (softmax scores)",
    "--moe-router-topk-scaling-factor": "model routed_scaling_factor (absent: None, no "
                                        "multiply)",
    "--moe-router-score-function": "model scoring_func softmax / sigmoid (sigmoid: "
                                   "norm_topk_prob when top-k > 1); sqrtsoftplus refused",
    "--moe-router-dtype": "kernel option moe_router_dtype: fp32 (fp32 router logits and "
                          "probabilities), absent: 'input' (in the activations' dtype); fp64 "
                          "refused",
    "--moe-router-enable-expert-bias": "model topk_method 'noaux_tc' (the (E,) fp32 "
                                       "correction bias) and router_gather",
    "--moe-router-force-load-balancing": "routing 'balanced' (tracemem's default routing "
                                         "model); approximation: the random (tokens, "
                                         "experts) logits it draws are not traced",
    "--moe-grouped-gemm": "experts 'grouped' (TE GroupedLinear); without it 'sequential' "
                          "(Megatron's SequentialMLP: one TE linear pair per local expert)",
    "--moe-token-dispatcher-type": "kernel option moe_token_dispatcher: alltoall or "
                                   "allgather (Megatron's default: tokens gathered over ETP x "
                                   "EP); flex refused for a MoE model",
    "--moe-layer-recompute": "recompute 'selective' with recompute_modules + 'moe' "
                             "(TransformerConfig.__post_init__; refused with full)",
    "--moe-permute-fusion": "kernel option moe_permute_fusion: TE's fused permute / unpermute "
                            "(modeling/kernels/moe.py); without it moe_utils.permute / "
                            "unpermute as torch ops",
    "--transformer-impl": "kernels 'megatron-te' (transformer_engine); local and "
                          "inference_optimized refused",
    # _add_network_size_args: network size
    "--fine-grained-activation-offloading": "fine_grained_activation_offloading: "
                                            "Megatron-Core's per-module offload / reload "
                                            "(pipeline_parallel/"
                                            "fine_grained_activation_offload.py at "
                                            "4e85d74ae9; modeling.common.offload): the "
                                            "groups' saved tensors to pinned host buffers "
                                            "at each commit, reloaded in backward, the "
                                            "manager's kept groups after the first "
                                            "iteration, the early reloads during the "
                                            "previous backward chunk; the host buffers in "
                                            "host memory",
    "--offload-modules": "offload_modules (attn_norm, qkv_linear, core_attn, attn_proj, "
                         "mlp_norm, expert_fc1, moe_act; d98e8a6's fused_group_mlp and "
                         "gdp_qkv refused); no effect without "
                         "--fine-grained-activation-offloading, as in Megatron",
    "--min-offloaded-tensor-size": "min_offloaded_tensor_size: elements; smaller saved "
                                   "tensors stay on the device; no effect without "
                                   "--fine-grained-activation-offloading, as in Megatron",
    "--encoder-num-layers": "model num_layers when --num-layers is not given (validate_args)",
    "--group-query-attention": "model num_key_value_heads from --num-query-groups (absent: "
                               "MHA)",
    "--max-position-embeddings": "model max_position_embeddings (the learned table's rows)",
    "--position-embedding-type": "model position_embedding learned_absolute / rope / none; "
                                 "yarn as rope (frequency values only); mrope, relative "
                                 "refused",
    "--use-rotary-position-embeddings": "model position_embedding 'rope' (deprecated alias)",
    "--rotary-base": "model rope_theta",
    "--rotary-percent": "model partial_rotary_factor",
    "--no-position-embedding": "model position_embedding; Megatron refuses it unless rope "
                               "(validate_args)",
    "--make-vocab-size-divisible-by": "make_vocab_size_divisible_by (default 128; the "
                                      "vocabulary pads to a multiple of it x TP)",
    "--squared-relu": "model hidden_act 'squared_relu', gated_mlp False",
    "--swiglu": "model hidden_act 'silu', gated_mlp True (default: 'gelu', not gated)",
    "--untie-embeddings-and-output-weights": "model tie_word_embeddings False (default True)",
    # _add_training_args
    "--micro-batch-size": "micro_batch_size",
    "--global-batch-size": "global_batch_size (M = G / (b x DP)); absent: G = b x DP, M = 1 "
                           "(validate_args)",
    "--decrease-batch-size-if-needed": "global_batch_size rounded down to a multiple of b x DP",
    "--empty-unused-memory-level": "approximation: 1 and 2 call torch.cuda.empty_cache() "
                                   "between backward and the optimizer step (2: also after "
                                   "it); tracemem's simulated cache is kept through the step, "
                                   "so its reserved peak of the optimizer step can be higher "
                                   "(allocated peaks are the same)",
    "--recompute-activations": "recompute 'selective' (validate_args)",
    "--no-rope-fusion": "Megatron-Core's unfused RoPE, which tracemem runs "
                        "(modeling/kernels/rope.py); without it approximation: TE's fused "
                        "RoPE saves less than the unfused RoPE traced, so the estimate is a "
                        "little high",
    "--optimizer": "optimizer 'fused' for adam (TE / apex FusedAdam); the others refused",
    "--optimizer-cpu-offload": "optimizer_cpu_offload: Megatron-Core's HybridDeviceOptimizer "
                               "(optimizer/cpu_offloading/hybrid_optimizer.py; "
                               "tracemem.offload): the offloaded parameters' fp32 masters, "
                               "moments and grads on the host, the rest's fp32 masters and "
                               "moments (FusedAdam) on the device; needs "
                               "--use-precision-aware-optimizer (validate_args)",
    "--optimizer-offload-fraction": "optimizer_offload_fraction: of each distributed "
                                    "optimizer's elements, whole parameters in its order "
                                    "(HybridDeviceOptimizer._get_sub_optimizer_param_groups)",
    "--overlap-cpu-optimizer-d2h-h2d": "approximation: one host optimizer per parameter "
                                       "(build_cpu_optimizer_list) and the copies on side "
                                       "streams: the same host and device bytes and the same "
                                       "temporaries; the side streams' own caching-allocator "
                                       "pools are not simulated",
    "--no-pin-cpu-grads": "pin_cpu_grads False: the host gradient buffers pageable "
                          "(HybridDeviceOptimizer._set_sub_optimizer_grads)",
    "--no-pin-cpu-params": "pin_cpu_params False: the host fp32 masters pageable "
                           "(_get_sub_optimizer_param_groups)",
    "--no-gradient-accumulation-fusion": "gradient_accumulation_fusion False (precision and "
                                         "kernel_options)",
    # _add_mixed_precision_args
    "--grad-reduce-in-bf16": "grad_reduce_in_bf16 (2-byte main-grad buffer)",
    "--accumulate-allreduce-grads-in-fp32": "main grads fp32 (the bf16 default already: "
                                            "validate_args)",
    # _add_distributed_args
    "--use-megatron-fsdp": "zero 2 / 3 from --data-parallel-sharding-strategy "
                           "(optim_grads / optim_grads_params); approximation: "
                           "Megatron-FSDP's communication units are not traced: its "
                           "all-gathers prefetch whole units (TransformerLayers) ahead up to "
                           "suggested_communication_unit_size / 2 elements (by default "
                           "max(1e9, 2 x the mean unit's parameters)), and its reduce-scatter "
                           "queue keeps each unit's unsharded gradient bucket until the queue "
                           "passes suggested_communication_unit_size elements or the backward "
                           "ends (megatron_fsdp.py MegatronFSDP.__init__, "
                           "param_and_grad_buffer.py AllGatherPipeline.all_gather_params and "
                           "GradReducePipeline.wait_for_previous_grad_reduce, Megatron-LM "
                           "febd25e3fb); tracemem gathers one unit at a time (one more "
                           "prefetched in backward) and counts the gradients as the sharded "
                           "main grads: the estimate is low by them where the peak falls "
                           "inside the layers' forward or backward (not at the loss)",
    "--decoder-first-pipeline-num-layers": "pp_first_stage_layers (with VPP: pp_layout, "
                                           "get_num_layers_to_build's split)",
    "--decoder-last-pipeline-num-layers": "pp_last_stage_layers (with VPP: pp_layout)",
    "--pipeline-model-parallel-layout": "pp_layout (decoder layers per virtual stage) and "
                                        "vpp; E in the first and L, m in the last virtual "
                                        "stage, else refused",
    "--num-layers-per-virtual-pipeline-stage": "vpp = layers per stage / this",
    "--num-virtual-stages-per-pipeline-rank": "vpp",
    "--no-overlap-p2p-communication": "overlap_p2p_comm = False (the interleaved "
                                      "schedule's next receive posted after the backward, "
                                      "not before it: tracemem.schedules.megatron_refs); "
                                      "Megatron-LM turns the overlap off without VPP",
    "--overlap-grad-reduce": "approximation: the same buffers, reduced per bucket; each "
                             "bucket's padding to DP x 128 elements is not modelled",
    "--ddp-num-buckets": "approximation: bucket boundaries; their padding is not modelled",
    "--ddp-bucket-size": "approximation: bucket boundaries; their padding is not modelled",
    "--ddp-pad-buckets-for-high-nccl-busbw": "approximation: pads each bucket to 2^16 "
                                             "elements (at most 256 KiB per bucket), not "
                                             "modelled",
    "--overlap-param-gather": "approximation: the distributed optimizer's all-gather runs "
                              "in place per bucket (no buffer of its own); the buckets' "
                              "padding is not modelled",
    "--use-distributed-optimizer": "zero 1 (absent: 0)",
    "--create-all-gather-group": "approximation: one more NCCL communicator; NCCL's own "
                                 "buffers are outside tracemem's estimate for every group "
                                 "(--non-pytorch-memory)",
    "--data-parallel-sharding-strategy": "zero 2 (optim_grads) / 3 (optim_grads_params) "
                                         "with --use-megatron-fsdp; optim, no_shard refused",
    "--num-distributed-optimizer-instances": "num_distributed_optimizer_instances: the "
                                             "distributed optimizer and its DDP buffers shard "
                                             "over DP x CP / N and EDP / N (parallel_state.py "
                                             "intra-partial groups); with Megatron-FSDP "
                                             "(HSDP) refused",
    "--cp-comm-type": "kernel_options cp_comm_type with CP > 1: p2p (Megatron's default: "
                      "TE's ring attention, AttnFuncWithCPAndKVP2P) or allgather / all_gather "
                      "(K, V all-gathered); one type for all layers; a2a, a2a+p2p refused",
    # _add_data_args
    "--seq-length": "seq_length",
    "--encoder-seq-length": "seq_length when --seq-length is not given (validate_args)",
    "--no-create-attention-mask-in-dataloader": "create_attention_mask_in_dataloader = "
                                                "False: no (b, 1, s / CP, s) bool mask on "
                                                "the first and last stages, which hold it "
                                                "through each forward without the flag "
                                                "(tracemem.estimator._dataloader_mask)",
    # _add_tokenizer_args
    "--vocab-size": "model vocab_size (before padding)",
    "--padded-vocab-size": "model vocab_size as given, make_vocab_size_divisible_by None",
    "--vocab-file": "the vocabulary comes from this file: its size is required "
                    "(tracemem's --vocab-size)",
    "--tokenizer-type": "NullTokenizer: the vocabulary is --vocab-size; the others read a "
                        "file, whose size tracemem's --vocab-size gives",
    "--tokenizer-model": "the vocabulary comes from this file: its size is required "
                         "(tracemem's --vocab-size)",
    "--tokenizer-metadata": "the vocabulary comes from this file: its size is required "
                            "(tracemem's --vocab-size)",
    "--tokenizer-special-tokens": "part of the tokenizer's vocabulary, whose size tracemem's "
                                  "--vocab-size gives",
    "--tiktoken-num-special-tokens": "part of the tokenizer's vocabulary, whose size "
                                     "tracemem's --vocab-size gives",
    # _add_moe_args
    "--num-experts": "model num_routed_experts (0 or absent: dense)",
    "--moe-layer-freq": "model first_k_dense_replace, moe_layer_freq, mlp_only_layers (an "
                        "int N: layer % N == 0; a list such as ([0]*3+[1]*58)); MTP layers "
                        "follow the last layer (get_gpt_mtp_block_spec)",
    "--moe-router-load-balancing-type": "aux_loss / seq_aux_loss / global_aux_loss / none, "
                                        "sinkhorn (model topk_method 'sinkhorn'; "
                                        "quantile_balancing refused); "
                                        "approximation: with a coefficient > 0 the loss's "
                                        "(tokens, experts) fp32 scores per MoE layer are not "
                                        "traced, and the routing is tracemem's --routing "
                                        "(balanced by default), which an aux-loss router's "
                                        "first steps are not (Sinkhorn's normalisation, "
                                        "moe_utils.py sinkhorn, balances from the first "
                                        "step): the busiest EP rank's expert activations are "
                                        "what is low",
    "--moe-aux-loss-coeff": "whether the aux loss runs (> 0); see "
                            "--moe-router-load-balancing-type",
    # _add_mla_args
    "--q-lora-rank": "model q_lora_rank",
    "--kv-lora-rank": "model kv_lora_rank",
    "--qk-head-dim": "model qk_nope_head_dim",
    "--qk-pos-emb-head-dim": "model qk_rope_head_dim",
    "--v-head-dim": "model v_head_dim",
    # _add_logging_args
    "--log-num-zeros-in-grad": "approximation: counting the zeros (torch.count_nonzero per "
                               "main-grad tensor in the optimizer step) makes a bool temporary "
                               "of each tensor in turn, not traced",
    # _add_transformer_engine_args
    "--fp8-param-gather": "kernel_options fp8_param_gather: FP8 weights 1 B an element in the "
                          "parameter buffer, no FP8 weight copy (tracemem.static.fp8_static); "
                          "with mxfp8 refused by name",
    # _add_experimental_args
    "--use-precision-aware-optimizer": "use_precision_aware_optimizer",
    "--main-grads-dtype": "main_grads_dtype",
    "--main-params-dtype": "main_params_dtype",
    "--exp-avg-dtype": "exp_avg_dtype",
    "--exp-avg-sq-dtype": "exp_avg_sq_dtype",
}

NEUTRAL: dict[str, str] = {
    # _add_network_size_args: TransformerConfig fields (ArgumentGroupFactory)
    "--pipeline-model-parallel-comm-backend": "the pipeline's send / recv backend: the same "
                                              "receive buffers (the backend's own, as NCCL's, "
                                              "are outside PyTorch's allocator)",
    "--no-initialization": _INIT,
    "--use-cpu-initialization": "parameters made on the host, then copied: the same "
                                "parameters on the device",
    "--no-tp-comm-bulk-wgrad": _only("--tp-comm-overlap"),
    "--no-tp-comm-bulk-dgrad": _only("--tp-comm-overlap"),
    "--no-tp-comm-overlap-ag": _only("--tp-comm-overlap"),
    "--no-tp-comm-overlap-rs": _only("--tp-comm-overlap"),
    "--tp-comm-overlap-rs-dgrad": _only("--tp-comm-overlap"),
    "--no-tp-comm-split-ag": _only("--tp-comm-overlap"),
    "--no-tp-comm-split-rs": _only("--tp-comm-overlap"),
    "--tp-comm-bootstrap-backend": _only("--tp-comm-overlap"),
    "--use-ring-exchange-p2p": "the pipeline's send / recv implementation: the same receive "
                               "buffers",
    "--wgrad-deferral-limit": _only("--defer-embedding-wgrad-compute"),
    "--cpu-offloading-retain-pinned-cpu-buffers": "TE keeps the host copies for the next "
                                                  "iteration instead of freeing them to "
                                                  "the caching host allocator: the same "
                                                  "host bytes at the peak, no device "
                                                  "bytes; no effect without "
                                                  "--cpu-offloading-num-layers, as in "
                                                  "Megatron",
    "--mtp-loss-scaling-factor": "the MTP loss's weight (a scalar)",
    "--mtp-hybrid-override-pattern": "hybrid models only; Megatron ignores it for GPT models "
                                     "(validate_args warns)",
    "--flash-attention-version": "which FlashAttention generation: each keeps the output "
                                 "and the softmax statistics",
    "--rotary-interleaved": "interleaved RoPE: the same bytes as rotate-half (Megatron-LM "
                            "d98e8a6 rope_utils.py _rotate_half stacks the two strided halves "
                            "where rotate-half concatenates them, one tensor of the input's "
                            "shape either way; rotary_pos_embedding.py RotaryEmbedding.forward "
                            "interleaves the frequencies by stack and view instead of cat)",
    "--qk-clip-alpha": _only("--qk-clip"),
    "--qk-clip-threshold": _only("--qk-clip"),
    "--calculate-per-token-loss": "the loss's normalisation (scalars)",
    "--dsa-indexer-n-heads": _only("--experimental-attention-variant dsa"),
    "--dsa-indexer-head-dim": _only("--experimental-attention-variant dsa"),
    "--dsa-indexer-topk": _only("--experimental-attention-variant dsa"),
    "--dsa-indexer-topk-freq": _only("--experimental-attention-variant dsa"),
    "--dsa-indexer-skip-topk-offset": _only("--experimental-attention-variant dsa"),
    "--dsa-indexer-loss-coeff": _only("--experimental-attention-variant dsa"),
    "--dsa-indexer-use-sparse-loss": _only("--experimental-attention-variant dsa"),
    "--dsa-kernel-backend": _only("--experimental-attention-variant dsa"),
    "--dsa-indexer-rope-interleaved": _only("--experimental-attention-variant dsa"),
    "--no-dsa-indexer-rotate-activation": _only("--experimental-attention-variant dsa"),
    "--no-dsa-indexer-scoring-relu": _only("--experimental-attention-variant dsa"),
    "--dsa-indexer-k-norm-epsilon": _only("--experimental-attention-variant dsa"),
    "--dsa-indexer-k-norm-fp32": _only("--experimental-attention-variant dsa"),
    "--linear-conv-kernel-dim": _only("--experimental-attention-variant gdn"),
    "--linear-key-head-dim": _only("--experimental-attention-variant gdn"),
    "--linear-value-head-dim": _only("--experimental-attention-variant gdn"),
    "--linear-num-key-heads": _only("--experimental-attention-variant gdn"),
    "--linear-num-value-heads": _only("--experimental-attention-variant gdn"),
    "--init-method-std": _INIT,
    "--embedding-init-method-std": _INIT,
    "--init-model-with-meta-device": "where parameters are first made: the same parameters",
    "--mup-width-mult": _only("--use-mup"),
    "--mup-base-hidden-size": _only("--use-mup"),
    "--mup-base-head-dim": "the attention's softmax scale (a scalar)",
    "--mup-attn-scale-power": "the attention's softmax scale (a scalar)",
    "--disable-bf16-reduced-precision-matmul": "matmul accumulation precision: the same "
                                               "tensors",
    "--fp8-quantizer-factory": _only("--fp8-recipe custom"),
    "--fp8-margin": "the scaling factor's value (a scalar margin): the same FP8 tensors",
    "--fp8-interval": "ignored by TE since v1.8 (Megatron's help): the same tensors",
    "--fp8-amax-compute-algo": "how the scale is taken from the amax history (most_recent / "
                               "max): the same history and FP8 tensors",
    "--kitchen-attention-backend": _only("--use-kitchen-attention"),
    "--fp4-recipe": _only("--fp4-format"),
    "--fp4-quantizer-factory": _only("--fp4-format"),
    "--high-priority-a2a-comm-stream": "a CUDA stream's priority",
    "--moe-router-bias-update-rate": "how fast the expert bias moves (values)",
    "--moe-router-quantile-balancing-ema": _only("--moe-router-load-balancing-type "
                                                 "quantile_balancing"),
    "--moe-flex-dispatcher-backend": _only("--moe-token-dispatcher-type flex"),
    "--moe-permute-fusion-into-hybridep": _only("--moe-token-dispatcher-type flex"),
    "--moe-hybridep-pad-uneven-dispatch-inputs": _only("--moe-token-dispatcher-type flex"),
    "--moe-per-layer-logging": _LOG,
    "--moe-pad-experts-for-cuda-graph-inference": _INFER,
    "--moe-token-drop-policy": _only("--moe-expert-capacity-factor"),
    "--gtp-remat-opt-in-modules": _only("--tensor-parallel-num-weight-shards"),
    "--moe-flex-dispatcher-num-sms": _only("--moe-token-dispatcher-type flex"),
    "--moe-deepep-num-sms": _only("--moe-token-dispatcher-type flex"),
    "--moe-hybridep-num-sms": _only("--moe-token-dispatcher-type flex"),
    "--moe-hybridep-num-blocks-permute": _only("--moe-token-dispatcher-type flex"),
    "--moe-hybridep-num-blocks-unpermute": _only("--moe-token-dispatcher-type flex"),
    "--moe-hybridep-num-sms-preprocessing": _only("--moe-token-dispatcher-type flex"),
    "--moe-ncclep-zero-copy": _only("--moe-token-dispatcher-type flex"),
    "--moe-dispatch-fwd-dtype": _only("--moe-token-dispatcher-type flex"),
    "--moe-combine-bwd-dtype": _only("--moe-token-dispatcher-type flex"),
    "--cuda-graph-warmup-steps": _only("--cuda-graph-impl"),
    "--inference-cuda-graph-scope": _INFER,
    "--mhc-num-residual-streams": _only("--enable-mhc-connections"),
    "--mhc-sinkhorn-iterations": _only("--enable-mhc-connections"),
    "--mhc-init-gating-factor": _only("--enable-mhc-connections"),
    "--mhc-recompute-layer-num": _only("--enable-mhc-connections"),
    "--config-logger-dir": _LOG,
    "--flash-decode": _INFER,
    "--batch-invariant-backend": _only("--batch-invariant-mode"),
    "--nccl-all-reduce-for-prefill": _INFER,
    "--inference-fuse-tp-communication": _INFER,
    "--inference-disable-triton-nvls-kernels": _INFER,
    "--inference-grouped-gemm-backend": _INFER,
    "--inference-moe-disable-fused-quant-kernels": _INFER,
    "--inference-moe-token-dispatcher-type": _INFER,
    "--mrope-section": _only("--position-embedding-type mrope"),
    "--mamba-state-dim": _only("--is-hybrid-model / --hybrid-layer-pattern"),
    "--mamba-head-dim": _only("--is-hybrid-model / --hybrid-layer-pattern"),
    "--mamba-num-groups": _only("--is-hybrid-model / --hybrid-layer-pattern"),
    "--mamba-num-heads": _only("--is-hybrid-model / --hybrid-layer-pattern"),
    "--gdp-num-householder": _only("--is-hybrid-model / --hybrid-layer-pattern"),
    "--disable-mamba-mem-eff-path": _only("--is-hybrid-model / --hybrid-layer-pattern"),
    "--gdp-cutedsl-kernel": _only("--is-hybrid-model / --hybrid-layer-pattern"),
    "--gdp-num-chunk-states-to-recompute": _only("--is-hybrid-model / --hybrid-layer-pattern"),
    "--mlp-chunks-for-prefill": _INFER,
    "--moe-paged-stash-page-size": _only("--moe-paged-stash"),
    "--moe-paged-stash-buffer-size-factor-cuda": _only("--moe-paged-stash"),
    "--moe-paged-stash-buffer-size-factor-cpu": _only("--moe-paged-stash"),
    # _add_network_size_args: network size
    "--decoder-num-layers": "T5's decoder: pretrain_gpt.py builds no decoder stack from it",
    "--window-attn-skip-freq": _only("--window-size"),
    "--yarn-original-max-position-embeddings": _ROPE_VALUES,
    "--yarn-beta-fast": _ROPE_VALUES,
    "--yarn-beta-slow": _ROPE_VALUES,
    "--yarn-correction-range-round-to-int": _ROPE_VALUES,
    "--no-yarn-correction-range-round-to-int": _ROPE_VALUES,
    "--relative-attention-num-buckets": _only("--position-embedding-type relative"),
    "--relative-attention-max-distance": _only("--position-embedding-type relative"),
    "--rotary-seq-len-interpolation-factor": _ROPE_VALUES,
    "--use-rope-scaling": _ROPE_VALUES,
    "--rope-scaling-factor": _ROPE_VALUES,
    "--openai-gelu": "registered but not read anywhere in Megatron-LM at d98e8a6",
    "--onnx-safe": "ONNX export workarounds: no training step reads it",
    "--bert-no-binary-head": "BERT only: pretrain_gpt.py does not read it",
    # _add_regularization_args
    "--weight-decay": _LR,
    "--apply-wd-to-qk-layernorm": _LR,
    "--clip-grad": "gradient clipping: a scalar norm per step",
    "--adam-beta1": "Adam's coefficients (values)",
    "--adam-beta2": "Adam's coefficients (values)",
    "--adam-eps": "Adam's coefficients (values)",
    "--sgd-momentum": _only("--optimizer sgd"),
    "--muon-momentum": _only("--optimizer muon"),
    "--muon-no-split-qkv": _only("--optimizer muon"),
    "--muon-nesterov": _only("--optimizer muon"),
    "--muon-scale-mode": _only("--optimizer muon"),
    "--muon-fp32-matmul-prec": _only("--optimizer muon"),
    "--muon-coefficient-type": _only("--optimizer muon"),
    "--muon-num-ns-steps": _only("--optimizer muon"),
    "--muon-tp-mode": _only("--optimizer muon"),
    "--muon-use-syrk": _only("--optimizer muon"),
    "--muon-extra-scale-factor": _only("--optimizer muon"),
    "--muon-scalar-optimizer": _only("--optimizer muon"),
    "--lion-beta1": _only("--optimizer lion"),
    "--lion-beta2": _only("--optimizer lion"),
    "--no-weight-decay-cond-type": _LR,
    # _add_training_args
    "--profile": "nsys profiling ranges",
    "--profile-step-start": "nsys profiling ranges",
    "--profile-step-end": "nsys profiling ranges",
    "--use-pytorch-profiler": "the PyTorch profiler's traces (host memory)",
    "--pytorch-profiler-collect-shapes": "the PyTorch profiler's traces (host memory)",
    "--pytorch-profiler-collect-callstack": "the PyTorch profiler's traces (host memory)",
    "--pytorch-profiler-collect-chakra": "the PyTorch profiler's traces (host memory)",
    "--profile-ranks": "which ranks profile",
    "--record-memory-history": "the allocator's history (host memory)",
    "--memory-snapshot-path": _PATH,
    "--record-shapes": "NVTX annotations",
    "--nvtx-ranges": "NVTX annotations",
    "--check-weight-hash-across-dp-replicas-interval": "a check between steps",
    "--train-sync-interval": "host / device synchronisation timing",
    "--train-iters": "how many steps, not what one step holds",
    "--train-samples": "how many steps, not what one step holds",
    "--exit-interval": "when the job stops",
    "--exit-duration-in-mins": "when the job stops",
    "--exit-signal-handler": _TIMEOUT,
    "--exit-signal": _TIMEOUT,
    "--exit-signal-handler-for-dataloader": _TIMEOUT,
    "--exit-signal-handler-for-training": _TIMEOUT,
    "--manual-gc": "Python's garbage collector (host objects); tensors are freed by "
                   "reference counting either way",
    "--manual-gc-interval": "Python's garbage collector (host objects)",
    "--no-manual-gc-eval": "Python's garbage collector (host objects)",
    "--iterations-to-skip": "which steps run",
    "--no-check-for-nan-in-loss-and-grad": "a scalar check on the loss and the grad norm",
    "--check-for-large-grads": "a scalar check on the grad norm",
    "--result-rejected-tracker-filename": _PATH,
    "--tp-comm-overlap-cfg": _only("--tp-comm-overlap"),
    "--no-masked-softmax-fusion": _LOCAL_ATTN + " (TE's unfused attention reads "
                                  "NVTE_MASKED_SOFTMAX_FUSION)",
    "--rope-type": _ROPE_VALUES,
    "--use-flash-attn": "registered but not read anywhere in Megatron-LM at d98e8a6 "
                        "(--attention-backend chooses)",
    "--use-torch-optimizer-for-cpu-offload": "for adam Megatron overwrites its choice: "
                                             "gpu_optimizer_cls = Adam after it "
                                             "(optimizer/__init__.py "
                                             "_get_megatron_optimizer_based_on_param_groups)"
                                             "; the other optimizers are refused",
    "--dump-param-to-param-group-map": "optimizer parameter groups (learning rates)",
    "--dataloader-type": _DATA,
    "--no-persist-layer-norm": "apex's persistent LayerNorm: not on the Transformer Engine "
                               "path",
    "--use-mcore-models": "deprecated and ignored (Megatron-Core models are the default)",
    # _add_rl_args
    "--rl-prompts-per-eval": _RL,
    "--grpo-prompts-per-step": _RL,
    "--grpo-group-size": _RL,
    "--rl-generation-lag": _RL,
    "--rl-max-inflight-requests": _RL,
    "--rl-submission-granularity": _RL,
    "--rl-consumption-granularity": _RL,
    "--rl-durable-rollout-bank": _RL,
    "--rl-rollout-bank-dir": _RL,
    "--rl-rollout-bank-max-bytes": _RL,
    "--grpo-iterations": _RL,
    "--grpo-clamp-eps-lower": _RL,
    "--grpo-clamp-eps-upper": _RL,
    "--grpo-kl-beta": _RL,
    "--grpo-entropy-term-weight": _RL,
    "--grpo-filter-groups-with-same-reward": _RL,
    "--langrl-env-config": _RL,
    "--rl-default-temperature": _RL,
    "--rl-default-top-p": _RL,
    "--rl-default-top-k": _RL,
    "--rl-offload-optimizer-during-inference": _RL,
    "--rl-kv-cache-management-mode": _RL,
    "--rl-persist-cuda-graphs": _RL,
    "--rl-partial-rollouts": _RL,
    "--rl-inference-logprobs-is-correction": _RL,
    "--rl-importance-sampling-truncation-coef": _RL,
    "--rl-use-sequence-packing": _RL,
    "--rl-sequence-packing-max-sequences-per-bin": _RL,
    "--rl-sequence-packing-algo": _RL,
    "--rl-training-cuda-graphs": _RL,
    "--rl-inference-tensor-model-parallel-size": _RL,
    "--rl-inference-pipeline-model-parallel-size": _RL,
    "--rl-inference-expert-model-parallel-size": _RL,
    "--rl-inference-expert-tensor-model-parallel-size": _RL,
    "--rl-inference-model-unified-memory-level": _RL,
    "--rl-offload-inference-model-weights-when-idle": _RL,
    "--refit-method": _RL,
    "--rl-verify-model-weights-swap": _RL,
    "--rl-skip-bos-token": _RL,
    "--rl-profile": _RL,
    "--rl-profile-dir": _RL,
    "--rl-inference-parsers": _RL,
    # _add_initialization_args
    "--seed": "random values, not shapes",
    "--te-rng-tracker": "RNG state bookkeeping (a few bytes per state)",
    "--inference-rng-tracker": _INFER,
    "--data-parallel-random-init": _INIT,
    "--init-method-xavier-uniform": _INIT,
    # _add_learning_rate_args
    "--lr-decay-style": _LR,
    "--lr-wsd-decay-style": _LR,
    "--lr-decay-iters": _LR,
    "--lr-decay-samples": _LR,
    "--lr-wsd-decay-iters": _LR,
    "--lr-wsd-decay-samples": _LR,
    "--lr-warmup-fraction": _LR,
    "--lr-warmup-iters": _LR,
    "--lr-warmup-samples": _LR,
    "--lr-warmup-init": _LR,
    "--override-opt_param-scheduler": _LR,
    "--use-checkpoint-opt_param-scheduler": _LR,
    "--start-weight-decay": _LR,
    "--end-weight-decay": _LR,
    "--weight-decay-incr-style": _LR,
    "--lr": _LR,
    "--min-lr": _LR,
    "--decoupled-lr": _LR,
    "--decoupled-min-lr": _LR,
    # _add_checkpointing_args
    "--save": _CKPT,
    "--save-interval": _CKPT,
    "--save-params-interval": _CKPT,
    "--save-activations-interval": _CKPT,
    "--save-tokens-per-expert-interval": _CKPT,
    "--save-wgrads-interval": _CKPT,
    "--save-dgrads-interval": _CKPT,
    "--save-retain-interval": _CKPT,
    "--load": _CKPT,
    "--load-main-params-from-ckpt": _CKPT,
    "--non-persistent-save-interval": _CKPT,
    "--non-persistent-ckpt-type": _CKPT,
    "--non-persistent-global-ckpt-dir": _CKPT,
    "--non-persistent-local-ckpt-dir": _CKPT,
    "--non-persistent-local-ckpt-algo": _CKPT,
    "--finetune": _CKPT,
    "--pretrained-checkpoint": _CKPT,
    "--ckpt-step": _CKPT,
    "--no-use-tokenizer-model-from-checkpoint-args": _CKPT,
    "--exit-on-missing-checkpoint": _CKPT,
    "--ckpt-format": _CKPT,
    "--auto-detect-ckpt-format": _CKPT,
    "--ckpt-convert-format": _CKPT,
    "--ckpt-convert-save": _CKPT,
    "--ckpt-convert-update-legacy-dist-opt-format": _CKPT,
    "--no-ckpt-fully-parallel-save": _CKPT,
    "--async-save": _CKPT,
    "--async-strategy": _CKPT,
    "--use-persistent-ckpt-worker": _CKPT,
    "--async-ckpt-cpu-priority": _CKPT,
    "--async-ckpt-io-priority": _CKPT,
    "--async-ckpt-use-cpu-shm": _CKPT,
    "--ckpt-fully-parallel-load": _CKPT,
    "--ckpt-fully-parallel-load-exchange-algo": _CKPT,
    "--ckpt-fully-parallel-load-per-rank-objects": _CKPT,
    "--ckpt-fully-parallel-save-process-group": _CKPT,
    "--ckpt-fully-parallel-load-process-group": _CKPT,
    "--ckpt-assume-constant-structure": _CKPT,
    "--ckpt-pg-tensors-cache-path": _CKPT,
    "--ckpt-pg-tensors-cache-create": _CKPT,
    "--no-ckpt-load-validate-sharding-integrity": _CKPT,
    "--no-strict-fsdp-dtensor-load": _CKPT,
    "--dist-ckpt-strictness": _CKPT,
    "--dist-ckpt-save-pre-mcore-014": _CKPT,
    "--dist-ckpt-optim-fully-reshardable": _CKPT,
    "--distrib-optim-fully-reshardable-mem-efficient": _CKPT,
    "--no-save-tokenizer-assets": _CKPT,
    "--replication": _CKPT,
    "--replication-jump": _CKPT,
    "--replication-factor": _CKPT,
    "--verify-integrity": _CKPT,
    "--no-save-optim": _CKPT,
    "--no-save-rng": _CKPT,
    "--no-load-optim": _CKPT,
    "--no-load-rng": _CKPT,
    "--override-ckpt-iteration": _CKPT,
    "--use-dist-ckpt": _CKPT + " (deprecated, no effect)",
    "--dist-ckpt-format": _CKPT + " (deprecated, no effect)",
    "--dist-ckpt-workers": _CKPT,
    "--ckpt-fully-parallel-save": _CKPT + " (deprecated, no effect)",
    "--ckpt-drop-redundant-extra-state": _CKPT,
    # _add_mixed_precision_args
    "--loss-scale": "fp16 loss scaling (scalars); " + _only("--fp16"),
    "--initial-loss-scale": "fp16 loss scaling (scalars); " + _only("--fp16"),
    "--min-loss-scale": "fp16 loss scaling (scalars); " + _only("--fp16"),
    "--loss-scale-window": "fp16 loss scaling (scalars); " + _only("--fp16"),
    "--hysteresis": "fp16 loss scaling (scalars); " + _only("--fp16"),
    "--attention-softmax-in-fp32": _LOCAL_ATTN + " (TE's unfused softmax falls back to fp32 "
                                   "itself)",
    "--reuse-grad-buf-for-mxfp8-param-ag": _only("--fp8-param-gather with --fp8-recipe "
                                                 "mxfp8"),
    "--mamba-training-ssm-states-dtype": _only("--is-hybrid-model / --hybrid-layer-pattern"),
    # _add_distributed_args
    "--distributed-backend": "the process-group backend",
    "--distributed-timeout-minutes": _TIMEOUT,
    "--no-align-grad-reduce": "when each pipeline stage launches its gradient reduction "
                              "(in place)",
    "--local-rank": "set by the launcher",
    "--lazy-mpu-init": "when process groups are made",
    "--nccl-communicator-config-path": "NCCL's thread-group settings",
    "--use-tp-pp-dp-mapping": "which global ranks form each group: every rank class holds "
                              "the same",
    "--disable-gloo-process-groups": "host-side (Gloo) process groups",
    "--use-sharp": "in-network reduction for data-parallel collectives",
    "--sharp-enabled-group": "in-network reduction for data-parallel collectives",
    "--high-priority-stream-groups": "CUDA stream priorities",
    "--distributed-timeout-seconds-after-init": _TIMEOUT,
    "--flight-recorder-dump-path": "NCCL flight recorder (host buffers)",
    "--flight-recorder-trace-buffer-size": "NCCL flight recorder (host buffers)",
    "--no-flight-recorder-dump-on-timeout": "NCCL flight recorder (host buffers)",
    "--flight-recorder-include-stack-trace": "NCCL flight recorder (host buffers)",
    "--no-flight-recorder-include-only-active": "NCCL flight recorder (host buffers)",
    "--no-flight-recorder-extra-dump-on-exec": "NCCL flight recorder (host buffers)",
    "--gtp-remat-reduce-scatter-with-fp32-accumulation": _only(
        "--tensor-parallel-num-weight-shards"),
    "--ddp-average-in-collective": "the gradient scaling happens inside the collective "
                                   "(in place)",
    "--overlap-param-gather-with-optimizer-step": "when the first bucket's in-place "
                                                  "all-gather starts; no buffer of its own",
    "--no-align-param-gather": "when each pipeline stage launches its parameter all-gather "
                               "(in place)",
    "--no-use-layer-wise-param-layout": "the layer-wise distributed optimizer only "
                                        "(non-Adam optimizers, refused)",
    "--disable-symmetric-registration": _only("--use-nccl-ub"),
    "--gtp-remat-nccl-ub": _only("--tensor-parallel-num-weight-shards"),
    "--gtp-expert-remat-nccl-ub": _only("--expert-tensor-parallel-num-weight-shards"),
    "--fsdp-manual-registration": _only("--use-nccl-ub"),
    "--no-gradient-reduce-div-fusion": "where the gradient division runs (in place)",
    "--keep-fp8-transpose-cache": _only("--fp8-format under --use-megatron-fsdp"),
    "--torch-fsdp2-no-reshard-after-forward": _only("--use-torch-fsdp2"),
    "--fake-process-group": "collectives skipped (a test mode); the buffers are the same",
    # _add_validation_args
    "--eval-iters": "evaluation (forward only, under no_grad) between training steps",
    "--eval-interval": "evaluation (forward only, under no_grad) between training steps",
    "--start-eval-at-iter": "evaluation (forward only, under no_grad) between training steps",
    "--eval-global-batch-size": "evaluation microbatches run forward only: none is kept "
                                "for a backward",
    "--test-mode": "extra tests alongside the run",
    "--full-validation": "evaluation (forward only, under no_grad) between training steps",
    "--multiple-validation-sets": "evaluation (forward only, under no_grad) between "
                                  "training steps",
    "--validation-set-names": _LOG,
    # _add_data_args
    "--data-path": _PATH,
    "--phase-transition-iterations": _DATA + "; the global batch stays fixed",
    "--split": _DATA,
    "--train-data-path": _PATH,
    "--valid-data-path": _PATH,
    "--test-data-path": _PATH,
    "--data-args-path": _PATH,
    "--per-split-data-args-path": _PATH,
    "--per-dataset-sequences-path": _PATH,
    "--dataloader-fast-cache-load": _DATA,
    "--dataloader-defer-npy-index-mmap": _DATA,
    "--data-cache-path": _PATH,
    "--no-mmap-bin-files": _DATA,
    "--mock-data": "synthetic tokens of the same shapes",
    "--decoder-seq-length": "T5's decoder: pretrain_gpt.py does not read it",
    "--sample-rate": _DATA,
    "--mask-prob": "BERT / T5 masking: pretrain_gpt.py does not read it",
    "--short-seq-prob": "BERT / T5 data: pretrain_gpt.py does not read it",
    "--num-workers": _DATA,
    "--eod-mask-loss": "loss-mask values",
    "--num-dataset-builder-threads": _DATA,
    "--object-storage-cache-path": _PATH,
    "--mid-level-dataset-surplus": _DATA,
    "--allow-ambiguous-pad-tokens": "loss-mask values",
    "--fim-data": "fill-in-the-middle rearranges tokens: the same sequence length",
    "--fim-rate": "fill-in-the-middle rearranges tokens: the same sequence length",
    "--fim-spm-rate": "fill-in-the-middle rearranges tokens: the same sequence length",
    "--fim-split-sample": "fill-in-the-middle rearranges tokens: the same sequence length",
    "--fim-fragment-rate": "fill-in-the-middle rearranges tokens: the same sequence length",
    "--fim-no-prefix": "fill-in-the-middle rearranges tokens: the same sequence length",
    "--fim-prefix-token": "fill-in-the-middle token names",
    "--fim-middle-token": "fill-in-the-middle token names",
    "--fim-suffix-token": "fill-in-the-middle token names",
    "--fim-pad-token": "fill-in-the-middle token names",
    "--fim-eod-token": "fill-in-the-middle token names",
    # _add_tokenizer_args
    "--merge-file": "the BPE merges: the vocabulary file gives the size",
    "--tiktoken-pattern": "how text is split into tokens",
    "--tokenizer-sentencepiece-legacy": "how text is split into tokens",
    "--no-tokenizer-sentencepiece-ignore-extra-whitespaces": "how text is split into tokens",
    "--tokenizer-hf-no-use-fast": "how text is split into tokens",
    "--tokenizer-hf-no-include-special-tokens": "how text is split into tokens",
    "--trust-remote-code": "how the tokenizer is loaded",
    "--null-tokenizer-eod-id": "a token id, not the vocabulary size",
    "--null-tokenizer-pad-id": "a token id, not the vocabulary size",
    "--chat-template": "how text is formatted",
    "--use-gigatoken": "a faster tokenizer implementation (host side)",
    # _add_autoresume_args
    "--adlr-autoresume": _TIMEOUT,
    "--adlr-autoresume-interval": _TIMEOUT,
    # _add_biencoder_args
    "--ict-head-size": _ICT,
    "--biencoder-projection-dim": _ICT,
    "--biencoder-shared-query-context-model": _ICT,
    "--ict-load": _ICT,
    "--bert-load": _ICT,
    "--titles-data-path": _ICT,
    "--query-in-block-prob": _ICT,
    "--use-one-sent-docs": _ICT,
    "--evidence-data-path": _ICT,
    "--retriever-report-topk-accuracies": _ICT,
    "--retriever-score-scaling": _ICT,
    "--block-data-path": _ICT,
    "--embedding-path": _ICT,
    "--indexer-batch-size": _ICT,
    "--indexer-log-interval": _ICT,
    # _add_vision_args
    "--num-classes": _VISION,
    "--img-h": _VISION,
    "--img-w": _VISION,
    "--num-channels": _VISION,
    "--patch-dim": _VISION,
    "--classes-fraction": _VISION,
    "--data-per-class-fraction": _VISION,
    "--no-data-sharding": _VISION,
    "--head-lr-mult": _VISION,
    "--vision-pretraining": _VISION,
    "--vision-pretraining-type": _VISION,
    "--vision-backbone-type": _VISION,
    "--swin-backbone-type": _VISION,
    "--mask-type": _VISION,
    "--mask-factor": _VISION,
    "--iter-per-epoch": _VISION,
    "--dino-local-img-size": _VISION,
    "--dino-local-crops-number": _VISION,
    "--dino-head-hidden-size": _VISION,
    "--dino-bottleneck-size": _VISION,
    "--dino-freeze-last-layer": _VISION,
    "--dino-norm-last-layer": _VISION,
    "--dino-warmup-teacher-temp": _VISION,
    "--dino-teacher-temp": _VISION,
    "--dino-warmup-teacher-temp-epochs": _VISION,
    # _add_moe_args
    "--moe-upcycling-granularity": _only("--moe-use-upcycling"),
    # _add_mla_args
    "--rotary-scaling-factor": _ROPE_VALUES + " (MLA's YaRN)",
    "--mscale": _ROPE_VALUES + " (MLA's YaRN)",
    "--mscale-all-dim": _ROPE_VALUES + " (MLA's YaRN)",
    "--cache-mla-latents": _INFER,
    # _add_logging_args
    "--log-interval": _LOG,
    "--log-params-norm": _LOG + "; the norm is a scalar",
    "--log-throughput": _LOG,
    "--log-progress": _LOG,
    "--timing-log-level": _LOG,
    "--timing-log-option": _LOG,
    "--tensorboard-dir": _LOG,
    "--tensorboard-log-interval": _LOG,
    "--tensorboard-queue-size": _LOG,
    "--log-timers-to-tensorboard": _LOG,
    "--no-log-loss-scale-to-tensorboard": _LOG,
    "--log-validation-ppl-to-tensorboard": _LOG,
    "--log-memory-to-tensorboard": _LOG + "; reads the allocator's counters",
    "--log-memory-interval": _LOG,
    "--log-device-memory-used": _LOG,
    "--log-max-attention-logit": _LOG + "; a (heads,) maximum per layer",
    "--no-barrier-with-level-1-timing": _LOG,
    "--log-world-size-to-tensorboard": _LOG,
    "--wandb-project": _LOG,
    "--wandb-exp-name": _LOG,
    "--wandb-save-dir": _LOG,
    "--wandb-entity": _LOG,
    "--logging-level": _LOG,
    "--log-energy": _LOG,
    "--moe-routing-trace-path": _LOG + "; routing decisions written as JSONL",
    "--moe-routing-trace-max-training-iters": _LOG,
    "--moe-routing-trace-dump-weights": _LOG + "; the router weights written to a file",
    "--otel-enabled": _LOG,
    "--otel-service-name": _LOG,
    "--otel-span-groups": _LOG,
    # _add_logits_distillation_args
    "--logits-save-top-k": _only("--logits-save-dir"),
    "--logits-save-top-p": _only("--logits-save-dir"),
    "--logits-save-top-p-min-k": _only("--logits-save-dir"),
    "--logits-save-dtype": _only("--logits-save-dir"),
    "--logits-load-decode-threads": _only("--logits-load-dir"),
    "--logits-load-prefetch-factor": _only("--logits-load-dir"),
    "--logits-load-msc-prefetch-depth": _only("--logits-load-dir"),
    "--logits-load-kd-loss-alpha": _only("--logits-load-dir"),
    "--logits-load-ignore-errors": _only("--logits-load-dir"),
    # _add_straggler_detector_args
    "--log-straggler": _LOG,
    "--straggler-ctrlr-port": _LOG,
    "--straggler-minmax-count": _LOG,
    "--disable-straggler-on-startup": _LOG,
    # _add_workload_inspector_server_args
    "--run-workload-inspector-server": "an on-demand profiling server (host side)",
    # _add_inference_args
    "--inference-batch-times-seqlen-threshold": _INFER,
    "--max-tokens-to-oom": _INFER,
    "--output-bert-embeddings": _INFER,
    "--bert-embedder-type": _INFER,
    "--cuda-graph-scope": _only("--cuda-graph-impl") + " (deprecated alias)",
    "--cuda-graph-modules": _only("--cuda-graph-impl"),
    "--use-legacy-static-engine": _INFER,
    "--inference-max-requests": _INFER,
    "--inference-max-seq-length": _INFER,
    "--inference-dynamic-batching": _INFER,
    "--inference-dynamic-batching-buffer-size-gb": _INFER,
    "--inference-dynamic-batching-paused-buffer-size-gb": _INFER,
    "--inference-dynamic-batching-mamba-memory-ratio": _INFER,
    "--inference-dynamic-batching-block-size": _INFER,
    "--inference-dynamic-batching-max-requests": _INFER,
    "--inference-dynamic-batching-max-tokens": _INFER,
    "--inference-dynamic-batching-num-cuda-graphs": _INFER,
    "--inference-dynamic-batching-track-paused-request-events": _INFER,
    "--inference-dynamic-batching-track-generated-token-events": _INFER,
    "--decode-only-cuda-graphs": _INFER,
    "--inference-cuda-graph-all-prefills": _INFER,
    "--inference-cuda-graph-max-tokens": _INFER,
    "--inference-dynamic-batching-unified-memory-level": _INFER,
    "--enable-chunked-prefill": _INFER,
    "--num-speculative-tokens": _INFER,
    "--inference-dynamic-batching-prefix-caching": _INFER,
    "--inference-dynamic-batching-prefix-caching-eviction-policy": _INFER,
    "--inference-dynamic-batching-prefix-caching-coordinator-policy": _INFER,
    "--inference-dynamic-batching-prefix-caching-routing-alpha": _INFER,
    "--inference-dynamic-batching-prefix-caching-mamba-gb": _INFER,
    "--inference-dynamic-batching-cuda-graph-mixed-prefill-count": _INFER,
    "--inference-dynamic-batching-cuda-graph-sizing-distribution": _INFER,
    "--inference-dynamic-batching-sampling-backend": _INFER,
    "--use-same-sampling-seed-across-dp-ranks": _INFER,
    "--inference-dynamic-batching-async-sched-mode": _INFER,
    "--inference-dynamic-batching-logprobs-mode": _INFER,
    "--inference-logging-step-interval": _INFER,
    "--inference-text-gen-server-logging": _INFER,
    "--inference-wandb-logging": _INFER,
    "--inference-coordinator-port": _INFER,
    "--mamba-inference-conv-states-dtype": _INFER,
    "--mamba-inference-ssm-states-dtype": _INFER,
    "--inference-use-synchronous-zmq-collectives": _INFER,
    "--inference-disable-ep-consensus": _INFER,
    "--inference-shards": _INFER,
    # _add_experimental_args
    "--enable-experimental": "turns on experimental code paths; at d98e8a6 only the flex "
                             "dispatcher's permute fusion reads it (flex is refused)",
    "--fsdp-db-use-persist-buf-on-alloc-fail": _only("--fsdp-double-buffer"),
    # _add_one_logger_args
    "--no-one-logger": _LOG,
    "--one-logger-project": _LOG,
    "--one-logger-run-name": _LOG,
    "--one-logger-async": _LOG,
    "--app-tag-run-name": _LOG,
    "--app-tag-run-version": _LOG,
    # _add_inprocess_restart_args
    "--inprocess-restart": "restarts the job in process after a fault; a step holds the same",
    "--inprocess-max-iterations": _TIMEOUT,
    "--inprocess-monitor-thread-interval": _TIMEOUT,
    "--inprocess-monitor-process-interval": _TIMEOUT,
    "--inprocess-progress-watchdog-interval": _TIMEOUT,
    "--inprocess-heartbeat-interval": _TIMEOUT,
    "--inprocess-soft-timeout": _TIMEOUT,
    "--inprocess-hard-timeout": _TIMEOUT,
    "--inprocess-heartbeat-timeout": _TIMEOUT,
    "--inprocess-barrier-timeout": _TIMEOUT,
    "--inprocess-completion-timeout": _TIMEOUT,
    "--inprocess-last-call-wait": _TIMEOUT,
    "--inprocess-termination-grace-time": _TIMEOUT,
    "--inprocess-granularity": _TIMEOUT,
    "--inprocess-active-world-size": "spare ranks of an in-process restart; give the active "
                                     "ranks as the world size",
    "--inprocess-empty-cuda-cache": "empties the cache on a restart, not in a step",
    # _add_ft_package_args
    "--enable-ft-package": _TIMEOUT,
    "--calc-ft-timeouts": _TIMEOUT,
    "--ft-num-warmup-iters": _TIMEOUT,
    # _add_rerun_machine_args
    "--error-injection-rate": "fault injection for the rerun machine (a test mode)",
    "--error-injection-type": "fault injection for the rerun machine (a test mode)",
    "--rerun-mode": "re-runs a step whose result is suspect: the same step again",
    "--check-for-spiky-loss": "a scalar check on the loss",
    # _add_msc_args
    "--enable-msc": "object-storage client for paths (host side)",
    "--disable-msc": "deprecated, no effect",
    # _add_sft_args
    "--sft-tokenizer-prompt-format": _only("--sft"),
    # _add_fault_injector_args
    "--fault-injector-ranks": "fault injection (a test mode)",
    "--fault-injector-num-ranks": "fault injection (a test mode)",
    "--fault-injector-fault-types": "fault injection (a test mode)",
    "--fault-injector-fault-probabilities": "fault injection (a test mode)",
    "--fault-injector-fault-delay": "fault injection (a test mode)",
    "--fault-injector-delay-start-iteration": "fault injection (a test mode)",
    "--fault-injector-mtti-seconds": "fault injection (a test mode)",
    "--fault-injector-offset-seconds": "fault injection (a test mode)",
    "--fault-injector-seed": "fault injection (a test mode)",
}

_NMY = "not modelled yet: "
_D98 = ("Megatron-LM d98e8a6's addition to fine-grained activation offloading (tracemem "
        "models the manager as at 4e85d74ae9: modeling.common.offload)")

REFUSED: dict[str, str] = {
    # _add_network_size_args: TransformerConfig fields (ArgumentGroupFactory)
    "--tensor-parallel-num-weight-shards": _NMY + "GTP weight sharding beyond TP "
                                          "(gtp_weight_remat_size > 1; the TP size itself "
                                          "is accepted)",
    "--hierarchical-context-parallel-sizes": _NMY + "hierarchical context parallelism "
                                             "(a2a+p2p)",
    "--max-seqlen-per-dp-cp-rank": _NMY + "packed sequences balanced over DP x CP ranks",
    "--hybrid-context-parallel": _NMY + "hybrid context parallelism (packed sequences)",
    "--expert-tensor-parallel-num-weight-shards": _NMY + "GTP weight sharding of the experts "
                                                 "(the ETP size itself is accepted)",
    "--fp16": _NMY + "fp16 training (its main-grad buffer is fp16 unless "
              "--accumulate-allreduce-grads-in-fp32; tracemem's recipes are bf16): use --bf16",
    "--tp-comm-overlap": _NMY + "TE's userbuffers for tensor-parallel communication overlap "
                         "(preallocated buffers)",
    "--overlap-moe-expert-parallel-comm": _NMY + "the EP all-to-all overlapped across "
                                          "microbatches (its combined 1F1B schedule)",
    "--delay-wgrad-compute": _NMY + "weight gradients delayed past their backward",
    "--overlap-dispatch-backward-with-experts-wgrad": _NMY + "the experts' delayed weight "
                                                      "gradients",
    "--ep-overlap-early-attn-memory-release": _NMY + "EP overlap's early release of attention "
                                              "activations",
    "--defer-embedding-wgrad-compute": _NMY + "the embedding's weight gradients deferred to "
                                       "the pipeline flush",
    "--overlap-p2p-communication-warmup-flush": _NMY + "pipeline receive buffers posted early "
                                                "in warm-up and flush",
    "--microbatch-group-size-per-virtual-pipeline-stage": _NMY + "an interleaved schedule "
                                                          "whose microbatch group is not PP "
                                                          "(PP, the default, is accepted)",
    "--mtp-standalone": _NMY + "a standalone MTP pipeline stage",
    "--mtp-use-repeated-layer": _NMY + "one MTP layer repeated (its parameters shared across "
                                "depths)",
    "--mtp-detach-heads": _NMY + "MTP heads detached from the main graph",
    "--mtp-hsm": _NMY + "MTP hidden-state mixing",
    "--softmax-type": _NMY + "off-by-one and learnable softmax in attention",
    "--fp32-residual-connection": _NMY + "an fp32 residual stream",
    "--apply-residual-connection-post-layernorm": _NMY + "BERT's residual order (the residual "
                                                  "taken after the norm)",
    "--glu-linear-offset": _NMY + "an offset in the GLU (unfused activation)",
    "--activation-func-clamp-value": _NMY + "a clamped activation (its saved mask)",
    "--qk-l2-norm": _NMY + "Llama-4 qk L2 norm",
    "--qk-clip": _NMY + "qk-clip's max-logit tracking (Muon)",
    "--attention-output-gate": _NMY + "an output gate on attention",
    "--experimental-attention-variant": _NMY + "experimental attention (DSA, gated delta net)",
    "--use-mup": _NMY + "MuP's embedding and output-logit multipliers (extra logits-sized "
                 "tensors)",
    "--mup-embedding-mult": _NMY + "an embedding-output multiplier (an extra (s, b, h) tensor)",
    "--mup-output-mult": _NMY + "an output-logit multiplier (an extra logits-sized tensor)",
    "--apply-query-key-layer-scaling": _NMY + "the fp32 attention softmax it turns on "
                                       "(validate_args sets --attention-softmax-in-fp32)",
    "--use-fused-weighted-squared-relu": _NMY + "the fused weighted squared-ReLU of MoE "
                                         "experts",
    "--fused-residual-rmsnorm": _NMY + "the fused residual + RMSNorm backward",
    "--use-transformer-engine-op-fuser": _NMY + "TE's operation fuser",
    "--no-fp8-wgrad": _NMY + "the weight-gradient GEMM in bf16 under FP8 (TE's "
                      "override_linear_precision: bf16 inputs kept for it)",
    "--fp8-output-proj": _NMY + "the output layer under MXFP8",
    "--use-kitchen-attention": _NMY + "the kitchen extension's attention",
    "--fp4-format": _NMY + "FP4 (NVFP4) training",
    "--use-grouped-gemm-for-shared-expert": _NMY + "the shared expert as a GroupedLinear",
    "--moe-shared-expert-glu-interleave-size": _NMY + "the shared expert's block-interleaved "
                                               "GLU",
    "--moe-enable-routing-replay": _NMY + "routing replay (the recorded routing decisions)",
    "--moe-router-padding-for-quantization": _NMY + "the routing map padded to multiples of "
                                             "16 / 32 tokens per expert",
    "--moe-router-padding-for-fp8": _NMY + "the routing map padded to multiples of 16 / 32 "
                                    "tokens per expert",
    "--moe-router-force-biased": _NMY + "a random expert bias (unbalanced routing from the "
                                 "router's own draw)",
    "--use-grouped-gemm-for-dense-mlp": _NMY + "the dense MLP as a GroupedLinear",
    "--moe-use-grouped-tensor": _NMY + "TE's GroupedTensor path (padded expert segments)",
    "--moe-single-grouped-weight": _NMY + "the experts' weights as one grouped parameter",
    "--moe-single-grouped-bias": _NMY + "the experts' biases as one grouped parameter",
    "--moe-z-loss-coeff": _NMY + "the router z-loss (its (tokens, experts) saved tensors)",
    "--moe-input-jitter-eps": _NMY + "input jitter (an extra (tokens, h) tensor)",
    "--moe-enable-deepep": _NMY + "DeepEP's flex dispatcher and its communication buffers",
    "--moe-expert-capacity-factor": _NMY + "token dropping at an expert capacity",
    "--moe-pad-expert-input-to-capacity": _NMY + "expert inputs padded to the capacity",
    "--moe-router-fusion": _NMY + "TE's fused top-k routing and aux-loss kernel",
    "--moe-apply-probs-on-input": _NMY + "routing probabilities applied to the experts' "
                                  "input",
    "--moe-latent-size": _NMY + "MoE latent projections",
    "--moe-mlp-glu-interleave-size": _NMY + "the experts' block-interleaved GLU",
    "--moe-expert-rank-capacity-factor": _NMY + "token dropping at an expert-rank capacity",
    "--enable-cuda-graph": _NMY + "CUDA graphs (their static memory pools)",
    "--external-cuda-graph": _NMY + "CUDA graphs (their static memory pools)",
    "--cuda-graph-impl": _NMY + "CUDA graphs (their static memory pools)",
    "--enable-mhc-connections": _NMY + "mHC residual streams",
    "--no-clone-scatter-output-in-embedding": _NMY + "the embedding's scattered output kept "
                                              "as a view of the full one",
    "--batch-invariant-mode": _NMY + "batch-invariant kernels",
    "--use-te-activation-func": _NMY + "TE's activation modules",
    "--symmetric-ar-type": _NMY + "symmetric-memory all-reduce buffers",
    "--is-hybrid-model": _NMY + "hybrid (Mamba) models",
    "--mlp-chunks-for-training": _NMY + "the MLP run in sequence chunks",
    "--delay-offload-until-cuda-graph": _NMY + _D98,
    "--delta-offload-bytes-across-pp-ranks": _NMY + _D98,
    "--activation-offload-fraction": _NMY + _D98,
    "--moe-paged-stash": _NMY + "the paged stash of expert activations",
    "--fine-grained-offloading-max-inflight-offloads": _NMY + _D98,
    # _add_network_size_args: network size
    "--window-size": _NMY + "sliding-window attention",
    "--no-rope-freq": _NMY + "layers without RoPE",
    "--quick-geglu": _NMY + "the quick-GeGLU activation",
    # _add_training_args
    "--rampup-batch-size": _NMY + "a global batch that changes during training (tracemem "
                           "estimates one step: give the final batch)",
    "--step-batch-size-schedule": _NMY + "a global batch that changes during training "
                                  "(tracemem estimates one step: give one batch)",
    "--gpu-sniff-test-interval": _NMY + "the GEMM / all-to-all / send-recv sniff tests' own "
                                "buffers",
    "--batch-size": "Megatron refuses it: '--batch-size argument is no longer valid, use "
                    "--micro-batch-size instead' (validate_args)",
    "--checkpoint-activations": "Megatron refuses it: '--checkpoint-activations is no longer "
                                "valid, use --recompute-activations, or, for more control, "
                                "--recompute-granularity and --recompute-method' "
                                "(validate_args)",
    "--no-bias-gelu-fusion": _NMY + "the unfused bias + GELU (no effect without biases or "
                             "GELU)",
    "--no-bias-swiglu-fusion": _NMY + "the unfused SwiGLU (no effect without --swiglu)",
    "--no-bias-dropout-fusion": _NMY + "the unfused bias-dropout-add (no effect without "
                                "dropout)",
    "--optimizer-cuda-graph": _NMY + "the optimizer step in a CUDA graph (its static pool)",
    # _add_rl_args
    "--perform-rl-step": _NMY + "RL steps (inference engine, KV cache and training in one "
                         "job)",
    # _add_learning_rate_args
    "--warmup": "Megatron refuses it: '--warmup argument is no longer valid, use "
                "--lr-warmup-fraction instead' (validate_args)",
    "--freeze-all-layers": _NMY + "frozen parameters (no gradients, no optimizer states)",
    # _add_checkpointing_args
    "--use-checkpoint-args": _NMY + "the model's arguments read from a checkpoint: give them "
                             "as arguments",
    "--use-mp-args-from-checkpoint-args": _NMY + "the parallel sizes read from a checkpoint: "
                                          "give them as arguments",
    # _add_mixed_precision_args
    "--fp16-lm-cross-entropy": _NMY + "the fp16 cross entropy (fp16 training)",
    "--output-logit-dtype": _NMY + "logits in another dtype than the activations (bf16 is "
                            "accepted)",
    # _add_distributed_args
    "--use-torch-fsdp2": _NMY + "PyTorch FSDP2's wrapping (tracemem's ZeRO-2 / 3 are "
                         "Megatron-FSDP's)",
    "--disable-jit-fuser": _NMY + "the eager (unfused) bias-GELU / bias-dropout-add",
    "--model-parallel-size": "Megatron refuses it: '--model-parallel-size is no longer valid, "
                             "use --tensor-model-parallel-size instead' (validate_args)",
    "--ddp-reduce-scatter-with-fp32-accumulation": _NMY + "the fp32-accumulating "
                                                   "reduce-scatter's scratch buffer (no "
                                                   "effect with fp32 main grads: "
                                                   "validate_args turns it off)",
    "--ddp-param-name-patterns-for-fp32-local-accumulation": _NMY + "fp32 local gradient "
                                                             "accumulation buffers",
    "--megatron-fsdp-version": _NMY + "Megatron-FSDP version 2",
    "--use-nccl-ub": _NMY + "NCCL userbuffer registration (its own pools and, with FSDP, "
                     "double buffers)",
    "--outer-dp-sharding-strategy": _NMY + "hybrid-sharded data parallelism (HSDP)",
    "--fsdp-double-buffer": _NMY + "Megatron-FSDP's double buffers",
    "--suggested-communication-unit-size": _NMY + "Megatron-FSDP communication units other "
                                           "than the modules",
    "--enable-full-sharding-in-hsdp": _NMY + "hybrid-sharded data parallelism (HSDP)",
    # _add_validation_args
    "--eval-micro-batch-size": _NMY + "evaluation with another micro batch than training "
                               "(its forward can set the peak; the training one is accepted)",
    "--skip-train": _NMY + "evaluation without training (tracemem estimates a training step)",
    # _add_data_args
    "--reset-position-ids": _NMY + "per-document position ids (per-sample RoPE tables)",
    "--reset-attention-mask": _NMY + "per-document attention masks",
    "--dataloader-inter-document-masking": _NMY + "packed documents (THD attention)",
    # _add_tokenizer_args
    "--no-pad-vocab-size": _NMY + "the unpadded vocabulary path: give --padded-vocab-size "
                           "(no effect with it)",
    "--vocab-extra-ids": _NMY + "which tokenizers add the extra ids: give the final size "
                         "with --vocab-size",
    # _add_moe_args
    "--moe-use-upcycling": _NMY + "dense-to-MoE upcycling (a checkpoint conversion)",
    # _add_mla_args
    "--mla-down-proj-fusion": _NMY + "MLA's fused down projection (FusedMLASelfAttention)",
    # _add_experimental_attention_variant_args
    "--linear-attention-freq": _NMY + "linear-attention layers",
    # _add_heterogeneous_args
    "--heterogeneous-layers-config-path": _NMY + "heterogeneous layers",
    "--heterogeneous-layers-config-encoded-json": _NMY + "heterogeneous layers",
    # _add_logging_args
    "--moe-routing-trace-capture-logits": _NMY + "router logits captured for tracing",
    "--moe-routing-trace-capture-hidden-states": _NMY + "router inputs captured for tracing",
    # _add_logits_distillation_args
    "--logits-save-dir": _NMY + "the top-k logits saved for distillation",
    "--logits-load-dir": _NMY + "the distillation loss on loaded logits",
    # _add_transformer_engine_args
    "--fp4-param-gather": _NMY + "FP4 parameters",
    "--te-precision-config-file": _NMY + "per-module precision overrides",
    # _add_experimental_args
    "--spec": _NMY + "a custom layer spec (tracemem builds Megatron's GPT spec)",
    "--hybrid-layer-pattern": _NMY + "hybrid (Mamba) models",
    "--hybrid-override-pattern": _NMY + "hybrid (Mamba) models",
    "--yaml-cfg": _NMY + "arguments from Megatron's experimental YAML file: give them as "
                  "arguments or as a functional-test model_config.yaml",
    "--megatron-fsdp-main-params-dtype": _NMY + "Megatron-FSDP's own main-parameter dtype",
    "--megatron-fsdp-main-grads-dtype": _NMY + "Megatron-FSDP's own main-gradient dtype",
    "--megatron-fsdp-grad-comm-dtype": _NMY + "Megatron-FSDP's gradient communication dtype",
    "--megatron-fsdp-enable-fine-grained-param-gather": _NMY + "Megatron-FSDP's fine-grained "
                                                        "parameter gathers",
    "--megatron-fsdp-max-pool-double-buffer": _NMY + "Megatron-FSDP's double buffers",
    # _add_sft_args
    "--sft": _NMY + "SFT's packed sequences",
    # _add_kitchen_quantization_arguments (only when NVIDIA kitchen is installed)
    "--kitchen-config-file": _NMY + "kitchen quantization",
    "--kitchen-recipe-number": _NMY + "kitchen quantization",
}

# Environment variables (a model_config.yaml's ENV_VARS): name -> what it sets / why not
ENV_HONOURED: dict[str, str] = {
    "PYTORCH_CUDA_ALLOC_CONF": "alloc_conf (the simulated caching allocator)",
    "NVTE_FLASH_ATTN": "checked against --attention-backend as Megatron-Core checks it "
                       "(language_module.py _set_attention_backend)",
    "NVTE_FUSED_ATTN": "checked against --attention-backend as Megatron-Core checks it",
    "NVTE_UNFUSED_ATTN": "checked against --attention-backend as Megatron-Core checks it",
    "WORLD_SIZE": "world_size when it is not given otherwise (Megatron reads it from the "
                  "launcher's environment)",
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "approximation: how long tensors used by NCCL live "
                                       "after their collective is not modelled either way",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "approximation: TE's kernel choice; the same saved "
                                        "tensors, workspaces not traced",
    "CUBLAS_WORKSPACE_CONFIG": "cublas_workspace_config: the size of PyTorch's cuBLAS "
                               "workspaces (:4096:8 = 32 MiB per handle and stream; "
                               "tracemem.workspaces, counted with a GPU kind)",
    "NVTE_NORM_FWD_USE_CUDNN": "approximation: cuDNN norm kernels save the same mean and "
                               "rsigma; workspaces not traced",
    "NVTE_NORM_BWD_USE_CUDNN": "approximation: cuDNN norm kernels save the same mean and "
                               "rsigma; workspaces not traced",
    "NVTE_MASKED_SOFTMAX_FUSION": "kernel_options masked_softmax_fusion (0: TE's unfused "
                                  "attention runs torch's fp32 softmax)",
}

ENV_NEUTRAL: dict[str, str] = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "how many hardware queues the host uses",
    "NVTE_FWD_LAYERNORM_SM_MARGIN": "SMs left to communication kernels",
    "NVTE_BWD_LAYERNORM_SM_MARGIN": "SMs left to communication kernels",
    "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE": "checkpoint loading",
    "NVTE_CPU_OFFLOAD_V1": "TE's CPU offload code path (1: the v1 path Megatron's "
                           "fine-grained activation offloading needs with TE >= 2.10, "
                           "validate_args; its hooks are Megatron's, modelled with the flag); "
                           "with --cpu-offloading-num-layers the v1 path is refused",
    "NVTE_FLASH_ATTN_V2": "which FlashAttention generation (the same saved tensors)",
    "NVTE_FLASH_ATTN_V3": "which FlashAttention generation (the same saved tensors)",
    "NVTE_FLASH_ATTN_V4": "which FlashAttention generation (the same saved tensors)",
    "NVTE_DEBUG": "logging",
    "NVTE_DEBUG_LEVEL": "logging",
    "PYTHONWARNINGS": "logging",
    "CUDA_GRAPHS_USE_NODE_PRIORITY": "CUDA graph scheduling (graphs are refused)",
    "MAMBA_DETERMINISTIC": "Mamba layers only (hybrid models are refused)",
    "CAUSAL_CONV1D_DETERMINISTIC": "Mamba layers only (hybrid models are refused)",
    "TRITON_CACHE_AUTOTUNING": "Triton's autotuning cache (host side)",
    "TORCHINDUCTOR_WORKER_START": "torch.compile's workers (host side)",
    "TORCH_INDUCTOR_DISABLE": "torch.compile is not on Megatron's training path",
    "TORCH_COMPILE_DISABLE": "torch.compile is not on Megatron's training path",
    "TORCHDYNAMO_DISABLE": "torch.compile is not on Megatron's training path",
    "USE_MNNVL": "multi-node NVLink transport",
    "NVLINK_DOMAIN_SIZE": "the flex dispatcher's topology (flex is refused)",
    "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN": "HybridEP's topology (flex is refused)",
    "NUM_OF_TOKENS_PER_CHUNK_COMBINE_API": "HybridEP's chunking (flex is refused)",
    "TORCH_NCCL_HIGH_PRIORITY": "NCCL stream priority",
    "MEGATRON_OTEL_ENABLED": "logging",
    "RANK": "set by the launcher",
    "LOCAL_RANK": "set by the launcher",
    "MASTER_ADDR": "set by the launcher",
    "MASTER_PORT": "set by the launcher",
    "HF_HOME": "a path",
    "SKIP_PYTEST": _HARNESS,
    "NON_DETERMINSTIC_RESULTS": _HARNESS,
    "N_REPEAT": _HARNESS,
    "N_REPEATS": _HARNESS,
    "ARTIFACTS_ROOT": _HARNESS,
    "THROUGHPUT_START_STEP": _HARNESS,
    "ENABLE_LIGHTWEIGHT_MODE": _HARNESS,
    "TOKENIZER": _HARNESS + " (a tokenizer name for its scripts)",
    "PTQ_QUANTIZED_CKPT": _HARNESS + " (a path)",
    "MODEL_BF16_CKPT": _HARNESS + " (a path)",
    "QUANTIZATION_TYPE_DEBUG": "logging",
}
# every variable of NCCL's own and NVSHMEM's (only the refused flex dispatcher uses it):
# transport, algorithm and logging settings; NCCL's buffers are outside tracemem's estimate
ENV_NEUTRAL_PREFIXES: dict[str, str] = {
    "NCCL_": "NCCL's transport / algorithm settings (NCCL's own buffers are outside "
             "tracemem's estimate: --non-pytorch-memory)",
    "NVSHMEM_": "NVSHMEM transport (the flex dispatcher only, refused)",
}

ENV_REFUSED: dict[str, str] = {
    "NVTE_APPLY_QK_LAYER_SCALING": _NMY + "query-key layer scaling (fp32 softmax)",
    "NVTE_CUTEDSL_FUSED_GROUPED_MLP": _NMY + "the CuTe DSL fused grouped MLP",
    "DISTILL_CONFIG": _NMY + "distillation (a teacher model beside the student)",
}
