"""Exact parameter counts of the dense families' presets, derived by hand (issue 12, "Must show").

Reference: the arithmetic written out below from each official config.json (Hugging Face
meta-llama/Meta-Llama-3-8B, meta-llama/Meta-Llama-3-70B, meta-llama/Llama-3.1-405B,
Qwen/Qwen2.5-14B), which gives the published totals: Llama-3-70B 70,553,706,496 (issue 12),
Llama-3-8B 8,030,261,248 and Llama-3.1-405B 405,853,388,800 (the safetensors totals of the
Hugging Face repositories), Qwen2.5-14B 14,770,033,664 ("14.8B" on its model page).
Per layer: q h * n_h * d, k and v h * n_kv * d each, o n_h * d * h, SwiGLU 3 * h * f, two
RMSNorms 2 * h; then the embedding and untied head V * h each and the final norm h.
Activated = total - the input embedding (a lookup), as for DeepSeek (modeling/params.py).
"""

import pytest

from modeling import build_model, load_config
from modeling.params import count_activated, count_by_component, count_total


def _dense(h, layers, heads, kv_heads, head_dim, ffn, vocab, tied=False, qkv_bias=False,
           qk_norm=False):
    attention = (h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
                 + (heads + 2 * kv_heads) * head_dim * qkv_bias)
    layer = attention + 3 * h * ffn + 2 * h + 2 * head_dim * qk_norm
    return layers * layer + vocab * h * (1 if tied else 2) + h


@pytest.mark.parametrize("preset, total, embedding", [
    # Llama-3-8B: h 4096, 32 layers, 32 heads, 8 KV heads of 128, f 14336, V 128256
    # layer: q 16,777,216 + k 4,194,304 + v 4,194,304 + o 16,777,216 + MLP 176,160,768
    #        + norms 8,192 = 218,112,000; x 32 = 6,979,584,000
    # + embedding 525,336,576 + head 525,336,576 + final norm 4,096 = 8,030,261,248
    ("llama-3-8b", 8_030_261_248, 525_336_576),
    # Llama-3-70B: h 8192, 80 layers, 64 heads, 8 KV heads of 128, f 28672, V 128256
    # layer: q 67,108,864 + k 8,388,608 + v 8,388,608 + o 67,108,864 + MLP 704,643,072
    #        + norms 16,384 = 855,654,400; x 80 = 68,452,352,000
    # + embedding 1,050,673,152 + head 1,050,673,152 + final norm 8,192 = 70,553,706,496
    ("llama-3-70b", 70_553_706_496, 1_050_673_152),
    # Llama-3.1-405B: h 16384, 126 layers, 128 heads, 8 KV heads of 128, f 53248, V 128256
    # layer: q 268,435,456 + k 16,777,216 + v 16,777,216 + o 268,435,456
    #        + MLP 2,617,245,696 + norms 32,768 = 3,187,703,808; x 126 = 401,650,679,808
    # + embedding 2,101,346,304 + head 2,101,346,304 + final norm 16,384 = 405,853,388,800
    ("llama-3.1-405b", 405_853_388_800, 2_101_346_304),
    # Qwen2.5-14B: h 5120, 48 layers, 40 heads, 8 KV heads of 128, f 13824, V 152064,
    # q, k, v biases; layer: q 26,214,400 + 5,120 + k 5,242,880 + 1,024 + v 5,242,880
    #        + 1,024 + o 26,214,400 + MLP 212,336,640 + norms 10,240 = 275,268,608
    # x 48 = 13,212,893,184 + embedding 778,567,680 + head 778,567,680 + norm 5,120
    #        = 14,770,033,664
    ("qwen2.5-14b", 14_770_033_664, 778_567_680),
])
def test_published_dense_presets_have_their_exact_counts(preset, total, embedding):
    cfg = load_config(preset)
    model = build_model(cfg, "meta")
    assert count_total(model) == total
    assert count_by_component(model)["embedding"] == embedding
    assert count_activated(model, cfg) == total - embedding


def test_the_formula_of_this_module_gives_the_same_totals():
    assert _dense(8192, 80, 64, 8, 128, 28672, 128256) == 70_553_706_496
    assert _dense(5120, 48, 40, 8, 128, 13824, 152064, qkv_bias=True) == 14_770_033_664


@pytest.mark.parametrize("preset, total", [
    # llama-tiny: h 64, 4 layers, 4 heads, 2 KV heads of 16, f 128, V 256, untied
    # layer: q 4,096 + k 2,048 + v 2,048 + o 4,096 + MLP 24,576 + norms 128 = 36,992
    # x 4 = 147,968 + embedding 16,384 + head 16,384 + norm 64 = 180,800
    ("llama-tiny", 180_800),
    # qwen2-tiny: h 64, 4 layers, 4 heads, 2 KV heads of 16, f 96, V 256, tied, q/k/v biases
    # layer: q 4,096 + 64 + k 2,048 + 32 + v 2,048 + 32 + o 4,096 + MLP 18,432 + norms 128
    #        = 30,976; x 4 = 123,904 + embedding (= head) 16,384 + norm 64 = 140,352
    ("qwen2-tiny", 140_352),
    # qwen3-tiny: h 64, 4 layers, 4 heads of 32 (wider than h / heads), 2 KV heads, f 128,
    # V 256, untied, qk-norm; layer: q 8,192 + k 4,096 + v 4,096 + o 8,192 + MLP 24,576
    #        + norms 128 + q_norm, k_norm 64 = 49,344; x 4 = 197,376
    #        + embedding 16,384 + head 16,384 + norm 64 = 230,208
    ("qwen3-tiny", 230_208),
])
def test_tiny_family_configs_have_their_exact_counts(preset, total):
    cfg = load_config(preset)
    model = build_model(cfg, "meta")
    assert count_total(model) == total
    assert _dense(cfg.hidden_size, cfg.num_layers, cfg.num_attention_heads,
                  cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size,
                  cfg.vocab_size, cfg.tie_word_embeddings, cfg.qkv_bias, cfg.qk_norm) == total
    embedding = cfg.vocab_size * cfg.hidden_size
    # a tied embedding is also the head, which every token computes with
    assert count_activated(model, cfg) == total - (0 if cfg.tie_word_embeddings else embedding)


def test_mqa_mha_and_the_gelu_mlp_have_their_shapes():
    import dataclasses
    cfg = load_config("llama-tiny")
    mqa = build_model(dataclasses.replace(cfg, num_key_value_heads=1), "meta")
    assert tuple(mqa.layers["0"].attn.wk.weight.shape) == (16, 64)  # one KV head of 16
    mha = build_model(dataclasses.replace(cfg, num_key_value_heads=4), "meta")
    assert tuple(mha.layers["0"].attn.wk.weight.shape) == (64, 64)
    gelu = build_model(dataclasses.replace(cfg, hidden_act="gelu", gated_mlp=False), "meta")
    assert not hasattr(gelu.layers["0"].ffn, "w3")
    # the plain GELU MLP drops w3: 4 layers x 64 x 128 fewer than llama-tiny's 180,800
    assert count_total(gelu) == 180_800 - 4 * 64 * 128
