"""Parameters declare their group where they are made (modeling.parallel.groups); static memory,
ZeRO sharding, the optimizer step's shards, ZeRO-3 units and parameter counts read the
declarations, never module or parameter names.

References: Megatron-Core at NVIDIA/Megatron-LM d98e8a6 for what each declaration must say:
megatron/core/tensor_parallel/layers.py ``set_tensor_model_parallel_attributes`` (partition_dim
0 for ``ColumnParallelLinear`` and ``VocabParallelEmbedding``, 1 for ``RowParallelLinear``) and
``setattr(self.weight, "allreduce", not use_expert_pgs)`` (False only for the routed experts,
``is_expert=True`` from megatron/core/transformer/moe/experts.py ``TEGroupedMLP.__init__``);
modeling/parallel/plans.py's docstring for which module is column / row / replicated; arXiv
2502.07846's plan for the shared expert (replicated, ZeRO over EDP). The byte figures of a
renamed model are compared with the same model's before renaming (the existing exact-byte tests
in tests/tracemem/test_static.py and test_zero3.py hold the figures themselves).
"""

import pytest
import torch
from torch import nn

from modeling import load_config
from modeling.common.model import build_model
from modeling.parallel.build import build_rank
from modeling.parallel.groups import (
    ParamGroup,
    declare,
    declared_tensors,
    group_of,
    numel_by_kind,
)
from modeling.params import count_by_component
from tracemem.errors import TracememError
from tracemem.parallel import ParallelConfig
from tracemem.static import static_memory
from tracemem.zero3 import Zero3Gathers, unit_params

TINY = load_config("deepseek-tiny")

# Megatron-Core's attributes for each DeepSeek module (the leaf name: the parameter's module):
# (kind, tp_dim, ep)
COLUMN, ROW, REPLICATED = ("dense", 0, False), ("dense", 1, False), ("dense", None, False)
MEGATRON = {
    "attn.wq_a": REPLICATED, "attn.wkv_a": REPLICATED, "attn.q_norm": REPLICATED,
    "attn.kv_norm": REPLICATED, "attn.wq_b": COLUMN, "attn.wkv_b": COLUMN, "attn.wo": ROW,
    "attn_norm": REPLICATED, "ffn_norm": REPLICATED, "ffn.w1": COLUMN, "ffn.w3": COLUMN,
    "ffn.w2": ROW, "ffn.gate": REPLICATED, "ffn.shared_experts.w1": COLUMN,
    "ffn.shared_experts.w3": COLUMN, "ffn.shared_experts.w2": ROW,
    "embed": COLUMN, "head": COLUMN, "norm": REPLICATED, "enorm": REPLICATED,
    "hnorm": REPLICATED, "eh_proj": COLUMN,
}


def _expected(name: str, plan: str) -> tuple:
    """(kind, tp_dim, ep) of parameter ``name`` by Megatron-Core's rules."""
    module = name.rsplit(".", 1)[0]
    parts = module.split(".")
    if "experts" in parts:  # routed: EP-sharded, ETP splits fc1's output and fc2's input
        leaf = parts[-1] if parts[-1] in ("w1", "w2", "w3") else name.rsplit(".", 1)[1]
        grouped = name.endswith(("experts.w1", "experts.w2", "experts.w3"))
        return "expert", (1 if leaf != "w2" else 2) if grouped else (0 if leaf != "w2" else 1), \
            True
    if plan == "paper-2502.07846" and "shared_experts" in parts:
        return "expert", None, False
    if plan == "paper-2502.07846" and parts[-1] == "wq_r":
        return REPLICATED
    for suffix, expected in MEGATRON.items():
        if module == suffix or module.endswith("." + suffix):
            return expected
    raise AssertionError(f"no rule for {name}")


@pytest.mark.parametrize("plan, experts", [("megatron", "grouped"), ("megatron", "sequential"),
                                           ("paper-2502.07846", "sequential")])
def test_every_parameter_declares_megatrons_group(plan, experts):
    par = ParallelConfig.create(TINY, world_size=8, tp=2, ep=2, pp=2, plan=plan)
    for rank in (0, 4):  # the first stage (embedding, dense layers), the last (head, MTP)
        model = build_rank(TINY, par, rank, experts=experts, dtype=torch.bfloat16)
        for module_name, name, tensor, group in declared_tensors(model, buffers=True):
            path = f"{module_name}.{name}"
            if name == "e_score_correction_bias":  # a buffer: the router's group
                assert group == group_of(dict(model.named_parameters())[
                    f"{module_name}.weight"])
                continue
            assert (group.kind, group.tp_dim, group.ep) == _expected(path, plan), path


