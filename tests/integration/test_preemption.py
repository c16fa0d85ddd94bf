"""Preemptions on real Ray: a node drained with the real `ray drain-node` (a multi-node
ray.cluster_utils.Cluster, in a subprocess so it does not share the session's Ray), and a real
SIGTERM to a driver run from the command line. Nothing trained before the notice is lost."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("preemption_job.py")


def test_drain_of_a_rank_node_resumes_at_the_notice_bit_identical(tmp_path):
    """25 s notice on the node of rank 1, interval 50, max_restarts 0, a replacement node joins."""
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "replace"], capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    r = json.loads(lines[-1])
    ref, run = r["reference"], r["drained"]
    assert r["victim"] in r["draining_seen"]                  # Ray's own drain record, raised by the CLI
    assert run["state"] == "SUCCEEDED", run
    assert run["kinds"] == ["preemption"] and run["attempts"] == 2     # no restart spent (max_restarts=0)
    [p] = run["preemptions"]
    assert p["node"] == r["victim"] and p["tier"] == "durable" and p["steps_lost"] == 0
    assert 20 < p["time_left_s"] <= 25
    saved = p["saved_step"]
    assert saved > 50 and saved in run["committed"]             # the step in hand, not the interval save at 50
    assert run["start_steps"] == [saved, saved]                 # resumed there: nothing trained twice
    assert sorted(map(int, run["losses"])) == list(range(saved + 1, r["steps"] + 1))
    assert run["fingerprints"] == ref["fingerprints"]           # bit-identical to the uninterrupted run
    assert all(run["losses"][k] == ref["losses"][k] for k in run["losses"])


def _cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(REPO), RAY_AUTH_MODE="disabled", RAY_TMPDIR=tempfile.mkdtemp(prefix="rtc-", dir="/tmp"))
    return env


def _run_cli(ckpt: Path, steps: int) -> subprocess.Popen:
    sets = [f"training.steps={steps}", f"checkpoint.dir={ckpt}", "checkpoint.interval_steps=20",
            "checkpoint.keep_latest_k=null", "training.log_every_steps=1", "fault_tolerance.max_restarts=0",
            "fault_tolerance.poll_interval_s=0.2"]
    args = [sys.executable, "-m", "raytrain_ckpt", "run", "jobs/llama_debug_fsdp.yaml", "--address", "local"]
    for s in sets:
        args += ["--set", s]
    return subprocess.Popen(args, cwd=REPO, env=_cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigterm_to_the_driver_commits_the_step_in_hand_and_a_rerun_resumes_there(tmp_path):
    root = tmp_path / "llama-debug-fsdp"
    proc = _run_cli(tmp_path, 400)
    try:
        deadline = time.monotonic() + 300
        while not (root / "step-00000020").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert (root / "step-00000020").exists(), proc.communicate(timeout=60)[1][-3000:]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    m = re.search(r"stopped: job llama-debug-fsdp: SIGTERM: step (\d+) is committed and safe", err)
    assert m, err[-3000:]
    safe = int(m.group(1))
    assert 20 < safe < 400 and (root / f"step-{safe:08d}" / "manifest.json").exists()
    rerun = _run_cli(tmp_path, safe + 2)
    out, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err[-3000:]
    assert f"resumed at step {safe}" in out
