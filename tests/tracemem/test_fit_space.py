"""``tracemem fit``'s default search space, derived from the model and the world size (issue 26:
the old default, DeepSeek-V3's PP 8 / 16 and ZeRO-1, tried no PP 1, 2 or 4 nor ZeRO-3 for
Llama-3-70B on 64 GPUs, and found no layout for small models), TP kept within a node, and the
tables that fit 100 columns.

References: hand arithmetic on each preset's config (heads, key / value heads, layers,
routed experts: the presets' Hugging Face config.json, named in each preset's "_comment") and
on the derivation rule stated in ``tracemem.fit.SearchSpace``; Megatron-Core's rank order (TP
fastest, megatron/core/parallel_state.py at d98e8a6) for why a TP group within a node is
consecutive ranks.
"""

from __future__ import annotations

from modeling import load_config
from tracemem.cli import main
from tracemem.fit import MAX_DEFAULT_CANDIDATES, SearchSpace, enumerate_layouts


def _dims(space):
    return {k: getattr(space, k) for k in ("tp", "pp", "ep", "zero")}


def test_a_small_dense_model_gets_a_space_of_its_own():
    # llama-tiny: 4 heads, 2 KV heads, 4 layers, dense. World 8, 8 ranks per node: TP the
    # powers of two <= 8 dividing 4 and 2 (1, 2); PP <= 4 / 2 layers (1, 2); EP 1
    space = SearchSpace().resolve(load_config("llama-tiny"), 8)
    assert _dims(space) == {"tp": (1, 2), "pp": (1, 2), "ep": (1,), "zero": (1, 3)}
    layouts, _ = enumerate_layouts(load_config("llama-tiny"), 8, 64, 8, SearchSpace())
    assert {(l.tp, l.pp, l.zero) for l in layouts} == {
        (t, p, z) for t in (1, 2) for p in (1, 2) for z in (1, 3)}


def test_llama_70b_on_64_gpus_tries_pp_1_2_4_and_zero_3():
    # 64 heads, 8 KV heads, 80 layers: TP 1-8; PP the powers of two <= min(64, 40): 1-32;
    # 4 x 6 x 1 (EP) x 2 (ZeRO) x 3 (recompute) = 144 candidates, within the bound
    space = SearchSpace().resolve(load_config("llama-3-70b"), 64)
    assert _dims(space) == {"tp": (1, 2, 4, 8), "pp": (1, 2, 4, 8, 16, 32), "ep": (1,),
                            "zero": (1, 3)}
    assert 4 * 6 * 2 * 3 == 144 <= MAX_DEFAULT_CANDIDATES


def test_a_large_moe_space_is_thinned_from_the_least_sharded_end():
    # DeepSeek-V3 on 2,048 GPUs: 128 heads (MLA: 128 KV heads), 61 layers, 256 experts. TP
    # 1-8 (4); PP <= 30: 1-16 (5); EP 1-256 (9); ZeRO 1, 3; 3 recompute modes: 1,080. The
    # longer of EP and PP (EP on a tie) loses its smallest value until <= 384:
    # EP 9 -> 5 values (EP 16-256): 4 x 5 x 5 x 6 = 600; tie, EP -> 4 (32-256): 480;
    # PP 5 -> 4 (2-16): 4 x 4 x 4 x 6 = 384
    space = SearchSpace().resolve(load_config("deepseek-v3"), 2048)
    assert _dims(space) == {"tp": (1, 2, 4, 8), "pp": (2, 4, 8, 16),
                            "ep": (32, 64, 128, 256), "zero": (1, 3)}
    # a given dimension is kept whole: EP's 9 values given, PP alone is thinned,
    # 4 x 9 x 6 = 216 a PP value: 5 -> 1 (PP 16), 216 <= 384
    given = SearchSpace(ep=(1, 2, 4, 8, 16, 32, 64, 128, 256)).resolve(
        load_config("deepseek-v3"), 2048)
    assert len(given.ep) == 9 and given.pp == (16,)


def test_tp_stays_within_a_node():
    cfg = load_config("llama-tiny")
    assert SearchSpace().resolve(cfg, 8, ranks_per_node=1).tp == (1,)
    space = SearchSpace(tp=(1, 2), pp=(1,), recompute=("none",), zero=(1,))
    layouts, rejected = enumerate_layouts(cfg, 8, 64, 8, space, ranks_per_node=1)
    assert {l.tp for l in layouts} == {1}
    # TP 2 over nodes of 1 GPU: one candidate (SP on), rejected by name
    assert rejected == {"--tp 2 spans nodes of --ranks-per-node 1 (TP traffic would cross "
                        "the inter-node network)": 1}


def test_fit_cli_takes_ranks_per_node_and_prints_a_table_of_100_columns(capsys):
    args = ["fit", "--model", "llama-tiny", "--world-size", "2", "--hbm", "1GiB",
            "--seq-length", "64", "--global-batch-size", "2", "--kernels", "eager",
            "--tp", "1,2", "--pp", "1", "--recompute", "none", "--zero", "1",
            "--ranks-per-node", "1", "--workers", "1", "--quiet"]
    assert main(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    table = lines[lines.index(next(l for l in lines if l.startswith("#  "))):]
    table = table[:table.index(next(l for l in table if l.startswith("best")))]
    # one layout: every column but TP and PP said once above the table
    assert table[0].split() == ["#", "TP", "PP", "(first/../last)", "needs", "GiB", "headroom",
                                "GiB", "cost"]
    assert max(len(l) for l in table) <= 100
    # (DP 2: M = 2 / (1 x 2) = 1); a longer line wraps at 100 columns
    assert ("Every layout below: SP -, CP 1, EP 1, ETP 1, VPP 1, b 1, M 1, recompute none, "
            "ZeRO 1, schedule 1f1b.") in lines
    assert "TP within a node of 1 ranks (--ranks-per-node)" in out
    assert "--tp 2 spans nodes of --ranks-per-node 1" in out
    assert main(args + ["--wide"]) == 0
    wide = capsys.readouterr().out
    assert "bubble  recompute  comm GiB/step" in wide and "Every layout below" not in wide
