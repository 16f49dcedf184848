"""Megatron-Core itself as the oracle (issues 11 and 23): its GPTModel with tracemem's
megatron-te leaves, traced on meta under a fake process group, against tracemem's build_rank;
and its DistributedDataParallel and DistributedOptimizer, built on meta, against
tracemem.static.static_memory per rank.

Reference: megatron-core 0.16.1's own code (the `megatron` extra): its orchestration decides
what every layer keeps and when, the leaves being the same kernels on both sides, and its
buffers decide static memory. Expected differences are derived by hand below from the cited
Megatron-Core source; every layout of `tracemem validate --against megatron-core` is run
(about 20 s). Skipped, with the reason, when megatron-core is not installed; `make test`
installs it.
"""

import dataclasses
import importlib
import inspect

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed: "
                                            "pip install 'tracemem[megatron]' (make test does)")

from tracemem.oracle import megatron_patches  # noqa: E402
from tracemem.oracle import compare, schedule_oracle, static_oracle  # noqa: E402
from tracemem.oracle.compare import (  # noqa: E402
    ORACLE_CASES,
    OracleCase,
    oracle_model_config,
    residue,
    run_case,
    run_command,
)

S, D_R, E, H = 16, 8, 8, 64  # deepseek-tiny: seq_length, qk_rope_head_dim, experts, hidden
# RotaryEmbedding.forward (models/common/embeddings/rotary_pos_embedding.py) is lru_cache'd:
# each layer's cache keeps emb [s, 1, 1, d_r] fp32 after its forward (persistent, not counted)
ROPE_CACHE = S * D_R * 4  # 512

def _names(code):
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _names(const)
    return names


@pytest.mark.parametrize("patch", megatron_patches.PATCHES,
                         ids=lambda p: f"{p.module}.{p.name}")
def test_every_patched_attribute_is_where_the_patch_says(patch):
    owner, attr = patch.owner()
    module = importlib.import_module(patch.module)
    if not patch.read_by:
        assert hasattr(owner, attr), f"{patch.module}.{patch.name} moved: {patch.replaces}"
    for qualname in patch.read_by:
        func = module
        for part in qualname.split("."):
            func = getattr(func, part)
        func = inspect.unwrap(func)  # custom_bwd and the like wrap with functools.wraps
        assert attr in _names(func.__code__), f"{qualname} no longer reads {attr}"


def test_patches_are_undone_on_exit():
    import torch
    before = torch.cuda.current_device
    with megatron_patches.applied():
        assert torch.cuda.current_device() == torch.device("meta")
    assert torch.cuda.current_device is before


CASES = [OracleCase(), OracleCase(tp=2, sp=True, ep=4), OracleCase(tp=2, sp=True, ep=4, etp=2),
         OracleCase(tp=2, sp=True, ep=4, recompute="full")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.name)
def result(request):
    return run_case(request.param)


def test_parameter_bytes_per_layer_are_equal(result):
    for layer in result.megatron:
        assert result.megatron[layer].params == result.tracemem[layer].params
    # layer 0, dense, TP1 by hand (bf16): input norm h, q down 48h, q up norm 48 + 4*24*48,
    # kv down (32+8)h, kv up norm 32 + 4*32*32, proj 64h, fc1 norm h + 2*128h, fc2 128h
    if result.case.tp == 1:
        by_hand = (H + 48 * H + 48 + 4 * 24 * 48 + 40 * H + 32 + 4 * 32 * 32 + 64 * H
                   + H + 2 * 128 * H + 128 * H) * 2
        assert result.megatron[0].params == by_hand == 86_432


