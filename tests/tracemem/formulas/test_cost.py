"""``tracemem.formulas.cost`` against hand arithmetic from its sources: Narayanan et al. 2021
(section 2.2: 1F1B (p - 1) / m, interleaved (p - 1) / (v m)), DeepSeek-V3 Table 2 (ZB1P and
DualPipe bubbles with F = B_in = W = 1), Korthikanti et al. 2022 (section 4.2.2), the
DeepSeek-V3 report's dispatch / combine and Ring Attention's KV passing."""

from __future__ import annotations

import pytest

from tracemem.formulas.cost import (
    bubble_fraction,
    cp_bytes,
    ep_bytes,
    rank_key,
    recompute_overhead,
    step_cost,
    tp_bytes,
)


def test_bubble_fractions():
    assert bubble_fraction("1f1b", 1, 1, 8) == 0.0
    assert bubble_fraction("1f1b", 16, 1, 32) == 15 / 32
    assert bubble_fraction("gpipe", 4, 1, 8) == 3 / 8
    assert bubble_fraction("interleaved-1f1b", 8, 2, 16) == 7 / 32
    # ZB1P: (p - 1)(F + B - 2W) = 7 (1 + 2 - 2) = 7 over m (F + B) = 8 x 3 = 24
    assert bubble_fraction("zb-h1", 8, 1, 8) == 7 / 24
    # DualPipe: (p/2 - 1)(F&B + B - 3W) = 3 (3 + 2 - 3) = 6 over 16 x 3 = 48
    assert bubble_fraction("dualpipe", 8, 1, 16) == 6 / 48
    # DualPipeV: PP = 2 x 8 = 16 stages: (16/2 - 1) x 2 = 14 over 48
    assert bubble_fraction("dualpipev", 8, 2, 16) == 14 / 48
    with pytest.raises(ValueError, match="no bubble formula"):
        bubble_fraction("other", 2, 1, 2)


def test_communication_bytes():
    # TP 4, b 1, s 4096, h 7168: 8 x 3/4 x 4096 x 7168 x 2 B = 352,321,536
    assert tp_bytes(1, 4096, 7168, 4) == 8 * 3 * 4096 * 7168 * 2 // 4 == 352_321_536
    assert tp_bytes(1, 4096, 7168, 1) == 0
    # EP 8, top-8, SP over TP 2: tokens 4096 / 2 = 2048; 4 x 7/8 x 2048 x 8 x 7168 x 2 B
    assert ep_bytes(1, 4096, 7168, 8, 8, 1, 2) == 4 * 7 * 2048 * 8 * 7168 * 2 // 8
    # CP 2, TP 1, 128 heads, d_qk 192, d_v 128: 3 x 1 x 2048 x 128 x 320 x 2 B
    assert cp_bytes(1, 4096, 128, 192, 128, 1, 2) == 3 * 2048 * 128 * 320 * 2
    assert rank_key(0.1 + 0.2, 5) == rank_key(0.3, 5)


def test_recompute_overhead_and_step_cost():
    assert recompute_overhead("none", 4096, 7168) == 0
    assert recompute_overhead("full", 4096, 7168) == 1 / 3
    # s = 4096, h = 7168: 4 b s^2 h / (3 (24 b s h^2 + 4 b s^2 h)) = 4096 / (18 x 7168 + 3 x 4096)
    assert recompute_overhead("selective", 4096, 7168) == 4096 / (129024 + 12288)
    with pytest.raises(ValueError, match="no overhead formula"):
        recompute_overhead("some", 1, 1)
    assert step_cost(0.5, 1 / 3) == pytest.approx(2.0)
