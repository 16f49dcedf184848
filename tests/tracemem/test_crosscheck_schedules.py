"""tracemem crosscheck --schedules on deepseek-tiny (the API the CLI calls on the demo
layout).

References: DeepSeek-V3 report Table 2 (arXiv 2412.19437) through
tracemem/formulas/pipeline_schedules.py; the per-rank 1F1B count min(PP - p, M)
(Megatron-LM's warm-up); the placements: DualPipe rank r holds stages r and PP - 1 - r.
"""

from tracemem.crosscheck import schedule_rows

TINY = dict(world_size=4, tp=2, sp=True, pp=2)


def test_every_rank_of_1f1b_zb1p_and_dualpipe_beside_table_2():
    rows = schedule_rows("deepseek-tiny", b=2, s=64, num_microbatches=4, layout=TINY,
                         experts="sequential")
    assert [(r.schedule, r.rank) for r in rows] == [
        ("1f1b", 0), ("1f1b", 1), ("zb-h1", 0), ("zb-h1", 1), ("dualpipe", 0), ("dualpipe", 1)]
    by = {(r.schedule, r.rank): r for r in rows}
    # Table 2: PP = 2 for 1F1B / ZB1P (rank 0 holds it, rank 1 min(2 - 1, 4) = 1), PP + 1 = 3
    # for DualPipe on every rank
    assert [(r.inflight, r.inflight_formula) for r in rows] == [
        (2, 2), (1, 2), (2, 2), (1, 2), (3, 3), (3, 3)]
    assert "min(PP - 1, M) = 1" in by[("1f1b", 1)].reason
    # DualPipe: each rank holds both stages of PP 2: twice a mean stage, Table 2's 2x
    assert by[("dualpipe", 0)].param_multiple == 2.0 and by[("dualpipe", 0)].reason == ""
    # 1F1B's stages differ (embedding on 0; head, loss and MTP on 1): the reason says so
    assert "with the embedding" in by[("1f1b", 0)].reason
    assert by[("1f1b", 0)].param_multiple + by[("1f1b", 1)].param_multiple == 2.0


def test_v_schedules_beside_their_closed_forms():
    layout = dict(TINY, vpp=2, pp_layout=(1, 1, 1, 1))
    rows = schedule_rows("deepseek-tiny", b=2, s=64, num_microbatches=4, layout=layout,
                         experts="sequential")
    # ZB-V: 2 pp = 4 chunks (Qi et al.: p M_B); DualPipeV: 2 pp + 1 = 5 (README: PP + 1)
    assert [(r.schedule, r.inflight, r.inflight_formula) for r in rows] == [
        ("zbv", 4, 4), ("zbv", 4, 4), ("dualpipev", 5, 5), ("dualpipev", 5, 5)]
    assert rows[0].layers == [0, 3] and "the embedding and the head" in rows[0].reason


def test_dualpipe_beside_table_2_under_recompute():
    # issue 28: Table 2's DualPipe row (2x parameters, PP + 1 = 3 microbatch-stages) holds
    # under recompute too: recompute changes the bytes of a held microbatch, not the count
    # (DeepSeek-V3 report 3.2.1 and 3.3.2); full recompute keeps fewer activation bytes at
    # the peak than none (each layer keeps its input only, until B)
    rows = {}
    for recompute, modules in (("none", None), ("full", None),
                               ("selective", ("layernorm", "mla_up_proj"))):
        extra = {} if modules is None else {"recompute_modules": modules}
        rows[recompute] = schedule_rows("deepseek-tiny", b=2, s=64, num_microbatches=4,
                                        layout=TINY, experts="sequential",
                                        schedules=("dualpipe",), recompute=recompute, **extra)
    for recompute, ranks in rows.items():
        assert [(r.inflight, r.inflight_formula, r.param_multiple, r.param_formula)
                for r in ranks] == [(3, 3, 2.0, 2), (3, 3, 2.0, 2)], recompute
    assert rows["selective"][0].recompute == "selective (layernorm mla_up_proj)"
    assert rows["full"][0].activation_bytes < rows["none"][0].activation_bytes
