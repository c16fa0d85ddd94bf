"""A SIGTERM to the driver's whole process group (what `timeout`, a shell's job control and batch
schedulers send) reaches the driver and not the local Ray it started: the driver's stop path runs,
the step in hand is committed and reported, and no staging buffer of the job is left in shared
memory. A second SIGTERM soon after the first stops the driver at once, and says so."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raytrain_ckpt.common.faults import ENV_VAR
from tests.conftest import REFERENCE_20, ray_tmpdir

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _start(tmp_path: Path, shm: Path) -> subprocess.Popen:
    """`raytrain-ckpt run` of the demo job, 40 steps, a save every 5, rank 0 pausing after steps
    6-8 (the signal comes mid-run), as the leader of a process group of its own."""
    sets = [*REFERENCE_20, "training.steps=40", f"checkpoint.dir={tmp_path}", "fault_tolerance.poll_interval_s=0.2"]
    args = [sys.executable, "-m", "raytrain_ckpt", "run", "jobs/llama_debug_fsdp.yaml", "--address", "local"]
    for s in sets:
        args += ["--set", s]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(REPO), RAY_AUTH_MODE="disabled", RAY_TMPDIR=ray_tmpdir(),
               RAYTRAIN_CKPT_SHM_DIR=str(shm), **{ENV_VAR: ";".join(f"slow@step:rank=0,step={s}" for s in (6, 7, 8))})
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _signal_group_after_first_save(proc: subprocess.Popen, root: Path, *gaps_s: float) -> tuple[str, str]:
    """Once step 5 is committed: SIGTERM to the driver's process group, then again after each gap."""
    try:
        deadline = time.monotonic() + 300
        while not (root / "step-00000005").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert (root / "step-00000005").exists(), proc.communicate(timeout=60)[1][-3000:]
        os.killpg(proc.pid, signal.SIGTERM)
        for gap in gaps_s:
            time.sleep(gap)
            os.killpg(proc.pid, signal.SIGTERM)
        return proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_sigterm_to_the_drivers_process_group_saves_reports_and_frees_staging(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    root = tmp_path / "llama-debug-fsdp"
    proc = _start(tmp_path, shm)
    _, err = _signal_group_after_first_save(proc, root)
    assert proc.returncode == 143, err[-3000:]  # STOPPED by SIGTERM (130 is Ctrl-C's, and a second signal's)
    m = re.search(r"stopped: job llama-debug-fsdp: SIGTERM: step (\d+) is committed and safe", err)
    assert m, err[-3000:]
    safe = int(m.group(1))
    assert safe > 5 and (root / f"step-{safe:08d}" / "manifest.json").exists()  # the step in hand, not the interval save
    assert "GCS" not in err.split("SIGTERM", 1)[1], err[-3000:]  # the cause is the signal, not a lost Ray
    assert sorted(p.name for p in shm.iterdir()) == [], "staging buffers left in shared memory"


def test_a_second_sigterm_to_the_group_stops_the_driver_now_and_says_so(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    proc = _start(tmp_path, shm)
    _, err = _signal_group_after_first_save(proc, tmp_path / "llama-debug-fsdp", 0.3)
    assert proc.returncode == 130, err[-3000:]
    assert "SIGTERM again: stopping now" in err, err[-3000:]
    assert "interrupted: job llama-debug-fsdp stopped" in err, err[-3000:]
    assert (tmp_path / "llama-debug-fsdp" / "step-00000005" / "manifest.json").exists()
