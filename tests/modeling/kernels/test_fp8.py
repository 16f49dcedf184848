"""TE's FP8 linears under each recipe and GPU architecture allocate, keep and free what their
source does (``modeling.kernels.fp8``).

Reference: TransformerEngine d0067d0, read by hand: ``module/linear.py``
``_linear_forward_impl`` / ``_linear_backward``, ``module/layernorm_linear.py``,
``module/grouped_linear.py``, ``module/base.py`` ``grad_output_preprocess``, the quantisers'
``create_tensor`` / ``get_scale_shape`` (``csrc/quantizer.cpp``), ``bulk_allocate``
(``csrc/extensions/allocate.cpp``), ``nvte_is_non_tn_fp8_gemm_supported``
(``common/transformer_engine.cpp``: Hopper needs the transposed copy, Blackwell not). Each
expected allocation is written out below from those functions: shapes, dtypes (uint8 data,
fp32 or E8M0 uint8 scales) and whether autograd keeps it; bytes are numel x element size.
"""

import pytest
import torch

from modeling.kernels import get_profile
from modeling.kernels.linear import te_linear
from modeling.kernels.moe import te_grouped_linear
from tracemem import MemoryTracer
from tracemem.errors import TracememError

BF16, F32, U8 = torch.bfloat16, torch.float32, torch.uint8
T, A, C, G = "temporary", "activation", "comm_buffer", "gradient"


def leaf(*shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)


def run(fn, inputs):
    """Forward and backward of ``fn(*inputs)`` traced: forward allocations, what forward
    made and autograd keeps (besides the output), backward allocations besides the seed
    gradient; allocations as (shape, dtype, category)."""
    tracer = MemoryTracer(rounding=None)
    tracer.track_external(*inputs)
    with tracer:
        out = fn(*inputs)
    forward = [(e.shape, e.dtype, e.category.value) for e in tracer.events
               if e.action == "alloc" and e.phase.value == "forward"]
    out_id = tracer._live[out.untyped_storage()._cdata].sid
    kept = sorted(((i.shape, i.dtype) for i in tracer.live_at("now")
                   if i.phase.value == "forward" and i.storage_id != out_id), key=str)
    grad = torch.empty(out.shape, dtype=out.dtype, device="meta")
    tracer.track_external(grad)
    start = len(tracer.events)
    with tracer:
        out.backward(grad)
    backward = [(e.shape, e.dtype, e.category.value) for e in tracer.events[start:]
                if e.action == "alloc"]
    return forward, kept, backward


def nbytes(entries):
    size = {U8: 1, BF16: 2, F32: 4}
    return sum(torch.Size(s).numel() * size[d] for s, d, *_ in entries)


def linear(recipe, arch, mode="duplicated", sp=1, x=(1, 64, 128), w=(256, 128), **kw):
    return run(lambda x, w: te_linear(x, [w], mode, sp, fp8_recipe=recipe, fp8_arch=arch,
                                      **kw), [leaf(*x), leaf(*w)])


# One TE Linear, no SP: x (1, 64, 128) bf16 -> 64 rows of 128; W (256, 128); out (1, 64, 256).
# Forward: input_quantizer(x) with rowwise and columnwise usage (backward_needs_input), the GEMM
# output, then update_usage(rowwise_usage=False, columnwise_usage=True) drops what the wgrad
# does not need; the weight is TE's cached FP8 workspace (static, not allocated here).
# Backward: grad_output_preprocess quantises dy (1, 64, 256) with both usages; the dgrad
# (1, 64, 128) bf16; the wgrad goes to main_grad (gradient accumulation fusion).

def test_per_tensor_fp8_on_hopper_keeps_the_transposed_input_only():
    for recipe in ("delayed", "tensorwise"):
        forward, kept, backward = linear(recipe, "sm90")
        # Float8Quantizer::create_tensor: _data (1, 64, 128) u8, _transpose (128, 1, 64) u8
        # (columnwise on Hopper), _scale_inv (1,) f32; _data dies after the GEMM
        assert forward == [((1, 64, 128), U8, T), ((128, 1, 64), U8, A), ((1,), F32, A),
                           ((1, 64, 256), BF16, T)]
        assert kept == [((1,), F32), ((128, 1, 64), U8)]  # 8192 + 4 B
        assert nbytes(kept) == 128 * 64 + 4
        # dy: _data (1, 64, 256), _transpose (256, 1, 64), _scale_inv; dgrad (1, 64, 128)
        assert backward == [((1, 64, 256), U8, T), ((256, 1, 64), U8, T), ((1,), F32, T),
                            ((1, 64, 128), BF16, G)]


