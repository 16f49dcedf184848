"""``tracemem fit`` on DeepSeek-V3 over 1,024 GPUs: a sweep of 120 layouts (TP 1-2, EP 4-64,
PP 16 with DeepSeek's 4 / 1 end stages, every recompute mode, ZeRO 1-2, 1F1B and GPipe) on
this machine's cores, with the trace-reuse ratio; then the same sweep as Ray tasks on a local
Ray instance (started here, as many CPUs as local workers), and the ratio of the two wall
times (Ray's overhead). The rows of both runs are compared: they must be equal.

    .venv/bin/python benchmarks/fit_sweep.py [--workers N] [--skip-ray]
"""

from __future__ import annotations

import argparse
import os
import resource
import time

from tracemem.fit import SearchSpace, fit

SPACE = SearchSpace(tp=(1, 2), ep=(4, 8, 16, 32, 64), pp=(16,),
                    recompute=("none", "selective", "full"), zero=(1, 2),
                    schedule=("1f1b", "gpipe"))
JOB = dict(world_size=1024, hbm="80GiB", seq_length=4096, global_batch_size=1024,
           space=SPACE)


def figures(result):
    return [{k: v for k, v in r.as_dict().items() if not k.startswith("traces_")}
            for r in result.rows + result.closest]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--skip-ray", action="store_true")
    args = parser.parse_args()
    def cpu() -> float:  # this process and its finished worker processes, user + system
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    start, cpu0 = time.perf_counter(), cpu()
    local = fit("deepseek-v3", workers=args.workers, **JOB)
    local_s, local_cpu = time.perf_counter() - start, cpu() - cpu0
    t = local.traces
    asked = t["computed"] + t["reused"] + t["loaded"]
    print(f"local, {local.workers} workers: {len(local.rows)} layouts ({len(local.fitting)} fit) "
          f"+ {len(local.closest)} closest in full: {local_s:.1f} s; rank-class traces "
          f"{asked} needed, {t['computed']} computed, {t['reused']} reused "
          f"({t['reused'] / asked:.0%}); {local_cpu:.1f} CPU s ({local_cpu / args.workers:.1f} "
          f"s on {args.workers} idle cores); load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    if args.skip_ray:
        return
    import ray

    start = time.perf_counter()
    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    started_s = time.perf_counter() - start
    remote = fit("deepseek-v3", engine="ray", **JOB)
    ray_s = time.perf_counter() - start
    ray.shutdown()
    assert figures(remote) == figures(local), "the Ray engine's rows differ"
    t = remote.traces
    print(f"ray, local instance of {args.workers} CPUs: {ray_s:.1f} s ({started_s:.1f} s of "
          f"it starting Ray); {t['computed']} traces computed, {t['reused']} reused; "
          f"overhead ratio ray / local = {ray_s / local_s:.2f}; rows equal")


if __name__ == "__main__":
    main()