def _residue(case: OracleCase, moe: bool) -> tuple[int, int, int]:
    """Megatron-Core minus tracemem (kept, forward peak, backward peak), by hand.

    Every layer: the RoPE cache. MoE layers: MoEAlltoAllTokenDispatcher.dispatch_preprocess
    (transformer/moe/token_dispatcher.py) keeps self.probs [T, E] fp32 and self.routing_map
    [T, E] bool until the layer's next forward (the routing map is also alive at the forward
    peak; probs is anyway); under full recompute also the row-id map [T, 2E + 1] int32
    (self.reversed_local_input_permutation_mapping; else the unpermute saves it), and the
    recompute in backward replaces the forward's three (freed before the backward peak) while
    the new routing map stays.
    """
    if not moe:
        return ROPE_CACHE, ROPE_CACHE, 0
    tokens = S // case.tp if case.sp else S
    probs, routing_map, row_id_map = tokens * E * 4, tokens * E, tokens * (2 * E + 1) * 4
    if case.recompute == "full":
        return (ROPE_CACHE + probs + routing_map + row_id_map, ROPE_CACHE + routing_map,
                -(probs + row_id_map))
    return ROPE_CACHE + probs + routing_map, ROPE_CACHE + routing_map, 0


def test_every_layer_differs_only_by_the_itemised_residue(result):
    for layer in result.megatron:
        m, t = result.megatron[layer], result.tracemem[layer]
        assert (m.kept - t.kept, m.forward_peak - t.forward_peak,
                m.backward_peak - t.backward_peak) == _residue(result.case, layer > 0)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_the_residue_table_is_the_hand_arithmetic(case):
    for layer in range(3):
        rows = residue(case, layer)
        assert tuple(sum(getattr(r, a) for r in rows) for a in
                     ("kept", "forward_peak", "backward_peak")) == _residue(case, layer > 0)


def test_the_selective_recompute_residue_by_hand():
    # mla_up_proj: both sides keep core attention's statistics and RNG state now (tracemem's
    # CheckpointWithoutOutput, modeling.common.checkpoint); what is left is 0.16.1's
    # copy-on-restore at the backward peak (read from the traces: 912 B on the dense layer 0).
    # layernorm: the MoE layers' pre-MLP norm output [T, h] = [8, 64] bf16 (TP 2 + SP:
    # T = 16 / 2) is held twice at the backward peak: 8 x 64 x 2 = 1,024 B
    case = next(c for c in ORACLE_CASES if c.modules == ("mla_up_proj",))
    dense = {r.tensor: r for r in residue(case, 0)}
    assert sum(r.kept for r in dense.values()) == ROPE_CACHE
    assert sum(r.backward_peak for r in dense.values()) == 912
    case = next(c for c in ORACLE_CASES if c.modules == ("layernorm",))
    assert sum(r.backward_peak for r in residue(case, 0)) == 0
    moe = [r for r in residue(case, 1) if r.tensor.startswith("recomputed outputs")]
    assert [r.backward_peak for r in moe] == [8 * 64 * 2]


@pytest.fixture(scope="module")
def every_layout():
    return [run_case(case) for case in ORACLE_CASES]


def test_every_layout_of_the_command_differs_only_by_the_residue(every_layout):
    assert len(every_layout) == len(ORACLE_CASES) == 23
    for result in every_layout:
        assert result.unexplained == [], result.case.name
        parts = ({-1, 0, 1, 2, 3} | ({4} if result.case.mtp else set()) if result.case.whole
                 else {0, 1, 2})
        assert set(result.megatron) == set(result.tracemem) == parts


def test_the_whole_models_residue_by_hand():
    # b = 1, s = 16, h = 64, TP 2 + SP. Embedding: masked input 16 x 8 B + mask 16 x 1 B;
    # its backward: the masked gradient copy 2 x 16 x 64, less the SP-local gradient
    # 2 x 8 x 64 and the mask. Output part: per-token loss 16 x 4 B less tracemem's 4-B
    # mean; two [s, b] fp32 fewer at the forward peak; tracemem's mean backward 16 x 4 B;
    # SP: the 'mpu' buffer of the gathered input, 16 x 64 bf16
    case = ORACLE_CASES[-1]
    assert case.whole and case.tp == 2 and case.sp

    def total(layer):
        rows = residue(case, layer)
        return tuple(sum(getattr(r, a) for r in rows) for a in
                     ("kept", "forward_peak", "backward_peak"))
    assert total(-1) == (16 * 9, 16 * 9, 2 * 16 * 64 - 2 * 8 * 64 - 16) == (144, 144, 1008)
    assert total(3) == (16 * 4 - 4 + 2 * 16 * 64, -2 * 16 * 4 + 2 * 16 * 64, -16 * 4)
    one = ORACLE_CASES[-2]
    assert one.whole and one.tp == 1 and residue(one, -1) == []
    assert [r.kept for r in residue(one, 3)] == [60, 0]


