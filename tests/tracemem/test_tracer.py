"""MemoryTracer on hand-checkable steps.

Reference: hand arithmetic, bytes = numel * element_size (float32 = 4 B, bfloat16 = 2 B), and
the CUDA caching allocator's 512-byte block rounding (c10/cuda/CUDACachingAllocator.cpp,
``round_size``).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tracemem import (
    Category,
    DataDependentOpError,
    FusedOptimizerError,
    MemoryTracer,
    MissingMetaKernelError,
    Phase,
    TracememError,
)

META = "meta"


def traced(step, *externals, **options):
    tracer = MemoryTracer(**options)
    tracer.track_external(*externals)
    with tracer:
        step()
    return tracer


def test_externals_form_the_baseline():
    model = nn.Linear(8, 4, device=META)  # weight 32 floats + bias 4 floats
    x = torch.empty(2, 8, device=META)  # 16 floats
    tracer = traced(lambda: None, model, x)
    assert tracer.baseline_bytes == (32 + 4 + 16) * 4
    assert tracer.by_category(at="now") == {"parameter": 144, "input": 64}
    assert tracer.by_module(at="now") == {"": 144 + 64}  # the root module, and the input


def test_views_share_their_base_storage_and_cost_nothing():
    x = torch.empty(4, 8, device=META)

    def step():
        x.view(32), x.t(), x[1:], x.chunk(2), x.narrow(1, 0, 4), x.detach(), x.reshape(8, 4)

    tracer = traced(step, x)
    assert tracer.peak_bytes == tracer.baseline_bytes == 128
    assert [e.phase for e in tracer.events] == [Phase.EXTERNAL]


def test_new_outputs_count_numel_times_element_size_and_die_with_their_last_reference():
    x = torch.empty(4, 8, device=META, dtype=torch.bfloat16)
    kept = []

    def step():
        y = x * x  # 32 * 2 B, dies at the end of this function
        kept.append(torch.cat([x, x]))  # 64 * 2 B, kept
        del y

    tracer = traced(step, x)
    assert tracer.peak_bytes - tracer.baseline_bytes == 64 + 128
    assert tracer.current_bytes - tracer.baseline_bytes == 128
    assert [(e.action, e.nbytes) for e in tracer.events[1:]] == [
        ("alloc", 64), ("alloc", 128), ("free", 64)]


def test_in_place_ops_allocate_nothing():
    x = torch.empty(16, device=META)
    tracer = traced(lambda: x.mul_(2).add_(x).relu_(), x)
    assert tracer.peak_bytes == tracer.baseline_bytes == 64


def test_growing_resize_holds_old_and_new_block_then_frees_the_old():
    buf = torch.empty(10, device=META)  # 40 B

    def step():
        buf.resize_(20)  # 80 B: allocated while the 40 B block is still held
        buf.resize_(5)  # shrinking keeps the 80 B block

    tracer = traced(step, buf)
    assert tracer.peak_bytes == 40 + 80
    assert tracer.current_bytes == 80
    assert [(e.action, e.nbytes) for e in tracer.events] == [
        ("alloc", 40), ("alloc", 80), ("free", 40)]


def test_set_swaps_storage_and_frees_the_old_one():
    a = torch.empty(10, device=META)
    b = torch.empty(3, device=META)
    tracer = traced(lambda: a.set_(b), a, b)
    assert tracer.baseline_bytes == 52
    assert tracer.current_bytes == 12  # a's 40 B storage died when a let go of it


def test_rounding_512_rounds_each_storage_up_to_a_block():
    x = torch.empty(25, device=META)  # 100 B -> 512 B
    kept = []

    def step():
        kept.append(torch.empty(129, device=META))  # 516 B -> 1024 B
        kept.append(torch.empty(0, device=META))  # 0 B -> 0 B

    tracer = traced(step, x, rounding=512)
    assert tracer.baseline_bytes == 512
    assert tracer.peak_bytes == 512 + 1024


@pytest.mark.parametrize("rounding", [0, -512, 1.5, True, "512"])
def test_invalid_rounding_is_a_clear_error(rounding):
    with pytest.raises(TracememError, match=r"rounding=.* is invalid; use None"):
        MemoryTracer(rounding=rounding)


def test_saved_tensors_are_activations_and_the_rest_temporaries():
    w = torch.empty(8, 8, device=META, requires_grad=True)
    x = torch.empty(4, 8, device=META)
    out = []

    def step():
        h = x @ w  # 128 B: mm saves x and w, not h -> temporary, alive until tanh is done
        out.append(torch.tanh(h))  # 128 B: tanh saves its output -> activation

    tracer = traced(step, x, w)  # both tracked as plain tensors: inputs, 128 + 256 B
    assert tracer.by_category(at="peak") == {"input": 384, "activation": 128, "temporary": 128}
    assert tracer.by_category(at="now") == {"input": 384, "activation": 128}


def test_no_grad_saves_no_activations():
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).to(META)
    x = torch.empty(4, 8, device=META)
    out = []

    def step():
        with torch.no_grad():
            out.append(model(x))

    tracer = traced(step, model, x)
    assert "activation" not in tracer.by_category(at="now")
    assert tracer.by_category(at="now")["temporary"] == 4 * 8 * 4


def test_gradients_and_optimizer_states_are_named_and_attributed_to_their_module():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(META)
    opt = torch.optim.Adam(model.parameters())
    x = torch.empty(4, 8, device=META)
    params = (8 * 16 + 16) * 4, (16 * 2 + 2) * 4  # 576 B, 136 B

    def step():
        model(x).sum().backward()
        opt.step()

    tracer = traced(step, model, opt, x)
    now = tracer.by_category(at="now")
    assert now["parameter"] == now["gradient"] == sum(params)
    # exp_avg and exp_avg_sq per parameter (meta), plus one float32 `step` scalar per
    # parameter tensor on the CPU (non-capturable Adam keeps it there): 4 tensors * 4 B.
    assert now["optimizer_state"] == 2 * sum(params) + 4 * 4
    modules = tracer.by_module(at="now")
    assert modules["0"] == params[0] * 4 + 2 * 4  # param, grad, exp_avg, exp_avg_sq, 2 steps
    assert modules["2"] == params[1] * 4 + 2 * 4


def test_devices_filter_counts_only_the_estimated_device():
    model = nn.Linear(8, 8).to(META)
    opt = torch.optim.Adam(model.parameters())

    def step():
        model(torch.empty(2, 8, device=META)).sum().backward()
        opt.step()

    tracer = traced(step, model, opt, devices={"meta"})
    assert tracer.by_category(at="now")["optimizer_state"] == 2 * (64 + 8) * 4  # no CPU steps


def test_module_attribution_in_forward_and_backward():
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).to(META)
    x = torch.empty(2, 8, device=META)
    tracer = traced(lambda: model(x).sum().backward(), model, x)
    made = {(e.op, e.phase.value, e.module) for e in tracer.events if e.action == "alloc"}
    assert ("aten::addmm", "forward", "0") in made
    assert ("aten::tanh", "forward", "1") in made
    assert ("aten::tanh_backward", "backward", "1") in made
    assert ("aten::mm", "backward", "0") in made  # weight gradient of layer 0
    assert ("aten::mm", "backward", "2") in made


def test_checkpoint_recompute_is_its_own_phase_and_saves_memory():
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 256), nn.GELU(), nn.Linear(256, 16)).to(META)

    x = torch.empty(64, 16, device=META)
    plain, ckpt = make(), make()
    t_plain = traced(lambda: plain(x).sum().backward(), plain, x)
    t_ckpt = traced(lambda: checkpoint(ckpt, x, use_reentrant=False).sum().backward(), ckpt, x)
    assert any(e.phase is Phase.RECOMPUTE for e in t_ckpt.events)
    # Without checkpoint the forward keeps the (64, 256) linear output and GELU input: 2 * 64 KiB.
    assert t_plain.by_category(at=_end_of_forward(t_plain))["activation"] >= 2 * 64 * 256 * 4
    assert "activation" not in t_ckpt.by_category(at=_end_of_forward(t_ckpt))


def _end_of_forward(tracer):
    return min(e.index for e in tracer.events if e.phase is Phase.BACKWARD) - 1


def test_custom_function_saved_input_is_an_activation():
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return 2 * grad * x

    w = torch.empty(32, device=META, requires_grad=True)
    kept = []
    tracer = traced(lambda: kept.append(Square.apply(w + 1)), w)
    # w + 1 is saved by the Function (activation); its output x * x is kept (temporary)
    assert tracer.by_category(at="now") == {"input": 128, "activation": 128, "temporary": 128}


def test_reentering_continues_one_timeline_across_microbatches():
    model = nn.Linear(64, 64).to(META)
    tracer = MemoryTracer()
    tracer.track_external(model)
    for _ in range(3):
        with tracer:
            model(torch.empty(8, 64, device=META)).sum().backward()
    # gradients are allocated once and accumulated in place afterwards
    assert tracer.by_category(at="now") == {"parameter": (64 * 64 + 64) * 4,
                                            "gradient": (64 * 64 + 64) * 4}
    assert tracer.baseline_bytes == (64 * 64 + 64) * 4


def test_queries_reject_an_unknown_point():
    tracer = traced(lambda: None, torch.empty(2, device=META))
    with pytest.raises(TracememError, match=r"at='start' is invalid; use 'peak', 'now'"):
        tracer.by_category(at="start")
    with pytest.raises(TracememError, match="at=5 is invalid"):
        tracer.live_at(5)


def test_track_external_rejects_other_objects():
    with pytest.raises(TracememError, match="track_external got an object of type str"):
        MemoryTracer().track_external("model.pt")


def test_devices_accepts_a_name_or_names_and_rejects_unknown_ones():
    assert MemoryTracer(devices="meta").devices == {"meta"}
    assert MemoryTracer(devices=["cuda:0", "cpu"]).devices == {"cuda", "cpu"}
    with pytest.raises(TracememError, match="devices: 'gpu' is not a device type"):
        MemoryTracer(devices=["gpu"])


def test_missing_meta_kernel_names_the_op_and_how_to_register_one():
    lib = torch.library.Library("tracemem_test", "FRAGMENT")
    lib.define("mystery(Tensor x) -> Tensor")
    lib.impl("mystery", lambda x: x.clone(), "CPU")
    x = torch.empty(4, device=META)
    with pytest.raises(MissingMetaKernelError,
                       match=r'tracemem_test::mystery has no meta kernel(.|\n)*'
                             r'register_fake\("tracemem_test::mystery"\)'):
        traced(lambda: torch.ops.tracemem_test.mystery(x), x)

    torch.library.register_fake("tracemem_test::mystery", lambda x: torch.empty_like(x), lib=lib)
    tracer = traced(lambda: torch.ops.tracemem_test.mystery(x), x)
    assert tracer.peak_bytes == 32


def test_event_fields_describe_the_storage():
    x = torch.empty(3, 5, device=META, dtype=torch.bfloat16)
    kept = []
    tracer = traced(lambda: kept.append(F.relu(x)), x)
    event = tracer.events[-1]
    assert (event.action, event.nbytes, event.total_bytes) == ("alloc", 30, 60)
    assert (event.dtype, event.shape, event.device) == (torch.bfloat16, (3, 5), "meta")
    assert (event.category, event.phase, event.op) == (Category.TEMPORARY, Phase.FORWARD,
                                                       "aten::relu")


# --------------------------------------------------------------------------- lifetimes
# A tracer must never change what it measures: no tensor may live longer because it is
# watched (issue 9, item 1). The real run's live set is checked against these in
# tests/tracemem/test_proof.py (case "saved_output_node_never_runs").

def test_saved_output_whose_node_never_runs_dies_with_the_graph():
    # Issue 9's input: amax saves its output for backward, but its output feeds only topk's
    # indices, so AmaxBackward never runs. Run for real on CPU, after three steps only x.grad
    # is left: 4096 * 160 float32 = 2,621,440 B (and x itself, the input).
    x = torch.ones(4096, 160, device=META, requires_grad=True)
    tracer = MemoryTracer()
    tracer.track_external(x)
    for _ in range(3):
        with tracer:
            m = x.amax(dim=-1)
            idx = m.topk(2)[1]
            x.sum().backward()
            del m, idx
    assert [i.shape for i in tracer.live_at("now") if i.op == "aten::amax"] == []
    assert tracer.by_category(at="now") == {"input": 2_621_440, "gradient": 2_621_440}
    assert tracer.current_bytes == 2 * 4096 * 160 * 4


def test_saved_tensors_unpack_to_the_same_values_and_grads():
    # The pack hook saves a detached alias; backward must still see the saved output and
    # input (exp saves its output, mul its inputs, a custom Function what it is given).
    x = torch.linspace(-1, 1, 6, requires_grad=True)
    expected = torch.autograd.grad((x.exp() * x).sum(), x)[0]
    tracer = traced(lambda: None, x)
    with tracer:
        got = torch.autograd.grad((x.exp() * x).sum(), x)[0]
    assert torch.equal(got, expected)  # d/dx (x e^x) = (1 + x) e^x


def test_v2_router_stage_peak_does_not_grow_with_the_number_of_microbatches():
    # Issue 9: with DeepSeek-V2's router (softmax scores, group-limited top-k: groups ranked
    # by amax, whose output feeds only topk's indices) each microbatch's AmaxBackward saved
    # output leaked, so the last stage's peak grew with M. Under 1F1B a PP2 stage holds at
    # most 2 microbatches, so its peak is the same for every M >= 2 (as it is with V3's
    # router); measured before the fix: 6,168,544 B at M = 4 and 7,704,544 B at M = 64.
    import dataclasses

    import tracemem
    from modeling import load_config

    v2_router = dataclasses.replace(
        load_config("deepseek-tiny"), name="deepseek-tiny-v2-router", scoring_func="softmax",
        topk_method="group_limited_greedy", routed_scaling_factor=1.0)
    peaks = [tracemem.estimate(v2_router, world_size=2, pp=2, micro_batch_size=1,
                               seq_length=64, num_microbatches=m).ranks[1].peak_bytes
             for m in (4, 64)]
    assert peaks[0] == peaks[1]


# --------------------------------------------------------------------------- values on meta
# Meta tensors have shapes and no values. Ops that need values end in one line naming the op,
# the module path that ran it and the way out (issue 9, item 6). Reference: the ops' meta
# behaviour in torch 2.13 (torch/_meta_registrations.py; Tensor.item() on meta raises in
# aten::_local_scalar_dense).

class _Router(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return self.body(x)


def _in_module(body):
    model = nn.ModuleDict({"router": nn.ModuleDict({"gate": _Router(body)})})
    return model, lambda x: model["router"]["gate"](x)


_SHAPE_STATIC = r"make the shape static: take the counts from a routing model"
_BRANCH_STATIC = r"decide the branch from the config or a routing model"


def _any_branch(x):
    mask = x > 0
    if (mask == 0).any():
        return x + 1
    return x


@pytest.mark.parametrize("body, op, needs, way_out", [
    (_any_branch, "aten::_local_scalar_dense", r"if \(mask == 0\)\.any\(\):", _BRANCH_STATIC),
    (lambda x: x * x.sum().item(), "aten::_local_scalar_dense", r"Tensor\.item\(\)",
     _BRANCH_STATIC),
    (lambda x: x.nonzero(), "aten::nonzero", "shape depends on tensor values", _SHAPE_STATIC),
    (lambda x: x.masked_select(x > 0), "aten::masked_select", "depends on the mask's values",
     _SHAPE_STATIC),
    (lambda x: x[x > 0], "aten::index", r"boolean mask \(t\[mask\]\)", _SHAPE_STATIC),
    (lambda x: x.tolist(), "aten::_to_copy", r"\.tolist\(\)",
     "keep the values that decide shapes in Python"),
])
def test_data_dependent_ops_name_the_op_the_module_and_the_way_out(body, op, needs, way_out):
    x = torch.empty(4, 8, device=META)
    model, step = _in_module(body)
    with pytest.raises(DataDependentOpError,
                       match=rf"^operator {op} in module 'router\.gate' .*{needs}.*; meta "
                             rf"tensors have no values, so .*{way_out}"):
        traced(lambda: step(x), model, x)
    with pytest.raises(DataDependentOpError) as info:
        traced(lambda: step(x), model, x)
    assert "\n" not in str(info.value)
    assert "register_fake" in str(info.value) or "routing model" in str(info.value)


def test_data_dependent_op_outside_modules_and_in_backward_is_located():
    x = torch.empty(4, device=META)
    with pytest.raises(DataDependentOpError, match=r"aten::nonzero at the top level"):
        traced(lambda: x.nonzero(), x)

    class ItemInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * grad.sum().item()

    lin = nn.Linear(4, 4).to(META)
    model = nn.Sequential(lin, _Router(ItemInBackward.apply)).to(META)
    with pytest.raises(DataDependentOpError,
                       match=r"aten::_local_scalar_dense in module '1' reads"):
        traced(lambda: model(torch.empty(2, 4, device=META)).sum().backward(), model)


def test_fused_adam_on_meta_names_the_optimizer_and_foreach():
    model = nn.Sequential(nn.Linear(4, 4)).to(META)
    opt = torch.optim.Adam(model.parameters(), fused=True)

    def step():
        model(torch.empty(2, 4, device=META)).sum().backward()
        opt.step()

    with pytest.raises(FusedOptimizerError,
                       match=r"^torch\.optim\.Adam\(fused=True\) cannot step parameters \(first "
                             r"of module '0'\) on the meta device .*foreach=True\), which keeps "
                             r"the same states$"):
        traced(step, model, opt)
    foreach = torch.optim.Adam(model.parameters(), foreach=True)

    def step_foreach():
        model(torch.empty(2, 4, device=META)).sum().backward()
        foreach.step()

    # (16 + 4) floats * 4 B of exp_avg and exp_avg_sq, two CPU float32 steps of 4 B
    tracer = traced(step_foreach, model, foreach)
    assert tracer.by_category(at="now")["optimizer_state"] == 2 * 20 * 4 + 2 * 4


def test_data_dependent_op_reached_from_the_cli_is_one_line_and_exit_2(capfd, monkeypatch):
    # `tracemem validate` traces a case on meta after its real CPU run: a case whose model
    # branches on values runs on CPU and stops on meta with the one-line error.
    from tracemem.cli import main
    from tracemem.validation import cases

    def build(device):
        model = _Router(_any_branch).to(device)
        x = torch.randn(4, 8).to(device)
        return cases.Setup(lambda: model(x), (model, x))

    monkeypatch.setattr(cases, "CASES", (cases.Case("branchy", build, "branches on values"),))
    assert main(["validate", "--case", "branchy"]) == 2
    out, err = capfd.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert err.startswith("tracemem: error: operator aten::_local_scalar_dense in the root "
                          "module reads a tensor's value")
