"""The user's own layer (modeling.common.custom): ``replace=`` of the Python API and
``--replace`` of the CLI; data-dependent ops and ops without a meta kernel in it.

References: shapes and parameter counts by hand from the deepseek-tiny sizes (h 64, 4 heads,
MLA per layer at TP 2: wq_a 64 x 48, wkv_a 64 x 40, q_norm 48, kv_norm 32 replicated; wq_b
48 x 48, wkv_b 32 x 64, wo 32 x 64 split); the ops' meta behaviour in torch 2.13
(torch/_meta_registrations.py; ``Tensor.item()`` on meta raises in aten::_local_scalar_dense);
``torch.library.custom_op`` / ``register_fake`` (torch/_library/custom_ops.py).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from modeling import load_config
from modeling.common.custom import LayerContext, resolve_replacements
from modeling.common.model import build_model
from modeling.parallel.build import build_rank
from modeling.parallel.collectives import all_gather, reduce_scatter
from modeling.parallel.groups import column, declare, replicated, row
from modeling.params import count_by_component
from tracemem import estimate
from tracemem.cli import main
from tracemem.errors import DataDependentOpError, MissingMetaKernelError, TracememError
from tracemem.parallel import ParallelConfig
from tracemem.static import static_memory

TINY_CFG = load_config("deepseek-tiny")
TINY = dict(world_size=4, tp=2, sp=True, pp=2, micro_batch_size=2, seq_length=64,
            num_microbatches=4, experts="sequential", kernels="eager", attention="eager")
HEAD_DIM = 16


class TinyAttention(nn.Module):
    """Multi-head attention on this rank's heads: fused QKV (column-parallel), eager softmax,
    output projection (row-parallel); SP gathers and reduce-scatters the sequence."""

    def __init__(self, ctx: LayerContext, body=None):
        super().__init__()
        h, self.heads, self.sp = ctx.cfg.hidden_size, ctx.sizes.num_heads, ctx.sizes.sp
        self.wqkv = declare(nn.Parameter(torch.empty(3 * self.heads * HEAD_DIM, h)),
                            column("attention"))
        self.wo = declare(nn.Parameter(torch.empty(h, self.heads * HEAD_DIM)), row("attention"))
        self.body = body

    def forward(self, x):
        x = all_gather(x, self.sp, dim=1)
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.heads, HEAD_DIM).transpose(1, 2)
                   for t in F.linear(x, self.wqkv).chunk(3, dim=-1))
        scores = (q @ k.transpose(-2, -1)).softmax(dim=-1)
        if self.body is not None:
            scores = self.body(scores)
        out = (scores @ v).transpose(1, 2).reshape(b, s, -1)
        return reduce_scatter(F.linear(out, self.wo), self.sp, dim=1)


class TinyMLP(nn.Module):
    """GELU MLP of the dense layers' width held (TP-split)."""

    def __init__(self, ctx: LayerContext):
        super().__init__()
        h, inter, self.sp = ctx.cfg.hidden_size, ctx.sizes.dense_inter, ctx.sizes.sp
        self.fc1 = declare(nn.Parameter(torch.empty(inter, h)), column("dense_mlp"))
        self.fc2 = declare(nn.Parameter(torch.empty(h, inter)), row("dense_mlp"))

    def forward(self, x):
        x = all_gather(x, self.sp, dim=1)
        return reduce_scatter(F.linear(F.gelu(F.linear(x, self.fc1)), self.fc2), self.sp, dim=1)


class TinyBlock(nn.Module):
    """x + attn(norm(x)) + mlp(norm(x)) (parallel attention and MLP), no MoE."""

    def __init__(self, ctx: LayerContext):
        super().__init__()
        self.norm = nn.RMSNorm(ctx.cfg.hidden_size)
        declare(self.norm.weight, replicated("norms"))
        self.attn, self.mlp = TinyAttention(ctx), TinyMLP(ctx)

    def forward(self, x, routing):
        h = self.norm(x)
        return x + self.attn(h) + self.mlp(h)


