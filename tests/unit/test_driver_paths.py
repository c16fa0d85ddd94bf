"""The driver's path for Ray workers (every entry absolute, none empty, each once), and Ray
addresses it cannot join said in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_workers_path_is_the_drivers_with_every_entry_absolute(tmp_path, monkeypatch):
    from raytrain_ckpt.control.driver import _worker_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["src", "", "/opt/site", str(tmp_path), "src"]))
    # a relative entry means the driver's directory; an empty one (the worker's own cwd) is dropped
    assert _worker_path().split(os.pathsep) == [str(tmp_path), str(tmp_path / "src"), "/opt/site"]
    monkeypatch.delenv("PYTHONPATH")
    assert _worker_path() == str(tmp_path)


@pytest.mark.parametrize(("args", "env", "expected"), [
    (["--address", "bogus"], {}, "Ray cluster bogus: Invalid address format"),
    (["--address", "127.0.0.1:1"], {}, "nothing answers at 127.0.0.1:1"),
    (["--address", "ray://127.0.0.1:1"], {}, "nothing answers at 127.0.0.1:1"),
    ([], {"RAY_ADDRESS": "garbage"}, "Ray cluster RAY_ADDRESS=garbage"),
    ([], {"RAY_ADDRESS": "127.0.0.1:1"}, "Ray cluster RAY_ADDRESS=127.0.0.1:1: nothing answers"),
], ids=["not_an_address", "nothing_listens", "ray_client_nothing_listens", "env_not_an_address",
        "env_nothing_listens"])
def test_a_ray_address_that_cannot_be_joined_is_one_line_and_exit_2_within_seconds(tmp_path, args, env, expected):
    """Ray's own client raises a traceback for a malformed address and retries one where nothing
    listens for minutes; `run` says which address and how to fix it, at once."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "raytrain_ckpt", "run", str(REPO / "jobs" / "llama_debug_fsdp.yaml"),
                           "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0] and "--address local" in errors[0], proc.stderr[-3000:]
    assert time.monotonic() - started < 60
    assert not (tmp_path / "ckpt").exists()  # nothing created for a run that never started
