"""Routing and size inputs at their limits (issue 16 items 7-9, issue 9 item 8).

Reference: the apportionment as it was before it became closed-form (commit 883570b), kept
here as ``apportion_by_rounds``; hand arithmetic for the skewed case at a million tokens; the
messages each item asks for.
"""

import json

import pytest

from modeling.common.routing import apportion, parse_routing
from tracemem.errors import TracememError
from tracemem.estimator import estimate, parse_bytes


def apportion_by_rounds(shares, total, cap):
    """commit 883570b's apportion: capped slots handed out one at a time."""
    weight = sum(shares)
    exact = [total * s / weight for s in shares]
    counts = [int(x) for x in exact]
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[:total - sum(counts)]:
        counts[i] += 1
    excess = sum(max(0, c - cap) for c in counts)
    counts = [min(c, cap) for c in counts]
    while excess:
        for i in sorted(range(len(shares)), key=lambda i: (-shares[i], i)):
            if excess and counts[i] < cap:
                counts[i] += 1
                excess -= 1
    return counts


@pytest.mark.parametrize("spec", ["hot:1:1.0", "hot:2:0.9", "hot:3:0.5", "zipf:1.0",
                                  "zipf:3.0", "zipf:0", "balanced"])
@pytest.mark.parametrize("tokens, top_k, experts", [(64, 2, 8), (1000, 8, 256), (37, 6, 16),
                                                    (5, 4, 4)])
def test_closed_form_gives_the_same_counts_as_the_rounds(spec, tokens, top_k, experts):
    model = parse_routing(spec, seed=3)
    if spec.startswith("hot") and int(spec.split(":")[1]) > experts:
        return
    for layer in (0, 7):
        counts = model.counts(tokens, top_k, experts, layer)
        assert sum(counts) == tokens * top_k and max(counts) <= tokens
        if spec != "balanced":
            shares = _shares(model, experts, layer)
            assert counts == apportion_by_rounds(shares, tokens * top_k, tokens)


def _shares(model, experts, layer):
    import random
    if hasattr(model, "alpha"):
        rank = list(range(experts))
        random.Random(f"{model.seed}:{layer}").shuffle(rank)
        return [(rank[e] + 1) ** -model.alpha for e in range(experts)]
    hot = set(random.Random(f"{model.seed}:{layer}").sample(range(experts), model.num_hot))
    cold = experts - model.num_hot
    return [model.fraction / model.num_hot if e in hot else (1 - model.fraction) / cold
            for e in range(experts)]


def test_a_million_tokens_all_to_one_hot_expert_by_hand():
    # hot:1:1.0, 2^20 tokens, top-8, 256 experts: the hot expert takes T (its cap); the other
    # 7T slots go round the 255 others (all share 0: by index), 7T // 255 each and one more
    # for the first 7T mod 255 of them
    t = 2**20
    counts = parse_routing("hot:1:1.0").counts(t, 8, 256, 0)
    hot = counts.index(t)
    others = counts[:hot] + counts[hot + 1:]
    q, r = divmod(7 * t, 255)
    assert others == [q + 1] * r + [q] * (255 - r)
    assert apportion([1.0] + [0.0] * 255, 8 * t, t)[0] == t


def test_hot_experts_that_are_all_the_experts_need_fraction_1():
    with pytest.raises(TracememError, match=r"hot:8:0.0: K=8 makes all 8 routed experts hot.*"
                       r"FRACTION must be 1"):
        parse_routing("hot:8:0").counts(64, 2, 8, 0)
    assert parse_routing("hot:8:1").counts(64, 2, 8, 0) == [16] * 8


@pytest.mark.parametrize("content, message", [
    (b"\x80\x81binary", r"not UTF-8 JSON text"),
    (json.dumps({"\u00b2": [1]}).encode(), r'key "\\u00b2" is not a layer number'),
    (b"[" + b"9" * 5000 + b"]", r"unreadable JSON: Exceeds the limit"),
    (b"[" * 100_000 + b"]" * 100_000, r"unreadable JSON: nested too deeply"),
])
def test_counts_file_errors_say_what_is_wrong(tmp_path, content, message):
    path = tmp_path / "counts.json"
    path.write_bytes(content)
    with pytest.raises(TracememError, match=message):
        parse_routing(f"counts:{path}")


