"""Megatron-LM's ``theoretical_memory_usage.py`` (NVIDIA/Megatron-LM d98e8a6, the project's pin)
as ``tracemem.formulas.megatron`` reimplements it, held against hand arithmetic: for each of
five jobs every expected value is written out below following the source line by line ("line
N" is a line of megatron/training/theoretical_memory_usage.py at d98e8a6; "arguments.py N" a
line of megatron/training/arguments.py there), not computed by the code under test.

Where the source's float operations are exact (powers of two, 3 / 2) the expected values are
exact integers; the 1.05 overhead factor (line 450) is written as the source applies it, on the
hand-computed total, so the comparison stays exact.
"""

import argparse

import pytest

from tracemem.errors import TracememError
from tracemem.formulas import megatron
from tracemem.formulas.megatron import formula_bytes_for_job, theoretical_memory_usage
from tracemem.frontdoors.megatron_args import parse_megatron_args

MAX_POS = ["--max-position-embeddings", "4096"]  # required by validate_args, read by no term


def job(flags: str, world_size: int):
    return formula_bytes_for_job(MAX_POS + flags.split(), world_size)


# --- A: a small dense GPT: LayerNorm, biases, tied embeddings, TP 2, distributed optimizer --
DENSE = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 "
         "--micro-batch-size 2 --global-batch-size 16 --vocab-size 1000 "
         "--tensor-model-parallel-size 2 --use-distributed-optimizer")


def test_small_dense_gpt_follows_the_source_line_by_line():
    r = job(DENSE, 8)
    d, w, a = r.derived, r.weights, r.activations
    # derived as validate_args would: DP = 8 / (TP 2 x PP 1 x CP 1) (arguments.py 448);
    # ffn 4h (arguments.py 1329); kv_channels h / heads (1333); vocab 1000 padded to a
    # multiple of 128 x TP 2 = 256: 4 x 256 (build_tokenizer.py 138-139); M = 16 / (2 x 4)
    assert (d.data_parallel_size, d.ffn_hidden_size, d.kv_channels) == (4, 1024, 32)
    assert (d.padded_vocab_size, d.num_microbatches) == (4 * 256, 2)
    assert w.query_projection_size == 32 * 8  # line 14
    assert w.num_query_groups == 8  # lines 17-18: no GQA, heads
    assert w.norm_size == 2  # line 60: LayerNorm has a bias
    assert w.self_attn_term == 2 * 256 * 256 * ((1 + 8 / 8) * 1.0) == 262_144  # lines 82-93
    assert w.embedding_size == 256 * 1024 == 262_144  # line 95
    assert w.dense_mlp_params == 2 * 256 * 1024 * 1 == 524_288  # line 103
    assert w.layernorm_params == 2 * 256 * 2 == 1024  # line 127
    assert w.num_parameters_in_transformer_layer_dense == 262_144 + 524_288 + 1024  # 139-141
    assert w.num_parameters_in_transformer_block == 787_456 * 4 + 2 * 256  # lines 160-164
    assert w.num_total_parameters == 3_150_336 + 262_144 == 3_412_480  # lines 174-178
    # lines 248-252: (layers / PP + MTP 0 + embedding) / TP; tied, so no output layer
    assert w.tp_sharded_params_on_most_loaded_shard == (
        (262_144 + 524_288) * 4 / 1 + 0 + 262_144) / 2 == 1_703_936
    assert w.replicated_params_on_most_loaded_shard == 1024 * 4 + 512 == 4608  # 219-229, 253
    assert w.num_parameters_on_other_model_shards is None  # line 274: PP 1
    assert w.bytes_per_parameter == 6 + 12 / 4 == 9  # line 296, DP 4
    assert r.weight_and_optimizer_exact == (1_703_936 + 4608) * 9 == 15_376_896  # 298-303
    # activations: no SP, no selective recompute -> without_sp (line 473)
    assert a.function == "compute_activation_memory_without_sp"
    assert a.per_layer == 512 * 2 * 256 * (10 + 24 / 2) == 5_767_168  # line 386
    assert a.layers == 5_767_168 * 4  # line 395
    assert a.embedding_input == 8 * 512 * 2 * 1 == 8192  # lines 399-401
    assert a.embedding_dropout == 512 * 2 * 256 * 1 == 262_144  # lines 403-408
    assert a.interleaved_schedule_memory_penalty is None and a.in_flight_microbatches is None
    assert a.pipeline_microbatch_discount is None  # lines 428-435: PP 1
    assert a.output_layer == (512 * 2 * 1024 / 2 + 512 * 2 * 256) * 2 == 1_572_864  # 438-447
    before_overhead = 23_068_672 + 8192 + 262_144 + 1_572_864
    assert before_overhead == 24_911_872
    assert r.activation_exact == 24_911_872 * 1.05  # lines 450-451
    assert r.activation_bytes == 26_157_466  # 26,157,465.6 to the nearest byte
    assert r.total_exact == 15_376_896 + 24_911_872 * 1.05  # line 479
    assert r.total_bytes == 41_534_362
    assert r.weight_and_optimizer_bytes == 15_376_896


