"""The tracer's remembered meta outputs (``tracemem.tracer._MetaOutputs``) change nothing it
measures: every family's tiny model, under each kernel profile, recompute mode, FP8, ZeRO-3,
CP and split backwards, and the demo's DeepSeek-V3 stages, traced with and without them give
the same events (action, bytes, running total, phase, op, storage id, category, module,
dtype, shape, retained slot) and the same static memory, segment by segment.

Reference: the same tracer with every op running torch's own meta kernel
(``MetaOutputs.cacheable`` off), in the same process.
"""

import pytest
import torch

import tracemem.tracer as tracer_module
from tracemem.estimator import TraceCache, rank_classes, trace_classes
from tracemem.job import Job

STEP = dict(micro_batch_size=1, seq_length=32, num_microbatches=4)
MOE = ["deepseek-tiny", "mixtral-tiny", "qwen2-moe-tiny", "qwen3-moe-tiny"]
DENSE = ["llama-tiny", "qwen2-tiny", "qwen3-tiny", "gpt-tiny"]


def _events(job: Job) -> list:
    out = []
    for traced in trace_classes(job, rank_classes(job), TraceCache()):
        out.append(repr(traced.static))
        for key, events in sorted(traced.segments.events.items()):
            out.append((key, [(e.action, e.nbytes, e.total_bytes, e.phase, e.op, e.storage_id,
                               e.category, e.module, e.dtype, e.shape, e.retain)
                              for e in events]))
    return out


def _same_with_and_without(job: Job, monkeypatch) -> None:
    tracer_module.META_OUTPUTS.outputs.clear()
    first = _events(job)  # remembered as it goes (microbatch 1 repeats microbatch 0's ops)
    hits = tracer_module.META_OUTPUTS.hits
    again = _events(job)  # every op's outputs remembered now
    assert tracer_module.META_OUTPUTS.hits > hits
    with monkeypatch.context() as m:
        m.setattr(tracer_module.META_OUTPUTS, "cacheable", lambda func: False)
        plain = _events(job)
    assert first == plain
    assert again == plain


@pytest.mark.parametrize("preset", DENSE + MOE)
@pytest.mark.parametrize("kernels", ["eager", "torch", "megatron-te"])
def test_every_family_traces_the_same_events(preset, kernels, monkeypatch):
    moe = dict(ep=2) if preset in MOE else {}
    job = Job.create(preset, world_size=8, tp=2, sp=True, pp=2, kernels=kernels, **moe, **STEP)
    _same_with_and_without(job, monkeypatch)


@pytest.mark.parametrize("options", [
    dict(recompute="full"),
    dict(recompute="selective"),
    dict(zero=3),
    dict(cp=2, world_size=8),
    dict(schedule="zb-h1"),
    dict(kernel_options={"fp8_format": "e4m3", "fp8_recipe": "blockwise"}, gpu="H100"),
    dict(kernel_options={"fp8_format": "hybrid", "fp8_recipe": "delayed"}, gpu="H100"),
])
def test_options_trace_the_same_events(options, monkeypatch):
    fields = dict(world_size=4, tp=2, sp=True, pp=2, kernels="megatron-te") | options
    job = Job.create("deepseek-tiny", **(STEP | fields))
    _same_with_and_without(job, monkeypatch)


def test_the_demo_traces_the_same_events(monkeypatch):
    job = Job.create("deepseek-v3", world_size=1024, tp=2, sp=True, pp=16, ep=8, etp=1,
                     pp_first_stage_layers=4, pp_last_stage_layers=1, micro_batch_size=1,
                     seq_length=4096, num_microbatches=16, schedule="1f1b", recompute="none",
                     attention="flash", zero=1, precision="megatron", hbm="80GiB")
    _same_with_and_without(job, monkeypatch)


def test_what_is_not_remembered():
    outputs = tracer_module.META_OUTPUTS
    assert not outputs.cacheable(torch.ops.aten.add_.Tensor)  # mutates
    assert not outputs.cacheable(torch.ops.aten.view.default)  # aliases its input
    assert not outputs.cacheable(torch.ops.aten.nonzero.default)  # data-dependent shape
    assert outputs.cacheable(torch.ops.aten.mm.default)
    x = torch.empty(2, 3, device="meta")
    # a CPU tensor, a Python object, a tensor subclass: no key
    assert outputs.key(torch.ops.aten.mm.default, (torch.Tensor,), (torch.ones(2, 3),), {})[0] \
        is None
    assert outputs.key(torch.ops.aten.mm.default, (torch.Tensor,), (x, object()), {})[0] is None
    assert outputs.key(torch.ops.aten.mm.default, (torch.nn.Parameter,), (x,), {})[0] is None
    # True and 1 are different arguments
    key_true, _ = outputs.key(torch.ops.aten.mm.default, (torch.Tensor,), (x, True), {})
    key_one, _ = outputs.key(torch.ops.aten.mm.default, (torch.Tensor,), (x, 1), {})
    assert key_true != key_one


def test_a_tracer_can_run_every_kernel():
    from tracemem.tracer import MemoryTracer

    def step(remember: bool) -> tuple[list, int]:
        model = torch.nn.Linear(8, 4, device="meta")
        x = torch.empty(2, 8, device="meta")
        tracer = MemoryTracer(remember_meta_outputs=remember)
        tracer.track_external(model, x)
        hits = tracer_module.META_OUTPUTS.hits
        with tracer:
            for _ in range(2):
                model(x).sum().backward()
        return ([(e.action, e.nbytes, e.op, e.category) for e in tracer.events],
                tracer_module.META_OUTPUTS.hits - hits)
    kept, hits = step(True)
    plain, none = step(False)
    assert hits > 0 and none == 0 and kept == plain