def test_per_tensor_fp8_on_blackwell_keeps_one_copy():
    forward, kept, backward = linear("tensorwise", "sm100")
    # non-TN GEMMs: one _data serves both usages (inner_tensor_specs: no _transpose)
    assert forward == [((1, 64, 128), U8, A), ((1,), F32, A), ((1, 64, 256), BF16, T)]
    assert kept == [((1, 64, 128), U8), ((1,), F32)]
    assert backward == [((1, 64, 256), U8, T), ((1,), F32, T), ((1, 64, 128), BF16, G)]


def test_mxfp8_keeps_columnwise_data_and_e8m0_scales_padded():
    forward, kept, backward = linear("mxfp8", "sm100")
    # MXFP8Quantizer::get_scale_shape, one uint8 scale per 32 values:
    # rowwise (roundup(64, 128), roundup(128 / 32, 4)) = (128, 4);
    # columnwise (roundup(64 / 32, 4), roundup(128, 128)) = (4, 128)
    assert forward == [((1, 64, 128), U8, T), ((128, 4), U8, T), ((1, 64, 128), U8, A),
                       ((4, 128), U8, A), ((1, 64, 256), BF16, T)]
    assert nbytes(kept) == 64 * 128 + 4 * 128  # 8192 + 512
    # dy (64 rows, 256): rowwise scales (128, roundup(8, 4)) = (128, 8), columnwise
    # (roundup(2, 4), 256) = (4, 256)
    assert backward == [((1, 64, 256), U8, T), ((128, 8), U8, T), ((1, 64, 256), U8, T),
                        ((4, 256), U8, T), ((1, 64, 128), BF16, G)]


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_blockwise_keeps_transposed_columnwise_data_and_fp32_tile_scales(arch):
    forward, kept, backward = linear("blockwise", arch)
    # Float8BlockQuantizer, 1x128 tiles for activations and gradients (x / grad
    # block_scaling_dim 1): rowwise scales (ceil(128 / 128), roundup(64, 4)) = (1, 64) f32;
    # columnwise data transposed (128, 1, 64), scales (ceil(64 / 128), roundup(128, 4)) =
    # (1, 128) f32. The same on Blackwell (the GEMM emulates it with MXFP8, gemm.cpp)
    assert forward == [((1, 64, 128), U8, T), ((1, 64), F32, T), ((128, 1, 64), U8, A),
                       ((1, 128), F32, A), ((1, 64, 256), BF16, T)]
    assert nbytes(kept) == 128 * 64 + 128 * 4
    # dy (64 rows, 256): rowwise scales (2, 64), columnwise (256, 1, 64) and (1, 256)
    assert backward == [((1, 64, 256), U8, T), ((2, 64), F32, T), ((256, 1, 64), U8, T),
                        ((1, 256), F32, T), ((1, 64, 128), BF16, G)]


def test_column_parallel_with_sp_saves_the_local_rowwise_shard_on_hopper():
    # x (1, 32, 128) local, SP 2: the local input quantised rowwise only (per-tensor FP8 does
    # not all-gather columnwise data), gathered to (1, 64, 128) u8 (scale shared) for the
    # GEMM and freed after it; the local rowwise shard is saved (backward_input_needs_gather
    # with supports_only_rowwise_all_gather)
    forward, kept, backward = linear("tensorwise", "sm90", "column", 2, x=(1, 32, 128))
    assert forward == [((1, 32, 128), U8, A), ((1,), F32, A), ((1, 64, 128), U8, C),
                       ((1, 64, 256), BF16, T)]
    assert kept == [((1, 32, 128), U8), ((1,), F32)]
    # dy (1, 64, 256) quantised (data, transpose, scale); the re-gather (1, 64, 128) and its
    # transpose (128, 1, 64) for the wgrad (update_usage(columnwise_usage=True)); dgrad
    # (1, 64, 128) reduce-scattered to (1, 32, 128)
    assert backward == [((1, 64, 256), U8, T), ((256, 1, 64), U8, T), ((1,), F32, T),
                        ((1, 64, 128), U8, C), ((128, 1, 64), U8, T), ((1, 64, 128), BF16, T),
                        ((1, 32, 128), BF16, C)]