# --- B: GQA + SwiGLU + RMSNorm, no biases, untied, TP 4 + SP + selective recompute ---------
GQA = ("--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --group-query-attention "
       "--num-query-groups 4 --swiglu --normalization RMSNorm --disable-bias-linear "
       "--untie-embeddings-and-output-weights --seq-length 1024 --micro-batch-size 1 "
       "--global-batch-size 32 --vocab-size 32000 --tensor-model-parallel-size 4 "
       "--sequence-parallel --recompute-activations")


def test_gqa_swiglu_with_sp_and_selective_recompute():
    r = job(GQA, 16)
    d, w, a = r.derived, r.weights, r.activations
    # SwiGLU's ffn: int((4 x 1024 x 2 / 3) / 64) x 64 = int(42.67) x 64 (arguments.py 1327)
    assert d.ffn_hidden_size == 42 * 64 == 2688
    assert d.recompute_granularity == "selective"  # --recompute-activations, arguments.py 608
    assert d.padded_vocab_size == 63 * 512 == 32_256  # ceil(32000 / (128 x 4)) x 512
    assert w.num_query_groups == 4
    assert w.gated_linear_multiplier == 3 / 2  # line 21
    assert w.self_attn_term == 2 * 1024 * 1024 * ((1 + 4 / 16) * 1.0) == 2_621_440  # 82-93
    assert w.dense_mlp_params == 2 * 1024 * 2688 * 1.5 == 8_257_536  # line 103
    assert w.layernorm_params == 2 * 1024 * 1 and w.final_layernorm == 1024  # RMSNorm: 1
    assert w.num_parameters_in_embedding_layers == 2 * 1024 * 32_256  # lines 97-98: untied
    assert w.num_total_parameters == (2_621_440 + 8_257_536 + 2048) * 8 + 1024 + 66_060_288
    # lines 248-252, then line 266: the untied output layer at PP 1
    assert w.tp_sharded_params_on_most_loaded_shard == (
        (2_621_440 + 8_257_536) * 8 + 33_030_144) / 4 + 33_030_144 / 4 == 38_273_024
    assert w.replicated_params_on_most_loaded_shard == 2048 * 8 + 1024 == 17_408
    assert w.bytes_per_parameter == 18  # line 296: no distributed optimizer
    assert r.weight_and_optimizer_exact == (38_273_024 + 17_408) * 18 == 689_227_776
    # SP and selective -> compute_activation_memory (line 466)
    assert a.function == "compute_activation_memory"
    assert a.per_layer == (1024 * 1 * 1024) * (18 + 4 * (2688 / 1024)) == 29_884_416  # 317-319
    assert a.output_layer == 1024 * 1 * 1024 * 4 * (1 + 32_256 / 1024) == 136_314_880  # 370-376
    assert a.overhead_factor is None
    total = 29_884_416 * 8 + 8 * 1024 * 1 * 1 + 1024 * 1 * 1024 * 1 + 136_314_880
    assert r.activation_exact == total / 4 == 94_111_744  # line 379: / TP
    assert r.total_bytes == 689_227_776 + 94_111_744 == 783_339_520


