"""Wall time of each ``raytrain-ckpt`` command, as a user at a shell sees it (median of 3).

Makes a checkpoint with a 2-step demo job (local Ray, through the Python API), times the
offline commands on it, then starts a longer job and times ``status --job`` against its live
CheckpointActor. Every command runs as a fresh ``python -m raytrain_ckpt`` process. Usage::

    .venv/bin/python bench/cli_latency.py [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "jobs" / "llama_debug_fsdp.yaml")
SHORT = ["lr_scheduler.warmup_steps=1", "resources.cpus_per_worker=1", "fault_tolerance.max_restarts=0"]


def _time(args: list[str], reps: int) -> tuple[float, int]:
    """Median wall seconds of ``raytrain-ckpt ARGS`` and its last exit code."""
    times, rc = [], 0
    for _ in range(reps):
        t0 = time.perf_counter()
        rc = subprocess.run([sys.executable, "-m", "raytrain_ckpt", *args], cwd=REPO, capture_output=True).returncode
        times.append(time.perf_counter() - t0)
    return statistics.median(times), rc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH", "")) if x)
    import ray

    import raytrain_ckpt

    work = Path(tempfile.mkdtemp(prefix="cli-latency-"))
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}})
    result = raytrain_ckpt.run(DEMO, [*SHORT, "training.steps=2", f"checkpoint.dir={work}"])
    assert result.state is raytrain_ckpt.JobState.SUCCEEDED, result.error
    root = work / "llama-debug-fsdp"
    commands = {
        "validate": ["validate", DEMO],
        "ls": ["ls", str(root)],
        "status DIR": ["status", str(root)],
        "verify": ["verify", str(root / "step-00000002")],
        "schema": ["schema"],
    }
    rows = [(name, *_time(cmd, args.reps)) for name, cmd in commands.items()]
    # a live job for `status --job`: long enough to outlast the timing
    live = threading.Thread(target=raytrain_ckpt.run, daemon=True,
                            args=(DEMO, [*SHORT, "training.steps=100000", "name=cli-latency-live",
                                         f"checkpoint.dir={work}"]))
    live.start()
    from raytrain_ckpt.checkpoint.roles.names import NAMESPACE, actor_name

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            ray.get_actor(actor_name("cli-latency-live"), namespace=NAMESPACE)
            break
        except ValueError:
            time.sleep(0.5)
    address = ray.get_runtime_context().gcs_address
    rows.append(("status --job", *_time(["status", "--job", "cli-latency-live", "--address", address], args.reps)))
    print(f"{'command':<14} {'median s':>9}  rc   (median of {args.reps}, fresh process each)")
    for name, seconds, rc in rows:
        print(f"{name:<14} {seconds:>9.2f}  {rc}")
    ray.shutdown()  # stops the local cluster, and with it the live job
    os._exit(0)  # the live job's thread is still unwinding; nothing of it is left to wait for


if __name__ == "__main__":
    main()
