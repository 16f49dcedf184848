"""torchtitan itself as the oracle of the torch profile (issue 25, item 3): torchtitan 0.3.0's
llama3 debugmodel, built on meta and parallelised by its own parallelize_llama (FSDP2
fully_shard) under a fake process group, traced whole (tokens to loss, forward and backward)
against tracemem's build_rank(kernels="torch") with its FSDP2 gathers (tracemem.zero3).

Reference: torchtitan 0.3.0's own code (its model, its FSDP2 wrapping, its loss) on torch
2.13's FSDP2: every expected byte below is derived by hand from the debugmodel's shapes
(torchtitan/models/llama3/__init__.py _debugmodel: dim 256, 6 layers, 16 heads and 16 KV
heads of 16, FFN 768, vocabulary 2048) and the cited source. Every layout of `tracemem
validate --against torchtitan` is run once (about 10 s). Skipped when torchtitan is not
importable.
"""

import dataclasses

import pytest

pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is not installed")

from tracemem.oracle import torchtitan_oracle as oracle  # noqa: E402
from tracemem.oracle.torchtitan_oracle import TITAN_CASES, TitanCase  # noqa: E402

S, N, D, H, FFN, V = 16, 16, 16, 256, 768, 2048  # seq_len; heads, head dim; dim; FFN; vocab


@pytest.fixture(scope="module")
def results():
    return [oracle.run_case(case) for case in TITAN_CASES]


def test_every_layout_is_traced_on_both_sides(results):
    # the embedding (-1), the 6 decoder layers, the output part (6)
    for r in results:
        assert sorted(r.torchtitan) == sorted(r.tracemem) == list(range(-1, 7))


def test_parameter_bytes_are_torchtitans_fp32_shards(results):
    # a block: wqkv (3 x 256) x 256 + wo 256 x 256 + w1, w2, w3 3 x 768 x 256 + 2 norms 256
    block = 3 * H * H + H * H + 3 * FFN * H + 2 * H  # 852,480 elements
    assert block == 852_480
    for r in results:
        dp = r.case.dp  # FSDP2 shards every parameter over dp; fp32 (training.dtype)
        assert r.torchtitan[0].params == r.tracemem[0].params == block * 4 // dp
        assert r.torchtitan[-1].params == V * H * 4 // dp  # tok_embeddings
        assert r.torchtitan[6].params == (H + V * H) * 4 // dp  # norm + lm_head


def test_residue_rows_by_hand():
    from tracemem.frontdoors.torchtitan import torchtitan_model_config
    fsdp1, fsdp2 = TitanCase(), TitanCase(dp=2, spmd_backend="partial_dtensor")
    cfg = torchtitan_model_config(oracle._config(fsdp1).model_spec)
    d = oracle._dims(fsdp1, cfg, 0)
    attention, scalars, copy_out = oracle.titan_residue(fsdp1, cfg, 0)
    # flex: logsumexp + max_scores 2 x 16 x 16 x 4 = 2048; SDPA: logsumexp 16 x 32 x 4 = 2048
    # and philox seed + offset 2 x 8
    assert attention.kept(d) == 2 * N * S * 4 - (N * 32 * 4 + 16) == -16
    assert scalars.kept(d) == 4 * 4 + 2 * 2 == 20  # score_mod examples: four int32, two bf16
    # FSDP2's world-size-1 copy-out (bf16 bytes): torchtitan's order wqkv 393,216, wo
    # 131,072, w1 w2 w3 393,216 each, attention_norm and ffn_norm 512: the peak at the first
    # norm's cast, 393,216 + 131,072 + 3 x 393,216 buffers + w3's cast 393,216 + its own 512
    # = 2,097,664; tracemem's order attn_norm 512, wqkv 393,216 (the torch profile's
    # fused_qkv), wo 131,072, ffn_norm 512, w1 w2 w3 393,216 each: the peak at w3's cast,
    # 512 + 393,216 + 131,072 + 512 + 2 x 393,216 buffers + w2's and w3's casts 2 x 393,216
    # = 2,098,176
    assert copy_out.forward_peak(d) == 2_097_664 - 2_098_176 == -512
    # in backward each side frees its own statistics before the layer's peak: the kept
    # difference reversed
    assert attention.backward_peak(d) == 16 and scalars.backward_peak(d) == 0
    # the RoPE casts (tracemem's rotate-half) and the final norm's gather at the root are no
    # longer rows: fixed (the torch profile runs torchtitan's ComplexRoPE; tracemem.zero3
    # gathers [norm, head] as one unit under fsdp2); FSDP degree 2 has no copy-out row
    assert [r.tensor for r in oracle.titan_residue(fsdp2, cfg, 0)] == [attention.tensor,
                                                                       scalars.tensor]
    assert oracle.titan_residue(fsdp1, cfg, -1) == oracle.titan_residue(fsdp1, cfg, 6) == []