# --- C: MoE with EP 4 and ETP 1, a dense first layer, shared expert with its gate ----------
MOE = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --num-experts 8 "
       "--moe-ffn-hidden-size 256 --moe-router-topk 2 --moe-shared-expert-intermediate-size 512 "
       "--moe-shared-expert-gate --moe-layer-freq ([0]*1+[1]*3) --expert-model-parallel-size 4 "
       "--expert-tensor-parallel-size 1 --tensor-model-parallel-size 2 --swiglu "
       "--normalization RMSNorm --disable-bias-linear --use-distributed-optimizer "
       "--seq-length 256 --micro-batch-size 1 --global-batch-size 8 --vocab-size 50000")


def test_moe_with_expert_parallelism_shards_experts_over_edp():
    r = job(MOE, 8)
    w, a = r.weights, r.activations
    assert r.derived.ffn_hidden_size == 21 * 64  # int((4 x 512 x 2 / 3) / 64) x 64
    assert r.derived.padded_vocab_size == 196 * 256 == 50_176
    assert w.moe_layer_pattern == (0, 1, 1, 1) and (w.num_dense_layers, w.num_moe_layers) == (
        1, 3)  # lines 34-43
    assert w.self_attn_term == 2 * 512 * 512 * 2.0 == 1_048_576
    assert w.dense_mlp_params == 2 * 512 * 1344 * 1.5 == 2_064_384  # line 103
    assert w.shared_expert_params == 2 * 512 * 512 * 1.5 == 786_432  # line 104
    assert w.routed_expert_params == 2 * 512 * 256 * 8 * 1.5 == 3_145_728  # lines 110-112
    assert w.active_routed_expert_params == 2 * 512 * 256 * 2 * 1.5 == 786_432  # 113-121
    assert w.router_params == 512 * 8 + 0 == 4096  # lines 128-132: no bias
    assert w.shared_expert_gate_params == 512  # lines 133-137
    assert w.num_parameters_in_transformer_layer_moe == (
        1_048_576 + 786_432 + 3_145_728 + 0 + 1024 + 4096 + 512) == 4_986_368  # 142-150
    assert w.num_active_parameters_in_transformer_layer_moe == (
        1_048_576 + 786_432 + 786_432 + 0 + 1024 + 4096 + 512) == 2_627_072  # 151-159
    assert w.num_total_parameters == (1_048_576 + 2_064_384 + 1024) + 4_986_368 * 3 + 512 + (
        512 * 50_176)  # lines 160-178, tied
    assert w.expert_data_parallel_size == 8 // (1 * 4 * 1) == 2  # lines 207-212
    assert w.tp_sharded_params_on_most_loaded_shard == (
        (1_048_576 + 2_064_384) * 1 + (1_048_576 + 786_432) * 3 + 25_690_112) / 2 == 17_154_048
    assert w.replicated_params_on_most_loaded_shard == (
        1024 * 1 + (1024 + 0 + 4096 + 512) * 3 + 512) == 18_432  # lines 219-229
    assert w.expert_sharded_params_on_most_loaded_shard == 3_145_728 * 3 / (1 * 4)  # 256-259
    # DP 4: 6 + 12 / 4 = 9 B; EDP 2: 6 + 12 / 2 = 12 B (lines 298-303)
    assert (w.bytes_per_parameter, w.expert_bytes_per_parameter) == (9, 12)
    assert r.weight_and_optimizer_exact == (
        (17_154_048 + 18_432) * 9 + 2_359_296 * 12) == 182_863_872
    # no SP: without_sp, the dense term for every layer (lines 386-453), no MoE term
    assert a.per_layer == 256 * 1 * 512 * (10 + 24 / 2)
    total = (256 * 1 * 512 * 22 * 4 + 8 * 256 * 1 * 1 + 256 * 1 * 512 * 1
             + (256 * 1 * 50_176 / 2 + 256 * 1 * 512) * 2)
    assert total == 24_774_656
    assert r.activation_exact == 24_774_656 * 1.05
    assert r.total_exact == 182_863_872 + 24_774_656 * 1.05


