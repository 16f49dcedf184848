"""deepseek-tiny run for real on CPU (real routing) against the same step traced on meta.

Reference: the CPU allocator under torch.profiler (tracemem.validation.groundtruth), as in
tests/tracemem/test_proof.py. The real step routes with its router's real choices
(``Observed``); their per-expert counts are written to a counts file and the meta trace routes
with ``counts:FILE``, so both runs have the same shapes.
"""

import json

import pytest
import torch

from modeling import load_config
from modeling.common.model import build_model
from modeling.common.routing import Observed, parse_routing
from tracemem import MemoryTracer
from tracemem.validation import profile_cpu_step

CFG = load_config("deepseek-tiny")
B, S = 2, 16


def build(device, experts, dtype):
    torch.manual_seed(0)
    model = build_model(CFG, "cpu", attention="eager", experts=experts, dtype=dtype)
    for param in model.parameters():  # real values, so the real router makes real choices
        torch.nn.init.normal_(param, std=0.02)
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, CFG.vocab_size, (B, S)).to(device)
    labels = torch.randint(0, CFG.vocab_size, (B, S)).to(device)
    return model, optimizer, tokens, labels


# The step's peak is AdamW's `exp_avg_sq.sqrt() / bias_correction2_sqrt` on the largest
# parameter: the Python float is wrapped as a float64 CPU tensor (8 B) and TensorIterator copies
# it to the parameter dtype (float32: 4 B, bfloat16: 2 B), both below the dispatcher.
@pytest.mark.parametrize("experts, dtype, unseen_bytes", [
    ("sequential", torch.float32, 8 + 4),
    ("grouped", torch.bfloat16, 8 + 2),
])
def test_traced_meta_step_matches_the_real_cpu_step(tmp_path, experts, dtype, unseen_bytes):
    model, optimizer, tokens, labels = build("cpu", experts, dtype)
    model(tokens, labels, Observed()).backward()  # warm-up on a throw-away copy
    optimizer.step()

    model, optimizer, tokens, labels = build("cpu", experts, dtype)
    observed = Observed()

    def step():
        model(tokens, labels, observed).backward()
        optimizer.step()

    real = profile_cpu_step(step)
    moe_layers = [i for i in range(CFG.num_layers + CFG.num_mtp_modules) if CFG.is_moe_layer(i)]
    assert sorted(observed.recorded) == moe_layers == [2, 3, 4]  # layers 2, 3 and the MTP's
    assert all(sum(c) == B * S * CFG.num_experts_per_tok for c in observed.recorded.values())

    counts_file = tmp_path / "counts.json"
    counts_file.write_text(json.dumps({str(k): v for k, v in observed.recorded.items()}))
    meta = build("meta", experts, dtype)
    tracer = MemoryTracer()
    tracer.track_external(*meta)
    with tracer:
        meta[0](meta[2], meta[3], parse_routing(f"counts:{counts_file}")).backward()
        meta[1].step()

    assert real.peak_bytes - (tracer.peak_bytes - tracer.baseline_bytes) == unseen_bytes
    assert real.end_bytes == tracer.current_bytes - tracer.baseline_bytes
