"""Allocations below the dispatcher (``tracemem.workspaces``) on small ranks built on meta.

Reference: hand arithmetic from the sources each item cites, written out per test:
- torch 2.13 ``aten/src/ATen/cuda/CublasHandlePool.cpp`` ``parseChosenWorkspaceSize``: 4096 *
  8 KiB = 33,554,432 B on compute capability major 9 / 10, else ``:4096:2:16:8`` = 2 x 4 MiB +
  8 x 16 KiB = 8,519,680 B; one per (handle, stream), handles per thread
  (``getCurrentCUDABlasHandle``, ``setWorkspaceForHandle``).
- TransformerEngine d0067d0 ``pytorch/cpp_extensions/gemm.py``
  ``get_cublas_workspace_size_bytes``: 32 MiB + 1 KiB = 33,555,456 B on major >= 9, else
  4,194,304 B; ``get_cublas_workspace``: one for ``general_gemm``, 4 more for the grouped GEMM
  (``common/util/multi_stream.cpp`` ``get_num_compute_streams``).
- TE ``pytorch/module/base.py`` ``get_dummy_wgrad``: ``torch.empty(shape, dtype)`` per distinct
  (shape, dtype) of the fused weights (bf16: 2 B per element).
- Megatron-LM d98e8a6 ``megatron/core/utils.py`` ``GlobalMemoryBuffer.get_tensor`` (the output
  layer's SP gather ``[s / CP, b, h]`` bf16; ``--attention local`` scores ``[b n / TP, s, s]``),
  ``models/common/embeddings/rotary_pos_embedding.py`` ``RotaryEmbedding.forward``
  (``lru_cache(maxsize=32)``: ``[s / CP, 1, 1, d_rope]`` fp32 per instance).
"""

import dataclasses

import pytest
import torch

from modeling import load_config
from modeling.kernels import get_profile
from modeling.parallel.build import build_rank
from tracemem.errors import TracememError
from tracemem.parallel import ParallelConfig
from tracemem.workspaces import (
    Workspace,
    te_cublas_workspace_bytes,
    torch_cublas_workspace_bytes,
    workspaces,
)

GPT, DEEPSEEK, LLAMA, QWEN_MOE = (load_config(n) for n in (
    "gpt-tiny", "deepseek-tiny", "llama-tiny", "qwen2-moe-tiny"))
MTE = get_profile("megatron-te")
B, S = 2, 16  # micro batch size, sequence length

TORCH_WS_HOPPER = 4096 * 8 * 1024  # 33,554,432
TORCH_WS_AMPERE = 4096 * 1024 * 2 + 16 * 1024 * 8  # 8,519,680
TE_WS_HOPPER = 32 * 1024 * 1024 + 1024  # 33,555,456
TE_WS_AMPERE = 4 * 1024 * 1024  # 4,194,304


def rank(cfg, r, kernels=MTE, attention="flash", experts="auto", **layout):
    layout = {"world_size": 4, "tp": 2, "sp": True, "pp": 2} | layout
    par = ParallelConfig.create(cfg, **layout)
    return build_rank(cfg, par, r, kernels=kernels, dtype=torch.bfloat16, attention=attention,
                      experts=experts)


def sizes(items, prefix):
    return [w.nbytes for w in items if w.name.startswith(prefix)]


def test_sizes_per_architecture():
    # A100 is sm80, H100 / H200 / H800 sm90, B200 / GB200 sm100 (tracemem.job.GPUS)
    assert torch_cublas_workspace_bytes((8, 0)) == 8_519_680 == TORCH_WS_AMPERE
    assert torch_cublas_workspace_bytes((9, 0)) == 33_554_432 == TORCH_WS_HOPPER
    assert torch_cublas_workspace_bytes((10, 0)) == 33_554_432
    assert te_cublas_workspace_bytes((8, 0)) == 4_194_304 == TE_WS_AMPERE
    assert te_cublas_workspace_bytes((9, 0)) == 33_555_456 == TE_WS_HOPPER
    assert te_cublas_workspace_bytes((10, 0)) == 33_555_456


