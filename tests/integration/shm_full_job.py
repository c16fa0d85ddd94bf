"""Run by test_shm_full.py in its own process, inside a private mount namespace where the
staging directory (``RAYTRAIN_CKPT_SHM_DIR``) is a 1 MiB tmpfs: no rank's staging buffer fits.
Prints one JSON line with what happened."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # tests.conftest, and this checkout's package
os.environ["PYTHONPATH"] = str(REPO)  # inherited by the cluster's processes (see driver._init_ray)
from tests.conftest import ray_tmpdir  # noqa: E402

os.environ["RAY_TMPDIR"] = ray_tmpdir()  # removed when this run exits
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ.pop("RAY_ADDRESS", None)

import ray  # noqa: E402

from raytrain_ckpt.control.driver import run_job  # noqa: E402
from raytrain_ckpt.control.preflight import load_spec  # noqa: E402


def main(ckpt_dir: str, shm_dir: str) -> None:
    os.environ["RAYTRAIN_CKPT_SHM_DIR"] = shm_dir  # before Ray starts: every writer inherits it
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    spec = load_spec(REPO / "jobs" / "llama_debug_fsdp.yaml", [
        "training.steps=10", "lr_scheduler.warmup_steps=2", f"checkpoint.dir={ckpt_dir}",
        "checkpoint.enabled=true", "checkpoint.interval_steps=5", "fault_tolerance.max_restarts=0"])
    r = run_job(spec)
    print(json.dumps({
        "state": r.state.value, "error": r.error, "committed": (r.checkpoints or {}).get("committed"),
        "failed": {str(k): v for k, v in ((r.checkpoints or {}).get("failed") or {}).items()},
        "steps": [x.steps for x in r.results], "checkpoints": r.checkpoints,
    }, default=str))
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