def test_kept_bytes_and_storages_are_equal_or_itemised(results):
    """Every layout: each part's kept bytes differ by exactly the residue's rows and every
    kept storage without a counterpart is named by a row; nothing is unexplained."""
    for r in results:
        for part in r.torchtitan:
            rows = oracle.titan_residue(r.case, r.cfg, part)
            d = oracle._dims(r.case, r.cfg, part)
            got = r.torchtitan[part].kept - r.tracemem[part].kept
            assert got == sum(row.kept(d) for row in rows), (r.case.name, part)
        assert r.unexplained == [], r.unexplained
    # a layer: -16 (attention) + 20 (flex examples) = +4 B; the embedding and the output
    # equal (the final norm's 512 B gather is the output's on both sides)
    assert results[0].torchtitan[0].kept - results[0].tracemem[0].kept == 4
    for part in (-1, 6):
        assert results[0].torchtitan[part].kept == results[0].tracemem[part].kept


def test_forward_peaks_are_fsdp2s_gathers(results):
    """torch 2.13 FSDP2 as tracemem.zero3 now traces it (fsdp2_group): at degree 2 a layer's
    forward peak is its all-gather's flat output beside the unsharded parameters during the
    copy-out (_fsdp_collectives.py foreach_all_gather_copy_out), 2 x its bf16 parameters; at
    degree 1 the embedding's is its bf16 cast beside its unsharded buffer
    (_fsdp_param_group.py wait_for_unshard), 2 x 2048 x 256 x 2 B."""
    fsdp1, fsdp2 = results
    for side in (fsdp2.torchtitan, fsdp2.tracemem):
        assert side[0].forward_peak == 2 * 852_480 * 2 == 3_409_920
    for side in (fsdp1.torchtitan, fsdp1.tracemem):
        assert side[-1].forward_peak == 2 * V * H * 2 == 2_097_152
    assert not any("forward_peak" in line for r in results for line in r.unexplained)


def test_the_root_final_callback_is_the_embeddings():
    """torchtitan_patches wraps FSDPParamGroup.post_backward: what the root's final callback
    allocates for a unit outside any module (the embedding's reduce-scatter) is that unit's,
    not the root's (which the oracle gives to the output part)."""
    import torch

    from tracemem.oracle.torchtitan_patches import _attribute_post_backward
    from tracemem.tracer import MemoryTracer

    class Group:  # the one attribute the wrapper reads, FSDPParamGroup._module_fqn
        _module_fqn = "tok_embeddings"

        def post_backward(self):
            self.buffer = torch.empty(16, device="meta")

    tracer, group = MemoryTracer(rounding=None, devices={"meta"}), Group()
    with tracer:
        _attribute_post_backward(Group.post_backward)(group)
    assert [(e.action, e.nbytes, e.module) for e in tracer.events] == [
        ("alloc", 64, "tok_embeddings")]


def test_backward_peaks_are_fsdp2s_reduce_scatter(results):
    """torch 2.13 foreach_reduce (_fsdp_collectives.py) as tracemem.zero3 traces it: the
    fp32 reduce-scatter input (every unsharded gradient, dim 0 padded), then the reduce output
    (the fp32 sharded gradient, kept as the parameters' .grad), and at world size 1 the
    quotient input / gradient_divide_factor; at world size 2 the last parameter's bf16
    gradient, which the dim-0 check's loop variable holds until foreach_reduce returns."""
    fsdp1, fsdp2 = results
    for side in (fsdp1.torchtitan, fsdp1.tracemem):
        # degree 1, a layer: input, output, quotient, 852,480 fp32 elements each
        at_peak = [(n, dtype) for n, dtype, *_ in side[3].backward_peak_storages]
        assert at_peak == [(852_480 * 4, "float32")] * 3
    # above the layer's first backward allocation: the three, less what the reduce and the
    # attention's backward freed: layer 4's reduce input (released at this reduce,
    # reduce_scatter_max_input_buffers 1) and the layer's kept activations (torchtitan's
    # 166,036 but its 20 B of flex examples, tracemem's 166,032)
    assert fsdp1.torchtitan[3].backward_peak == 2 * 852_480 * 4 - (166_036 - 20) == 6_653_824
    assert fsdp1.tracemem[3].backward_peak == 2 * 852_480 * 4 - 166_032 == 6_653_808
    for side in (fsdp2.torchtitan, fsdp2.tracemem):
        # degree 2, the output unit [norm, head]: its input (256 + 2048 x 256) x 4 B, its
        # output half of it, and the head's bf16 gradient 2048 x 256 x 2 B still held
        at_peak = [(n, dtype) for n, dtype, *_ in side[6].backward_peak_storages]
        for item in ((524_544 * 4, "float32"), (262_272 * 4, "float32"),
                     (V * H * 2, "bfloat16")):
            assert item in at_peak
    assert fsdp2.torchtitan[6].backward_peak == fsdp2.tracemem[6].backward_peak == 4_712_384