def test_the_default_before_pytorch_175344_is_sm90s_alone():
    # CublasHandlePool.cpp before pytorch/pytorch#175344: 32 MiB where major == 9 and
    # minor == 0, else :4096:2:16:8 = 2 x 4 MiB + 8 x 16 KiB
    assert torch_cublas_workspace_bytes((9, 0), None, "sm90") == 33_554_432
    assert torch_cublas_workspace_bytes((10, 0), None, "sm90") == 2 * 4_194_304 + 8 * 16_384
    assert torch_cublas_workspace_bytes((12, 0), None, "sm90") == 8_519_680
    assert torch_cublas_workspace_bytes((8, 0), None, "sm90") == 8_519_680
    # a CUBLAS_WORKSPACE_CONFIG set is the same under both
    assert torch_cublas_workspace_bytes((10, 0), ":4096:8", "sm90") == 33_554_432
    with pytest.raises(TracememError, match=r"torch_cublas_default 'x' is invalid"):
        torch_cublas_workspace_bytes((10, 0), None, "x")
    # the GB200 last stage: its two PyTorch workspaces, nothing else moves
    old = workspaces(rank(GPT, 3), gpu="GB200", kernels=MTE, micro_batch_size=B, seq_length=S)
    new = workspaces(rank(GPT, 3), gpu="GB200", kernels=MTE, micro_batch_size=B, seq_length=S,
                     torch_cublas_default="sm90")
    assert sizes(new, "PyTorch") == [8_519_680, 8_519_680]
    assert (sum(w.nbytes for w in old) - sum(w.nbytes for w in new)
            == 2 * (33_554_432 - 8_519_680) == 50_069_504)
    assert all("#175344" in w.source for w in new if w.name.startswith("PyTorch"))


def test_gpt_last_stage_itemised_by_hand():
    # gpt-tiny (h 64, 4 heads, 4h MLP, no RoPE) at TP 2 + SP, PP 2: rank 3 holds layers 2-3,
    # the final norm and the output layer [V / TP, h] = [128, 64]
    items = workspaces(rank(GPT, 3), gpu="H100", kernels=MTE, micro_batch_size=B, seq_length=S)
    got = [(w.name.split(" (")[0] if w.name.startswith(("TE cuBLAS", "PyTorch")) else w.name,
            w.nbytes, w.first_use) for w in items]
    assert got == [
        # the output layer's torch.matmul (main thread) and its backward GEMMs (device thread)
        ("PyTorch cuBLAS workspace", 33_554_432, "forward"),
        ("PyTorch cuBLAS workspace", 33_554_432, "backward"),
        ("TE cuBLAS workspace", 33_555_456, "forward"),  # general_gemm, no grouped GEMM
        # [s, b, h] = 16 x 2 x 64 bf16
        ("Megatron global memory buffer ('mpu', bf16: largest request, output layer's "
         "sequence-parallel gather)", 16 * 2 * 64 * 2, "forward"),
        # linear_qkv [(4 + 2 * 4) * 16 / 2, 64] = [96, 64]: (32 + 32 + 32) * 64 * 2
        ("TE dummy wgrad [96, 64] bf16 (layers.2.attn.wq and 1 more)", 96 * 64 * 2,
         "backward"),
        # linear_proj [64, 32]
        ("TE dummy wgrad [64, 32] bf16 (layers.2.attn.wo and 1 more)", 64 * 32 * 2,
         "backward"),
        # linear_fc1 [4h / 2, h] = [128, 64], the output layer [128, 64] shares it
        ("TE dummy wgrad [128, 64] bf16 (layers.2.ffn.w1 and 2 more)", 128 * 64 * 2,
         "backward"),
        ("TE dummy wgrad [64, 128] bf16 (layers.2.ffn.w2 and 1 more)", 64 * 128 * 2,
         "backward"),
    ]
    assert all(isinstance(w, Workspace) and w.source for w in items)
    assert sum(w.nbytes for w in items) == (2 * 33_554_432 + 33_555_456 + 4_096 + 12_288
                                            + 4_096 + 16_384 + 16_384)


