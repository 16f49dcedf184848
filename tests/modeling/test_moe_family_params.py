"""Parameter counts of the MoE family presets: mixtral-8x7b, qwen3-30b-a3b, qwen1.5-moe-a2.7b.

References: each model's published ``config.json`` (Hugging Face Hub: mistralai/Mixtral-8x7B-v0.1,
Qwen/Qwen3-30B-A3B, Qwen/Qwen1.5-MoE-A2.7B) multiplied out by hand with the module shapes of
Hugging Face transformers' ``modeling_mixtral.py`` (``MixtralAttention``,
``MixtralSparseMoeBlock``), ``modeling_qwen3_moe.py`` (``Qwen3MoeAttention`` with ``q_norm`` /
``k_norm`` of ``head_dim``, ``Qwen3MoeSparseMoeBlock``) and ``modeling_qwen2_moe.py``
(``Qwen2MoeAttention`` with q/k/v bias, ``Qwen2MoeSparseMoeBlock`` with ``shared_expert`` and
``shared_expert_gate``); the totals stated in issue 12 (Mixtral-8x7B 46,702,792,704;
Qwen3-30B-A3B 30,532,122,624); the published activated figures (Mistral AI, "Mixtral of
experts", 2023-12-11: "12.9B parameters per token"; Qwen3 model card: "30.5B in total and 3.3B
activated"; Qwen1.5-MoE model card: "14.3B parameters in total and 2.7B activated"). Those
publishers count the input embedding as activated; ``count_activated`` follows DeepSeek's
convention (it does not), so each test checks both.
"""

import pytest

from modeling.params import count_activated, count_by_component, count_total
from modeling.registry import load_config
from modeling.common.model import build_model


def test_mixtral_8x7b_counts():
    # vocab 32,000, h 4,096, 32 layers, 32 heads of 128, 8 KV heads, 8 experts of 14,336, top-2
    h, vocab, layers = 4096, 32000, 32
    attention = 4096 * 4096 + 2 * 4096 * (8 * 128) + 4096 * 4096  # q, k + v, o: 41,943,040
    expert = 3 * 4096 * 14336  # w1, w2, w3: 176,160,768
    router = 8 * 4096  # 32,768
    layer = attention + 8 * expert + router + 2 * h  # + input / post-attention RMSNorm
    assert layer == 1_451_270_144
    embedding = vocab * h  # 131,072,000; the head is untied and as large
    total = layers * layer + 2 * embedding + h  # + final norm
    assert total == 46_702_792_704

    cfg = load_config("mixtral-8x7b")
    model = build_model(cfg)
    assert count_total(model) == total
    by = count_by_component(model)
    assert by["attention"] == layers * 41_943_040
    assert by["routed_experts"] == layers * 8 * expert
    assert by["router"] == layers * router
    assert by["shared_experts"] == by["dense_mlp"] == by["mtp_layer"] == 0
    assert by["norms"] == layers * 2 * h + h
    # a token skips 6 of the 8 experts in every layer
    activated = total - embedding - layers * 6 * expert
    assert count_activated(model, cfg) == activated == 12_748_853_248
    assert activated + embedding == 12_879_925_248  # Mistral's "12.9B" counts the embedding


def test_qwen3_30b_a3b_counts():
    # vocab 151,936, h 2,048, 48 layers, 32 query heads and 4 KV heads of head_dim 128,
    # q_norm / k_norm of 128, 128 experts of 768, top-8, no shared expert, every layer MoE
    h, vocab, layers = 2048, 151936, 48
    attention = 2048 * (32 * 128) + 2 * 2048 * (4 * 128) + (32 * 128) * 2048 + 2 * 128
    assert attention == 18_874_624  # q 8,388,608, k + v 2,097,152, o 8,388,608, norms 256
    expert = 3 * 2048 * 768  # 4,718,592
    router = 128 * 2048  # 262,144
    layer = attention + 128 * expert + router + 2 * h
    assert layer == 623_120_640
    embedding = vocab * h  # 311,164,928, untied head as large
    total = layers * layer + 2 * embedding + h
    assert total == 30_532_122_624

    cfg = load_config("qwen3-30b-a3b")
    model = build_model(cfg)
    assert count_total(model) == total
    by = count_by_component(model)
    assert by["routed_experts"] == layers * 128 * expert
    assert by["router"] == layers * router
    assert by["shared_experts"] == by["dense_mlp"] == 0
    activated = total - embedding - layers * (128 - 8) * expert
    assert count_activated(model, cfg) == activated == 3_041_867_776
    assert activated + embedding == 3_353_032_704  # Qwen's "3.3B activated"


def test_qwen1_5_moe_a2_7b_counts():
    # vocab 151,936, h 2,048, 24 layers, 16 heads (MHA) of 128 with q/k/v bias, 60 experts of
    # 1,408, top-4, one shared expert of 5,632 with a Linear(h, 1) sigmoid gate
    h, vocab, layers = 2048, 151936, 24
    attention = 3 * (2048 * 2048 + 2048) + 2048 * 2048  # q, k, v with bias; o without
    assert attention == 16_783_360
    expert = 3 * 2048 * 1408  # 8,650,752
    router = 60 * 2048  # 122,880
    shared = 3 * 2048 * 5632 + 2048  # the shared expert, and its gate: 34,605,056
    layer = attention + 60 * expert + router + shared + 2 * h
    assert layer == 570_560_512
    embedding = vocab * h
    total = layers * layer + 2 * embedding + h
    assert total == 14_315_784_192  # the model card's "14.3B"

    cfg = load_config("qwen1.5-moe-a2.7b")
    model = build_model(cfg)
    assert count_total(model) == total
    by = count_by_component(model)
    assert by["shared_experts"] == layers * shared
    assert by["router"] == layers * router
    activated = total - embedding - layers * (60 - 4) * expert
    assert count_activated(model, cfg) == activated == 2_378_008_576
    assert activated + embedding == 2_689_173_504  # the model card's "2.7B activated"
