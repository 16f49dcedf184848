"""``tracemem fit --engine ray`` on a local Ray instance that the test starts (Ray's
``ray.init()`` with no address): the same rows as the local engine, in the same order."""

from __future__ import annotations

import pytest

from tracemem.fit import SearchSpace, fit

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install "
                                        "'tracemem[ray]'; make test installs it)")


def test_ray_engine_matches_local():
    space = SearchSpace(tp=(1, 2), ep=(2,), pp=(2,), recompute=("none",), zero=(1, 2))
    job = dict(world_size=4, hbm="1GiB", seq_length=64, global_batch_size=4, space=space,
               kernels="eager", non_pytorch_memory="1000MiB", closest=1)
    local = fit("deepseek-tiny", workers=1, **job)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        remote = fit("deepseek-tiny", engine="ray", **job)
    finally:
        ray.shutdown()
    assert remote.engine == "ray"
    def figures(rows):  # which worker traced first is the engine's business
        return [{k: v for k, v in r.as_dict().items() if not k.startswith("traces_")}
                for r in rows]

    assert figures(remote.rows) == figures(local.rows)
    assert figures(remote.closest) == figures(local.closest)
    # 4 layouts x 2 stages; ZeRO 1 and 2 of one TP share their traces (one family, one
    # worker): 4 traced, 4 reused, in the first pass
    assert [r.traces_computed for r in remote.rows] == [r.traces_computed for r in local.rows]
    assert sum(r.traces_computed for r in local.rows) == 4
