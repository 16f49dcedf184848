"""``tracemem fit``'s search-space input, from a fresh-user trial: an empty list item is an
error, a non-integer says so, a dense model's EP defaults to 1 (the MoE defaults 8-64 would
reject every layout), and the "no valid layout" reasons give counts as counts."""

from __future__ import annotations

import pytest

from modeling import load_config
from tracemem.cli import main
from tracemem.errors import TracememError
from tracemem.fit import enumerate_layouts, fit, search_space


@pytest.mark.parametrize("text, message", [
    ("1,,2", r"--tp '1,,2' has an empty value"),
    ("-2", r"--tp value '-2' must be a positive integer"),
    ("0", r"--tp value 0 is invalid; give positive integers"),
])
def test_bad_lists(text, message):
    with pytest.raises(TracememError, match=message):
        search_space(tp=text)


def test_a_dense_model_gets_ep_1_by_default(monkeypatch):
    seen = {}

    def record(cfg, world_size, seq_length, global_batch_size, space, **kwargs):
        seen["ep"], seen["etp"] = space.ep, space.etp
        return [], {"stopped here": 1}

    monkeypatch.setattr("tracemem.fit.enumerate_layouts", record)
    with pytest.raises(TracememError, match=r"\(stopped here \(1 layout\)\)"):
        fit("llama-tiny", world_size=4, hbm="1GiB", seq_length=64, global_batch_size=8,
            space=search_space(pp="1"))
    assert seen == {"ep": (1,), "etp": (1,)}
    with pytest.raises(TracememError):
        fit("llama-tiny", world_size=4, hbm="1GiB", seq_length=64, global_batch_size=8,
            space=search_space(pp="1", ep="8"))
    assert seen == {"ep": (8,), "etp": (1,)}  # given explicitly: kept


def test_no_valid_layout_counts_read_as_counts(capsys):
    args = ["fit", "--model", "deepseek-tiny", "--world-size", "4", "--hbm", "1GiB",
            "--seq-length", "64", "--global-batch-size", "4", "--tp", "3", "--quiet"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert " layout" in err and " x " not in err.split("(", 1)[1].split(")")[0][:3]


def test_enumerate_is_unchanged_for_a_moe_model():
    cfg = load_config("deepseek-tiny")
    layouts, _ = enumerate_layouts(cfg, 4, 64, 4, search_space(tp="1", pp="1", ep="2",
                                                               recompute="none"))
    assert layouts and all(l.ep == 2 for l in layouts)
