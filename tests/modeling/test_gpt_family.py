"""Megatron-LM's GPT model as the "gpt" family: its defaults, what it refuses, exact parameter
counts, the tiny model's real CPU step against the meta trace, and what the learned position
embedding allocates under megatron-te.

References: Megatron-LM d98e8a6, read by hand: megatron/core/transformer/transformer_config.py
(LayerNorm, eps 1e-5, GELU, add_bias_linear, dropout 0.1), megatron/training/arguments.py
(``--position-embedding-type learned_absolute``, ``--untie-embeddings-and-output-weights``,
``validate_args``' ffn_hidden_size 4h or int(4h * 2/3 / 64) * 64 with SwiGLU, kv_channels h /
heads, ``max_position_embeddings >= seq_length``), megatron/core/models/common/embeddings/
language_model_embedding.py (``position_embeddings`` Embedding(max_sequence_length, h); the
sum, its [s, b, h] copy, the SP scatter and clone), tests/functional_tests/test_cases/gpt/
gpt3_mcore_te_tp1_pp4_vp1/model_config.yaml (the gpt3-mcore-64m shape). Counts are the
arithmetic written out below; the CPU step is the real allocator under torch.profiler
(tracemem.validation.groundtruth), as in tests/modeling/test_family_real_step.py.
"""

import dataclasses
import json

import pytest
import torch

from modeling import build_model, load_config
from modeling.common.model import Transformer
from modeling.common.norm import LayerNorm, RMSNorm
from modeling.common.routing import Balanced
from modeling.kernels import get_profile
from modeling.parallel.groups import ParamGroup, group_of
from modeling.parallel.plans import LocalSizes
from modeling.params import count_activated, count_by_component, count_total
from tracemem import MemoryTracer
from tracemem.errors import TracememError
from tracemem.validation import model_step_real_and_traced


def _write(tmp_path, **data):
    path = tmp_path / "gpt.json"
    path.write_text(json.dumps({"model_type": "gpt"} | data))
    return path


SHAPE = dict(vocab_size=50257, hidden_size=512, num_layers=12, num_attention_heads=8,
             max_position_embeddings=1024)


