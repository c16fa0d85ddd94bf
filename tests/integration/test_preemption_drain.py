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

from raytrain_ckpt.faults import ENV_VAR
from tests.conftest import REFERENCE_20

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("preemption_job.py")


def test_drain_of_a_rank_node_resumes_at_the_notice_bit_identical(reference_20_run, tmp_path):
    """25 s notice on the node of a rank, interval 50, max_restarts 0, a replacement node joins."""
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "replace"], capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    r = json.loads(lines[-1])
    ref, run = reference_20_run[0], r["drained"]   # the same job, uninterrupted, on the session's Ray
    assert r["victim"] in r["draining_seen"]                  # Ray's own drain record, raised by the CLI
    assert run["state"] == "SUCCEEDED", run
    assert run["kinds"] == ["preemption"] and run["attempts"] == 2     # no restart spent (max_restarts=0)
    [p] = run["preemptions"]
    assert p["node"] == r["victim"] and p["tier"] == "durable" and p["steps_lost"] == 0
    assert 20 < p["time_left_s"] <= 25
    saved = p["saved_step"]
    assert 7 <= saved < 20 and saved in run["committed"]       # the step in hand: no interval save fell before it
    assert run["start_steps"] == [saved, saved]                 # resumed there: nothing trained twice
    assert sorted(map(int, run["losses"])) == list(range(saved + 1, 21))
    assert run["fingerprints"] == [x.fingerprint for x in ref.results]    # bit-identical to the uninterrupted run
    assert all(v == ref.losses[int(k)] for k, v in run["losses"].items())


def test_a_deadline_too_short_for_a_durable_save_resumes_from_ram_on_a_surviving_node(reference_20_run, tmp_path):
    """12 s notice after a durable save that took 15 s (step 5's write slowed): the RAM tier. The
    step in hand is pushed from the draining node to the surviving one, storage is left as it was,
    and the next attempt loads that step from memory, bit-identical to the uninterrupted run."""
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "ram"], capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    r = json.loads(lines[-1])
    ref, run = reference_20_run[0], r["drained"]
    assert r["victim"] in r["draining_seen"] and run["state"] == "SUCCEEDED", run
    assert run["kinds"] == ["preemption"] and run["attempts"] == 2
    [p] = run["preemptions"]
    assert p["node"] == r["victim"] and p["tier"] == "ram" and p["steps_lost"] == 0, (p, out.stderr[-3000:])
    saved = p["saved_step"]
    assert 5 < saved < 20 and "tier ram" in run["failures"][0] and "held in RAM on nodes not draining" in run["failures"][0]
    # the copy of the draining node's rank went to the surviving node's writer, before the deadline
    assert re.search(rf"rank \d+'s copy of step {saved} pushed from draining node {r['victim'][:12]} to node", out.stderr)
    assert f"resuming from step {saved} held in RAM" in out.stderr
    assert run["start_steps"] == [saved, saved] and run["loaded_from_memory"] == [1.0, 1.0]
    assert sorted(map(int, run["losses"])) == list(range(saved + 1, 21))
    assert run["fingerprints"] == [x.fingerprint for x in ref.results]    # bit-identical to the uninterrupted run
    assert all(v == ref.losses[int(k)] for k, v in run["losses"].items())
    # storage: step 5 was the only committed step at the notice, and stayed byte for byte; the RAM
    # step never reached it
    assert list(r["committed_before"]) == ["step-00000005"]
    assert r["committed_after"]["step-00000005"] == r["committed_before"]["step-00000005"]
    assert f"step-{saved:08d}" not in r["committed_after"] and saved not in run["committed"]


def _cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(REPO), RAY_AUTH_MODE="disabled", RAY_TMPDIR=tempfile.mkdtemp(prefix="rtc-", dir="/tmp"))
    return env


def _run_cli(ckpt: Path, steps: int, faults: str = "") -> subprocess.Popen:
    sets = [*REFERENCE_20, f"training.steps={steps}", f"checkpoint.dir={ckpt}", "fault_tolerance.poll_interval_s=0.2"]
    args = [sys.executable, "-m", "raytrain_ckpt", "run", "jobs/llama_debug_fsdp.yaml", "--address", "local"]
    for s in sets:
        args += ["--set", s]
    return subprocess.Popen(args, cwd=REPO, env=_cli_env() | {ENV_VAR: faults}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_sigterm_to_the_driver_commits_the_step_in_hand_and_a_rerun_resumes_there(tmp_path):
    root = tmp_path / "llama-debug-fsdp"
    # a save every 5 steps; rank 0 pauses 3 s after steps 6, 7 and 8: the signal comes mid-run
    proc = _run_cli(tmp_path, 40, ";".join(f"slow@step:rank=0,step={s}" for s in (6, 7, 8)))
    try:
        deadline = time.monotonic() + 300
        while not (root / "step-00000005").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert (root / "step-00000005").exists(), proc.communicate(timeout=60)[1][-3000:]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    m = re.search(r"stopped: job llama-debug-fsdp: SIGTERM: step (\d+) is committed and safe", err)
    assert m, err[-3000:]
    safe = int(m.group(1))
    assert 5 < safe < 10 and (root / f"step-{safe:08d}" / "manifest.json").exists()   # not the interval save
    rerun = _run_cli(tmp_path, safe + 2)
    out, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err[-3000:]
    assert f"resumed at step {safe}" in out