def test_components_are_declared_where_the_modules_are_made():
    model = build_model(TINY, "meta", experts="grouped", dtype=torch.bfloat16)
    components = {f"{m}.{n}": g.component for m, n, _, g in declared_tensors(model, True)}
    assert components["layers.0.attn.wq_b.weight"] == "attention"
    assert components["layers.0.attn.q_norm.weight"] == "norms"
    assert components["layers.0.ffn.w1.weight"] == "dense_mlp"
    assert components["layers.2.ffn.gate.weight"] == "router"
    assert components["layers.2.ffn.gate.e_score_correction_bias"] == "router"
    assert components["layers.2.ffn.shared_experts.w2.weight"] == "shared_experts"
    assert components["layers.2.ffn.experts.w1"] == "routed_experts"
    assert components["mtp.0.eh_proj.weight"] == "mtp_projection"
    assert components["mtp.0.enorm.weight"] == "mtp_projection"
    assert components["mtp.0.block.ffn.experts.w1"] == "mtp_layer"
    assert components["mtp.0.block.attn_norm.weight"] == "mtp_layer"
    assert (components["embed.weight"], components["head.weight"]) == ("embedding",
                                                                       "output_head")


def _rename(model: nn.Module) -> nn.Module:
    """Every module the old name-matching looked for, under another name: ``layers`` ->
    ``decoder``, ``ffn`` -> ``mixer``, ``experts`` -> ``bank``, ``shared_experts`` ->
    ``common``, ``embed`` -> ``tok_embeddings``, ``head`` -> ``output``, ``mtp`` -> ``nextn``,
    ``attn`` -> ``mixing``."""
    def move(parent, old, new):
        if old in parent._modules:
            parent._modules[new] = parent._modules.pop(old)

    for module in list(model.modules()):
        for old, new in (("ffn", "mixer"), ("experts", "bank"), ("shared_experts", "common"),
                         ("attn", "mixing"), ("block", "layer")):
            move(module, old, new)
    for old, new in (("layers", "decoder"), ("embed", "tok_embeddings"), ("head", "output"),
                     ("mtp", "nextn")):
        move(model, old, new)
    return model


@pytest.mark.parametrize("plan", ["megatron", "paper-2502.07846"])
def test_a_renamed_model_has_the_same_static_and_zero_bytes(plan):
    # The names the old code matched ("experts", "shared_experts", "embed", "layers.<i>", ...)
    # are all gone; every figure stays, because the declarations travel with the tensors.
    for zero in (1, 2, 3):
        par = ParallelConfig.create(TINY, world_size=8, tp=2, ep=2, pp=2, zero=zero, plan=plan,
                                    precision="megatron")
        for rank in (0, 4):
            model = build_rank(TINY, par, rank, experts="sequential")
            before = static_memory(model, par)
            units = sorted(sum(p.numel() for p in ps) for ps in unit_params(model).values())
            renamed = _rename(model)
            assert "experts" not in str([n for n, _ in renamed.named_parameters()]).split(".")
            assert static_memory(renamed, par) == before
            assert sorted(sum(p.numel() for p in ps)
                          for ps in unit_params(renamed).values()) == units
            assert before.dense_params > 0 and (before.expert_params > 0) == (rank == 4)


def test_the_head_stays_gathered_after_forward_by_its_declaration_not_its_name():
    # torchtitan's apply_fsdp: the output head is wrapped with reshard_after_forward=False
    par = ParallelConfig.create(TINY, world_size=2, pp=2, zero=3)
    model = build_rank(TINY, par, 1)
    assert Zero3Gathers().install(model).keep_after_forward == {"head"}
    assert Zero3Gathers().install(_rename(model)).keep_after_forward == {"output"}


def test_a_renamed_model_counts_the_same_per_component():
    model = build_model(TINY, "meta")
    before = count_by_component(model)
    assert count_by_component(_rename(model)) == before
    assert before["routed_experts"] == 2 * 8 * 3 * 64 * 32  # layers 2 and 3, by hand


def test_an_undeclared_parameter_is_a_one_line_error_naming_it():
    par = ParallelConfig.create(TINY, world_size=1)
    model = build_rank(TINY, par, 0)
    model.layers["1"].extra = nn.Parameter(torch.empty(4, 3, device="meta"))
    for run in (lambda: static_memory(model, par), lambda: numel_by_kind(model),
                lambda: count_by_component(model)):
        with pytest.raises(TracememError, match=r"^parameter 'layers\.1\.extra' \(4, 3\) "
                                                r"declares no group; declare it where it is "
                                                r"made, e\.g\. modeling\.parallel\.groups\."
                                                r"declare\(param, ParamGroup\(") as info:
            run()
        assert "\n" not in str(info.value)
    declare(model.layers["1"].extra, ParamGroup("attention", "expert", tp_dim=1, ep=True))
    assert numel_by_kind(model)["expert"] == numel_by_kind(build_rank(TINY, par, 0))[
        "expert"] + 12


@pytest.mark.parametrize("kwargs, match", [
    (dict(component="attention", kind="moe"), r"kind 'moe' is invalid; choose one of dense, "
                                              r"expert"),
    (dict(component="attention", ep=True), r"ep=True\) needs kind='expert'"),
    (dict(component="attention", tp_dim=-1), r"tp_dim -1 must be None"),
    (dict(component=""), r"component '' must be a name"),
])
def test_a_bad_declaration_is_refused(kwargs, match):
    with pytest.raises(TracememError, match=match):
        ParamGroup(**kwargs)


def test_declarations_survive_the_dtype_cast():
    model = build_model(TINY, "meta", dtype=torch.bfloat16)
    weight = model.layers["0"].attn.wo.weight
    assert weight.dtype == torch.bfloat16
    assert group_of(weight) == ParamGroup("attention", "dense", tp_dim=1)
