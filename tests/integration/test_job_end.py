"""``status`` across the end of a real job, on a private Ray head that outlives it.

A 12-step job (checkpoints at 5, 10 and the final 12; retention keeps 2) runs from its own driver process while
``status --job --watch`` follows it from another: the watch must stop by itself once the job
ended, with the final state and the last committed step, exit 0. ``status --job`` calls (while
it runs and after) read the job's bulletin without joining the cluster: the Ray Jobs list holds
the job's driver and nothing else. Once the head is gone, ``status --job`` reports how the job
ended from the record its driver left on this machine, and the steps from its root. The job's
name and spec are in its Ray job metadata.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.integration.test_progress import REPO, Head, _env

pytestmark = pytest.mark.integration


def _status(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "raytrain_ckpt", "status", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _jobs(env: dict[str, str]) -> dict[str, dict]:
    """The cluster's job table (what the dashboard's Jobs list shows) with each job's metadata,
    read without joining it (in a process with the head's authentication settings)."""
    code = ("import json, os; from ray._raylet import GcsClient; t = GcsClient(address=os.environ['RAY_ADDRESS'])"
            ".get_all_job_info(skip_submission_job_info_field=True, skip_is_running_tasks_field=True); "
            "print(json.dumps({k.hex(): dict(v.config.metadata) for k, v in t.items()}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _wait_for_status(name: str, env: dict[str, str], driver: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert driver.poll() is None, f"driver exited {driver.returncode}:\n{log.read_text()[-3000:]}"
        out = _status("--job", name, "--json", env=env)
        if out.returncode == 0 and json.loads(out.stdout)["source"] == "cluster":  # the job posted its status
            return
        time.sleep(0.5)
    raise AssertionError(f"the job posted no status:\n{log.read_text()[-3000:]}")


def test_status_across_the_end_of_a_real_job(tmp_path):
    head = Head()
    name, ckpt = f"end-{uuid.uuid4().hex[:6]}", tmp_path / "ckpt"
    env = _env(RAY_ADDRESS=head.address, XDG_STATE_HOME=str(tmp_path / "state"))
    log_path = tmp_path / "driver.log"
    driver = watch = None
    try:
        head.wait_for_gcs()
        with open(log_path, "w") as log:
            driver = subprocess.Popen(
                [sys.executable, "-m", "raytrain_ckpt", "run", "jobs/llama_debug_fsdp.yaml", "--set", f"name={name}",
                 "--set", "training.steps=12", "--set", "checkpoint.interval_steps=5", "--set",
                 f"checkpoint.dir={ckpt}"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
            _wait_for_status(name, env, driver, log_path)
            watch = subprocess.Popen([sys.executable, "-m", "raytrain_ckpt", "status", "--job", name, "--watch", "0.5"],
                                     cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
            running = _status("--job", name, "--json", env=env)
            assert running.returncode == 0, running.stderr
            assert driver.wait(timeout=300) == 0, log_path.read_text()[-3000:]
        t_end = time.monotonic()
        out, err = watch.communicate(timeout=60)
        assert watch.returncode == 0, err
        assert time.monotonic() - t_end < 15, "the watch kept going after the job ended"
        last = out.rstrip().splitlines()
        assert last[-1] == f"job {name} ended: SUCCEEDED; watch stopped", out[-2000:]
        final = next(ln for ln in reversed(last) if ln.startswith(f"job {name}: "))
        assert final.startswith(f"job {name}: SUCCEEDED ") and ", last committed step 12" in final, final
        assert "Failed to connect" not in err and "Traceback" not in err

        after = _status("--job", name, "--json", env=env)  # the cluster lives on: its bulletin says how it ended
        assert after.returncode == 0, after.stderr
        data = json.loads(after.stdout)
        assert data["source"] == "cluster" and data["ended"] and data["job"]["state"] == "SUCCEEDED"
        assert data["resume_step"] == 12 and data["job"]["train_step"] == 12
        assert [r["step"] for r in data["steps"] if r["status"] == "valid"] == [10, 12]  # (retention keeps 2)

        driver_log = log_path.read_text()  # the driver's progress line, as plain log lines (not a terminal)
        assert "raytrain_ckpt.observe.progressline: progress: step " in driver_log and "/12 (" in driver_log
        jobs = _jobs(env)  # the driver's job only: no status call joined the cluster
        assert len(jobs) == 1, jobs
        meta = next(iter(jobs.values()))
        assert meta["job_name"] == name and meta["raytrain_ckpt.steps"] == "12" and meta["raytrain_ckpt.workers"] == "2"
        assert meta["raytrain_ckpt.checkpoint_root"] == f"{ckpt}/{name}"
    finally:
        for proc in (driver, watch):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        head.stop()
    gone = _status("--job", name, "--json", env=env)  # the head is gone: the driver's record and the root
    assert gone.returncode == 0, gone.stderr
    data = json.loads(gone.stdout)
    assert data["source"] == "record" and data["job"]["state"] == "SUCCEEDED" and data["resume_step"] == 12
    assert "is gone" in data["note"]
    offline = _status(str(ckpt / name), env=env)
    assert offline.returncode == 0 and f"job {name}: SUCCEEDED " in offline.stdout, offline.stdout
