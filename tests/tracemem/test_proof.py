"""The tracer against real execution.

Reference: the CPU allocator itself. Each case is built and run for real on CPU, a loop of
``STEPS`` training steps, under ``torch.profiler.profile(activities=[CPU], profile_memory=True)``;
its allocation events (address and signed size, reported by c10 below the dispatcher) give
the real peak of every step and the set of blocks alive after every step. The same loop is
traced on the meta device. After every step the same storages must be alive (as many of each
size: the allocator knows only sizes), and the bytes left and the peak must agree to the byte,
except for allocations below the dispatcher, which each case names and sizes by hand in
``Case.unseen_bytes`` / ``Case.unseen_cause`` (tracemem/validation/cases.py).
"""

import os

import pytest
import torch

from tracemem import MemoryTracer
from tracemem.validation import CASES, STEPS, compare_case, get_case, trace_case
from tracemem.validation.groundtruth import profile_cpu_step, quiet_stderr, unseen_allocations

# Kernel workspaces below the dispatcher may differ by at most max(256 B, 0.05 %) of the peak.
# The RNG-state stash of torch.utils.checkpoint is not a workspace: it is host memory that
# PyTorch makes outside any op, and its case exists to show that difference, itemised.
ITEMISED_HOST_MEMORY = {"checkpoint_rng_state"}


@pytest.fixture(scope="module", params=CASES, ids=lambda case: case.name)
def comparison(request):
    return compare_case(request.param)


def test_live_storages_after_every_step_equal_the_real_ones(comparison):
    assert len(comparison.steps) == STEPS == 3
    for step in comparison.steps:
        assert step.real.live  # the model, at least
        assert step.live_sets_equal, f"{comparison.case.name}: {step.live_difference()}"


def test_traced_peak_of_every_step_equals_real_cpu_peak_up_to_named_unseen_bytes(comparison):
    case = comparison.case
    for step in comparison.steps:
        assert step.real.peak_bytes > 0
        gap = step.real.peak_bytes - step.traced_peak_bytes
        cause = case.unseen_cause_later if step.index and case.unseen_bytes_later is not None \
            else case.unseen_cause
        assert gap == case.unseen_bytes_at(step.index), (
            f"{case.name} step {step.index}: real {step.real.peak_bytes} B, traced "
            f"{step.traced_peak_bytes} B; expected gap {case.unseen_bytes_at(step.index)} B "
            f"({cause or 'none'})")
    assert comparison.gap_bytes == case.unseen_bytes


def test_unseen_bytes_are_named_and_within_the_workspace_allowance(comparison):
    case = comparison.case
    if case.unseen_bytes:
        assert case.unseen_cause
    if case.unseen_bytes_later is not None:
        assert case.unseen_cause_later
    if case.name not in ITEMISED_HOST_MEMORY:
        for step in comparison.steps:
            assert case.unseen_bytes_at(step.index) <= max(256, 0.0005 * step.real.peak_bytes)


def test_bytes_left_after_every_step_equal_the_real_ones(comparison):
    for step in comparison.steps:
        assert step.traced_end_bytes == step.real.end_bytes


def test_tracing_real_cpu_tensors_gives_the_meta_trace(comparison):
    cpu_tracer, _setup = trace_case(comparison.case, device="cpu", steps=STEPS)
    meta_tracer = comparison.tracer
    assert cpu_tracer.peak_bytes == meta_tracer.peak_bytes
    assert cpu_tracer.by_category() == meta_tracer.by_category()
    def inside(tracer):  # the comparison's meta setup is gone: drop the frees that followed
        return [(e.action, e.nbytes, e.phase) for e in tracer.events if e.phase != "outside"]
    assert inside(cpu_tracer) == inside(meta_tracer)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_once_the_program_lets_go_nothing_traced_is_left(case):
    # Whatever the tracer keeps (records, hooks, Node metadata, finalizers) must not hold a
    # tensor: with the model, optimizer and inputs gone, every storage it saw has died.
    import gc

    tracer, setup = trace_case(case, steps=STEPS)
    assert tracer.current_bytes > 0
    del setup
    gc.collect()  # the hooks case's model is a cycle (a hook bound to its own module)
    assert tracer.current_bytes == 0, tracer.live_at("now")