def test_first_stage_without_the_output_layer_runs_no_torch_gemm():
    # rank 0: embedding and layers 0-1, TE fused attention: every GEMM is TE's
    items = workspaces(rank(GPT, 0), gpu="H100", kernels=MTE)  # no sequence item: no s needed
    assert sizes(items, "PyTorch") == []
    assert sizes(items, "Megatron global") == []
    assert sizes(items, "TE cuBLAS") == [33_555_456]
    assert sorted(sizes(items, "TE dummy")) == [64 * 32 * 2, 96 * 64 * 2, 128 * 64 * 2,
                                                64 * 128 * 2]


@pytest.mark.parametrize("gpu, torch_ws, te_ws", [
    ("A100", TORCH_WS_AMPERE, TE_WS_AMPERE), ("H100", TORCH_WS_HOPPER, TE_WS_HOPPER),
    ("H200", TORCH_WS_HOPPER, TE_WS_HOPPER), ("H800", TORCH_WS_HOPPER, TE_WS_HOPPER),
    ("B200", TORCH_WS_HOPPER, TE_WS_HOPPER), ("GB200", TORCH_WS_HOPPER, TE_WS_HOPPER)])
def test_workspace_bytes_per_gpu_kind(gpu, torch_ws, te_ws):
    items = workspaces(rank(GPT, 3), gpu=gpu, kernels=MTE, micro_batch_size=B, seq_length=S)
    assert sizes(items, "PyTorch") == [torch_ws, torch_ws]
    assert sizes(items, "TE cuBLAS") == [te_ws]
    # the rest does not depend on the GPU
    assert sum(sizes(items, "TE dummy")) == 12_288 + 4_096 + 16_384 + 16_384


def test_deepseek_last_stage_moe_mla_mtp():
    # deepseek-tiny at TP 2 + SP, PP 2, EP 1: rank 3 holds MoE layers 2-3 (8 experts, f 32,
    # 1 shared expert of 32 split to 16), the output layer and MTP depth 1
    items = workspaces(rank(DEEPSEEK, 3), gpu="H100", kernels=MTE, micro_batch_size=B,
                       seq_length=S)
    assert sizes(items, "PyTorch") == [33_554_432] * 2  # the output layer only
    # general_gemm (TE linears, the fp32 router) + 4 for GroupedLinear's grouped GEMM
    assert sizes(items, "TE cuBLAS") == [33_555_456] * 5
    assert sizes(items, "Megatron global") == [16 * 2 * 64 * 2]
    # one RotaryEmbedding per MLA layer: layers 2, 3 and the MTP layer, [16, 1, 1, 8] fp32
    assert sizes(items, "RoPE") == [16 * 8 * 4] * 3
    dummies = {w.name.split(" (")[0]: w.nbytes for w in items if w.name.startswith("TE dummy")}
    assert dummies == {
        "TE dummy wgrad [48, 64] bf16": 48 * 64 * 2,  # linear_q_down_proj (duplicated)
        "TE dummy wgrad [48, 48] bf16": 48 * 48 * 2,  # linear_q_up_proj: 2 heads x (16 + 8)
        "TE dummy wgrad [40, 64] bf16": 40 * 64 * 2,  # linear_kv_down_proj: 32 + 8
        # linear_kv_up_proj [2 x (16 + 16), 32], linear_proj [64, 2 x 16], experts' fc2
        "TE dummy wgrad [64, 32] bf16": 64 * 32 * 2,
        "TE dummy wgrad [64, 64] bf16": 64 * 64 * 2,  # experts' fc1 weight{i}: [2 x 32, 64]
        "TE dummy wgrad [32, 64] bf16": 32 * 64 * 2,  # shared experts' fc1: [2 x 16, 64]
        "TE dummy wgrad [64, 16] bf16": 64 * 16 * 2,  # shared experts' fc2
        "TE dummy wgrad [128, 64] bf16": 128 * 64 * 2,  # the output layer
        "TE dummy wgrad [32, 128] bf16": 32 * 128 * 2,  # MTP eh_proj [h / TP, 2h]
    }