# --------------------------------------------------------------------------- the Python API
def test_build_calls_the_factory_per_layer_with_the_ranks_sizes():
    seen = []

    def factory(ctx):
        seen.append((ctx.layer_id, ctx.sizes.num_heads, ctx.sizes.sp, ctx.moe,
                     ctx.rank.pp_rank, ctx.kernels.name))
        return TinyAttention(ctx)

    par = ParallelConfig.create(TINY_CFG, world_size=4, tp=2, sp=True, pp=2)
    model = build_rank(TINY_CFG, par, 2, replace={"attn": factory})  # stage 1: layers 2-3, MTP
    assert seen == [(2, 2, 2, True, 1, "eager"), (3, 2, 2, True, 1, "eager"),
                    (4, 2, 2, True, 1, "eager")]
    assert isinstance(model.mtp["0"].block.attn, TinyAttention)
    assert build_model(TINY_CFG, replace={"attn": TinyAttention}).layers["0"].attn.wo.shape \
        == (64, 4 * HEAD_DIM)


def test_static_memory_counts_the_users_parameters_by_their_declared_groups():
    par = ParallelConfig.create(TINY_CFG, world_size=4, tp=2, sp=True, pp=2)
    mla = build_rank(TINY_CFG, par, 0)
    mine = build_rank(TINY_CFG, par, 0, replace={"attn": TinyAttention, "mlp": TinyMLP})
    # per layer at TP 2, by hand: MLA 64*48 + 64*40 replicated, 48*48 + 32*64 + 32*64 split =
    # 12,032 (its q_norm and kv_norm count under "norms"); TinyAttention wqkv 96 x 64 + wo
    # 64 x 32 = 8,192; the dense SwiGLU 3 * 64 * 64 = 12,288, TinyMLP 2 * 64 * 64 = 8,192
    assert count_by_component(mla)["attention"] == 2 * 12_032
    assert count_by_component(mine)["attention"] == 2 * 8_192
    assert count_by_component(mine)["dense_mlp"] == 2 * 8_192
    assert static_memory(mine, par).dense_params == static_memory(mla, par).dense_params \
        - 2 * (12_032 + 48 + 32 - 8_192) - 2 * (12_288 - 8_192)


@pytest.mark.parametrize("recompute, more", [
    ("none", {}), ("selective", dict(schedule="gpipe", zero=2)),
    ("full", dict(schedule="interleaved-1f1b", vpp=2)), ("none", dict(zero=3))])
def test_estimate_runs_with_a_users_attention_and_mlp(recompute, more):
    base = estimate("deepseek-tiny", recompute=recompute, **TINY, **more)
    mine = estimate("deepseek-tiny", recompute=recompute,
                    replace={"attn": TinyAttention, "mlp": TinyMLP}, **TINY, **more)
    assert [r.pp_stage for r in mine.ranks] == [0, 1]
    assert all(r.peak_bytes > 0 for r in mine.ranks)
    assert mine.ranks[0].static != base.ranks[0].static
    assert mine.settings["replace"] == {"attn": "TinyAttention", "mlp": "TinyMLP"}
    if more.get("zero") == 3:  # stage 0's largest unit, a dense layer at TP 2, by hand:
        # TinyAttention 8,192 + TinyMLP 2 x 64 x 64 / 2 = 8,192 + two norms 2 x 64, bf16
        assert mine.ranks[0].static.zero3_gather_bytes == 2 * (8_192 + 8_192 + 128)


def test_estimate_with_a_users_block_under_full_recompute_keeps_less():
    none = estimate("deepseek-tiny", replace={"block": TinyBlock}, **TINY)
    full = estimate("deepseek-tiny", recompute="full", replace={"block": TinyBlock}, **TINY)
    assert all(f.activation_bytes < n.activation_bytes for f, n in zip(full.ranks, none.ranks))
    with pytest.raises(TracememError, match=r"^--recompute selective names parts of "
                                            r"tracemem's decoder layer; a replaced block"):
        estimate("deepseek-tiny", recompute="selective", replace={"block": TinyBlock}, **TINY)