def test_column_parallel_with_sp_saves_the_local_columnwise_shard_under_mxfp8():
    forward, kept, _ = linear("mxfp8", "sm100", "column", 2, x=(1, 32, 128))
    # local rowwise (1, 32, 128) + (128, 4), columnwise (1, 32, 128) + (roundup(1, 4), 128);
    # gathered rowwise (1, 64, 128) + (roundup(64, 128), 4) for the GEMM; the local
    # columnwise part is saved (MXFP8 gathers columnwise data in backward)
    assert forward == [((1, 32, 128), U8, T), ((128, 4), U8, T), ((1, 32, 128), U8, A),
                       ((4, 128), U8, A), ((1, 64, 128), U8, C), ((128, 4), U8, T),
                       ((1, 64, 256), BF16, T)]
    assert kept == [((1, 32, 128), U8), ((4, 128), U8)]


def test_save_original_input_keeps_the_bf16_input_and_requantises_in_backward():
    # linear_proj under tensorwise (Megatron's set_save_original_input): rowwise only for the
    # GEMM, nothing of it saved (x is the caller's); backward quantises x again with both
    # usages for the wgrad (supports_only_rowwise_all_gather, no gather: columnwise too)
    forward, kept, backward = linear("tensorwise", "sm90", save_original_input=True)
    assert forward == [((1, 64, 128), U8, T), ((1,), F32, T), ((1, 64, 256), BF16, T)]
    assert kept == []
    assert backward == [((1, 64, 256), U8, T), ((256, 1, 64), U8, T), ((1,), F32, T),
                        ((1, 64, 128), U8, T), ((128, 1, 64), U8, T), ((1,), F32, T),
                        ((1, 64, 128), BF16, G)]


def test_e5m6_cache_keeps_the_16_bit_input_and_its_1x128_scales():
    # linear_proj under DeepSeek-V3's E5M6 cache (option e5m6_attention_output, blockwise):
    # the input kept is the caller's bf16 x (1, 64, 128), the 16-bit container (not counted
    # here: x is external), plus one fp32 scale per 1x128 tile: (1, 64, ceil(128 / 128)) =
    # 64 x 4 = 256 B, made in forward after the output, kept until backward
    forward, kept, backward = linear("blockwise", "sm90", save_original_input="e5m6")
    assert forward[-1] == ((1, 64, 1), F32, A)
    assert kept == [((1, 64, 1), F32)] and nbytes(kept) == 256
    _, plain, plain_backward = linear("blockwise", "sm90", save_original_input=True)
    assert plain == [] and plain_backward == backward


def test_e5m6_cache_needs_blockwise_fp8():
    from tracemem.job import Job

    with pytest.raises(TracememError) as error:
        Job.create("deepseek-tiny", world_size=8, ep=8, micro_batch_size=1, seq_length=64,
                   num_microbatches=1, gpu="H100",
                   kernel_options={"e5m6_attention_output": True, "fp8_recipe": "tensorwise"})
    assert str(error.value) == ("kernel option e5m6_attention_output (DeepSeek-V3's E5M6 cache "
                                "of the attention output, 1x128 tiles) needs --fp8-format and "
                                "--fp8-recipe blockwise")


def test_fp8_param_gather_needs_the_distributed_optimizer_in_python_too():
    # the Megatron door refuses it (validate_args); the Job, which every door builds, too
    from tracemem.job import Job

    with pytest.raises(TracememError, match=r"kernel option fp8_param_gather "
                                            r"\(--fp8-param-gather\) needs Megatron's "
                                            r"distributed optimizer: give --zero 1 or more"):
        Job.create("deepseek-tiny", world_size=8, ep=8, zero=0, micro_batch_size=1,
                   seq_length=64, num_microbatches=1, gpu="H100",
                   kernel_options={"fp8_recipe": "tensorwise", "fp8_param_gather": True})


def test_layernorm_linear_quantises_ln_out_through_a_bf16_copy():
    norm = torch.nn.RMSNorm(128, device="meta", dtype=BF16)
    x, w = leaf(1, 64, 128), leaf(256, 128)
    tracer_in = [x, w, norm.weight]
    forward, kept, _ = run(lambda x, w, g: te_linear(x, [w], norm=norm, fp8_recipe="tensorwise",
                                                     fp8_arch="sm90"), tracer_in)
    # rmsnorm_fwd: rsigma (64,) f32 first, the FP8 ln_out (create_tensor), the bf16 ln_out
    # it is quantised from (FUSED_NORM_AMAX_FP8, freed), the GEMM output
    assert forward == [((1, 64), F32, A), ((1, 64, 128), U8, T), ((128, 1, 64), U8, A),
                       ((1,), F32, A), ((1, 64, 128), BF16, T), ((1, 64, 256), BF16, T)]
    assert kept == [((1, 64), F32), ((1,), F32), ((128, 1, 64), U8)]


