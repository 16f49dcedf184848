"""Hidden and attention dropout at p > 0 under the eager profile: a tiny model's training step
run for real on CPU against the same step traced on meta.

Reference: the CPU allocator under torch.profiler (tracemem.validation.groundtruth), as in
tests/modeling/test_family_real_step.py. ``F.dropout`` takes aten's composite path on both
devices (torch 2.13 aten/src/ATen/native/Dropout.cpp ``_dropout_impl``: a noise tensor of the
input's dtype, ``bernoulli_`` and ``div_`` in place, kept by the multiply), so the meta trace
must match the real step byte for byte, as without dropout.
"""

import dataclasses

import pytest
import torch

from modeling import build_model, load_config
from modeling.common.routing import Balanced
from tracemem import MemoryTracer
from tracemem.validation import model_step_real_and_traced

B, S = 2, 16


def build(cfg, device, attention):
    torch.manual_seed(0)
    model = build_model(cfg, device, attention=attention, dtype=torch.float32, kernels="eager")
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (B, S)).to(device)
    labels = torch.randint(0, cfg.vocab_size, (B, S)).to(device)
    return model, optimizer, tokens, labels


# The peak is AdamW's `exp_avg_sq.sqrt() / bias_correction2_sqrt` on the largest parameter:
# a float64 CPU scalar (8 B) and its float32 copy (4 B), below the dispatcher
# (tests/modeling/test_real_step.py), as without dropout.
@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-tiny"])
def test_traced_meta_step_with_dropout_matches_the_real_cpu_step(preset):
    cfg = dataclasses.replace(load_config(preset), hidden_dropout=0.1, attention_dropout=0.1)
    real, peak, end = model_step_real_and_traced(cfg)
    assert real.peak_bytes - peak == 8 + 4
    assert real.end_bytes == end


def test_dropout_adds_its_noise_tensors_to_the_eager_trace():
    # per layer (llama-tiny: 4, h 64, 4 heads): the two residual branches' noise [b, s, h]
    # (the dropped copies replace the undropped outputs, which nothing saves); for the
    # attention probabilities [b, n, s, s] their noise and their dropped copy (the softmax
    # keeps its own output, the weighted sum keeps the copy); one more [b, s, h] noise for the
    # embedding; all fp32 here (the model's dtype)
    cfg = load_config("llama-tiny")
    h, n, layers = cfg.hidden_size, cfg.num_attention_heads, cfg.num_layers

    def kept(config):
        model, _, tokens, labels = build(config, "meta", "eager")
        tracer = MemoryTracer(rounding=None)
        tracer.track_external(model, tokens, labels)
        with tracer:
            loss = model(tokens, labels, Balanced())
        return tracer.current_bytes - tracer.baseline_bytes - loss.untyped_storage().nbytes()

    extra = kept(dataclasses.replace(cfg, hidden_dropout=0.1, attention_dropout=0.1)) - kept(cfg)
    assert extra == ((2 * layers + 1) * B * S * h + layers * 2 * B * n * S * S) * 4 == 139_264
