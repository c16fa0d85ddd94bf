"""What a logger whose service is unreachable costs a training step.

Each repetition runs two fresh processes, one after the other, training the same small MLP
(torch, one thread) for ``--steps`` timed steps after ``--warmup``: one logs nothing, the other
logs rank 0's four scalars per step (``train/loss``, ``train/lr``, ``train/tokens_per_s``,
``train/step_time_s``) through the job's loggers, opened as a job opens them
(``loggers.BackgroundLogger``): MLflow with its tracking URI at a closed local port and W&B
online with its base URL at another. Opening them fails (MLflow after its HTTP retries; W&B's
init keeps retrying for its init timeout, 90 s, through the whole run); training never waits on
their thread. The warm-up covers the imports of mlflow and wandb and MLflow's first failure,
which happen once, on the loggers' thread, in the first seconds of an attempt.

Printed: each repetition's median step with and without the loggers (the wall-clock ratio, which
on a shared machine is dominated by its load: it is shown with the load average), and the
figures that do not depend on the load: the step's own CPU (the training thread), the time the
logger calls take on the training thread (all a step waits for by construction: a put into a
bounded queue), the CPU of the other threads in the process (the loggers' and W&B's: the most
GIL time they can take from the training thread) and of W&B's core process (another process: it
takes a core's share only when training fills every core). The bound is (calls + the other
threads' CPU) / the step's CPU. Usage::

    .venv/bin/python bench/logger_overhead.py --reps 2 --steps 150 --warmup 300
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loggers(tmp: str) -> list:
    from raytrain_ckpt.observe.loggers import BackgroundLogger, MlflowLogger, WandbLogger

    mlflow_uri = f"http://127.0.0.1:{_closed_port()}"
    os.environ.update(WANDB_BASE_URL=f"http://127.0.0.1:{_closed_port()}", WANDB_API_KEY="x" * 40,
                      MLFLOW_HTTP_REQUEST_MAX_RETRIES="3")
    return [BackgroundLogger("mlflow", lambda: MlflowLogger("bench", "rtc-bench", "bench", mlflow_uri, ()), 10000, "bench"),
            BackgroundLogger("wandb", lambda: WandbLogger("bench", "rtc-bench", "train", "bench", tmp, "online"),
                             10000, "bench")]


def _descendants_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of ``pid``'s descendant processes (W&B's core), from /proc."""
    stats = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # a process that ended while the table was read
            continue
        stats[int(stat.parent.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    total, frontier = 0.0, {pid}
    while frontier:
        frontier = {p for p, (ppid, _) in stats.items() if ppid in frontier}
        total += sum(stats[p][1] for p in frontier)
    return total


def _child(with_loggers: bool, steps: int, warmup: int, tmp: str) -> None:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU()) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(256, 1024), torch.randn(256, 1024)
    began = time.perf_counter()
    outs = _loggers(tmp) if with_loggers else []
    times, log_s, log_cpu_s = [], 0.0, 0.0
    for step in range(1, warmup + steps + 1):
        if step == warmup + 1:
            warm_s, cpu0 = time.perf_counter() - began, (time.process_time(), time.thread_time(),
                                                          _descendants_cpu_s(os.getpid()))
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        value = loss.item()
        t1, c1 = time.perf_counter(), time.thread_time()
        for out in outs:
            for tag, v in (("train/loss", value), ("train/lr", 1e-3), ("train/tokens_per_s", 1e4),
                           ("train/step_time_s", 0.1)):
                out.scalar(tag, v, step)
        if step > warmup:
            times.append(time.perf_counter() - t0)
            log_s += time.perf_counter() - t1
            log_cpu_s += time.thread_time() - c1
    # CPU beside the training thread in the timed steps: this process's other threads (the
    # loggers', torch's) and its descendants (W&B's core)
    train_cpu_s = time.thread_time() - cpu0[1]
    other_s = (time.process_time() - cpu0[0]) - train_cpu_s
    child_s = _descendants_cpu_s(os.getpid()) - cpu0[2]
    print(json.dumps({"mean_s": statistics.fmean(times), "median_s": statistics.median(times), "warm_s": warm_s,
                      "log_us": log_s / steps * 1e6, "log_cpu_us": log_cpu_s / steps * 1e6, "train_cpu_s": train_cpu_s / steps, "thread_cpu_s": other_s / steps,
                      "child_cpu_s": child_s / steps, "load": os.getloadavg()[0],
                      "dropped": sum(out.dropped for out in outs)}), flush=True)
    os._exit(0)  # the loggers' threads are still retrying the dead services: leave them behind


def _run(with_loggers: bool, args: argparse.Namespace, tmp: str) -> dict:
    cmd = [sys.executable, __file__, "--child", "1" if with_loggers else "0", "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--tmp", tmp]
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_SILENT": "true"}
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--child", choices=["0", "1"])
    p.add_argument("--tmp", default=None)
    args = p.parse_args()
    if args.child is not None:
        _child(args.child == "1", args.steps, args.warmup, args.tmp)
    import tempfile

    tmp = tempfile.mkdtemp(prefix="rtc-logger-bench-")
    ratios, rows, logged_runs = [], [], []
    for rep in range(args.reps):
        os.makedirs(tmp, exist_ok=True)
        try:
            plain, logged = _run(False, args, tmp), _run(True, args, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # W&B's files of the run that just ended
        ratios.append(logged["median_s"] / plain["median_s"] - 1)
        logged_runs.append(logged)
        rows.append(f"  rep {rep}: median step {plain['median_s'] * 1e3:6.1f} ms without, {logged['median_s'] * 1e3:6.1f} ms "
                    f"with ({ratios[-1]:+.1%}; load average {logged['load']:.1f}); {logged['dropped']} points dropped")
    med = {k: statistics.median(r[k] for r in logged_runs) for k in ("log_us", "log_cpu_us", "train_cpu_s", "thread_cpu_s", "child_cpu_s")}
    bound = (med["log_cpu_us"] / 1e6 + med["thread_cpu_s"]) / med["train_cpu_s"]
    print(f"a step with MLflow (tracking URI at a closed port) and W&B online (base URL at a closed port), "
          f"{args.steps} timed steps after {args.warmup}, {args.reps} reps (medians):")
    print("\n".join(rows))
    print(f"  wall: median step slowdown {statistics.median(ratios):+.1%} (min {min(ratios):+.1%}, max {max(ratios):+.1%})")
    print(f"  the step's own CPU (training thread): {med['train_cpu_s'] * 1e3:.1f} ms")
    print(f"  the logger calls on the training thread: {med['log_cpu_us']:.1f} us CPU per step "
          f"({med['log_us']:.1f} us wall, waits for the GIL and the machine's other processes included)")
    print(f"  the other threads in the process (the loggers', W&B's; GIL they can hold): "
          f"{med['thread_cpu_s'] * 1e3:.2f} ms CPU per step")
    print(f"  W&B's core process (another process; a core's share only when the cores are full): "
          f"{med['child_cpu_s'] * 1e3:.2f} ms CPU per step")
    print(f"  bound: (calls' CPU + other threads' CPU) / step CPU = {bound:.2%}")
    print(f"  opening (the first {args.warmup} steps): {statistics.median(r['warm_s'] for r in logged_runs):.1f} s with the "
          f"loggers, their imports and first failed connections on their thread")


if __name__ == "__main__":
    main()