def test_the_native_fused_cross_entropy_rows_by_hand():
    # b = 1, s = 16, V = 256 (128 a rank at TP 2). Backward: Megatron-Core's eager
    # calculate_gradients keeps an arange 16 x 8 B and 1 - target_mask 16 x 4 B beside the
    # bf16 gradient; tracemem's inductor buffers add the fp32 copy 16 x V / TP x 4 B. The
    # default loss's two [s, b] fp32 forward temporaries do not apply
    one, two = (c for c in ORACLE_CASES if c.cross_entropy == "native")
    assert (one.tp, two.tp, two.sp) == (1, 2, True)

    def total(case):
        rows = residue(case, 3)
        return tuple(sum(getattr(r, a) for r in rows) for a in
                     ("kept", "forward_peak", "backward_peak"))
    assert total(one) == (16 * 4 - 4, 0, -16 * 4 + 16 * 8 + 16 * 4 - 16 * 256 * 4) \
        == (60, 0, -16_256)
    assert total(two) == (16 * 4 - 4 + 2 * 16 * 64, 2 * 16 * 64,
                          -16 * 4 + 16 * 8 + 16 * 4 - 16 * 128 * 4) == (2_108, 2_048, -8_064)


def test_the_mtp_rows_by_hand():
    # b = 1, s = 16, TP 1; the MTP layer (MoE, 8 experts): RoPE emb 16 x 8 fp32, dispatcher
    # probs 16 x 8 fp32 and routing map 16 x 8 bool kept, position_ids 16 int64 at its peak.
    # Output part: the MTP loss kept (scaled per-token 16 x 4, rolled mask 16 x 8, num_tokens
    # 8, the tracker 4 less tracemem's 4-B scalar); at its forward peak also 0.16.1's inline
    # locals (mtp_logits 16 x 256 bf16, mtp_labels 16 x 8, the masked loss 16 x 4) and the MTP
    # layer's three rows
    case = ORACLE_CASES[-3]
    assert case.whole and case.mtp and case.tp == 1
    cfg = dataclasses.replace(compare.oracle_model_config(), num_mtp_modules=1)

    def total(layer):
        rows = residue(case, layer, cfg)
        return tuple(sum(getattr(r, a) for r in rows) for a in
                     ("kept", "forward_peak", "backward_peak"))
    assert total(4) == (512 + 512 + 128, 512 + 128 + 16 * 8, 0) == (1_152, 768, 0)
    mtp_loss = 16 * 4 + 16 * 8 + 8 + 4 - 4
    assert total(3) == (16 * 4 - 4 + mtp_loss,
                        -2 * 16 * 4 + 1_152 + 16 * 256 * 2 + 16 * 8 + 16 * 4 + mtp_loss,
                        -16 * 4) == (260, 9_608, -64)


