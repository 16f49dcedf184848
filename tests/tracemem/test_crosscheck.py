"""tracemem crosscheck --paper 2502.07846.

Reference: arXiv 2502.07846's own figures (static rows), its M^A_2 = 2bsh / t (the layer
input under full recompute, checked by hand: 2 * 4096 * 7168 / 2 = 29,360,128 B at b 1, s 4096),
and its Table 10 total (about 23 GiB per microbatch).
"""

import json

import pytest

from tracemem.cli import main


@pytest.fixture(scope="module")
def rows():
    from tracemem.crosscheck import paper_rows
    return {r.quantity: r for r in paper_rows(b=1, s=4096)}


def test_static_rows_agree_to_the_byte(rows):
    static = [r for q, r in rows.items() if ("parameter" in q or "ZeRO-3" in q)
              and "Megatron" not in q]
    assert len(static) == 6 and all(r.difference == 0 for r in static)
    assert rows["ZeRO-3 parameter bytes (DP 32, EDP 8)"].traced == 1_480_642_560


def test_megatron_theoretical_bytes_per_parameter(rows):
    zero0 = rows["Megatron theoretical_memory_usage, ZeRO-0: 18 B per parameter"]
    assert zero0.difference == 0 and zero0.formula == 18 * 6_250_364_928
    zero1 = rows["Megatron theoretical_memory_usage, ZeRO-1: 6 + 12 / DP B per parameter"]
    dense, expert = 437_059_584, 5_813_305_344
    assert zero1.formula == round((6 + 12 / 32) * (dense + expert))
    assert zero1.traced == 6 * (dense + expert) + 12 * (dense // 32 + expert // 8)


def test_full_recompute_layer_input_agrees_and_the_rest_is_explained(rows):
    mla = rows["MLA per layer, full recompute (M^A_2 = 2bsh / t: the layer input)"]
    assert mla.formula == mla.traced == 2 * 4096 * 7168 // 2
    for r in rows.values():
        if r.difference:
            # every difference names traced tensors ([shape] dtype) or the mechanism behind it
            assert "[" in r.reason or "Megatron" in r.reason or "microbatch" in r.reason


def test_table_10_total_and_the_traced_peak_are_both_printed(rows):
    peak = rows["stage-1 activations at its peak, 1F1B, M = 16"]
    assert peak.formula == 24_671_158_272  # 4 (M^A_1 + M^E_1): the paper's ~23 GiB
    assert "15 in flight" in peak.reason and "ratio" in peak.reason
    assert peak.traced > 15 * 0.9 * peak.formula


def test_crosscheck_cli_json(capsys, monkeypatch, rows):
    # the CLI's wiring and JSON fields over the module's rows (b=1, s=4096), not a second
    # crosscheck of the whole model (16 s)
    import tracemem.crosscheck

    asked = []
    monkeypatch.setattr(tracemem.crosscheck, "paper_rows",
                        lambda b, s: asked.append((b, s)) or list(rows.values()))
    assert main(["crosscheck", "--paper", "2502.07846", "--b", "1", "--s", "4096",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert asked == [(1, 4096)]
    assert {"quantity", "formula", "traced", "difference", "unit", "reason"} <= set(result[0])
    assert [(r["quantity"], r["traced"], r["difference"]) for r in result] == \
        [(r.quantity, r.traced, r.difference) for r in rows.values()]
    assert result[0]["difference"] == 0


def test_korthikanti_layer_agrees_once_dropout_and_layernorm_statistics_are_itemised():
    from tracemem.crosscheck import korthikanti_rows

    s, b, h, a = 1024, 2, 256, 8
    rows = korthikanti_rows(s=s, b=b, h=h, a=a)
    layer = rows[0]
    sbh, as2b = s * b * h, a * s * s * b
    assert layer.formula == sbh * (34 + 5 * a * s // h)
    dropout = as2b + 2 * as2b + 2 * sbh  # masks (1 B) and outputs (2 B) the model lacks
    layernorm_stats = 2 * 2 * s * b * 4  # two LayerNorms' float32 mean and rstd, (b, s, 1)
    assert layer.traced == layer.formula - dropout + layernorm_stats
    assert rows[1].formula == rows[1].traced == 2 * sbh  # full recompute: the layer input
    assert all(r.difference == 0 for r in rows[2:])  # first-stage factors
