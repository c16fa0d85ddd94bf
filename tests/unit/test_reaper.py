"""The reaper (``control/reaper.py``) signals only the processes it recorded, each known by its pid and
start time taken once: a recycled pid is never signalled, and a process it may not signal never
ends the watcher. Real processes, a real pid recycled in a PID namespace of its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from raytrain_ckpt.control import reaper

REPO = Path(__file__).resolve().parents[2]
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="a PID namespace and another user's processes need root")

_IN_NAMESPACE = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from raytrain_ckpt.control import reaper

    def sleeper():
        return subprocess.Popen(["sleep", "600"])

    driver, root, agent = sleeper(), sleeper(), sleeper()   # agent: a Ray process that stays
    roots = reaper.identities({root.pid, agent.pid})          # taken once, before anything exits
    me = f"{driver.pid}:{reaper._start_time(driver.pid)}"
    watcher = subprocess.Popen([sys.executable, "-m", "raytrain_ckpt.control.reaper", me,
                                *(f"{p}:{s}" for p, s in roots.items())])
    time.sleep(reaper.REFRESH_S + 0.5)
    root.kill(); root.wait()                                  # a Ray root exits ...
    stranger = None
    for _ in range(20):                                       # ... and its pid goes to a stranger
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(root.pid - 1))
        stranger = sleeper()
        if stranger.pid == root.pid:
            break
        stranger.kill(); stranger.wait()
    reused = stranger.pid == root.pid
    time.sleep(2 * reaper.REFRESH_S + 0.5)                    # refreshes that see the stranger at that pid
    driver.kill(); driver.wait()                              # the driver is killed: the watcher acts
    rc = watcher.wait(timeout=120)
    out = {"reused": reused, "watcher_rc": rc, "stranger_alive": stranger.poll() is None,
           "agent_alive": agent.poll() is None}
    for p in (stranger, agent):
        p.kill(); p.wait()
    print(json.dumps(out))
""")


@needs_root
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_a_recycled_pid_of_a_ray_root_is_never_signalled() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(["unshare", "-p", "--fork", "--mount-proc", sys.executable, "-c", _IN_NAMESPACE],
                         env=env, capture_output=True, text=True, timeout=300)
    if run.returncode != 0 and "unshare" in run.stderr and "Operation not permitted" in run.stderr:
        pytest.skip(f"no PID namespace here: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["reused"], "the stranger did not get the recycled pid"
    assert out["watcher_rc"] == 0
    assert out["stranger_alive"], "the reaper signalled a process that took a Ray root's recycled pid"
    assert not out["agent_alive"], "the reaper left a recorded Ray process running"


@needs_root
def test_a_process_the_watcher_may_not_signal_is_skipped_and_the_rest_are_stopped() -> None:
    """A watcher running as another user than one of its processes (here: root's) gets EPERM
    for it; it goes on and stops the processes it may signal."""
    nobody = 65534
    theirs = subprocess.Popen(["sleep", "600"])                # root's: EPERM for the watcher
    mine = subprocess.Popen(["sleep", "600"], user=nobody)
    driver = subprocess.Popen(["sleep", "600"], user=nobody)
    readable = Path(tempfile.mkdtemp(prefix="rtc-reaper-"))
    try:
        roots = reaper.identities({theirs.pid, mine.pid})
        assert min(roots) == theirs.pid                       # signalled first
        args = [f"{driver.pid}:{reaper._start_time(driver.pid)}", *(f"{p}:{s}" for p, s in roots.items())]
        # the watcher module (it imports nothing of the package) where the other user can read it:
        # the checkout may sit under a directory only its owner may enter
        readable.chmod(0o755)
        script = readable / "reaper.py"
        shutil.copyfile(REPO / "raytrain_ckpt" / "control/reaper.py", script)
        script.chmod(0o644)
        watcher = subprocess.Popen(["/usr/bin/python3", str(script), *args], user=nobody,
                                   cwd="/", env={"PATH": "/usr/bin:/bin"}, stderr=subprocess.PIPE, text=True)
        driver.kill()
        driver.wait()
        _, err = watcher.communicate(timeout=120)
        assert watcher.returncode == 0, err
        assert mine.wait(timeout=60) is not None              # stopped
        assert theirs.poll() is None                          # untouched, and the watcher lived on
    finally:
        for p in (theirs, mine, driver):
            p.kill()
            p.wait()
        shutil.rmtree(readable, ignore_errors=True)


def test_identities_are_taken_from_live_processes_only() -> None:
    alive = subprocess.Popen(["sleep", "600"])
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        ids = reaper.identities({alive.pid, gone.pid})
        assert ids == {alive.pid: reaper._start_time(alive.pid)}
    finally:
        alive.kill()
        alive.wait()
