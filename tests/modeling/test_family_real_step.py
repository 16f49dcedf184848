"""Each dense family's tiny config run for real on CPU against the same step traced on meta,
eager profile (issue 12, "Must show").

Reference: the CPU allocator under torch.profiler (tracemem.validation.groundtruth), as in
tests/modeling/test_real_step.py for deepseek-tiny. Dense models route nothing, so the meta
step has the real step's shapes with no counts file.
"""

import pytest
import torch

from modeling import build_model, load_config
from modeling.common.routing import Balanced
from tracemem import MemoryTracer
from tracemem.validation import profile_cpu_step

B, S = 2, 16


def build(cfg, device, attention):
    torch.manual_seed(0)
    # built on the device itself: Module.to("meta") unties a tied head from the embedding
    model = build_model(cfg, device, attention=attention, dtype=torch.float32, kernels="eager")
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (B, S)).to(device)
    labels = torch.randint(0, cfg.vocab_size, (B, S)).to(device)
    return model, optimizer, tokens, labels


# The peak is AdamW's `exp_avg_sq.sqrt() / bias_correction2_sqrt` on the largest parameter:
# the Python float wrapped as a float64 CPU tensor (8 B) and its float32 copy (4 B), both
# below the dispatcher (tests/modeling/test_real_step.py).
@pytest.mark.parametrize("preset", ["llama-tiny", "qwen2-tiny", "qwen3-tiny"])
def test_traced_meta_step_matches_the_real_cpu_step(preset):
    cfg = load_config(preset)
    model, optimizer, tokens, labels = build(cfg, "cpu", "eager")
    model(tokens, labels, Balanced()).backward()  # warm-up on a throw-away copy
    optimizer.step()

    model, optimizer, tokens, labels = build(cfg, "cpu", "eager")

    def step():
        model(tokens, labels, Balanced()).backward()
        optimizer.step()

    real = profile_cpu_step(step)
    meta = build(cfg, "meta", "eager")
    tracer = MemoryTracer()
    tracer.track_external(*meta)
    with tracer:
        meta[0](meta[2], meta[3], Balanced()).backward()
        meta[1].step()

    assert real.peak_bytes - (tracer.peak_bytes - tracer.baseline_bytes) == 8 + 4
    assert real.end_bytes == tracer.current_bytes - tracer.baseline_bytes
