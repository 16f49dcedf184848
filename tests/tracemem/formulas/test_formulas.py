"""Every closed form pinned to hand-computed values at two configurations.

References: arXiv 2502.07846 (its stated figures for PP16@TP2@EP8, b=1, s=4096), Korthikanti
et al. 2022 Table 2, Megatron-LM theoretical_memory_usage; the arithmetic is written out term
by term below.
"""

import pytest

from tracemem.formulas import korthikanti, megatron
from tracemem.formulas import paper_2502_07846 as paper

P = paper.PAPER_V3


def test_paper_parameter_counts_match_its_text():
    assert paper.rmsnorm_params(P, 4) == (7168 * 2 + 1536 + 512) * 4 == 65_536
    assert paper.mla_params(P, 4, tp=2) == (318_767_104, 110_886_912)
    assert paper.moe_params(P, 4, ep=8) == (4 * 1_835_008, 5_813_305_344)
    # second configuration: 2 layers, TP 4, EP 16 (16 + 1 experts per layer)
    assert paper.mla_params(P, 2, tp=4) == (
        (16384 * 1536 + 16384 * 512 * 2 + 7168 * 16384) * 2 // 4,
        (1536 * 7168 + 512 * 7168 + 8192 * 1536 + 64 * 7168) * 2)
    assert paper.moe_params(P, 2, ep=16) == (2 * 256 * 7168, 2 * 17 * 3 * 7168 * 2048)


def test_paper_zero_static_bytes():
    dense = 65_536 + 429_654_016 + 4 * 1_835_008
    assert paper.zero_static_bytes(dense, 5_813_305_344, 32, 8) == (
        1_480_642_560, 2_961_285_120, 5_922_570_240)
    assert paper.zero_static_bytes(1000, 800, 10, 8) == (2 * 200, 4 * 200, 8 * 200)


