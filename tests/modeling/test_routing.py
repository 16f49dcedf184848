"""Routing models: per-expert token-slot counts.

Reference: hand arithmetic of each model's formula (modeling/common/routing.py docstring).
"""

import json

import pytest

from modeling.common.routing import Balanced, Counts, Hot, Zipf, apportion, parse_routing
from tracemem.errors import TracememError


def test_balanced_is_the_exact_integer_split():
    # 10 tokens * top-2 = 20 slots over 8 experts: 2 each, the first 4 get one more
    assert Balanced().counts(10, 2, 8, layer=3) == [3, 3, 3, 3, 2, 2, 2, 2]
    assert Balanced().counts(4096, 8, 256, layer=3) == [128] * 256


@pytest.mark.parametrize("spec", ["balanced", "zipf:0.5", "zipf:2", "hot:4:0.5", "hot:1:0.01"])
def test_counts_sum_to_tokens_times_topk_and_respect_the_token_cap(spec):
    model = parse_routing(spec, seed=7)
    for layer in range(3, 6):
        counts = model.counts(100, 8, 64, layer)
        assert sum(counts) == 800 and len(counts) == 64
        assert max(counts) <= 100 and min(counts) >= 0


def test_seeded_models_are_deterministic_and_vary_by_layer_and_seed():
    assert Zipf(1.0, seed=1).counts(64, 4, 16, 3) == Zipf(1.0, seed=1).counts(64, 4, 16, 3)
    assert Zipf(1.0, seed=1).counts(64, 4, 16, 3) != Zipf(1.0, seed=1).counts(64, 4, 16, 4)
    assert Hot(2, 0.5, seed=1).counts(64, 4, 16, 3) != Hot(2, 0.5, seed=2).counts(64, 4, 16, 3)


def test_zipf_skew_grows_with_alpha():
    tops = [max(Zipf(alpha).counts(4096, 8, 256, 3)) for alpha in (0.0, 0.25, 0.5, 0.75)]
    assert tops[0] == 128  # alpha 0 is balanced
    assert tops == sorted(tops) and len(set(tops)) == 4
    # alpha 0.5: the top share is 1 / sum(r^-0.5, r = 1..256) = 1 / 30.5709 of 32768 slots =
    # 1071.87, rounded up by the largest-remainder step (its remainder .87 is among the largest)
    assert 32768 / sum(r ** -0.5 for r in range(1, 257)) == pytest.approx(1071.87, abs=0.01)
    assert tops[2] == 1072
    # alpha 1: 1 / H_256 = 1 / 6.1243... of 32768 = 5350.5 slots, capped at the 4096 tokens
    assert max(Zipf(1.0).counts(4096, 8, 256, 3)) == 4096


def test_hot_experts_share_the_fraction():
    counts = Hot(4, 0.5, seed=0).counts(1000, 8, 64, 3)  # 8000 slots: 4000 to 4 hot experts
    assert sorted(counts, reverse=True)[:4] == [1000] * 4
    # 4000 slots over 60 cold experts: 66.67 each, so 40 get 67 and 20 get 66
    assert sorted(counts)[:60] == [66] * 20 + [67] * 40


def test_apportion_is_largest_remainder_with_a_cap():
    assert apportion([1, 1, 1], 10, cap=10) == [4, 3, 3]
    assert apportion([0.7, 0.2, 0.1], 10, cap=5) == [5, 3, 2]  # 7 capped at 5, 2 handed on


def test_counts_file_lists_fractions_and_per_layer(tmp_path):
    counts = tmp_path / "counts.json"
    counts.write_text(json.dumps([4, 3, 1, 0]))
    assert parse_routing(f"counts:{counts}").counts(4, 2, 4, 3) == [4, 3, 1, 0]
    counts.write_text(json.dumps([0.5, 0.25, 0.25, 0.0]))
    assert parse_routing(f"counts:{counts}").counts(4, 2, 4, 3) == [4, 2, 2, 0]
    counts.write_text(json.dumps({"3": [2, 2, 2, 2], "4": [4, 4, 0, 0]}))
    model = parse_routing(f"counts:{counts}")
    assert model.counts(4, 2, 4, 4) == [4, 4, 0, 0]
    with pytest.raises(TracememError, match="no counts for MoE layer 5"):
        model.counts(4, 2, 4, 5)


@pytest.mark.parametrize("spec, message", [
    ("uniform", "--routing 'uniform' is invalid; use balanced, zipf:ALPHA, hot:K:FRACTION"),
    ("zipf:-1", "--routing 'zipf:-1' is invalid"),
    ("zipf:x", "--routing 'zipf:x' is invalid"),
    ("zipf:nan", "--routing 'zipf:nan' is invalid"),
    ("zipf:inf", "--routing 'zipf:inf' is invalid"),
    ("hot:0:0.5", "--routing 'hot:0:0.5' is invalid"),
    ("hot:2:1.5", "--routing 'hot:2:1.5' is invalid"),
    ("counts:", "--routing 'counts:' is invalid"),
    ("counts:/no/such/file.json", "cannot read"),
])
def test_bad_specs_are_clear_errors(spec, message):
    with pytest.raises(TracememError, match=message):
        parse_routing(spec)


def test_counts_that_do_not_fit_the_step_are_clear_errors(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps([5, 3, 1, 0]))
    with pytest.raises(TracememError, match=r"sum to 9; tokens \* top_k = 4 \* 2 = 8"):
        parse_routing(f"counts:{path}").counts(4, 2, 4, 3)
    with pytest.raises(TracememError, match="has 4 counts; the model has 8 routed experts"):
        parse_routing(f"counts:{path}").counts(4, 2, 8, 3)
    path.write_text(json.dumps([6, 2, 0, 0]))
    with pytest.raises(TracememError, match="gives an expert 6 token-slots, more than the 4"):
        parse_routing(f"counts:{path}").counts(4, 2, 4, 3)
    path.write_text(json.dumps(["a"]))
    with pytest.raises(TracememError, match="must be a non-empty list of non-negative numbers"):
        parse_routing(f"counts:{path}")
    path.write_text(json.dumps({"3": "x"}))
    with pytest.raises(TracememError, match="layer 3 must be a non-empty list"):
        parse_routing(f"counts:{path}")
    path.write_text(json.dumps({"-1": [1, 1]}))
    with pytest.raises(TracememError, match='key "-1" is not a layer number'):
        parse_routing(f"counts:{path}")
    path.write_text("[" + ",".join(["1e308"] * 4) + "]")
    with pytest.raises(TracememError, match="non-negative numbers"):
        parse_routing(f"counts:{path}")
    path.write_text(json.dumps([0.3] * 4))
    with pytest.raises(TracememError, match=r"fractions sum to 1\.2, not 1 \(integers are read as "):
        parse_routing(f"counts:{path}").counts(4, 2, 4, 3)
    with pytest.raises(TracememError, match="K=5 hot experts exceeds the 4 routed experts"):
        Hot(5, 0.5).counts(4, 2, 4, 3)


def test_counts_model_from_python():
    model = Counts(per_layer={3: (1, 1)}, source="captured")
    assert model.counts(1, 2, 2, 3) == [1, 1] and model.spec == "counts:captured"
