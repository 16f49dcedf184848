"""Each MoE family's tiny config run for real on CPU (real routing) against the same step
traced on meta, eager profile (issue 12, "Must show").

Reference: the CPU allocator under torch.profiler (tracemem.validation.groundtruth), as in
tests/modeling/test_real_step.py for deepseek-tiny: the real step routes with its router's real
choices (``Observed``), their per-expert counts go to a counts file, and the meta trace routes
with ``counts:FILE``, so both runs have the same shapes.
"""

import json

import pytest
import torch

from modeling import build_model, load_config
from modeling.common.routing import Observed, parse_routing
from tracemem import MemoryTracer
from tracemem.validation import profile_cpu_step

B, S = 2, 16


def build(cfg, device):
    torch.manual_seed(0)
    # built on the device itself: Module.to("meta") unties a tied head from the embedding
    model = build_model(cfg, device, attention="eager", experts="sequential",
                        dtype=torch.float32, kernels="eager")
    for param in model.parameters():  # real values, so the real router makes real choices
        torch.nn.init.normal_(param, std=0.02)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (B, S)).to(device)
    labels = torch.randint(0, cfg.vocab_size, (B, S)).to(device)
    return model, optimizer, tokens, labels


# The peak is AdamW's `exp_avg_sq.sqrt() / bias_correction2_sqrt` on the largest parameter:
# the Python float wrapped as a float64 CPU tensor (8 B) and its float32 copy (4 B), both
# below the dispatcher (tests/modeling/test_real_step.py).
@pytest.mark.parametrize("preset, moe_layers", [
    ("qwen3-moe-tiny", [1, 2, 3]),  # mlp_only_layers [0]
    ("qwen2-moe-tiny", [1, 3]),  # decoder_sparse_step 2: (layer + 1) % 2 == 0
    ("mixtral-tiny", [0, 1, 2, 3]),
])
def test_traced_meta_step_matches_the_real_cpu_step(tmp_path, preset, moe_layers):
    cfg = load_config(preset)
    model, optimizer, tokens, labels = build(cfg, "cpu")
    model(tokens, labels, Observed()).backward()  # warm-up on a throw-away copy
    optimizer.step()

    model, optimizer, tokens, labels = build(cfg, "cpu")
    observed = Observed()

    def step():
        model(tokens, labels, observed).backward()
        optimizer.step()

    real = profile_cpu_step(step)
    assert sorted(observed.recorded) == moe_layers
    assert all(sum(c) == B * S * cfg.num_experts_per_tok for c in observed.recorded.values())

    counts_file = tmp_path / "counts.json"
    counts_file.write_text(json.dumps({str(k): v for k, v in observed.recorded.items()}))
    meta = build(cfg, "meta")
    tracer = MemoryTracer()
    tracer.track_external(*meta)
    with tracer:
        meta[0](meta[2], meta[3], parse_routing(f"counts:{counts_file}")).backward()
        meta[1].step()

    assert real.peak_bytes - (tracer.peak_bytes - tracer.baseline_bytes) == 8 + 4
    assert real.end_bytes == tracer.current_bytes - tracer.baseline_bytes
