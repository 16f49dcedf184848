"""tracemem estimate under the zero-bubble and DualPipe schedules, on deepseek-tiny.

References: the placements of tracemem/schedules/placement.py (DualPipe: rank r holds chunks r
and pp - 1 - r; V: r and 2 pp - 1 - r), the in-flight counts derived by hand in
test_schedules.py, and DualPipe's README memory table (PP + 1 activations, 2x parameters).
"""

import pytest

from tracemem.errors import TracememError
from tracemem.estimator import estimate

TINY = dict(world_size=4, tp=2, sp=True, micro_batch_size=2, seq_length=64,
            experts="sequential", num_microbatches=4)


def test_dualpipe_every_rank_holds_two_stages_and_pp_plus_one_microbatches():
    one = estimate("deepseek-tiny", pp=2, schedule="1f1b", **TINY)
    dual = estimate("deepseek-tiny", pp=2, schedule="dualpipe", **TINY)
    # pp 2: rank 0 and rank 1 both hold chunks 0 and 1 (layers 0-3): the whole model
    assert [r.layers for r in dual.ranks] == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert [r.inflight_microbatches for r in dual.ranks] == [3, 3]  # pp + 1
    # both stages' parameters on every rank: 1F1B's two stages, less the MTP module's
    # embedding, which shares the first stage's table when one rank holds both
    from modeling import load_config
    cfg = load_config("deepseek-tiny")
    embedding = 2 * cfg.vocab_size * cfg.hidden_size // 2  # bf16, vocabulary split by TP 2
    assert dual.ranks[0].parameter_bytes == \
        one.ranks[0].parameter_bytes + one.ranks[1].parameter_bytes - embedding


def test_v_schedules_put_the_first_and_last_chunk_on_rank_0():
    for name, inflight in (("zbv", [4, 4]), ("dualpipev", [5, 5])):
        result = estimate("deepseek-tiny", pp=2, vpp=2, pp_layout=(1, 1, 1, 1),
                          schedule=name, **TINY)
        assert [r.layers for r in result.ranks] == [[0, 3], [1, 2]], name
        assert [r.inflight_microbatches for r in result.ranks] == inflight, name


def test_zb_h1_peaks_at_an_input_gradient_step():
    result = estimate("deepseek-tiny", pp=2, schedule="zb-h1", **TINY)
    assert [r.inflight_microbatches for r in result.ranks] == [2, 1]
    assert all(r.peak_step[1] in "FIW" for r in result.ranks)


def test_w_steps_with_recompute_are_traced_and_with_zero_3_rejected():
    # issue 28: the split backward runs under every recompute mechanism
    # (tests/tracemem/test_split_backward.py); ZeRO-3 with W steps stays refused
    estimate("deepseek-tiny", pp=2, vpp=2, pp_layout=(1, 1, 1, 1), schedule="zbv",
             recompute="full", **TINY)
    with pytest.raises(TracememError, match="--schedule zbv defers weight gradients"):
        estimate("deepseek-tiny", pp=2, vpp=2, pp_layout=(1, 1, 1, 1), schedule="zbv",
                 zero=3, **TINY)


def test_dualpipe_doubles_a_middle_stages_static_memory_on_the_paper_layout(capsys):
    """arXiv 2502.07846's stage of 4 MoE layers: 6,250,364,928 parameters; under ZeRO-3 (its
    recipe) 1,480,642,560 B of parameters, 2,961,285,120 of gradients and 5,922,570,240 of
    optimizer states. Under DualPipe rank 1 holds stages 1 and 14 (both 4 MoE layers): twice
    each (DeepSeek-V3 report Table 2: 2x parameters)."""
    import json

    from tracemem.cli import main
    assert main(["static", "--model", "deepseek-v3", "--plan", "paper-2502.07846",
                 "--precision", "paper-2502.07846", "--world-size", "1024", "--tp", "2",
                 "--pp", "16", "--ep", "8", "--etp", "1", "--zero", "3", "--pp-layout",
                 "4*15,1", "--schedule", "dualpipe", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    stage = result["stages"][1]
    assert stage["layers"] == [4, 5, 6, 7, 56, 57, 58, 59]
    assert stage["dense_params"] + stage["expert_params"] == 2 * 6_250_364_928
    assert (stage["param_bytes"], stage["grad_bytes"], stage["optimizer_bytes"]) == \
        (2 * 1_480_642_560, 2 * 2_961_285_120, 2 * 5_922_570_240)
    assert result["parallel"]["schedule"] == "dualpipe"
