"""Parameter counts of the built models.

References: the totals stated in the issue (hand arithmetic from the official configs):
V3 main model 671,026,419,200 (including 58 x 256 correction-bias values), V3 with one MTP
module 682,636,487,424, V2 235,741,434,880, V2-Lite 15,706,484,224; and, per component, the
shapes of DeepSeek-V3's reference model (inference/model.py) multiplied out below from the
config numbers alone.
"""

import json
import os
import resource

import pytest
import torch

from modeling import load_config
from modeling.common.model import build_model
from modeling.params import count_activated, count_by_component, count_total


def hand_counts(cfg):
    """Per-component counts from config numbers only (not from the model code)."""
    h, n = cfg.hidden_size, cfg.num_attention_heads
    qk, v, rope, kv = cfg.qk_head_dim, cfg.v_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank:
        q = h * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * n * qk  # wq_a, q_norm, wq_b
    else:
        q = h * n * qk  # wq
    attention = q + h * (kv + rope) + kv + kv * n * (cfg.qk_nope_head_dim + v) + n * v * h
    expert = 3 * h * cfg.moe_intermediate_size
    moe = (cfg.num_routed_experts * expert + cfg.num_shared_experts * expert
           + cfg.num_routed_experts * h + (cfg.num_routed_experts if cfg.has_correction_bias else 0))
    dense = 3 * h * cfg.intermediate_size
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    main = (cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2) + h
            + cfg.num_layers * (attention + 2 * h)
            + moe_layers * moe + (cfg.num_layers - moe_layers) * dense)
    mtp = cfg.num_mtp_modules * (2 * h + 2 * h * h + attention + 2 * h + moe + h)
    return main, mtp


@pytest.fixture(scope="module")
def v3():
    cfg = load_config("deepseek-v3")
    return cfg, build_model(cfg)


def test_deepseek_v3_counts(v3):
    cfg, model = v3
    assert count_total(model, include_mtp=False) == 671_026_419_200 == hand_counts(cfg)[0]
    assert count_total(model, include_mtp=True) == 682_636_487_424 == sum(hand_counts(cfg))
    by = count_by_component(model)
    assert by["router"] == 58 * (256 * 7168 + 256)  # weight + correction bias, 58 MoE layers
    assert by["routed_experts"] == 58 * 256 * 3 * 7168 * 2048
    assert by["dense_mlp"] == 3 * 3 * 7168 * 18432
    # wq_a 7168*1536 + wq_b 1536*128*192 + wkv_a 7168*576 + wkv_b 512*128*256 + wo 16384*7168
    assert by["attention"] == 61 * 187_105_280
    # per layer attn_norm, ffn_norm (7168 each), q_norm 1536, kv_norm 512; final norm 7168
    assert by["norms"] == 61 * (2 * 7168 + 1536 + 512) + 7168
    assert by["mtp_projection"] == 2 * 7168 + 2 * 7168 * 7168 + 7168  # enorm, hnorm, eh_proj, norm
    assert by["mtp_layer"] == 187_105_280 + 2 * 7168 + 1536 + 512 + 256 * 7168 + 256 \
        + 257 * 3 * 7168 * 2048
    # "37B activated": the total less the embedding table and, per MoE layer, the 248 routed
    # experts a token skips
    assert count_activated(model, cfg) == \
        671_026_419_200 - 129280 * 7168 - 58 * 248 * 3 * 7168 * 2048 == 36_625_618_432


@pytest.mark.parametrize("name, total", [("deepseek-v2", 235_741_434_880),
                                         ("deepseek-v2-lite", 15_706_484_224)])
def test_deepseek_v2_counts(name, total):
    cfg = load_config(name)
    model = build_model(cfg)
    assert count_total(model) == total == hand_counts(cfg)[0]
    assert hand_counts(cfg)[1] == 0


@pytest.mark.parametrize("name, published", [("deepseek-v3", 37e9), ("deepseek-v2", 21e9),
                                             ("deepseek-v2-lite", 2.4e9)])
def test_activated_counts_round_to_deepseeks_published_figures(name, published):
    cfg = load_config(name)
    activated = count_activated(build_model(cfg), cfg)
    # Published figures are rounded (V3 "37B", V2 "21B", V2-Lite "2.4B"): within 5 %. Counting
    # the embedding table instead would put V2-Lite at 2.66B, 11 % off.
    assert abs(activated - published) / published < 0.05


def test_correction_bias_is_a_float32_buffer_without_gradient(v3):
    _, model = v3
    gate = model.layers["3"].ffn.gate
    assert "e_score_correction_bias" in dict(gate.named_buffers())
    assert gate.e_score_correction_bias.dtype == torch.float32
    assert all("correction" not in name for name, _ in model.named_parameters())
    assert model.layers["3"].ffn.experts.w1.dtype == torch.bfloat16


def _rss_bytes():
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def test_building_v3_on_meta_takes_no_real_memory():
    cfg = load_config("deepseek-v3")
    before = _rss_bytes()
    model = build_model(cfg)
    grown = _rss_bytes() - before
    assert all(p.device.type == "meta" for p in model.parameters())
    # 682.6e9 bf16 parameters would be 1.27 TiB; module objects take well under 256 MiB
    assert grown < 256 * 2**20, grown


def test_params_cli_json(capsys):
    from tracemem.cli import main
    assert main(["params", "--model", "deepseek-v2-lite", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["total"] == result["total_with_mtp"] == 15_706_484_224
    assert sum(result["by_component"].values()) == 15_706_484_224