def test_the_mtp_rows_at_tp2_sp_by_hand():
    # b = 1, s = 16, TP 2 + SP (T = 8 tokens a rank at the router). The MTP part: RoPE emb
    # 16 x 8 fp32, probs 8 x 8 fp32 and routing map 8 x 8 bool as any MoE layer, and the MTP
    # layer's own embedding call at TP 2: its mask 16 B kept, mask and masked input 16 x 9 B
    # at the forward peak (where the routing map is 64 B and the position_ids 16 x 8 B)
    case = next(c for c in ORACLE_CASES if c.mtp and c.tp == 2)
    assert case.whole and case.sp
    cfg = dataclasses.replace(compare.oracle_model_config(), num_mtp_modules=1)

    def total(layer):
        rows = residue(case, layer, cfg)
        return tuple(sum(getattr(r, a) for r in rows) for a in
                     ("kept", "forward_peak", "backward_peak"))
    assert total(4) == (512 + 256 + 64 + 16, 512 + 64 + 16 * 8 + 16 * 9, 0) == (848, 848, 0)
    # the output part's forward peak also holds the MTP embedding's mask: + 16 B
    rows = {r.tensor: r for r in residue(case, 3, cfg)}
    assert [r.forward_peak for t, r in rows.items() if "embedding call" in t] == [16]


def test_a_planted_difference_fails_the_command(monkeypatch):
    from tracemem.oracle import megatron_spec
    # without --gradient-accumulation-fusion Megatron-Core's leaves materialise each weight
    # gradient: its backward peaks rise, tracemem's (fused) do not; the residue does not say so
    one = (OracleCase(),)
    assert run_command(cases=one, static_cases=(), schedule_cases=())[1] == 0
    monkeypatch.setitem(megatron_spec.FUSE_WGRAD, "value", False)
    text, code = run_command(cases=one, static_cases=(), schedule_cases=())
    assert code == 1
    assert "FAIL" in text and "backward_peak differs" in text


def test_a_planted_static_difference_fails_the_command(monkeypatch):
    from tracemem import static
    case = (static_oracle.StaticCase(world_size=4, rank=3),)
    assert run_command(cases=(), static_cases=case, schedule_cases=())[1] == 0
    monkeypatch.setattr(static, "PARAM_START_ALIGN", 32)  # not Megatron's 64
    text, code = run_command(cases=(), static_cases=case, schedule_cases=())
    assert code == 1 and "static TP1 DP4, rank 3: grad_bytes" in text


def test_a_missing_residue_row_fails_the_layout(every_layout, monkeypatch):
    monkeypatch.setattr(compare, "RESIDUE", compare.RESIDUE[1:])  # drop the RoPE cache
    lines = every_layout[0].unexplained
    assert any("kept differs by +512 B" in line for line in lines)


@pytest.fixture(scope="module")
def static_results():
    return static_oracle.run_static_cases()


def test_static_memory_agrees_to_the_byte_at_every_static_case(static_results):
    import dataclasses
    assert len(static_results) == len(static_oracle.STATIC_CASES) == 21
    for r in static_results:
        assert r.unexplained == [], r.case.name
        # static memory itself with no residue at all; the step peak by STATIC_RESIDUE
        assert dataclasses.replace(r.megatron, step_peak_bytes=0) == \
            dataclasses.replace(r.tracemem, step_peak_bytes=0), r.case.name


def test_the_step_residue_by_hand(static_results):
    # TP1 DP1: one rank holds all 299,392 elements; Megatron-Core's no-weight-decay group is
    # the norms, 4 layers x (64 + 48 + 32 + 64) + the final 64 = 896 elements: its foreach
    # sqrt is 4 x (299,392 - 896) B, tracemem's 4 x 299,392 (one flat master)
    r = static_results[0]
    assert r.case.world_size == 1
    assert r.notes["optimizer_groups"] == {("dense", False): 299_392 - 896,
                                           ("dense", True): 896}
    assert r.megatron.step_peak_bytes == 4 * (299_392 - 896)
    assert r.tracemem.step_peak_bytes == 4 * 299_392
    # EP 4 over 8 ranks: the dense and expert optimizers step one after the other (the
    # larger group's sqrt at once); tracemem's one Adam takes both masters together
    ep = next(x for x in static_results if x.case == static_oracle.StaticCase(world_size=8,
                                                                              ep=4))
    groups = ep.notes["optimizer_groups"]
    assert ep.megatron.step_peak_bytes == 4 * max(groups.values())


