"""``tracemem fit`` on a grouped-query-attention family with context parallelism: the CP term
of ``tracemem.formulas.cost`` counts the key / value heads (query groups) of head_dim each
(Megatron-Core's CP exchanges K and V, megatron/core/transformer/attention.py at d98e8a6), and
the whole fit runs (it used to fail on the MLA-only ``v_head_dim``, a fresh-user finding)."""

from __future__ import annotations

import json

from tracemem.cli import main


def test_fit_gqa_with_cp_counts_kv_heads_by_hand(capsys):
    args = ["fit", "--model", "llama-tiny", "--world-size", "4", "--hbm", "1GiB",
            "--seq-length", "256", "--global-batch-size", "8", "--pp", "1", "--cp", "2",
            "--tp", "1", "--ep", "1", "--recompute", "none", "--kernels", "eager",
            "--workers", "1", "--quiet", "--json"]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    row = next(r for r in rows if r["cp"] == 2)
    # llama-tiny: h 64, 4 heads, 2 KV heads, head_dim 64 / 4 = 16, 4 layers; DP = 4 / 2 = 2,
    # M = 8 / (1 x 2) = 4. Per layer and microbatch: 3 (c - 1) b (s / c) (kv / t)(16 + 16) 2 B
    per_layer = 3 * (2 - 1) * 1 * (256 // 2) * (2 // 1) * (16 + 16) * 2
    assert per_layer == 49_152
    assert row["num_microbatches"] == 4
    assert row["cp_bytes"] == per_layer * 4 * 4 == 786_432
