"""Megatron-Core itself as the oracle (issue 11): its GPTModel with tracemem's megatron-te
leaves, traced on meta under a fake process group, against tracemem's build_rank.

Reference: megatron-core 0.16.1's own code (the `megatron` extra): its orchestration decides
what every layer keeps and when, the leaves being the same kernels on both sides. Expected
differences are derived by hand below from the cited Megatron-Core source. Skipped, with the
reason, when megatron-core is not installed; `make test` installs it.
"""

import importlib
import inspect

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed: "
                                            "pip install 'tracemem[megatron]' (make test does)")

from tracemem.oracle import megatron_patches  # noqa: E402
from tracemem.oracle.compare import OracleCase, oracle_model_config, run_case  # noqa: E402

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


def test_cli_json_gives_both_sides_per_layer(capsys, monkeypatch):
    import json

    from tracemem.cli import main
    from tracemem.oracle import compare
    monkeypatch.setattr(compare, "ORACLE_CASES", (OracleCase(),))
    assert main(["validate", "--against", "megatron-core", "--json"]) == 0
    (layout,) = json.loads(capsys.readouterr().out)
    assert layout["layout"] == "TP1 EP1 ETP1" and not layout["equal"]
    dense = layout["layers"]["0"]
    assert dense["megatron_core"]["params"] == dense["tracemem"]["params"] == 86_432
    assert dense["megatron_core"]["kept"] - dense["tracemem"]["kept"] == ROPE_CACHE