def test_static_buffers_are_megatron_cores_buffers(static_results):
    import torch

    from modeling.parallel import build_rank
    from tracemem.static import megatron_buffers
    import dataclasses
    for r in static_results:
        c = r.case
        cfg = dataclasses.replace(oracle_model_config(4), tie_word_embeddings=c.tied)
        par = static_oracle._layout(c, cfg)
        model = build_rank(cfg, par, c.rank, dtype=torch.bfloat16, kernels="megatron-te")
        from modeling.parallel.build import coordinates
        ours = megatron_buffers(model, par, overlap_grad_reduce=c.overlap,
                                bucket_size=c.bucket_size,
                                pp_rank=coordinates(par, c.rank).pp_rank)
        theirs = r.notes["buffers"]  # (param dtype, grad dtype, numel, unpadded, buckets)
        assert sorted(b.padded for b in ours) == sorted(b[2] for b in theirs), c.name
        assert sorted(len(b.layout()[2]) for b in ours) == sorted(b[4] for b in theirs)


def test_ep1_experts_share_the_dense_buffer_and_its_dp_shards():
    # TP 2 + SP, ETP 1, EP 1 over 8 ranks: DP 4, EDP 8; Megatron-Core's experts are
    # allreduce=True without EP (TEGroupedLinear), so their optimizer state is split 4 ways
    # (the dense DP group), not 8: one buffer, and rank 7's state is the dense group's shard
    result = static_oracle.run_static_case(static_oracle.STATIC_CASES[3])
    assert [b[2] for b in result.notes["buffers"]] == [236_160]
    assert result.megatron.optimizer_bytes == result.tracemem.optimizer_bytes == 706_560


def test_the_kept_storages_that_differ_are_the_rope_cache_and_the_dispatcher_state(result):
    tokens = S // result.case.tp if result.case.sp else S
    for layer in result.megatron:
        only = result.diff(layer)
        expected = [(ROPE_CACHE, "float32")]
        if layer > 0:
            expected += [(tokens * E * 4, "float32"), (tokens * E, "bool")]
            if result.case.recompute == "full":
                expected.append((tokens * (2 * E + 1) * 4, "int32"))
        assert sorted((s[0], s[1]) for s in only.only_megatron) == sorted(expected)
        assert not only.only_tracemem


def test_cli_megatron_core_refuses_a_cpu_case(capsys):
    from tracemem.cli import main
    assert main(["validate", "--against", "megatron-core", "--case", "mlp"]) == 2
    assert "--case names a CPU case" in capsys.readouterr().err


def test_command_json_gives_layers_static_and_what_is_unexplained():
    import json
    text, code = run_command(json_out=True, cases=(OracleCase(),),
                             static_cases=static_oracle.STATIC_CASES[:1],
                             schedule_cases=schedule_oracle.SCHEDULE_CASES[:1])
    result = json.loads(text)
    assert code == 0 and result["unexplained"] == []
    (layout,) = result["layers"]
    assert layout["layout"] == "TP1 EP1 ETP1" and layout["unexplained"] == []
    assert [r["kept"] for r in layout["layers"]["0"]["residue"]] == [ROPE_CACHE]
    (static,) = result["static"]
    assert static["unexplained"] == []
    (schedule,) = result["schedules"]
    assert schedule["megatron_core"] == schedule["tracemem"]
    assert static["megatron_core"]["grad_bytes"] == static["tracemem"]["grad_bytes"]


