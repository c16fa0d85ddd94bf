"""`status --job NAME` from a second process of the same user, against the local Ray that `run`
started (token authentication on by default, the token file made by that Ray), with no
--address, with the GCS address and with `auto`: each names the cluster it used.

Everything is private to the test: HOME (so the token file is the test's own), the Ray temp dir,
the job records; the Ray is the one the driver started, stopped with it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raytrain_ckpt.common.faults import ENV_VAR
from tests.conftest import ray_tmpdir

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
JOB = "status-address"


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
    (tmp / "home").mkdir(exist_ok=True)
    return env | {"HOME": str(tmp / "home"), "XDG_STATE_HOME": str(tmp / "state"), "RAY_TMPDIR": ray_tmpdir("rtc-sa-"),
                  "PYTHONPATH": str(REPO)}


def _status(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "raytrain_ckpt", "status", "--job", JOB, *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_status_of_a_local_run_from_a_second_process_uses_its_cluster_and_token(tmp_path):
    env = _env(tmp_path)
    faults = ";".join(f"slow@step:rank=0,step={s}" for s in range(3, 30))  # keeps it running while we look
    driver = subprocess.Popen(
        [sys.executable, "-m", "raytrain_ckpt", "run", "jobs/llama_debug_fsdp.yaml", "--address", "local",
         "--set", f"name={JOB}", "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", "--set", "training.steps=30",
         "--set", "checkpoint.interval_steps=2"],
        cwd=REPO, env=env | {ENV_VAR: faults}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        record = tmp_path / "state" / "raytrain_ckpt" / "jobs" / f"{JOB}.json"
        deadline = time.monotonic() + 240
        shown = None
        while time.monotonic() < deadline and driver.poll() is None:
            if record.exists():
                shown = _status(env)
                if shown.returncode == 0 and "RUNNING" in shown.stdout:
                    break
            time.sleep(1)
        assert shown is not None and shown.returncode == 0, (shown and shown.stderr, driver.poll())
        assert (tmp_path / "home" / ".ray" / "auth_token").is_file()     # the run's Ray made it: token auth on
        gcs = json.loads(record.read_text())["ray_address"]
        assert gcs and f"cluster: the job's record ({gcs})" in shown.stdout, shown.stdout
        by_gcs = _status(env, "--address", gcs)
        assert by_gcs.returncode == 0 and f"cluster: {gcs}\n" in by_gcs.stdout, by_gcs.stdout + by_gcs.stderr
        by_auto = _status(env, "--address", "auto")
        assert by_auto.returncode == 0 and f"cluster: the job's record ({gcs})" in by_auto.stdout, by_auto.stderr
    finally:
        if driver.poll() is None:
            driver.terminate()  # SIGTERM: the driver saves, stops and takes its local Ray down
        out, err = driver.communicate(timeout=180)
    assert driver.returncode == 143, err[-3000:]
