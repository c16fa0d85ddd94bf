"""A staging file system too small for any rank's buffer (a real 1 MiB tmpfs named by
``RAYTRAIN_CKPT_SHM_DIR``, mounted in a private mount namespace: needs root and unshare) fails
every save with the cause named, and training runs to its last step: no rank ever maps memory
that is not backed (before, every rank died of SIGBUS on its first save)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).with_name("shm_full_job.py")


def _isolated(command: str) -> list[str]:
    return ["unshare", "-m", "sh", "-c", command]


@pytest.fixture
def tmpfs_ok(tmp_path) -> None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a private tmpfs")
    probe = subprocess.run(_isolated(f"mount -t tmpfs -o size=1M tmpfs {tmp_path}"), capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a private mount namespace: {probe.stderr.strip()}")


def test_a_full_staging_file_system_fails_the_saves_not_the_training(tmpfs_ok, tmp_path):
    ckpt, shm = tmp_path / "ckpt", tmp_path / "shm"
    ckpt.mkdir()
    shm.mkdir()
    command = f"mount -t tmpfs -o size=1M tmpfs {shm} && exec {sys.executable} {SCRIPT} {ckpt} {shm}"
    out = subprocess.run(_isolated(command), capture_output=True, text=True, timeout=600, cwd=SCRIPT.parents[2])
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert lines, out.stderr[-3000:]
    r = json.loads(lines[-1])
    assert r["steps"] and set(r["steps"]) == {10}, r       # every rank trained to the end: no SIGBUS
    assert not r["committed"], r                            # nothing fits, nothing commits
    assert r["failed"] and all("staging buffer" in why and str(shm) in why for why in r["failed"].values()), r
    assert "SIGBUS" not in out.stderr and "OOM" not in (r["error"] or ""), r
