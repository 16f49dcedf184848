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
# each layer's cache keeps emb [s, 1, 1, d_r] fp32 and the inv_freq it scaled, [d_r / 2] fp32
ROPE_CACHE = S * D_R * 4 + D_R // 2 * 4  # 512 + 16


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


@pytest.fixture(scope="module", params=[OracleCase(), OracleCase(tp=2, sp=True, ep=4)],
                ids=lambda c: c.name)
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


def test_the_dense_layer_differs_only_by_the_rope_cache(result):
    m, t = result.megatron[0], result.tracemem[0]
    assert m.kept - t.kept == ROPE_CACHE
    assert m.forward_peak - t.forward_peak == ROPE_CACHE
    assert m.backward_peak == t.backward_peak
    only = result.diff(0)
    assert sorted(s[0] for s in only.only_megatron) == [16, 512] and not only.only_tracemem


def test_moe_layers_differ_by_the_rope_cache_and_the_dispatcher_state(result):
    # token_dispatcher.py dispatch_preprocess keeps self.probs [T, E] fp32 and
    # self.routing_map [T, E] bool until the layer's next forward; T = s / TP under SP
    tokens = S // result.case.tp if result.case.sp else S
    for layer in (1, 2):
        only = result.diff(layer)
        assert sorted((s[0], s[1]) for s in only.only_megatron) == sorted(
            [(16, "float32"), (512, "float32"), (tokens * E * 4, "float32"),
             (tokens * E, "bool")])
        assert not only.only_tracemem
        assert result.megatron[layer].kept - result.tracemem[layer].kept == \
            ROPE_CACHE + tokens * E * 5


def test_cli_megatron_core_refuses_a_cpu_case(capsys):
    from tracemem.cli import main
    assert main(["validate", "--against", "megatron-core", "--case", "mlp"]) == 2
    assert "--case names a CPU case" in capsys.readouterr().err