def test_issue_9_saved_output_leaves_only_x_and_its_gradient():
    # Issue 9: after each step of `m = x.amax(-1); idx = m.topk(2)[1]; x.sum().backward()`
    # the real CPU run holds x and x.grad, 4096 * 160 float32 = 2,621,440 B each; the traced
    # run must hold the same (it held one more (4096,) amax output per step).
    comparison = compare_case(get_case("saved_output_node_never_runs"))
    for step in comparison.steps:
        assert step.real.live == (2_621_440, 2_621_440)
        assert step.traced_live_sizes == (2_621_440, 2_621_440)


def test_the_live_set_invariant_catches_a_tracer_that_keeps_saved_outputs(monkeypatch):
    # The pack hook as it was before issue 9's fix: returning the tensor itself keeps a saved
    # output and its Node in a cycle. The step peaks and the first step's end bytes alone did
    # not show it; the live set after each step does, from the first step on.
    monkeypatch.setattr(MemoryTracer, "_pack_hook", lambda self, t: t)
    for name in ("saved_output_node_never_runs", "group_limited_router"):
        comparison = compare_case(get_case(name))
        assert not any(step.live_sets_equal for step in comparison.steps), name
        assert "aten::amax" in comparison.steps[0].live_difference()


def test_unseen_allocations_are_the_wrapped_scalars_in_the_mlp_case():
    # The tracer and the profiler on the same real CPU step: what the profiler sees and the
    # tracer does not are the scalars PyTorch wraps below the dispatcher (8 B float64 / int64,
    # their 4 B float32 copies), each allocated and freed again.
    torch.manual_seed(0)
    setup = get_case("mlp").build("cpu")
    tracer = MemoryTracer()
    tracer.track_external(*setup.externals)

    def step():
        with tracer:
            setup.step()

    unseen = unseen_allocations(profile_cpu_step(step), tracer)
    assert unseen and set(abs(d) for d in unseen) <= {4, 8} and sum(unseen) == 0


def test_profiling_writes_nothing_on_stderr(capfd):
    # Kineto prints "profiler_start" / "profiler_stop" on file descriptor 2 from C++.
    x = torch.ones(8)
    assert profile_cpu_step(lambda: x * 2).peak_bytes > 0
    assert capfd.readouterr().err == ""


def test_quiet_stderr_restores_fd_2_on_error_and_keeps_what_explains_it(capfd):
    with pytest.raises(RuntimeError, match="boom"):
        with quiet_stderr():
            os.write(2, b"USDT:2026-11-29 17:59:51 1:1 SyncActivityProfilerHandler.cpp:52] "
                        b"profiler_start\nnative detail\n")
            raise RuntimeError("boom")
    os.write(2, b"after\n")
    assert capfd.readouterr().err == "native detail\nafter\n"


def test_validate_cli_prints_the_table_and_nothing_on_stderr(capfd):
    from tracemem.cli import main

    assert main(["validate", "--case", "saved_output_node_never_runs"]) == 0
    out, err = capfd.readouterr()
    assert err == ""
    (row,) = [line for line in out.splitlines() if line.startswith("saved_output")]
    # At x.grad's birth: x.grad 4096 * 160 * 4 B, m = amax (4096,) 16,384 B, topk's int64
    # indices (2,) 16 B, the loss and its incoming gradient 4 B each.
    peak = 2_621_440 + 16_384 + 16 + 4 + 4
    assert row.split()[1:] == [f"{peak:,}", f"{peak:,}", "0", "0", "yes", "yes"]