# --- D: MLA with a q LoRA, MTP on an all-MoE model, PP 2 with fewer microbatches than PP ---
MLA_MTP = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --multi-latent-attention "
           "--q-lora-rank 128 --kv-lora-rank 64 --qk-head-dim 32 --qk-pos-emb-head-dim 16 "
           "--v-head-dim 32 --num-experts 4 --moe-ffn-hidden-size 128 --moe-router-topk 2 "
           "--expert-model-parallel-size 2 --mtp-num-layers 1 --position-embedding-type rope "
           "--swiglu --normalization RMSNorm --disable-bias-linear "
           "--untie-embeddings-and-output-weights --pipeline-model-parallel-size 2 "
           "--seq-length 128 --micro-batch-size 1 --global-batch-size 2 --vocab-size 4096")


def test_mla_and_mtp_on_the_most_loaded_shard():
    r = job(MLA_MTP, 4)
    d, w, a = r.derived, r.weights, r.activations
    assert (d.data_parallel_size, d.num_microbatches, d.expert_tensor_parallel_size) == (
        2, 1, 1)  # 4 / (1 x 2); 2 / (1 x 2); ETP defaults to TP 1 (arguments.py 588)
    # lines 65-80: q LoRA (rank 128) + up projection with RoPE + q norm; kv LoRA + kv norm;
    # the shared RoPE key; the output projection
    q_term = 128 * (256 + 4 * (32 + 16) + 1)
    kv_term = 64 * (256 + 4 * (32 + 32) + 1)
    assert w.self_attn_term == q_term + kv_term + 256 * 16 + (4 * 32) * 256 == 127_168
    assert w.moe_layer_pattern == (1, 1, 1, 1)  # moe_layer_freq 1: i % 1 == 0 (line 32)
    assert (w.mtp_num_moe_layers, w.mtp_num_dense_layers) == (1, 0)  # lines 51-54
    assert w.routed_expert_params == 2 * 256 * 128 * 4 * 1.5 == 393_216
    moe_layer = 127_168 + 0 + 393_216 + 0 + 2 * 256 + 256 * 4 + 0
    assert w.num_parameters_in_transformer_layer_moe == moe_layer == 521_920
    assert w.num_parameters_in_mtp_block == 521_920 * 1  # lines 170-173
    assert w.num_total_parameters == 521_920 * 4 + 256 + 521_920 + 2 * 256 * 4096
    assert w.expert_data_parallel_size == 4 // (1 * 2 * 2) == 1
    # lines 248-255: 1 / PP of the layers, the whole MTP block, the embedding; untied but
    # PP 2, so no output layer (line 265)
    assert w.tp_sharded_params_on_most_loaded_shard == (
        127_168 * 4 / 2 + 127_168 + 256 * 4096) / 1 == 1_430_080
    assert w.replicated_params_on_most_loaded_shard == (
        (512 + 1024) * 4 + 256) / 2 + (512 + 1024) == 4736
    assert w.expert_sharded_params_on_most_loaded_shard == (
        393_216 * 4 / 2 + 393_216) / (1 * 2) == 589_824
    assert w.num_parameters_on_other_model_shards == (
        127_168 * 4 / (2 * 1) + 6400 / 2 + 393_216 * 4 / (2 * 1 * 2)) == 650_752  # 274-286
    assert r.weight_and_optimizer_exact == (1_430_080 + 4736) * 18 + 589_824 * 18 == 36_443_520
    # TP 1: no SP (arguments.py 1439), without_sp; PP 2 without VPP and M = 1 < PP:
    # x min(1, 1 / 2) (line 430), one microbatch in flight (line 431); no output layer (438)
    assert a.pipeline_microbatch_discount == 0.5 and a.in_flight_microbatches == 1
    assert a.output_layer is None
    total = (128 * 1 * 256 * (10 + 24 / 1) * 4 + 8 * 128 * 1 * 2 + 128 * 1 * 256 * 2) * 0.5
    assert total == 2_262_016
    assert r.activation_exact == 2_262_016 * 1.05