def test_paper_mla_activation_per_layer():
    b, s, h = 1, 4096, 7168
    terms = [4 * b * s * h // 2, 2 * b * s * (1536 + 512), 4 * b * s * (128 + 64) * 128 // 2,
             2 * b * s * 128 * 128 // 2, 5 * b * 128 * s * s // 2, 2 * b * s * 128 * 128 // 2,
             b * s * h // 2]
    assert terms == [58_720_256, 16_777_216, 201_326_592, 67_108_864, 5_368_709_120,
                     67_108_864, 14_680_064]
    assert paper.mla_activation(P, 1, 4096, 2) == sum(terms) == 5_794_430_976
    # the paper's four-layer form: 10bsh + 8bs(d_cq + d_c) + 16bs d_h n_h + 8bs d_hr n_h
    # + 10 b n_h s^2
    four = 10 * b * s * h + 8 * b * s * 2048 + 16 * b * s * 16384 + 8 * b * s * 64 * 128 \
        + 10 * b * 128 * s * s
    assert 4 * paper.mla_activation(P, 1, 4096, 2) == four
    # second configuration: b 2, s 1024, TP 4
    b, s = 2, 1024
    assert paper.mla_activation(P, b, s, 4) == (
        4 * b * s * h // 4 + 2 * b * s * 2048 + 4 * b * s * 192 * 128 // 4
        + 2 * b * s * 16384 // 4 + 5 * b * 128 * s * s // 4 + 2 * b * s * 16384 // 4
        + b * s * h // 4)


def test_paper_moe_activation_per_layer():
    b, s, h = 1, 4096, 7168
    e_token = b * s * 8 // 256  # 128 tokens per expert
    terms = [4 * b * s * h // 2, 4 * b * s * 256, 2 * b * s * 8,
             32 * (3 * e_token * h + 8 * e_token * 2048), 3 * b * s * h + 8 * b * s * 2048]
    assert terms == [58_720_256, 4_194_304, 65_536, 155_189_248, 155_189_248]
    assert paper.moe_activation(P, 1, 4096, 2, 8) == sum(terms) == 373_358_592
    # the paper's simplified form: 5bsh + 4bsN + 2bsN_r + bs N_r / N (96h + 256 h_E) + 8bs h_E
    assert sum(terms) == 5 * b * s * h + 4 * b * s * 256 + 2 * b * s * 8 \
        + b * s * 8 // 256 * (96 * h + 256 * 2048) + 8 * b * s * 2048
    # per microbatch, four layers: about 23 GiB (the paper's Table 10)
    stage = 4 * (paper.mla_activation(P, 1, 4096, 2) + paper.moe_activation(P, 1, 4096, 2, 8))
    assert stage == 24_671_158_272 and round(stage / 2**30, 2) == 22.98
    # second configuration: b 2, s 1024, TP 4, EP 16: 2 * 1024 * 8 / 256 = 64 tokens / expert
    b, s = 2, 1024
    assert paper.moe_activation(P, b, s, 4, 16) == (
        4 * b * s * h // 4 + 4 * b * s * 256 + 2 * b * s * 8
        + 16 * (3 * 64 * h + 8 * 64 * 2048) + 3 * b * s * h + 8 * b * s * 2048)


def test_paper_full_recompute_terms():
    assert paper.mla_activation_full(P, 1, 4096, 2) == 2 * 4096 * 7168 // 2 == 29_360_128
    assert paper.moe_activation_full(P, 1, 4096, 2) == 4096 * 7168 + 2 * 4096 * 8
    assert 4 * (paper.mla_activation_full(P, 1, 4096, 2)
                + paper.moe_activation_full(P, 1, 4096, 2)) == 8 * 4096 * 7168 + 8 * 4096 * 8


@pytest.mark.parametrize("s, b, h, a, t, expected", [
    # GPT-3 175B (s 2048, h 12288, a 96), t 8: sbh = 25,165,824; 5as/h = 80
    (2048, 1, 12288, 96, 8, {"none": 25_165_824 * 114, "tp_sp": 25_165_824 / 8 * 114,
                             "tp": 25_165_824 * (10 + 3 + 80 / 8),
                             "tp_sp_selective": 34 * 25_165_824 / 8,
                             "tp_selective": 25_165_824 * 13, "full": 2 * 25_165_824}),
    # small: s 1024, b 2, h 1024, a 16, t 2: sbh = 2,097,152; 5as/h = 80
    (1024, 2, 1024, 16, 2, {"none": 2_097_152 * 114, "tp_sp": 2_097_152 / 2 * 114,
                            "tp": 2_097_152 * (10 + 12 + 40), "tp_sp_selective": 34 * 1_048_576,
                            "tp_selective": 2_097_152 * 22, "full": 4_194_304}),
])
def test_korthikanti_per_layer(s, b, h, a, t, expected):
    for case, value in expected.items():
        assert korthikanti.per_layer(s, b, h, a, t, case) == pytest.approx(value)


def test_korthikanti_first_stage_factor():
    assert korthikanti.first_stage_total(10.0, 96, 8) == 960.0
    assert korthikanti.first_stage_total(10.0, 96, 8, m=64, vpp=2) == 960 * (1 + 7 / 16)


def test_megatron_bytes_per_parameter():
    assert megatron.weight_and_optimizer_bytes_per_param(32, False) == 18
    assert megatron.weight_and_optimizer_bytes_per_param(32, True) == 6 + 12 / 32 == 6.375
    assert megatron.weight_and_optimizer_bytes_per_param(8, True) == 7.5


def test_pipeline_schedule_closed_forms_are_table_2():
    """DeepSeek-V3 report Table 2 (arXiv 2412.19437): 1F1B 1x / PP, ZB1P 1x / PP, DualPipe
    2x / PP + 1; DualPipe README: DualPipeV 2x / PP + 1 with PP = 2 x devices stages; Qi et
    al. 2023: ZB-V holds p M_B = 2 p half-stage chunks."""
    from tracemem.formulas import pipeline_schedules as closed
    assert [closed.parameter_multiple(n) for n in ("1f1b", "zb-h1", "dualpipe")] == [1, 1, 2]
    assert [closed.activation_multiple(n, 16) for n in ("1f1b", "zb-h1", "dualpipe")] == \
        [16, 16, 17]
    assert closed.activation_multiple("dualpipev", 4) == 9  # 8 stages + 1
    assert closed.activation_multiple("zbv", 4) == 8