# --------------------------------------------------------------------------- bad specs
@pytest.mark.parametrize("spec, match", [
    ("attn", r"--replace 'attn' is invalid; give KIND=pkg\.module:Name \(KIND one of attn, "
             r"mlp, block\)"),
    ("ffn=tests.tracemem.test_replace:TinyMLP", r"'ffn' cannot be replaced; choose one of "
                                                 r"attn, mlp, block"),
    ("attn=tests.tracemem.test_replace", r"is invalid; give attn=pkg\.module:Name or "
                                         r"attn=path/to/file\.py:Name"),
    ("attn=no_such_pkg.mod:X", r"cannot import module 'no_such_pkg\.mod'"),
    ("attn=tests.tracemem.test_replace:Missing", r"has no 'Missing'"),
    ("attn=tests.tracemem.test_replace:HEAD_DIM", r"16 is not a class or factory"),
    ("attn=missing/file.py:X", r"no file missing/file\.py"),
])
def test_a_bad_replace_spec_is_one_line_and_exit_2(spec, match, capsys):
    with pytest.raises(TracememError, match=match):
        resolve_replacements([spec])
    args = ["estimate", "--model", "deepseek-tiny", "--world-size", "1", "--micro-batch-size",
            "1", "--seq-length", "8", "--num-microbatches", "1", "--replace", spec]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tracemem: error: --replace")


def test_a_kind_twice_or_block_with_attn_is_refused():
    with pytest.raises(TracememError, match=r"attn is replaced twice"):
        resolve_replacements(["attn=tests.tracemem.test_replace:TinyAttention"] * 2)
    with pytest.raises(TracememError, match=r"--replace block= replaces the whole layer; drop "
                                            r"--replace attn="):
        resolve_replacements({"block": TinyBlock, "attn": TinyAttention})


def test_a_factory_that_returns_no_module_is_refused():
    with pytest.raises(TracememError, match=r"--replace attn=<lambda> returned int, not an "
                                            r"nn\.Module"):
        build_model(TINY_CFG, replace={"attn": lambda ctx: 3})


def test_the_cli_form_runs_the_same_estimate(capsys):
    args = ["estimate", "--model", "deepseek-tiny", "--world-size", "4", "--tp", "2", "--sp",
            "--pp", "2", "--micro-batch-size", "2", "--seq-length", "64",
            "--num-microbatches", "4", "--experts", "sequential", "--kernels", "eager",
            "--attention", "eager", "--json", "--quiet",
            "--replace", "attn=tests.tracemem.test_replace:TinyAttention",
            "--replace", "mlp=tests/tracemem/test_replace.py:TinyMLP"]
    import json
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out)
    api = estimate("deepseek-tiny", replace={"attn": TinyAttention, "mlp": TinyMLP}, **TINY)
    assert [r["peak_bytes"] for r in result["ranks"]] == [r.peak_bytes for r in api.ranks]


# --------------------------------------------------------------------------- values on meta
_SHAPE_STATIC = r"make the shape static: take the counts from a routing model"
_BRANCH_STATIC = r"decide the branch from the config or a routing model"


def _branch(x):
    if (x > 0).any():
        return x
    return x * 2


@pytest.mark.parametrize("body, op, needs, way_out", [
    (lambda x: x * x.sum().item(), "aten::_local_scalar_dense", r"Tensor\.item\(\)",
     _BRANCH_STATIC),
    (_branch, "aten::_local_scalar_dense", r"bool\(t\)", _BRANCH_STATIC),
    (lambda x: x + x.nonzero().shape[0], "aten::nonzero", "shape depends on tensor values",
     _SHAPE_STATIC),
    (lambda x: x + x.masked_select(x > 0).sum(), "aten::masked_select",
     "depends on the mask's values", _SHAPE_STATIC),
    (lambda x: x + x[x > 0].sum(), "aten::index", r"boolean mask \(t\[mask\]\)", _SHAPE_STATIC),
    (lambda x: x * len(x.tolist()), "aten::_to_copy", r"\.tolist\(\)",
     "keep the values that decide shapes in Python"),
    (lambda x: x + torch.unique(x).sum(), "aten::_unique2", "unique", _SHAPE_STATIC),
    (lambda x: x.repeat_interleave(torch.ones(x.shape[-1], dtype=torch.long, device=x.device),
                                   dim=-1), "aten::repeat_interleave", "repeats' values",
     _SHAPE_STATIC),
])
def test_a_data_dependent_op_in_a_users_layer_names_the_op_the_module_and_the_way_out(
        body, op, needs, way_out, capsys):
    with pytest.raises(DataDependentOpError,
                       match=rf"^operator {op} in module 'layers\.0\.attn' .*{needs}.*; meta "
                             rf"tensors have no values, so .*{way_out}") as info:
        estimate("deepseek-tiny", replace={"attn": lambda ctx: TinyAttention(ctx, body)},
                 **TINY)
    assert "\n" not in str(info.value)