def test_the_cli_gives_both_sides_per_layer_and_exits_1_on_a_planted_difference(
        capsys, monkeypatch):
    import json

    from tracemem.cli import main
    from tracemem.oracle import megatron_spec
    monkeypatch.setattr(compare, "ORACLE_CASES", (OracleCase(),))
    monkeypatch.setattr(static_oracle, "STATIC_CASES", ())
    monkeypatch.setattr(schedule_oracle, "SCHEDULE_CASES", ())
    assert main(["validate", "--against", "megatron-core", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (layout,) = out["layers"]
    assert layout["layout"] == "TP1 EP1 ETP1" and not layout["equal"]
    assert layout["unexplained"] == [] and out["unexplained"] == []
    dense = layout["layers"]["0"]
    assert dense["megatron_core"]["params"] == dense["tracemem"]["params"] == 86_432
    assert dense["megatron_core"]["kept"] - dense["tracemem"]["kept"] == ROPE_CACHE
    # the same planted fault as above: the command itself exits 1
    monkeypatch.setitem(megatron_spec.FUSE_WGRAD, "value", False)
    assert main(["validate", "--against", "megatron-core"]) == 1
    assert "FAIL" in capsys.readouterr().out


# ---------------------------------------------------------------------------- the schedules
@pytest.fixture(scope="module")
def schedule_results():
    return schedule_oracle.run_schedule_cases()


def test_megatron_cores_schedules_run_tracemems_step_order(schedule_results):
    assert len(schedule_results) == len(schedule_oracle.SCHEDULE_CASES) == 8
    for r in schedule_results:
        assert r.unexplained == [], r.case.name
        assert r.megatron_steps == r.tracemem_steps
        # the bytes after every step are compared too
        assert len(r.tracemem_bytes) == len(r.live_bytes) == len(r.residue), r.case.name


HIDDEN = 16 * 64 * 2  # one [s, b, h] bf16 pipeline tensor of deepseek-tiny at b 1, s 16


def test_the_schedule_residue_by_hand_on_the_last_stage(schedule_results):
    # PP 2, rank 1: layers 2 and 3, both MoE (8 experts), d_rope 8; after 1F1 (one
    # backward done, one microbatch in flight)
    last = schedule_results[1]
    assert last.case == schedule_oracle.ScheduleCase(pp=2, num_microbatches=4, rank=1)
    assert last.megatron_steps[2] == "1F1"
    want = {
        "RoPE inv_freq [d_r / 2] fp32, per MLA layer": 2 * 4 * 4,
        "labels (and, first stage, token ids) int64 [b, s] per microbatch in flight": -16 * 8,
        "total_num_tokens int32 [] and the MoE aux-loss scale fp32 [1]": 4 + 4,
        "each finished microbatch's loss fp32 [] in forward_data_store (last stage)": 4,
        "the last backward's loss stand-in fp32 [1] (last stage)": 4,
    }
    assert last.residue[2] == want
    assert last.live_bytes[2] - last.tracemem_bytes[2] == sum(want.values()) == -80
    # after 1B1 the previous input gradient is still assigned while backward_step runs
    rows = last.residue[3]
    assert rows["the previous backward's input gradient [s, b, h] bf16 while backward_step "
                "runs"] == HIDDEN


def test_what_tracemems_replay_holds_between_microbatches(schedule_results):
    # After 1B1 of PP 2 rank 1 (layers 2 and 3, MoE, 8 experts, 16 tokens), as Megatron-Core
    # holds it: each layer's dispatcher probs [16, 8] fp32, routing map [16, 8] bool and
    # row-id map [16, 17] int32 until the layer's next forward (MemoryTracer.retain); the
    # received input [16, 1, 64] bf16 and its .grad, kept by the 1F1B loop's popped output
    # and its input_tensor_grad (Segments.megatron_1f1b); RoPE's caches [16, 8] fp32
    last = schedule_results[1]
    assert last.megatron_steps[3] == "1B1"
    assert last.tracemem_bytes[3] == (2 * 16 * 8 * (4 + 1) + 2 * 16 * 17 * 4 + 2 * HIDDEN
                                      + 2 * 16 * 8 * 4)


def test_the_schedule_residue_by_hand_on_the_first_stage(schedule_results):
    # PP 4, rank 0: layer 0 only (dense); after 0F4, the first forward after a backward
    first = schedule_results[2]
    assert first.megatron_steps[5] == "0F4"
    assert first.residue[5] == {
        "RoPE inv_freq [d_r / 2] fp32, per MLA layer": 4 * 4,
        "labels (and, first stage, token ids) int64 [b, s] per microbatch in flight":
            -4 * 2 * 16 * 8,
        "total_num_tokens int32 [] and the MoE aux-loss scale fp32 [1]": 8,
        "the output [s, b, h] bf16 still whole when forward_step returns, less its stand-in":
            HIDDEN - 2,
    }
    assert first.live_bytes[5] - first.tracemem_bytes[5] == 1_046  # layer 0 is dense


def test_the_interleaved_residue_by_hand(schedule_results):
    # PP 2, VPP 2, M 4, rank 1: chunk 0 is virtual stage 1 (layer 1, MoE), chunk 1 virtual
    # stage 3 (layer 3, MoE, the loss). Warm-up (PP - rank - 1) x 2 + (VPP - 1) x PP = 2
    # forwards (1F0, 1F1), then the steady step 3F0 + 3B0. After 3B0 the schedule still holds
    # chunk 0's inputs of microbatches 0 and 1 (in flight: tracemem holds them too), their
    # deallocated outputs (in flight), and 3B0's input (the local input_tensor and chunk 1's
    # TransformerBlock.input_tensor) with its .grad; microbatch 0's loss stays in
    # forward_data_store. tracemem's replay holds those three (tracemem.schedules.
    # megatron_refs, Segments.schedule_refs), so the residue is the per-chunk rows alone
    r = schedule_results[5]
    assert r.case == schedule_oracle.ScheduleCase(pp=2, vpp=2, num_microbatches=4, rank=1)
    assert r.megatron_steps[:4] == ["1F0", "1F1", "3F0", "3B0"]
    refs = schedule_oracle.INTERLEAVED_REFERENCES
    held = dict(schedule_oracle.interleaved_references(2, 2, 4, 1, HIDDEN))
    assert held["3B0"] == {refs[0]: HIDDEN, refs[1]: HIDDEN, refs[5]: 4}
    assert r.residue[3] == {
        "RoPE inv_freq [d_r / 2] fp32, per MLA layer": 2 * 4 * 4,
        "labels (and, first stage, token ids) int64 [b, s] per microbatch in flight": -2 * 128,
        "total_num_tokens int32 [] and the MoE aux-loss scale fp32 [1]": 8,
    }
    assert r.live_bytes[3] - r.tracemem_bytes[3] == 32 - 256 + 8 == -216
    # before chunk 1's first forward tracemem already counts its layer's RoPE cache
    assert r.residue[0]["RoPE's cache [s, 1, 1, d_r] fp32 of layers whose chunk has not run a "
                        "forward yet"] == -16 * 8 * 4


def test_a_residue_row_removed_fails_the_schedule_bytes(monkeypatch):
    rows = tuple(r for r in schedule_oracle.SCHEDULE_RESIDUE if "labels" not in r.tensor)
    monkeypatch.setattr(schedule_oracle, "SCHEDULE_RESIDUE", rows)
    text, code = run_command(cases=(), static_cases=(),
                             schedule_cases=schedule_oracle.SCHEDULE_CASES[1:2])
    assert code == 1
    assert ("schedule PP2 M4, rank 1: after 1F0 Megatron-Core holds 104,732 B, tracemem "
            "104,820 B: -88 B; the residue explains +40 B") in text


def test_1f1b_by_hand_and_the_outputs_deallocated(schedule_results):
    # PP 2, M 4, rank 0: PP - rank = 2 warm-up forwards, then 1F1B, then the cool-down
    first = schedule_results[0]
    assert first.case == schedule_oracle.ScheduleCase(pp=2, num_microbatches=4, rank=0)
    assert " ".join(first.megatron_steps) == "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3"
    assert max(first.inflight(first.megatron_steps)) == 2
    # deallocate_output_tensor frees each sent output [s, b, h] bf16: 4 x 16 x 64 x 2 B
    assert first.deallocated_bytes == 4 * 16 * 64 * 2


def test_a_planted_schedule_difference_fails_the_command(monkeypatch):
    from tracemem import schedules
    case = schedule_oracle.SCHEDULE_CASES[:1]
    real = schedules.schedule

    def gpipe(name, pp, vpp, m):  # tracemem's GPipe in place of 1F1B
        return real("gpipe", pp, vpp, m)
    monkeypatch.setattr(schedules, "schedule", gpipe)
    text, code = run_command(cases=(), static_cases=(), schedule_cases=case)
    assert code == 1 and "schedule PP2 M4, rank 0: step 2" in text


def test_the_p2p_overlap_by_hand(schedule_results):
    # The same rank with Megatron-LM's default p2p overlap: pp_post_forward receives the next
    # forward's input right after each steady forward, so after 3B0 the loop also holds 1F2's
    # input (one [s, b, h] more than without the overlap); and the local input_tensor keeps the
    # warm-up's last received input (3F0's) with its .grad to the end: two more after 1B3
    plain, overlap = schedule_results[5], schedule_results[7]
    assert overlap.case == schedule_oracle.ScheduleCase(pp=2, vpp=2, num_microbatches=4,
                                                        rank=1, overlap_p2p_comm=True)
    assert overlap.unexplained == [] and overlap.megatron_steps == plain.megatron_steps
    assert overlap.live_bytes[3] - plain.live_bytes[3] == HIDDEN == 2_048  # after 3B0
    assert overlap.live_bytes[-1] - plain.live_bytes[-1] == 2 * HIDDEN  # after 1B3
    refs = schedule_oracle.INTERLEAVED_REFERENCES
    held = dict(schedule_oracle.interleaved_references(2, 2, 4, 1, HIDDEN, True))
    assert held["3B0"] == {refs[0]: 2 * HIDDEN, refs[1]: HIDDEN, refs[5]: 4}


def test_the_interleaved_model_without_the_overlap_fails_against_it(monkeypatch):
    # tracemem's model run as if the overlap were off, held against Megatron-Core's run with
    # it: the earlier receives are missing, and the rank must fail
    from tracemem.schedules import megatron_refs

    real = megatron_refs.interleaved_reference_tensors

    def never_overlapped(*args):
        return real(*args[:5])
    monkeypatch.setattr(megatron_refs, "interleaved_reference_tensors", never_overlapped)
    text, code = run_command(cases=(), static_cases=(),
                             schedule_cases=schedule_oracle.SCHEDULE_CASES[7:])
    assert code == 1
    assert ("schedule PP2 VPP2 M4, rank 1, p2p overlap: after 3B0 Megatron-Core holds 91,280 "
            "B, tracemem 89,448 B: +1,832 B; the residue explains -216 B") in text
    assert 1_832 + 216 == HIDDEN


def test_a_wrong_interleaved_model_fails_the_schedule_bytes(monkeypatch):
    # tracemem's model of the interleaved loop without the input gradients it holds: the
    # replay then lacks them, and VPP's rank 1 must fail
    from tracemem.schedules import megatron_refs

    real = megatron_refs.interleaved_reference_tensors
    gradients = schedule_oracle.INTERLEAVED_REFERENCES[1]

    def without_gradients(*args):
        return [(step, [t for t in tensors if t[0] != gradients])
                for step, tensors in real(*args)]
    monkeypatch.setattr(megatron_refs, "interleaved_reference_tensors", without_gradients)
    text, code = run_command(cases=(), static_cases=(),
                             schedule_cases=schedule_oracle.SCHEDULE_CASES[5:6])
    assert code == 1
    # after the last backward the loop still holds three input gradients (3 x 2,048 B)
    assert ("schedule PP2 VPP2 M4, rank 1: after 1B3 Megatron-Core holds 16,826 B, tracemem "
            "10,642 B: +6,184 B; the residue explains +40 B") in text
    assert 6_184 - 40 == 3 * HIDDEN