def test_absent_keys_take_megatrons_gpt_defaults(tmp_path):
    cfg = load_config(_write(tmp_path, **SHAPE))
    assert (cfg.normalization, cfg.rms_norm_eps, cfg.position_embedding) == \
        ("layernorm", 1e-5, "learned_absolute")
    assert (cfg.hidden_act, cfg.gated_mlp, cfg.intermediate_size) == ("gelu", False, 4 * 512)
    assert cfg.qkv_bias and cfg.o_bias and cfg.mlp_bias and cfg.tie_word_embeddings
    assert (cfg.hidden_dropout, cfg.attention_dropout) == (0.1, 0.1)
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.attention) == (8, 512 // 8, "gqa")
    assert cfg.rotary_dim == 0 and not cfg.has_rope and cfg.dtype == "bfloat16"
    # --swiglu: ffn_hidden_size = int((4 * 512 * 2 / 3) / 64) * 64 = int(21.33) * 64 = 1344
    swiglu = load_config(_write(tmp_path, **SHAPE, hidden_act="silu", gated_mlp=True))
    assert swiglu.intermediate_size == 1344
    assert load_config("gpt3-mcore-64m") == dataclasses.replace(cfg, name="gpt3-mcore-64m")


def test_a_gpt_config_refuses_keys_it_does_not_build_in_one_line(tmp_path):
    path = _write(tmp_path, **SHAPE, num_routed_experts=8)
    with pytest.raises(TracememError, match=rf"^{path}: num_routed_experts=8 is a ModelConfig "
                                            r"field model_type 'gpt' does not build .*; keys: "
                                            r"vocab_size, hidden_size,"):
        load_config(path)
    path = _write(tmp_path, **SHAPE, num_layer=12)
    with pytest.raises(TracememError, match=rf"^{path}: num_layer=12 is not a key of "
                                            r"model_type 'gpt'; keys: "):
        load_config(path)
    path = _write(tmp_path, **SHAPE, num_hidden_layers=12)  # a Hugging Face key
    with pytest.raises(TracememError, match=rf"^{path}: num_hidden_layers=12 contradicts "
                                            r"model_type 'gpt' \(it is a key of deepseek_v2"):
        load_config(path)
    path = _write(tmp_path, **SHAPE, num_mtp_modules=1)  # learned_absolute by default
    with pytest.raises(TracememError, match=r'num_mtp_modules=1 with position_embedding='
                                            r'"learned_absolute" is refused by Megatron-LM '
                                            r'\(megatron/training/arguments.py validate_args'):
        load_config(path)
    assert load_config(_write(tmp_path, **SHAPE, num_mtp_modules=1,
                              position_embedding="none")).num_mtp_modules == 1
    path = _write(tmp_path, **SHAPE, hidden_act="squared_relu", gated_mlp=True)
    with pytest.raises(TracememError, match=r"squared_relu.*gated_mlp=true is invalid: "
                                            r"Megatron's --squared-relu is non-gated"):
        load_config(path)
    path = _write(tmp_path, **{**SHAPE, "normalization": "batchnorm"})
    with pytest.raises(TracememError, match=r"normalization='batchnorm' is invalid; it must be "
                                            r"one of rmsnorm, layernorm"):
        load_config(path)


def _count(cfg):
    model = build_model(cfg, "meta")
    return model, count_total(model), count_by_component(model), count_activated(model, cfg)


def test_gpt_shapes_have_their_exact_parameter_counts(tmp_path):
    # gpt3-mcore-64m: h 512, 12 layers, 8 heads of 64, f = 4h = 2048, V 50257, 1024 positions;
    # LayerNorm (weight and bias), GELU, biases on linear_qkv, linear_proj, fc1, fc2, tied
    # layer: qkv 3 * 512 * 512 = 786,432 + bias 1,536; proj 262,144 + 512;
    #        fc1 512 * 2048 = 1,048,576 + 2,048; fc2 1,048,576 + 512; two LayerNorms 2,048
    #        = 3,152,384; x 12 = 37,828,608
    # + word embedding 50257 * 512 = 25,731,584 (also the head) + positions 1024 * 512 =
    #   524,288 + final LayerNorm 1,024 = 64,085,504
    layer = 786_432 + 1_536 + 262_144 + 512 + 1_048_576 + 2_048 + 1_048_576 + 512 + 2_048
    assert layer == 3_152_384
    model, total, parts, activated = _count(load_config("gpt3-mcore-64m"))
    assert total == 12 * layer + 25_731_584 + 524_288 + 1_024 == 64_085_504
    assert parts["embedding"] == 25_731_584 + 524_288 and parts["output_head"] == 0
    assert parts["norms"] == 12 * 2_048 + 1_024
    # activated: the position table is a lookup; the tied word embedding is the head too
    assert activated == 64_085_504 - 524_288
    assert model.head.weight is model.embed.weight
    # replicated over TP (no tp_dim), dense, counted under "embedding"
    assert group_of(model.position_embed.weight) == ParamGroup("embedding", "dense", None)

    # the same untied: a head of its own, 50257 * 512 = 25,731,584 more
    untied = dataclasses.replace(load_config("gpt3-mcore-64m"), tie_word_embeddings=False)
    _, total, parts, activated = _count(untied)
    assert total == 64_085_504 + 25_731_584 == 89_817_088
    assert parts["output_head"] == 25_731_584
    assert activated == 89_817_088 - 25_731_584 - 524_288

    # SwiGLU + RoPE + GQA (2 query groups) without biases, RMSNorm: h 512, 12 layers, 8 heads
    # of 64, f = int(4 * 512 * 2 / 3 / 64) * 64 = 1344, tied, no position table
    # layer: q 262,144 + k, v 2 * 512 * 128 = 131,072 + o 262,144 + MLP 3 * 512 * 1344
    #        = 2,064,384 + two RMSNorms 1,024 = 2,720,768; x 12 = 32,649,216
    # + word embedding 25,731,584 + final RMSNorm 512 = 58,381,312
    llama_like = load_config(_write(
        tmp_path, **SHAPE, hidden_act="silu", gated_mlp=True, position_embedding="rope",
        num_key_value_heads=2, qkv_bias=False, o_bias=False, mlp_bias=False,
        normalization="rmsnorm"))
    model, total, parts, activated = _count(llama_like)
    layer = 262_144 + 131_072 + 262_144 + 2_064_384 + 1_024
    assert layer == 2_720_768
    assert total == 12 * layer + 25_731_584 + 512 == 58_381_312
    assert model.position_embed is None and parts["embedding"] == 25_731_584
    assert activated == total  # tied: the only table is also the head
    assert isinstance(model.norm, RMSNorm) and model.layers["0"].attn.inv_freq.shape == (32,)


def test_every_norm_site_follows_the_normalization():
    cfg = dataclasses.replace(load_config("gpt-tiny"), qk_norm=True, num_mtp_modules=1)
    model = build_model(cfg, "meta")
    norms = [m for m in model.modules() if isinstance(m, (LayerNorm, RMSNorm))]
    # per layer attn_norm, ffn_norm, q_norm, k_norm (4 + 1 MTP layers), the final norm, MTP
    # enorm, hnorm and norm
    assert len(norms) == 5 * 4 + 1 + 3 and all(isinstance(m, LayerNorm) for m in norms)
    assert all(group_of(m.bias) == group_of(m.weight) for m in norms)
    assert not any(hasattr(m, "inv_freq") for m in model.modules())  # no RoPE anywhere
    rms = build_model(dataclasses.replace(cfg, normalization="rmsnorm"), "meta")
    assert not any(isinstance(m, LayerNorm) for m in rms.modules())



# The peak is AdamW's `exp_avg_sq.sqrt() / bias_correction2_sqrt` on the largest parameter:
# the Python float wrapped as a float64 CPU tensor (8 B) and its float32 copy (4 B), both
# below the dispatcher (tests/modeling/test_real_step.py).
@pytest.mark.parametrize("changes", [
    {},  # LayerNorm, GELU, learned positions, biases, tied
    {"hidden_act": "squared_relu", "tie_word_embeddings": False},
    # the MTP re-embeds the rolled tokens and position ids, as Megatron-Core's
    # MultiTokenPredictionLayer._get_embeddings does (Megatron-LM's validate_args refuses
    # this pair, the gpt family too; the model builds what Megatron-Core would run)
    {"num_mtp_modules": 1},
])
def test_tiny_gpt_meta_step_matches_the_real_cpu_step(changes):
    cfg = dataclasses.replace(load_config("gpt-tiny"), **changes)
    real, peak, end = model_step_real_and_traced(cfg)
    assert real.peak_bytes - peak == 8 + 4
    assert real.end_bytes == end


@pytest.mark.parametrize("b, copy", [(2, True), (1, False)])
def test_learned_positions_allocate_what_language_model_embedding_does(b, copy):
    # megatron-te, TP 2 with SP, bf16, s 16, h 64: position ids (16,) int64 and their (b, 16)
    # repeat; word and position embeddings (b, 16, 64) each, their sum, the [s, b, h] copy
    # (none when b is 1: the transposed view is already contiguous), then the scatter's clone
    # (b, 8, 64); word, position and sum are alive until the embedding returns
    cfg = load_config("gpt-tiny")
    sizes = dataclasses.replace(LocalSizes.full(cfg), tp=2, sp=2)
    with torch.device("meta"):
        model = Transformer(cfg, sizes=sizes, kernels=get_profile("megatron-te"),
                            post_process=False).to(torch.bfloat16)
    tokens = torch.zeros(b, 16, dtype=torch.long, device="meta")
    tracer = MemoryTracer(rounding=None)
    tracer.track_external(model, tokens)
    start = len(tracer.events)
    with tracer:
        out = model._embed(tokens, model._positions(tokens))
    bf16 = torch.bfloat16
    full = ((b, 16, 64), bf16)
    assert [(e.shape, e.dtype) for e in tracer.events[start:] if e.action == "alloc"] == [
        ((16,), torch.int64), ((b, 16), torch.int64), full, full, full,
        *([full] if copy else []), ((b, 8, 64), bf16)]
    assert out.shape == (b, 8, 64)


def test_a_sequence_longer_than_the_position_table_is_one_line():
    cfg = load_config("gpt-tiny")  # 128 positions
    model = build_model(cfg, "meta")
    tokens = torch.zeros(1, 256, dtype=torch.long, device="meta")
    with pytest.raises(TracememError, match=r"^--seq-length 256 is longer than "
                                            r"max_position_embeddings \(128\) of gpt-tiny: "
                                            r"learned absolute position embeddings have one "
                                            r"row per position; use --seq-length <= 128$"):
        model(tokens, tokens, Balanced())