def test_grouped_linear_bulk_allocates_one_buffer_per_usage_under_mxfp8():
    # experts of 32 and 64 rows, in 64, out 128 (x (96, 64)); tex.split_quantize bulk
    # allocation (cast.cpp bulk_allocate_mxfp8_tensors, allocate.cpp bulk_allocate): data at
    # 256-byte offsets, then scales at 16: rowwise data 32 x 64 = 2048 at 0, 64 x 64 = 4096
    # at 2048; scales (roundup(32, 128), roundup(2, 4)) = 512 B at 6144 and 512 at 6656:
    # 7168, + 256 alignment pad = 7424 B. Columnwise: the same data, scales (roundup(1, 4),
    # roundup(64, 128)) = 512 and (roundup(2, 4), 128) = 512: 7424 B
    x, w = leaf(96, 64), leaf(2, 128, 64)
    forward, kept, backward = run(
        lambda x, w: te_grouped_linear(x, [w], 128, fp8_recipe="mxfp8", fp8_arch="sm100",
                                       counts=[32, 64]), [x, w])
    assert forward == [((7424,), U8, T), ((7424,), U8, A), ((96, 128), BF16, T)]
    assert kept == [((7424,), U8)]
    # dy (96, 128): data 4096 at 0 and 8192 at 4096, scales (128, 4) = 512 at 12288 and
    # 12800: 13312 + 256 = 13568 B, rowwise and columnwise (scales (4, 128) each); dgrad
    assert backward == [((13568,), U8, T), ((13568,), U8, T), ((96, 64), BF16, G)]


def test_mxfp8_is_refused_on_hopper_by_name():
    with pytest.raises(TracememError, match="mxfp8 runs on Blackwell only"):
        get_profile("megatron-te", gpu_arch=(9, 0), fp8_recipe="mxfp8")
    with pytest.raises(TracememError, match="needs compute capability 8.9"):
        get_profile("megatron-te", gpu_arch=(8, 0), fp8_recipe="tensorwise")
    assert get_profile("megatron-te", gpu_arch=(10, 0), fp8_recipe="mxfp8").fp8_arch == "sm100"


def test_fp8_static_counts_the_weight_workspace_per_architecture():
    from modeling.common.linear import Linear
    from tracemem.static import fp8_static

    def static(arch, **options):
        k = get_profile("megatron-te", fp8_arch=arch, **options)
        model = torch.nn.Module()
        model.lin = Linear(128, 256, kernels=k).to("meta")
        return fp8_static(model, 2)

    # W (256, 128) = 32768 elements: Hopper per-tensor _data + _transpose + fp32 scale_inv
    assert static("sm90", fp8_recipe="tensorwise") == (2 * 32768 + 4, 0)
    assert static("sm100", fp8_recipe="tensorwise") == (32768 + 4, 0)
    # --fp8-param-gather: the data in the uint8 parameter buffer (2 - 1 B saved an element),
    # the transpose and scale beside it
    assert static("sm90", fp8_recipe="tensorwise", fp8_param_gather=True) == (32768 + 4, 32768)
    # delayed: scale + amax_history (1024 rows) for 3 + 2 quantisers: 20 x 1025 B
    assert static("sm90", fp8_recipe="delayed", fp8_amax_history_len=1024) == (
        2 * 32768 + 4 + 20 * 1025, 0)
    # blockwise weight, 128x128 blocks: rowwise scales (2, roundup(1, 4)) f32 = 32 B,
    # columnwise data (128, 256) and scales (1, roundup(2, 4)) f32 = 16 B
    assert static("sm90", fp8_recipe="blockwise") == (2 * 32768 + 32 + 16, 0)
    assert static("sm90") == (0, 0)  # bf16


MOE = ("--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256 "
       "--max-position-embeddings 256 --micro-batch-size 1 --bf16 --vocab-size 1000 "
       "--tokenizer-type NullTokenizer --num-experts 4 --swiglu --disable-bias-linear "
       "--moe-grouped-gemm --moe-permute-fusion --moe-token-dispatcher-type alltoall "
       "--use-distributed-optimizer").split()


def test_a_megatron_fp8_job_builds_and_estimates():
    from tracemem.estimator import estimate
    from tracemem.frontdoors.megatron import megatron_job

    bf16 = estimate(megatron_job(MOE, world_size=2, gpu="H100")).ranks[0]
    job = megatron_job(MOE + "--fp8-format hybrid --fp8-recipe tensorwise".split(),
                       world_size=2, gpu="H100")
    assert job.kernel_options["fp8_recipe"] == "tensorwise"
    fp8 = estimate(job).ranks[0]
    # the FP8 copies of the saved inputs are half their bf16 size; the weights' FP8 copies
    # (2 B an element on Hopper) are static
    assert fp8.activation_bytes < bf16.activation_bytes
    assert fp8.static.fp8_bytes > 0