def test_sequential_experts_run_general_gemm_not_the_grouped_gemm_streams():
    # Megatron's SequentialMLP (no --moe-grouped-gemm) runs one TE linear pair per local
    # expert (general_gemm, TE's one workspace); only TEGroupedMLP's general_grouped_gemm
    # takes the per-stream workspaces (TE cpp_extensions/gemm.py get_cublas_workspace)
    grouped = workspaces(rank(DEEPSEEK, 3), gpu="H100", kernels=MTE, micro_batch_size=B,
                         seq_length=S)
    sequential = workspaces(rank(DEEPSEEK, 3, experts="sequential"), gpu="H100",
                            kernels=MTE, micro_batch_size=B, seq_length=S)
    streams = [w for w in grouped if "general_grouped_gemm" in w.name]
    assert len(streams) == 4 and not [w for w in sequential if "grouped" in w.name]
    assert [w.nbytes for w in grouped if w not in streams] == [w.nbytes for w in sequential]


def test_cublas_workspace_config_sizes_pytorchs_workspace_whatever_the_gpu():
    # torch 2.13 CublasHandlePool.cpp parseChosenWorkspaceSize: the sum of SIZE KiB x COUNT
    # over ":SIZE:COUNT" matches; no match: the default
    assert torch_cublas_workspace_bytes((8, 0)) == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert torch_cublas_workspace_bytes((8, 0), ":4096:8") == 32 * 2**20
    assert torch_cublas_workspace_bytes((9, 0), ":16:8") == 16 * 1024 * 8
    assert torch_cublas_workspace_bytes((8, 0), ":4096:2:16:8") == 8_519_680
    assert torch_cublas_workspace_bytes((9, 0), "junk") == 32 * 2**20
    items = workspaces(rank(LLAMA, 3), gpu="A100", kernels=MTE, micro_batch_size=B,
                       seq_length=S, cublas_workspace_config=":4096:8")
    assert sizes(items, "PyTorch cuBLAS") == [32 * 2**20] * 2  # main and autograd threads


def test_rope_cache_one_per_model_chunk_and_per_cp_rank():
    # llama-tiny (GQA, RoPE over head_dim 16): with VPP 2 the last stage holds 2 chunks, each
    # a GPTModel with its own RotaryEmbedding: [16, 1, 1, 16] fp32 each
    items = workspaces(rank(LLAMA, 3, vpp=2), gpu="H100", kernels=MTE, micro_batch_size=B,
                       seq_length=S)
    assert sizes(items, "RoPE") == [16 * 16 * 4] * 2
    # CP 2: the cached tensor is this CP rank's slice [8, 1, 1, 16]; the output layer gathers
    # [s / CP, b, h] = [8, 2, 64]
    items = workspaces(rank(LLAMA, 3, cp=2, pp=1), gpu="H100", kernels=MTE,
                       micro_batch_size=B, seq_length=S)
    assert sizes(items, "RoPE") == [8 * 16 * 4]
    assert sizes(items, "Megatron global") == [8 * 2 * 64 * 2]


def test_rope_cache_holds_at_most_32():
    # lru_cache(maxsize=32) is the decorated function's: 40 MLA layers + 1 MTP layer keep 32
    cfg = dataclasses.replace(DEEPSEEK, num_layers=40)
    items = workspaces(rank(cfg, 0, world_size=1, tp=1, sp=False, pp=1), gpu="H100",
                       kernels=MTE, micro_batch_size=B, seq_length=S)
    assert sizes(items, "RoPE") == [16 * 8 * 4] * 32


def test_shared_expert_gate_runs_on_the_shared_expert_stream_under_overlap():
    # qwen2-moe-tiny: layer 1 (rank 0) is MoE with a shared-expert gate, F.linear [1, h]
    items = workspaces(rank(QWEN_MOE, 0), gpu="H100", kernels=MTE, seq_length=S)
    assert [w.name for w in items if w.name.startswith("PyTorch")] == [
        "PyTorch cuBLAS workspace (main thread, SharedExpertMLP.stream)",
        "PyTorch cuBLAS workspace (autograd device thread, SharedExpertMLP.stream)"]
    # without --moe-shared-expert-overlap it runs on the current stream, as the output layer
    plain = get_profile("megatron-te", moe_shared_expert_overlap=False)
    items = workspaces(rank(QWEN_MOE, 3, kernels=plain), gpu="H100", kernels=plain,
                       micro_batch_size=B, seq_length=S)
    assert sizes(items, "PyTorch") == [33_554_432] * 2
    items = workspaces(rank(QWEN_MOE, 3), gpu="H100", kernels=MTE, micro_batch_size=B,
                       seq_length=S)
    assert sizes(items, "PyTorch") == [33_554_432] * 4  # current + shared-expert stream