def test_counts_file_is_read_with_a_size_limit():
    with pytest.raises(TracememError, match=r"counts:/dev/zero: larger than 64 MiB"):
        parse_routing("counts:/dev/zero")


def test_missing_mtp_counts_name_the_mtp_module(tmp_path):
    # deepseek-tiny: 4 decoder layers (MoE from layer 2), one MTP module: layer 4
    path = tmp_path / "counts.json"
    path.write_text(json.dumps({"2": [16] * 8, "3": [16] * 8}))
    with pytest.raises(TracememError, match=r"no counts for MTP module 1 \(layer 4\)"):
        estimate("deepseek-tiny", world_size=1, micro_batch_size=1, seq_length=64,
                 num_microbatches=1, routing=f"counts:{path}")


@pytest.mark.parametrize("value, message", [
    ("0.1B", r"--hbm .0.1B. is invalid; give a positive size of whole bytes"),
    ("", r"--hbm '' is invalid"),
    ("inf", r"--hbm 'inf' is invalid"),
    ("infGiB", r"--hbm 'infGiB' is more than 4 TiB"),
    ("1e400GiB", r"--hbm '1e400GiB' is more than 4 TiB"),
    ("nanGiB", r"--hbm 'nanGiB' is invalid"),
    (80, r"--hbm '80' is 80 bytes; give a unit"),  # an int is a byte count, as the CLI's
    (80.0, r"--hbm 80.0 is invalid; give a size as text"),
])
def test_hbm_values_are_not_taken_silently(value, message):
    with pytest.raises(TracememError, match=message):
        parse_bytes(value)


def test_sizes_are_read_exactly_and_bounded():
    # exact decimals, rounded to the nearest byte: 1.1 x 2^30 = 1,181,116,006.4 B; 0.3 x 1024
    # = 307.2 B; 1.0000001 x 2^30 = 1,073,741,931.37 B (a float product would say ...931.4)
    assert parse_bytes("1.1GiB") == 1_181_116_006
    assert parse_bytes("0.3KiB", "--non-pytorch-memory") == 307
    assert parse_bytes("1.0000001GiB") == 1_073_741_931
    assert parse_bytes("4TiB") == 4 * 2**40  # the bound itself
    with pytest.raises(TracememError, match=r"--hbm '80TiB' is more than 4 TiB; no device"):
        parse_bytes("80TiB")
    # a plain number under 1 MiB: its count with digit groups, and an example of a size
    with pytest.raises(TracememError, match=r"--hbm '1048575' is 1,048,575 bytes; give a "
                                            r"unit, such as 80GB \(decimal\) or 80GiB"):
        parse_bytes("1048575")
    with pytest.raises(TracememError, match=r"--hbm '1_0GiB' is invalid"):
        parse_bytes("1_0GiB")


def test_routing_on_a_dense_model_is_refused():
    with pytest.raises(TracememError, match=r"^--routing zipf:1.2: llama-tiny is dense \(no "
                                            r"routed experts to route to\); drop --routing$"):
        estimate("llama-tiny", world_size=1, micro_batch_size=1, seq_length=16,
                 num_microbatches=1, routing="zipf:1.2")


def test_empty_hbm_reaches_the_check():
    with pytest.raises(TracememError, match=r"--hbm '' is invalid"):
        estimate("deepseek-tiny", world_size=1, micro_batch_size=1, seq_length=16,
                 num_microbatches=1, hbm="")


def test_parse_routing_takes_strings_only():
    with pytest.raises(TracememError, match=r"--routing 5 is invalid; give a string"):
        parse_routing(5)
    with pytest.raises(TracememError, match=r"--seed '1' must be an integer"):
        parse_routing("balanced", "1")
