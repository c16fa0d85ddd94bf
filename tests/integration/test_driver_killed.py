"""A `run` driver killed with SIGKILL leaves none of the local Ray it started running.

The raylet exits when its driver dies, but the agents it started (``ray::DashboardAgent``,
``ray::RuntimeEnvAgent``) were re-parented to init and ran on, one set per killed run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raytrain_ckpt.checkpoint.datapath.buffers import shm_dir, sweep_orphans

pytestmark = pytest.mark.integration

if not os.path.isdir("/proc"):
    pytest.skip("needs Linux /proc", allow_module_level=True)


def _stat(entry: str) -> list[str] | None:
    try:
        with open(f"/proc/{entry}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _ray_sessions(driver: int) -> set[int]:
    """The sessions of the driver and every process below it: the local Ray starts its processes
    in sessions of their own (so a signal to the driver's process group is the driver's)."""
    parent = {int(e): int(f[1]) for e in os.listdir("/proc") if e.isdigit() and (f := _stat(e)) is not None}
    below, grew = {driver}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in below} - below
        below, grew = below | more, bool(more)
    return {driver} | {int(f[3]) for p in below if (f := _stat(str(p))) is not None}


def _session(sids: set[int]) -> list[str]:
    """Command lines of the live processes in the sessions ``sids``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat(entry)
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if fields is not None and fields[0] != "Z" and int(fields[3]) in sids:
            found.append(f"{entry} {cmd[:120]}")
    return found


def test_a_driver_killed_with_sigkill_leaves_no_ray_process_behind(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("name: killed\nmodel: {name: debug}\ntraining: {steps: 100000, log_every_steps: 1}\n"
                    "resources: {num_workers: 2}\nfault_tolerance: {spare_workers: 0}\n")
    log = tmp_path / "driver.log"
    env = dict(os.environ, RAYTRAIN_CKPT_RESULTS=str(tmp_path / "results"))
    env.pop("RAY_ADDRESS", None)
    with open(log, "w") as out:
        # Its own session: it and the local Ray's processes (each in a session of its own, found
        # below the driver while it runs, the watcher too: it ends once it stopped them) are found by sid.
        driver = subprocess.Popen([sys.executable, "-m", "raytrain_ckpt", "run", str(spec), "--address", "local"],
                                  cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while "step 2/" not in log.read_text(errors="replace"):
            assert driver.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        sessions = _ray_sessions(driver.pid)
        running = _session(sessions)
        assert any("DashboardAgent" in p for p in running), running  # the agents exist, as Ray names them
        time.sleep(3)  # the watcher's list of Ray's processes is refreshed every 2 s
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=10)
        deadline = time.monotonic() + 30
        while _session(sessions) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _session(sessions) == [], _session(sessions)
    finally:
        if driver.poll() is None:
            driver.kill()
        for line in _session(locals().get("sessions", {driver.pid})):  # never leave a stray Ray on a shared machine
            try:
                os.kill(int(line.split()[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass
        # The writer died with its Ray (SIGKILL): its staging buffers are orphans now, which the next
        # writer to start or `raytrain-ckpt clean-buffers` removes; the test removes them as those would.
        sweep_orphans(shm_dir())