@pytest.mark.filterwarnings("ignore:.*an autograd kernel was not registered:UserWarning")
def test_an_op_without_a_meta_kernel_in_a_users_layer_shows_the_register_fake_stub():
    lib = torch.library.Library("tracemem_replace_test", "FRAGMENT")
    lib.define("mix(Tensor x) -> Tensor")
    lib.impl("mix", lambda x: x.clone(), "CPU")
    body = torch.ops.tracemem_replace_test.mix
    with pytest.raises(MissingMetaKernelError,
                       match=r'tracemem_replace_test::mix has no meta kernel(.|\n)*'
                             r'register_fake\("tracemem_replace_test::mix"\)'):
        estimate("deepseek-tiny", replace={"attn": lambda ctx: TinyAttention(ctx, body)},
                 **TINY)
    torch.library.register_fake("tracemem_replace_test::mix", lambda x: torch.empty_like(x),
                                lib=lib)
    assert estimate("deepseek-tiny", replace={"attn": lambda ctx: TinyAttention(ctx, body)},
                    **TINY).ranks[0].peak_bytes > 0


def test_params_and_static_take_replace_too(capsys):
    import json
    spec = "attn=tests.tracemem.test_replace:TinyAttention"
    assert main(["params", "--model", "deepseek-tiny", "--json", "--replace", spec]) == 0
    # unsharded, by hand: wqkv 3 x 4 heads x 16 x 64 = 12,288 + wo 64 x 64 = 4,096 per layer,
    # 4 layers in the main model (the MTP layer's count under mtp_layer)
    assert json.loads(capsys.readouterr().out)["by_component"]["attention"] == 4 * 16_384
    assert main(["static", "--model", "deepseek-tiny", "--world-size", "2", "--tp", "2",
                 "--json", "--replace", spec]) == 0
    stage = json.loads(capsys.readouterr().out)["stages"][0]
    assert stage["params_by_component"]["attention"] == 4 * 16_384 // 2  # split over TP 2


class Undeclared(nn.Module):
    def __init__(self, ctx):
        super().__init__()
        self.w = nn.Parameter(torch.empty(ctx.cfg.hidden_size, ctx.cfg.hidden_size))

    def forward(self, x):
        return x @ self.w


def test_a_users_undeclared_parameter_stops_the_estimate_in_one_line(capsys):
    with pytest.raises(TracememError, match=r"^parameter 'layers\.0\.attn\.w' \(64, 64\) "
                                            r"declares no group; declare it where it is made"):
        estimate("deepseek-tiny", replace={"attn": Undeclared}, **TINY)
    assert main(["estimate", "--model", "deepseek-tiny", "--world-size", "1",
                 "--micro-batch-size", "1", "--seq-length", "8", "--num-microbatches", "1",
                 "--replace", "attn=tests.tracemem.test_replace:Undeclared"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "modeling.parallel.groups.declare(param" in err


@pytest.mark.parametrize("model", [p for p in __import__("modeling").PRESETS
                                   if p.endswith("-tiny")])
def test_a_users_attention_runs_in_every_familys_tiny_model(model):
    # each family's own parameters declare their groups too: no undeclared-parameter error
    result = estimate(model, replace={"attn": TinyAttention}, **TINY)
    assert [r.pp_stage for r in result.ranks] == [0, 1]
    assert all(r.peak_bytes > 0 for r in result.ranks)


def test_activated_counts_subtract_only_declared_routed_experts(capsys):
    import json
    spec = "block=tests.tracemem.test_replace:TinyBlock"
    assert main(["params", "--model", "deepseek-tiny", "--json", "--replace", spec]) == 0
    result = json.loads(capsys.readouterr().out)
    # by hand, per TinyBlock: norm 64 + attention 16,384 + MLP 2 x 64 x 128 = 32,832; the main
    # model: 4 layers + embedding 16,384 + final norm 64 + head 16,384 = 164,160; no routed
    # experts, so activated = total - the embedding (a lookup)
    assert result["total"] == 4 * 32_832 + 16_384 + 64 + 16_384 == 164_160
    assert result["activated_per_token"] == 164_160 - 16_384
