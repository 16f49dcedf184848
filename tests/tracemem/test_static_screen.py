"""The screen before tracing (issue 27 item 3): a rank class's static memory, from its model
built on meta without tracing (``static_floors``), is the very ``StaticMemory`` the traced
class gets, so its device bytes are where every replay starts: a lower bound of the peak. A
job whose static memory alone is over ``--hbm`` is rejected with no trace at all."""

import pytest

from tracemem.estimator import (
    TraceCache,
    estimate,
    floor_bytes,
    rank_classes,
    static_floors,
    trace_classes,
)
from tracemem.job import Job

JOBS = [
    dict(model="deepseek-tiny", world_size=8, tp=2, sp=True, pp=2, ep=2, zero=1),
    dict(model="deepseek-tiny", world_size=8, tp=2, sp=True, pp=2, ep=2, zero=3),
    dict(model="deepseek-tiny", world_size=4, pp=2, zero=2, gpu="H100"),
    dict(model="llama-tiny", world_size=4, pp=2, zero=3, precision="fsdp2", kernels="torch"),
    dict(model="deepseek-tiny", world_size=4, pp=2, zero=1, optimizer_cpu_offload=True,
         optimizer_offload_fraction=0.5, use_precision_aware_optimizer=True),
    dict(model="deepseek-tiny", world_size=4, pp=2, schedule="dualpipe", zero=1, ema="host"),
]


@pytest.mark.parametrize("fields", JOBS, ids=range(len(JOBS)))
def test_static_floor_is_the_traced_static_memory(fields):
    fields = dict(fields)
    job = Job.create(fields.pop("model"), micro_batch_size=1, seq_length=16,
                     num_microbatches=4, **fields)
    classes, cache = rank_classes(job), TraceCache()
    floors = static_floors(job, classes, cache)
    assert cache.computed == 0  # built, not traced
    traced = trace_classes(job, classes, cache)
    assert floors == [t.static for t in traced]


def test_a_job_whose_static_memory_is_over_is_not_traced():
    # deepseek-tiny on 1 GPU, ZeRO-1 over DP 1, Megatron's precision: bf16 parameters, fp32
    # main grads (4 B against 2 B), fp32 master weights and Adam moments (12 B a dense or
    # expert parameter); 1 MiB cannot hold it, so nothing is traced and every row is its floor
    job = Job.create("deepseek-tiny", world_size=1, micro_batch_size=1, seq_length=16,
                     num_microbatches=2, hbm="1MiB", non_pytorch_memory="0")
    cache = TraceCache()
    result = estimate(job, trace_cache=cache, screen=True)
    assert result.screened and result.before_tracing and cache.counts()["computed"] == 0
    [row] = result.ranks
    static = row.static
    assert row.peak_bytes == floor_bytes(static) == static.total_bytes
    assert static.grad_bytes == 2 * static.param_bytes
    assert static.optimizer_bytes == 12 * (static.dense_params + static.expert_params)
    assert row.fits is False and row.allocated_peak_bytes == 0
    # the same job, untraced or traced, has the same static memory
    full = estimate(job)
    assert full.ranks[0].static == static and not full.screened
