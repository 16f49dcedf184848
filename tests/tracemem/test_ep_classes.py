"""EP-rank classes under skewed routing (issue 9 item 3): every class of EP ranks whose local
experts receive the same token counts is traced and reported; no stand-in measure picks one.

Reference: hand arithmetic on counts files written here (deepseek-tiny: 8 routed experts,
top-2, MoE layers 2 and 3 and the MTP module's layer 4, all on the one stage with PP 1); the
inversion of issue 9 item 3 (one EP rank takes every slot of one layer, the other more slots
in total spread over the other layers; under full recompute the first peaks higher) rebuilt at
deepseek-tiny's size.
"""

import json

import pytest

from tracemem.cli import main
from tracemem.errors import TracememError
from tracemem.estimator import estimate

TINY_EP2 = dict(world_size=2, ep=2, micro_batch_size=1, seq_length=256, num_microbatches=2,
                recompute="full", rounding=None)


def write_counts(tmp_path, name, per_layer):
    path = tmp_path / name
    path.write_text(json.dumps({str(layer): counts for layer, counts in per_layer.items()}))
    return f"counts:{path}"


def test_the_rank_with_fewer_slots_in_total_but_one_full_layer_peaks_higher(tmp_path):
    # 256 tokens * top-2 = 512 slots per MoE layer; EP 2: EP rank 0 holds experts 0-3, EP
    # rank 1 experts 4-7. EP rank 0 takes all 512 slots of layer 4 (the MTP module's MoE) and
    # 64 of layers 2 and 3; EP rank 1 takes 448 of layers 2 and 3 and none of layer 4.
    full, spread = [128] * 4 + [0] * 4, [16] * 4 + [112] * 4
    counts = {2: spread, 3: spread, 4: full}
    total = [sum(sum(c[4 * e:4 * e + 4]) for c in counts.values()) for e in (0, 1)]
    assert total == [64 + 64 + 512, 448 + 448 + 0]  # the old stand-in picked EP rank 1
    result = estimate("deepseek-tiny", routing=write_counts(tmp_path, "c.json", counts),
                      **TINY_EP2)
    assert [(r.ep_rank, r.ep_ranks, r.rank) for r in result.ranks] == [(0, (0,), 0),
                                                                      (1, (1,), 1)]
    rank0, rank1 = result.ranks
    # full recompute keeps only layer inputs: the peak is one layer's recompute + backward,
    # so the full layer outweighs the larger total
    assert rank0.peak_bytes > rank1.peak_bytes
    assert result.worst is rank0
    # the EP rank's number plays no part: swapping the expert blocks swaps the peaks exactly
    swapped = {layer: c[4:] + c[:4] for layer, c in counts.items()}
    again = estimate("deepseek-tiny", routing=write_counts(tmp_path, "s.json", swapped),
                     **TINY_EP2)
    assert [r.peak_bytes for r in again.ranks] == [rank1.peak_bytes, rank0.peak_bytes]


def test_ranks_with_equal_counts_share_one_class_and_its_peak(tmp_path, capsys):
    # EP 4, 2 experts each; 512 slots per layer. EP ranks 1 and 3 get the same counts in
    # every layer, so they trace alike: 3 classes, {0}, {1, 3}, {2}
    layer = [100, 60, 64, 64, 96, 0, 64, 64]
    routing = write_counts(tmp_path, "c.json", {2: layer, 3: layer, 4: layer})
    args = dict(TINY_EP2, world_size=4, ep=4)
    result = estimate("deepseek-tiny", routing=routing, **args)
    assert [r.ep_ranks for r in result.ranks] == [(0,), (1, 3), (2,)]
    assert [r.rank for r in result.ranks] == [0, 1, 2]
    assert main(["estimate", "--model", "deepseek-tiny", "--world-size", "4", "--ep", "4",
                 "--micro-batch-size", "1", "--seq-length", "256", "--num-microbatches", "2",
                 "--recompute", "full", "--rounding", "0", "--routing", routing, "--json",
                 "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["ep_ranks"] for r in out["ranks"]] == [[0], [1, 3], [2]]
    assert [r["peak_bytes"] for r in out["ranks"]] == [r.peak_bytes for r in result.ranks]
    assert main(["estimate", "--model", "deepseek-tiny", "--world-size", "4", "--ep", "4",
                 "--micro-batch-size", "1", "--seq-length", "256", "--num-microbatches", "2",
                 "--routing", routing, "--quiet"]) == 0
    table = capsys.readouterr().out
    assert " 1,3 " in table and "each row is one class of the stage's EP ranks" in table


def test_balanced_routing_is_one_class_of_all_ep_ranks():
    result = estimate("deepseek-tiny", **TINY_EP2)
    assert [(r.ep_rank, r.ep_ranks) for r in result.ranks] == [(None, ())]


def test_more_classes_than_the_cap_is_a_clear_error(tmp_path):
    layer = [100, 60, 64, 64, 96, 0, 64, 64]
    routing = write_counts(tmp_path, "c.json", {2: layer, 3: layer, 4: layer})
    with pytest.raises(TracememError, match=r"--routing counts:.* gives pipeline stage 0 3 "
                       r"distinct EP-rank loads .* --max-ep-classes 2: raise it to 3"):
        estimate("deepseek-tiny", routing=routing, max_ep_classes=2,
                 **dict(TINY_EP2, world_size=4, ep=4))