# --- E: dense GPT on PP 4 with VPP 2 (interleaved), TP 2 + SP + selective recompute ---------
VPP = ("--num-layers 8 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size 2048 "
       "--tensor-model-parallel-size 2 --sequence-parallel --recompute-granularity selective "
       "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1 "
       "--use-distributed-optimizer --seq-length 1024 --micro-batch-size 1 "
       "--global-batch-size 16 --vocab-size 50257")


def test_interleaved_pipeline_penalty():
    r = job(VPP, 16)
    d, w, a = r.derived, r.weights, r.activations
    # VPP = (8 layers / PP 4) / 1 layer per virtual stage (arguments.py 972-975)
    assert (d.virtual_pipeline_model_parallel_size, d.data_parallel_size) == (2, 2)
    assert d.padded_vocab_size == 197 * 256 == 50_432
    layer = 2 * 512 * 512 * 2.0 + 2 * 512 * 2048 + 2 * 512 * 2
    assert w.num_parameters_in_transformer_layer_dense == layer == 3_147_776
    assert w.tp_sharded_params_on_most_loaded_shard == (
        (1_048_576 + 2_097_152) * 8 / 4 + 512 * 50_432) / 2 == 16_056_320
    assert w.replicated_params_on_most_loaded_shard == (2048 * 8 + 1024) / 4 == 4352
    assert w.num_parameters_on_other_model_shards == 25_165_824 / (4 * 2) + 17_408 / 4
    assert r.weight_and_optimizer_exact == (16_056_320 + 4352) * (6 + 12 / 2) == 192_728_064
    # lines 342-355: 1 + (4 - 1) / (4 x 2) = 1.375; ceil(1.375 x 4) = 6 in flight
    assert a.interleaved_schedule_memory_penalty == 1.375 and a.in_flight_microbatches == 6
    assert a.pipeline_microbatch_discount is None  # line 359: VPP set
    assert a.output_layer is None  # line 368: PP 4
    total = ((1024 * 1 * 512) * (18 + 4 * (2048 / 512)) * 8
             + 8 * 1024 * 1 * 4 + 1024 * 1 * 512 * 4) * 1.375
    assert total == 199_012_352
    assert r.activation_exact == 199_012_352 / 2 == 99_506_176  # line 379
    assert r.total_bytes == 192_728_064 + 99_506_176


# --- who prints it, its units, what it is not --------------------------------------------

def test_module_docstring_states_who_prints_it_and_its_units():
    doc = " ".join(megatron.__doc__.split())
    assert megatron.NUM_BYTES_IN_MEGABYTE == 2 ** 20 == 1024 * 1024
    assert "1024 * 1024" in doc and "2**20 bytes" in doc and '"MB"' in doc
    assert "only on global rank 0" in doc and "training.py line 3683" in doc
    assert "most loaded model shard" in doc and "first pipeline stage" in doc
    assert "last rank (world_size - 1)" in doc
    assert megatron.PIN == "d98e8a64ddf34856e74b24714e3bedb2f5a39553"


