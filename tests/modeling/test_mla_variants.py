"""MLA as Megatron-Core builds it without --qk-layernorm and with add_bias_linear (Megatron-LM
d98e8a6 gpt_layer_specs.py: the up projections are TEColumnParallelLinear, q_layernorm and
kv_layernorm IdentityOp; multi_latent_attention.py MLASelfAttention.__init__: linear_proj has
bias=add_bias_linear, every other projection bias=False). Four measured Megatron-LM CI runs
of this layout are on the scoreboard (gpt3_mcore_te_tp2_pp2_mla); here the bytes by hand."""

import dataclasses

import torch

from modeling import load_config
from modeling.common.attention.mla import MLA
from modeling.kernels import get_profile
from tracemem.validation.kernel_trace import leaf, trace_call

S = 16  # tokens (b = 1)
# deepseek-tiny: h 64, q_lora_rank 48, kv_lora_rank 32, 4 heads
H, Q_LORA, KV_LORA = 64, 48, 32


def _mla(**changes):
    cfg = dataclasses.replace(load_config("deepseek-tiny"), **changes)
    with torch.device("meta"):
        return MLA(cfg, "flash", kernels=get_profile("megatron-te")).to(torch.bfloat16)


def test_no_latent_norms_and_a_linear_proj_bias_are_the_parameters():
    with_norms, without = _mla(), _mla(mla_latent_norms=False, o_bias=True)
    names = {n for n, _ in without.named_parameters()}
    assert not any("q_norm" in n or "kv_norm" in n for n in names)
    assert "wo.bias" in names
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    # minus the two RMSNorm weights (48 + 32), plus linear_proj's bias (h = 64)
    assert count(without) == count(with_norms) - Q_LORA - KV_LORA + H


def test_without_latent_norms_the_up_projections_keep_no_ln_out_nor_rsigma():
    # TE LayerNormLinear saves its input, ln_out (the input's shape, bf16) and rsigma (fp32,
    # one per token); TE Linear saves its (contiguous) input only. The inputs are saved in
    # both layouts (the q latent; the kv latent's contiguous copy, a split of
    # linear_kv_down_proj's output: TE prepare_forward), so the difference is two ln_outs
    # and two rsigmas: 16 x 48 x 2 + 16 x 4 + 16 x 32 x 2 + 16 x 4 = 2,688 B
    x = leaf(1, S, H)
    kept = {}
    for name, mla in (("norms", _mla()), ("none", _mla(mla_latent_norms=False))):
        kept[name] = trace_call(mla, [x], externals=list(mla.parameters())).kept_bytes
    assert kept["norms"] - kept["none"] == S * Q_LORA * 2 + S * 4 + S * KV_LORA * 2 + S * 4


def test_megatron_arguments_give_the_variant():
    from tracemem.frontdoors.megatron import megatron_job, to_megatron_args
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--multi-latent-attention", "--q-lora-rank", "48", "--kv-lora-rank", "32",
            "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size",
            "1", "--global-batch-size", "1", "--vocab-size", "256", "--bf16"]
    job = megatron_job(argv, world_size=1)
    # Megatron's defaults: add_bias_linear (linear_proj's bias, the MLP's), no --qk-layernorm
    assert (job.config.o_bias, job.config.mlp_bias, job.config.mla_latent_norms) == (
        True, True, False)
    back = to_megatron_args(job)
    assert "--qk-layernorm" not in back and "--disable-bias-linear" not in back
    job = megatron_job(argv + ["--qk-layernorm", "--disable-bias-linear"], world_size=1)
    assert (job.config.o_bias, job.config.mla_latent_norms) == (False, True)
    back = to_megatron_args(job)
    assert "--qk-layernorm" in back and "--disable-bias-linear" in back