def test_attention_local_shares_the_global_buffer():
    # Megatron's DotProductAttention: torch.baddbmm into ("mpu", bf16) [b n / TP, s, s]
    items = workspaces(rank(GPT, 0, attention="local"), gpu="H100", kernels=MTE,
                       micro_batch_size=B, seq_length=S)
    assert sizes(items, "PyTorch") == [33_554_432] * 2  # baddbmm / bmm are torch GEMMs
    assert sizes(items, "Megatron global") == [2 * 2 * 16 * 16 * 2]  # b x 2 heads x s x s
    # last stage at s = 64: the scores (2 x 2 x 64 x 64) outgrow the gather (64 x 2 x 64)
    items = workspaces(rank(GPT, 3, attention="local"), gpu="H100", kernels=MTE,
                       micro_batch_size=B, seq_length=64)
    buffer, = (w for w in items if w.name.startswith("Megatron global"))
    assert buffer.nbytes == 2 * 2 * 64 * 64 * 2 == 32_768
    assert "layers.2.attn scores" in buffer.name


def test_attention_unfused_runs_torch_gemms_but_its_own_buffers():
    # TE's UnfusedDotProductAttention: torch.baddbmm into a torch.empty per call
    items = workspaces(rank(GPT, 0, attention="unfused"), gpu="A100", kernels=MTE)
    assert sizes(items, "PyTorch") == [8_519_680] * 2
    assert sizes(items, "Megatron global") == []


def test_no_dummy_wgrads_without_gradient_accumulation_fusion():
    unfused = get_profile("megatron-te", gradient_accumulation_fusion=False)
    items = workspaces(rank(GPT, 3, kernels=unfused), gpu="H100", kernels=unfused,
                       micro_batch_size=B, seq_length=S)
    assert sizes(items, "TE dummy") == []
    assert len(items) == 4  # 2 PyTorch, 1 TE, the global buffer


@pytest.mark.parametrize("profile", ["eager", "torch"])
def test_eager_and_torch_profiles_count_pytorch_workspaces_only(profile):
    for r in (0, 3):
        items = workspaces(rank(GPT, r, kernels=profile), gpu="A100", kernels=profile)
        assert [(w.nbytes, w.first_use) for w in items] == [(8_519_680, "forward"),
                                                            (8_519_680, "backward")]


def test_recompute_changes_nothing():
    base = workspaces(rank(DEEPSEEK, 3), gpu="H100", kernels=MTE, micro_batch_size=B,
                      seq_length=S)
    for recompute in ("selective", "full"):
        assert workspaces(rank(DEEPSEEK, 3), gpu="H100", kernels=MTE, recompute=recompute,
                          micro_batch_size=B, seq_length=S) == base


def test_no_gpu_counts_nothing():
    assert workspaces(rank(GPT, 3), gpu=None, kernels=MTE) == []


def test_bad_arguments_are_named():
    model = rank(GPT, 3)
    with pytest.raises(TracememError, match=r"--gpu 'V100' is invalid; choose one of A100"):
        workspaces(model, gpu="V100", kernels=MTE)
    with pytest.raises(TracememError, match=r"recompute 'some' is invalid"):
        workspaces(model, gpu="H100", kernels=MTE, recompute="some")
    with pytest.raises(TracememError, match=r"pass micro_batch_size= and seq_length="):
        workspaces(model, gpu="H100", kernels=MTE)  # the output layer's gather needs b, s
    with pytest.raises(TracememError, match=r"micro_batch_size \(0\) and seq_length \(16\)"):
        workspaces(model, gpu="H100", kernels=MTE, micro_batch_size=0, seq_length=16)