def test_report_line_is_megatrons_print_in_mib():
    r = job(GQA, 16)
    # 689,227,776 / 2**20 = 657.3 MB; 94,111,744 / 2**20 = 89.75 MB (line 481)
    assert r.report_line() == ("Theoretical memory footprints: weight and optimizer=657.30 MB, "
                               "activation=89.75 MB, total=747.05 MB")


def test_hybrid_models_get_no_figures():
    ns = parse_megatron_args(MAX_POS + DENSE.split() + ["--hybrid-override-pattern", "M*M*"])
    r = theoretical_memory_usage(ns, 8)
    assert r.derived.hybrid_layer_pattern == "M*M*"  # arguments.py 754
    assert r.weights is None and r.activations is None
    assert (r.weight_and_optimizer_bytes, r.activation_bytes, r.total_bytes) == (None,) * 3
    assert "not yet supported for hybrid" in r.report_line()  # line 458


def test_args_are_not_changed():
    ns = parse_megatron_args(MAX_POS + DENSE.split())
    before = vars(ns).copy()
    theoretical_memory_usage(ns, 8)
    assert vars(ns) == before  # line 18 writes args.num_query_groups; here it is a local
    assert ns.num_query_groups == 1


# --- derivations that validate_args would make ----------------------------------------------

def test_sequence_parallel_is_off_at_tp_1():
    r = job(DENSE.replace("--tensor-model-parallel-size 2", "") + " --sequence-parallel "
            "--recompute-granularity selective", 4)
    assert r.derived.sequence_parallel is False  # arguments.py 1439
    assert r.activations.function == "compute_activation_memory_without_sp"


@pytest.mark.parametrize("flags, vpp", [
    ("--num-virtual-stages-per-pipeline-rank 2", 2),
    ("--num-virtual-stages-per-pipeline-rank 1", None),  # arguments.py 978-979
    ("--pipeline-model-parallel-layout Et|(t|)*6,tL", 2),  # 8 stages / PP 4 (arguments.py 950)
    ("", None),
])
def test_virtual_pipeline_size(flags, vpp):
    base = ("--num-layers 8 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
            "--micro-batch-size 1 --vocab-size 128 --pipeline-model-parallel-size 4 ")
    assert job(base + flags, 4).derived.virtual_pipeline_model_parallel_size == vpp


def test_padded_vocab_size_is_taken_as_given():
    r = job(DENSE.replace("--vocab-size 1000", "--padded-vocab-size 1000"), 8)
    assert r.derived.padded_vocab_size == 1000  # build_tokenizer.py 151: only when None


def test_vocab_size_for_a_tokenizer_file():
    argv = MAX_POS + DENSE.replace("--vocab-size 1000", "").split()
    with pytest.raises(TracememError, match="--vocab-size"):
        formula_bytes_for_job(argv, 8)
    assert formula_bytes_for_job(argv, 8, vocab_size=1000).derived.padded_vocab_size == 1024


def test_world_size_must_divide_by_the_model_parallel_size():
    with pytest.raises(TracememError, match=r"tp\(2\) \* pp\(1\) \* cp\(1\) \* gtp\(1\) = 2"):
        job(DENSE, 7)


def test_global_batch_must_divide():
    with pytest.raises(TracememError, match="global batch size \\(18\\) is not divisible"):
        job(DENSE.replace("--global-batch-size 16", "--global-batch-size 18"), 8)


def test_weight_and_optimizer_bytes_per_param_keeps_its_callers():
    # lines 293-296, as tracemem crosscheck uses it
    assert megatron.weight_and_optimizer_bytes_per_param(4, True) == 6 + 12 / 4
    assert megatron.weight_and_optimizer_bytes_per_param(4, False) == 18


def test_accepts_a_namespace_built_by_hand():
    ns = parse_megatron_args(MAX_POS + DENSE.split())
    assert isinstance(ns, argparse.Namespace)
    assert theoretical_memory_usage(ns, 8, num_microbatches=3).derived.num_microbatches == 3
