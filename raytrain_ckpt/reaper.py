"""The local Ray a driver started does not outlive the driver.

``ray.init()`` without a cluster starts a GCS, a raylet and their helpers as children of the
driver. When the driver exits they are stopped by ``ray.shutdown()``; when it is killed
(``kill -9``, the OOM killer), the raylet notices and exits, but the agents it started
(``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) are re-parented to init and run on, holding
ports and memory, one set per killed run.

``start(pids)`` launches a small watcher process in its own session (so a signal to the
driver's process group does not take it down first). It keeps a list of the local Ray's
processes (the ones Ray started and their descendants, each known by pid and start time, so a
recycled pid is never signalled), refreshed every ``REFRESH_S``. Once the driver is gone it
gives them ``GRACE_S`` to exit on their own, then SIGTERM, then SIGKILL. ``stop()`` ends the
watcher after a normal ``ray.shutdown()``; nothing is signalled then.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

REFRESH_S = 2.0
GRACE_S = 3.0
KILL_AFTER_S = 5.0

_watcher: subprocess.Popen | None = None


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _descendants(roots: set[int]) -> set[int]:
    tree, seen, todo = _children(), set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(tree.get(pid, ()))
    return seen


def _alive(known: dict[int, int]) -> dict[int, int]:
    return {pid: start for pid, start in known.items() if _start_time(pid) == start}


def _signal_all(known: dict[int, int], sig: signal.Signals) -> None:
    for pid in _alive(known):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def watch(driver: int, roots: set[int]) -> None:
    """The watcher's loop: ``driver``'s pid, ``roots`` the pids of the Ray processes it started."""
    driver_start = _start_time(driver)
    known: dict[int, int] = {}
    while _start_time(driver) == driver_start and driver_start is not None:
        known = _alive(known)
        for pid in _descendants(roots):
            start = _start_time(pid)
            if start is not None:
                known.setdefault(pid, start)
        time.sleep(REFRESH_S)
    deadline = time.monotonic() + GRACE_S
    while _alive(known) and time.monotonic() < deadline:
        time.sleep(0.2)
    _signal_all(known, signal.SIGTERM)
    deadline = time.monotonic() + KILL_AFTER_S
    while _alive(known) and time.monotonic() < deadline:
        time.sleep(0.2)
    _signal_all(known, signal.SIGKILL)


def start(roots: set[int]) -> None:
    """Watch the local Ray whose processes are ``roots`` on behalf of this process (Linux only)."""
    global _watcher
    if not os.path.isdir("/proc") or not roots:
        return
    _watcher = subprocess.Popen(
        [sys.executable, "-m", "raytrain_ckpt.reaper", str(os.getpid()), *map(str, sorted(roots))],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True)


def stop() -> None:
    """End the watcher: the local Ray was shut down in order."""
    global _watcher
    if _watcher is not None:
        _watcher.kill()
        _watcher.wait()
        _watcher = None


def local_ray_pids() -> set[int]:
    """The pids of the processes the local Ray node of this driver started (GCS, raylet, ...)."""
    from ray._private import worker

    node = getattr(worker, "_global_node", None)
    pids: set[int] = set()
    for infos in (getattr(node, "all_processes", None) or {}).values():
        for info in infos:
            process = getattr(info, "process", None)
            if process is not None and getattr(process, "pid", None):
                pids.add(process.pid)
    return pids


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the terminal is the driver's
    watch(int(sys.argv[1]), {int(a) for a in sys.argv[2:]})
