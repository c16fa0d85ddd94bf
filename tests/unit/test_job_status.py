"""``status`` at the edges of a job: the job's record after the end, a ``--watch`` that stops by
itself, a training step never shown below the committed one, a failed save's own cause.

Real parts: a CheckpointActor driven as a plain object commits real DCP steps into a real
root; the CLI runs in a subprocess against a port where nothing listens (a cluster that is
gone); a real ``RayTaskError`` (the class Ray raises for a remote call's error) wraps the cause.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raytrain_ckpt.report import jobrecord
from raytrain_ckpt.common.events import cause_text
from tests.unit.test_checkpoint_actor import _save, _single_rank_actor

REPO = Path(__file__).resolve().parents[2]


def _closed_port() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there any more: a cluster that is gone
    return f"127.0.0.1:{port}"


def _cli(*args: str, state: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "XDG_STATE_HOME": str(state), "HOME": str(state)}
    return subprocess.run([sys.executable, "-m", "raytrain_ckpt", "status", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def ended_job(tmp_path: Path) -> dict:
    """A job root with real committed steps 1 and 2 and the record its driver wrote at the end."""
    root = tmp_path / "ckpt" / "edge-job"
    actor = _single_rank_actor(root, k=None)

    async def two() -> dict:
        for step in (1, 2):
            assert await _save(actor, step) == "committed"
        return (await actor.status()).to_dict()

    status = asyncio.run(two())
    state = tmp_path / "state"
    record = jobrecord.started("edge-job", str(root))
    jobrecord.write(root, "edge-job", record)  # as the driver at start: no end yet
    info = {"state": "SUCCEEDED", "attempt": 1, "train_step": None}
    return {"root": root, "state": state, "status": status, "start": record, "info": info}


def _write_end(job: dict, info: dict | None = None, monkeypatch=None) -> dict:
    final = jobrecord.ended(job["start"], job["status"], info or job["info"], None)
    monkeypatch.setenv("XDG_STATE_HOME", str(job["state"]))
    jobrecord.write(job["root"], "edge-job", final)
    return final


def test_a_finished_job_reports_how_it_ended_from_its_record_when_the_cluster_is_gone(ended_job, monkeypatch):
    _write_end(ended_job, monkeypatch=monkeypatch)
    out = _cli("--job", "edge-job", "--address", _closed_port(), "--json", state=ended_job["state"])
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["job"]["state"] == "SUCCEEDED" and data["ended"] and data["source"] == "record"
    assert data["resume_step"] == 2 and [r["step"] for r in data["steps"]] == [1, 2]  # read from the root
    assert data["job"]["train_step"] == 2  # unknown at the end: never shown below the committed step
    assert "is gone" in data["note"] and str(jobrecord.local_path("edge-job")) in data["note"]
    text = _cli("--job", "edge-job", "--address", _closed_port(), state=ended_job["state"])
    assert text.returncode == 0 and "job edge-job: SUCCEEDED " in text.stdout
    assert "last committed step 2" in text.stdout and "Traceback" not in text.stderr


def test_watch_of_an_ended_job_prints_the_final_state_and_exits_0_at_once(ended_job, monkeypatch):
    _write_end(ended_job, monkeypatch=monkeypatch)
    t0 = time.monotonic()
    out = _cli("--job", "edge-job", "--address", _closed_port(), "--watch", "0.2", state=ended_job["state"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("job edge-job: SUCCEEDED") == 1  # one frame, not a minute of stale ones
    assert out.stdout.rstrip().endswith("job edge-job ended: SUCCEEDED; watch stopped")
    assert time.monotonic() - t0 < 30  # (the interpreter's start-up on a loaded box; no GCS retry of a minute)


def test_a_job_whose_driver_recorded_no_end_says_so(ended_job, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(ended_job["state"]))
    jobrecord.write(ended_job["root"], "edge-job", ended_job["start"])  # the driver was killed: only the start
    out = _cli("--job", "edge-job", "--address", _closed_port(), "--watch", state=ended_job["state"])
    assert out.returncode == 0, out.stderr
    assert "job edge-job: STARTING (no end recorded)" in out.stdout and "last committed step 2" in out.stdout
    assert "the job recorded no end" in out.stdout and "watch stopped" in out.stdout


def test_status_of_the_root_names_how_its_job_ended(ended_job, monkeypatch):
    _write_end(ended_job, {"state": "FAILED", "attempt": 2, "train_step": 7}, monkeypatch)
    out = _cli(str(ended_job["root"]), state=ended_job["state"])
    assert out.returncode == 0, out.stderr
    assert "job edge-job: FAILED " in out.stdout and "attempt 2, training step 7, last committed step 2" in out.stdout
    assert "valid of 2" in out.stdout  # the record is not a step


def test_no_cluster_and_no_record_is_one_line_exit_2(tmp_path):
    out = _cli("--job", "never-ran", "--address", _closed_port(), state=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: --job never-ran: cannot reach a Ray cluster")
    assert "raytrain-ckpt status DIR" in out.stderr


def test_watch_keeps_the_last_status_seen_when_the_cluster_goes(tmp_path, monkeypatch):
    from raytrain_ckpt.report.jobstatus import JobView, job_report, job_status

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))  # no record on this machine
    seen = JobView({"job": "j", "root": None, "latest": 4, "world_size": 2, "steps": {}, "failed": {},
                    "inflight": {"step": None, "phase": "idle", "ranks": {}},
                    "job_info": {"state": "RUNNING", "attempt": 0, "train_step": 6}}, "cluster")
    view = job_status("j", _closed_port(), last=seen)
    assert view.source == "last-seen" and view.ended and "is gone" in view.note
    text, data = job_report(view)
    assert text.startswith("job j: RUNNING (no end recorded), attempt 0, training step 6, last committed step 4")


@pytest.mark.parametrize(("train_step", "latest", "shown"), [
    (None, 10, 10),   # before the first poll, after a restart, at the end
    (8, 10, 10),      # the slowest rank's step lags a commit
    (12, 10, 12),
    (None, None, None),
    (3, None, 3),
])
def test_the_training_step_is_never_below_the_committed_step(train_step, latest, shown):
    assert jobrecord.clamped({"state": "RUNNING", "train_step": train_step}, latest)["train_step"] == shown


def test_a_failed_save_names_its_cause_not_rays_wrapper():
    from ray.exceptions import RayTaskError

    cause = PermissionError(13, "Permission denied", "/ckpt/job/.tmp-step-00000010/__0_0.distcp")
    tb = ("Traceback (most recent call last):\n  File \"writer.py\", line 1, in accept\n"
          "PermissionError: [Errno 13] Permission denied: '/ckpt/job/.tmp-step-00000010/__0_0.distcp'")
    wrapped = RayTaskError("CheckpointWriter.accept", tb, cause, proctitle="ray::CheckpointWriter.accept",
                           pid=4242, ip="192.0.2.2", actor_repr="<CheckpointWriter object at 0x7f>")
    for exc in (wrapped, wrapped.as_instanceof_cause()):  # what ray.get raises is the second
        assert "ray::CheckpointWriter.accept()" in str(exc)  # the wrapper this test is about
        assert cause_text(exc) == ("PermissionError: [Errno 13] Permission denied: "
                                   "'/ckpt/job/.tmp-step-00000010/__0_0.distcp'")
    assert cause_text(OSError(28, "No space left on device")) == "[Errno 28] No space left on device"