def test_megatron_fp8_flags_refuse_what_is_not_modelled_by_name():
    from tracemem.frontdoors.megatron import megatron_job_kwargs

    with pytest.raises(TracememError, match="--fp8-recipe custom is not modelled yet"):
        megatron_job_kwargs(MOE + "--fp8-format e4m3 --fp8-recipe custom".split(),
                            world_size=2)
    with pytest.raises(TracememError, match="--fp4-format e2m1: not modelled yet"):
        megatron_job_kwargs(MOE + "--fp4-format e2m1".split(), world_size=2)
    kwargs = megatron_job_kwargs(MOE + "--fp8-format e4m3 --first-last-layers-bf16".split(),
                                 world_size=2)
    options = kwargs["kernel_options"]
    assert (options["fp8_recipe"], options["fp8_layers_at_start_in_bf16"],
            options["fp8_layers_at_end_in_bf16"]) == ("delayed", 1, 1)  # Megatron's defaults
    k = get_profile("megatron-te", fp8_recipe="delayed", fp8_layers_at_start_in_bf16=1,
                    fp8_layers_at_end_in_bf16=1)
    assert [k.bf16_layer(i, 4).fp8_recipe for i in range(4)] == [
        "none", "delayed", "delayed", "none"]
    # an MTP module's layer (4, 5 of a 4-layer model) runs under Megatron's global FP8
    # context (multi_token_prediction.py: get_fp8_context(self.config), layer_no -1), with
    # or without --first-last-layers-bf16
    assert k.bf16_layer(4, 4) is k and k.bf16_layer(5, 4) is k
    plain = get_profile("megatron-te", fp8_recipe="delayed")
    assert [plain.bf16_layer(i, 4) is plain for i in range(6)] == [True] * 6


def test_save_original_input_after_a_recomputed_norm_is_refused_under_delayed_scaling():
    # transformer_layer.py: --recompute-modules layernorm under FP8 calls
    # set_for_recompute_input_layernorm, and TE's _linear_forward_impl raises "DelayedScaling
    # recipe is not supported with save_original_input"
    k = get_profile("megatron-te", fp8_recipe="delayed")
    with pytest.raises(TracememError, match="layernorm with --fp8-recipe delayed"):
        k.linear(leaf(1, 64, 128), [leaf(256, 128)], save_original_input="recompute")
    # linear_proj's marker (True) is Megatron's "recipe other than delayed": not honoured here
    forward, kept, _ = run(lambda x, w: k.linear(x, [w], save_original_input=True),
                           [leaf(1, 64, 128), leaf(256, 128)])
    assert kept == [((1,), F32), ((128, 1, 64), U8)]  # the FP8 transpose, as without it


def test_the_fp8_ci_cases_are_scored_now():
    from tracemem.validation.megatron_ci import selection

    scored, _ = selection()
    names = {case.name for case in scored}
    case = "gpt3_weekly_mcore_tp4_cp2_current_scaling_native_fp8_tp_sp_cp_tp_overlap"
    assert {f"{case}@dev_dgx_h100", f"{case}@dev_dgx_gb200"} <= names


def test_unaligned_expert_rows_are_padded_to_16_and_back():
    # Megatron TEGroupedMLP.forward: quantization_padding (TE Fp8Padding) pads each expert's
    # rows to get_fp8_align_size (16; 32 under mxfp8): counts 10 and 20 -> 16 and 32, a new
    # (48, 64) buffer; backward a (30, 64) gradient (fp8_padding.py _Fp8Padding)
    k = get_profile("megatron-te", fp8_recipe="tensorwise")
    x = leaf(30, 64)
    out = {}

    def pad(x):
        padded, _, counts = k.fp8_pad(x, None, [10, 20])
        out["counts"] = counts
        return padded

    forward, kept, backward = run(pad, [x])
    assert out["counts"] == [16, 32]
    assert forward == [((48, 64), BF16, T)] and kept == []
    assert backward == [((30, 64), BF16, G)]
    assert get_profile("megatron-te", fp8_recipe="mxfp8", fp8_arch="sm100").fp8_pad(
        x, None, [32, 64])[2] == [32, 64]  # aligned: unchanged, no copy