def test_sharded_gradients_stay_after_backward(results):
    """The reduce outputs are the step's gradients: alive after backward on both sides, the
    rank's fp32 shards of every parameter (FSDP2's dim-0 padding: none at these shapes)."""
    import torch

    from modeling.kernels import get_profile
    from modeling.parallel import build_rank
    from tracemem.categories import Category
    from tracemem.parallel import ParallelConfig
    from tracemem.tracer import MemoryTracer
    from tracemem.zero3 import Zero3Gathers
    from modeling.common.routing import Balanced

    cfg = results[1].cfg
    par = ParallelConfig.create(cfg, world_size=2, zero=3, precision="fsdp2")
    # the first step (zero_grad(set_to_none=True), as the oracle traces it)
    kernels = get_profile("torch", zero_grad_set_to_none=True)
    model = build_rank(cfg, par, 0, dtype=torch.bfloat16, kernels=kernels)
    gathers = Zero3Gathers.for_layout(par, kernels=kernels).install(model)
    tracer = MemoryTracer(rounding=None, devices={"meta"})
    tracer.track_external(model)
    tokens = torch.zeros(1, S, dtype=torch.long, device="meta")
    with tracer:
        model(tokens, tokens, Balanced()).backward()
        grads = tracer.by_category(at=len(tracer.events) - 1)[Category.GRADIENT.value]
    numel = sum(p.numel() for p in model.parameters())
    assert grads == numel * 4 // 2 == (6 * 852_480 + 2 * V * H + H) * 2
    assert sum(g.numel() for g in gathers.sharded_grads.values()) * 4 == grads
    gathers.zero_grad()
    assert gathers.sharded_grads == {}
    gathers.remove()


def test_a_planted_difference_fails(results):
    r = results[0]
    planted = dataclasses.replace(r, torchtitan=dict(r.torchtitan))
    planted.torchtitan[2] = dataclasses.replace(
        r.torchtitan[2], kept=r.torchtitan[2].kept + 64,
        kept_storages=r.torchtitan[2].kept_storages + ((64, "float32", (16,), "layers.2",
                                                        "aten::empty"),))
    lines = oracle.unexplained(planted)
    assert any("part 2: kept differs by +68 B; the residue explains +4 B" in line
               for line in lines)
    assert any("part 2: kept storages only on torchtitan's side" in line for line in lines)


def test_the_command_exits_0_when_itemised_and_1_on_a_planted_difference(results,
                                                                         monkeypatch):
    by_case = {r.case: r for r in results}
    monkeypatch.setattr(oracle, "run_case", lambda case: by_case[case])
    text, code = oracle.run_command()
    assert code == 0 and "OK: every difference is in the residue" in text
    r = results[1]
    planted = dataclasses.replace(r, tracemem=dict(r.tracemem))
    planted.tracemem[4] = dataclasses.replace(r.tracemem[4],
                                              backward_peak=r.tracemem[4].backward_peak + 8)
    by_case[r.case] = planted
    text, code = oracle.run_command()
    assert code == 1 and "FAIL:" in text and "llama3 dp_shard 2 TP1, part 4: backward_peak" in text
    text, code = oracle.run_command(json_out=True)
    assert code == 1 and '"unexplained"' in text


def test_cli_refuses_a_cpu_case(capsys):
    from tracemem.cli import main

    assert main(["validate", "--against", "torchtitan", "--case", "mlp"]) == 2
    assert "--against torchtitan" in capsys.readouterr().err
