"""What recording metrics costs the training loop, per step.

Times ``TrainerMetrics.after_step`` (the call a TrainWorker makes after every step: four
gauges, plus the stall histogram on a save step) inside a Ray worker process, over many
calls. Usage::

    .venv/bin/python bench/metrics_overhead.py --calls 20000
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import ray


@ray.remote(num_cpus=0)
def _time_after_step(calls: int) -> dict[str, float]:
    from raytrain_ckpt.rank.metrics import TrainerMetrics
    from raytrain_ckpt.rank.trainer import StepReport

    m = TrainerMetrics("bench", rank=0)
    report = StepReport(step=1, loss=1.0, step_time_s=0.1, tokens_per_s=1e4, lr=1e-3)
    m.after_step(report, None)  # create the metrics
    t0 = time.perf_counter()
    for i in range(calls):
        m.after_step(StepReport(i, 1.0, 0.1, 1e4, 1e-3), None)
    plain = (time.perf_counter() - t0) / calls
    stats = SimpleNamespace(saves=0, stall_s=0.0, last_stall_s=0.01)
    ckpt = SimpleNamespace(stats=stats)
    t0 = time.perf_counter()
    for i in range(calls):
        stats.saves += 1  # every step a save: the upper bound
        m.after_step(StepReport(i, 1.0, 0.1, 1e4, 1e-3), ckpt)
    return {"step_us": plain * 1e6, "save_step_us": (time.perf_counter() - t0) / calls * 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=20000)
    args = p.parse_args()
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        r = ray.get(_time_after_step.remote(args.calls))
    finally:
        ray.shutdown()
    print(f"TrainerMetrics.after_step: {r['step_us']:.1f} us per step, {r['save_step_us']:.1f} us on a save step "
          f"(mean of {args.calls} calls; the stall note to the CheckpointActor is stubbed out here)")


if __name__ == "__main__":
    main()
