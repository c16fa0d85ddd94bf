"""The local Ray a driver started does not outlive the driver.

``ray.init()`` without a cluster starts a GCS, a raylet and their helpers as children of the
driver. When the driver exits they are stopped by ``ray.shutdown()``; when it is killed
(``kill -9``, the OOM killer), the raylet notices and exits, but the agents it started
(``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) are re-parented to init and run on, holding
ports and memory, one set per killed run.

``start(pids)`` launches a small watcher process in its own session (so a signal to the
driver's process group does not take it down first). A process is known by its pid and its
start time (field 22 of ``/proc/PID/stat``), taken once, before it is ever signalled: the
driver and the Ray processes it started are named that way on the watcher's command line, taken
by the driver itself, and a descendant is recorded with the start time read in the same read of
``/proc`` that showed its parent. A root whose pid now shows another start time has exited and
its pid was recycled: neither it nor its children are ever added again. The list is refreshed
every ``REFRESH_S``. Once the driver is gone the watcher gives the known processes ``GRACE_S``
to exit on their own, then SIGTERM, then SIGKILL, each through a pidfd checked against the
recorded start time after it was opened, so the process signalled is the process recorded; a
process it may not signal (another user's) is skipped, never the end of the watcher. ``stop()``
ends the watcher after a normal ``ray.shutdown()``; nothing is signalled then.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

REFRESH_S = 2.0
GRACE_S = 3.0
KILL_AFTER_S = 5.0

_watcher: subprocess.Popen | None = None


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks since boot) of a live process, from one read of
    /proc/PID/stat (fields 4 and 22), or None (gone, or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return None if fields[0] == "Z" else (int(fields[1]), int(fields[19]))
    except (OSError, IndexError, ValueError):
        return None


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat), or None."""
    stat = _stat(pid)
    return stat[1] if stat is not None else None


def _children() -> dict[int, list[tuple[int, int]]]:
    """Every live process as (pid, start time), by parent pid."""
    tree: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            tree.setdefault(stat[0], []).append((int(entry), stat[1]))
    return tree


def _descendants(roots: dict[int, int]) -> dict[int, int]:
    """The live ``roots`` (pid -> start time; a recycled pid is not one of them) and their
    descendants, each with the start time read with its parent's pid."""
    tree, seen = _children(), {}
    todo = [(pid, start) for pid, start in roots.items() if _start_time(pid) == start]
    while todo:
        pid, start = todo.pop()
        if pid not in seen:
            seen[pid] = start
            todo.extend(tree.get(pid, ()))
    return seen


def _alive(known: dict[int, int]) -> dict[int, int]:
    return {pid: start for pid, start in known.items() if _start_time(pid) == start}


def _signal(pid: int, start: int, sig: signal.Signals) -> None:
    """Signal the process ``pid`` started at ``start``, never another one that took its pid."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # gone (or no pidfd: the start-time check below is all there is)
        return
    try:
        if _start_time(pid) == start:  # the pidfd names the process that has this start time now
            signal.pidfd_send_signal(fd, sig)
    except OSError:  # exited meanwhile, or another user's: skipped, the watcher goes on
        pass
    finally:
        os.close(fd)


def _signal_all(known: dict[int, int], sig: signal.Signals) -> None:
    for pid, start in _alive(known).items():
        _signal(pid, start, sig)


def watch(driver: tuple[int, int], roots: dict[int, int]) -> None:
    """The watcher's loop: ``driver`` the driver's (pid, start time), ``roots`` the Ray processes
    it started (pid -> start time), all taken by the driver before the watcher started."""
    known: dict[int, int] = {}
    while True:  # recorded once before the first look at the driver: one killed at once is seen too
        known = _alive(known)
        for pid, start in _descendants(roots).items():
            known.setdefault(pid, start)
        if _start_time(driver[0]) != driver[1]:
            break
        time.sleep(REFRESH_S)
    deadline = time.monotonic() + GRACE_S
    while _alive(known) and time.monotonic() < deadline:
        time.sleep(0.2)
    _signal_all(known, signal.SIGTERM)
    deadline = time.monotonic() + KILL_AFTER_S
    while _alive(known) and time.monotonic() < deadline:
        time.sleep(0.2)
    _signal_all(known, signal.SIGKILL)


def identities(pids: set[int]) -> dict[int, int]:
    """``pids`` that are alive, each with its start time: the identity it is known by from now on."""
    return {pid: start for pid in pids if (start := _start_time(pid)) is not None}


def _arg(pid: int, start: int) -> str:
    return f"{pid}:{start}"


def _parse(arg: str) -> tuple[int, int]:
    pid, start = arg.split(":")
    return int(pid), int(start)


def start(roots: set[int]) -> None:
    """Watch the local Ray whose processes are ``roots`` on behalf of this process (Linux only)."""
    global _watcher
    if not os.path.isdir("/proc") or not roots:
        return
    me = os.getpid()
    args = [_arg(me, _start_time(me) or 0), *(_arg(p, s) for p, s in sorted(identities(roots).items()))]
    _watcher = subprocess.Popen(
        [sys.executable, "-m", "raytrain_ckpt.control.reaper", *args],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True)


def stop() -> None:
    """End the watcher: the local Ray was shut down in order."""
    global _watcher
    if _watcher is not None:
        _watcher.kill()
        _watcher.wait()
        _watcher = None


@contextlib.contextmanager
def own_session() -> Iterator[None]:
    """While a local Ray starts (``ray.init`` without a cluster): every process Ray starts begins
    a session of its own (``setsid``), so a signal to the driver's process group (what `timeout`
    and a shell's job control send) reaches the driver, whose stop path saves and shuts Ray down
    in order, and not the Ray it depends on. A driver killed outright still takes them down
    (Ray's parent-death signal, then the watcher). Ray starts its processes through
    ``ray._private.services.ConsolePopen``; a Ray without it starts them as it always did."""
    from ray._private import services

    original = getattr(services, "ConsolePopen", None)
    if original is None or not sys.platform.startswith("linux"):
        yield
        return

    def popen(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("start_new_session", True)
        return original(*args, **kwargs)

    services.ConsolePopen = popen
    try:
        yield
    finally:
        services.ConsolePopen = original


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
    watch(_parse(sys.argv[1]), dict(map(_parse, sys.argv[2:])))
