"""Export lease liveness: judged by the reader's own clock from the holder's beat counter, never
by comparing file times written on another machine; heartbeats survive transient errors.
Readers get an injected clock; one test kills a real exporter process."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.checkpoint.storage.leases import LEASE_DIR, FileLease, LeaseFiles
from tests.unit.test_checkpoint_layout import _commit

REPO = Path(__file__).resolve().parents[2]
TTL = 60.0


class Clock:
    """The reader's monotonic clock, advanced by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _write_lease(root: Path, name: str, step: int, beat: int, mtime: float | None = None) -> Path:
    d = root / LEASE_DIR
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.json"
    path.write_text(json.dumps({"step": step, "beat": beat}), encoding="utf-8")
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def _until(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# (reader clock advance before this read, beat in the file at this read, step pinned after the read)
_TABLE = [
    pytest.param([(0, 0, True), (TTL - 1, 0, True), (2, 0, False)], id="no beat for longer than ttl: stale"),
    pytest.param([(0, 0, True), (TTL - 1, 1, True), (TTL - 1, 2, True), (TTL - 1, 3, True)],
                 id="beats keep it live far past ttl"),
    pytest.param([(0, 5, True), (TTL - 1, 6, True), (TTL - 1, 6, True), (2, 6, False)],
                 id="ttl counts from the last change seen"),
    pytest.param([(0, 7, True), (TTL + 5, 7, False)], id="a reader's first sight counts as a beat"),
    pytest.param([(0, 3, True), (TTL + 5, 2, True)], id="any change is a beat (a restarted holder counts down)"),
]


@pytest.mark.parametrize("reads", _TABLE)
def test_liveness_table(tmp_path: Path, reads: list[tuple[float, int, bool]]) -> None:
    clock = Clock()
    reader = LeaseFiles(tmp_path, ttl_s=TTL, clock=clock)
    for advance, beat, pinned in reads:
        clock.t += advance
        path = _write_lease(tmp_path, "export-x", 4, beat)
        assert (reader.leased_steps() == {4}) is pinned
        assert path.exists() is pinned       # a stale lease file is removed


def test_holder_clock_far_behind_does_not_make_a_beating_lease_stale(tmp_path: Path) -> None:
    # The exporter's host clock is an hour behind: its file times are an hour old when written.
    clock = Clock()
    reader = LeaseFiles(tmp_path, ttl_s=TTL, clock=clock)
    for beat in range(3):
        _write_lease(tmp_path, "export-x", 4, beat, mtime=time.time() - 3600)
        assert reader.leased_steps() == {4}
        clock.t += TTL / 2


def test_holder_clock_far_ahead_does_not_pin_a_dead_lease_forever(tmp_path: Path) -> None:
    clock = Clock()
    reader = LeaseFiles(tmp_path, ttl_s=TTL, clock=clock)
    path = _write_lease(tmp_path, "export-x", 4, 9, mtime=time.time() + 3600)
    assert reader.leased_steps() == {4}
    clock.t += TTL + 1
    assert reader.leased_steps() == set() and not path.exists()


def test_leases_are_judged_one_by_one(tmp_path: Path) -> None:
    clock = Clock()
    reader = LeaseFiles(tmp_path, ttl_s=TTL, clock=clock)
    _write_lease(tmp_path, "a", 1, 0)
    _write_lease(tmp_path, "b", 2, 0)
    assert reader.leased_steps() == {1, 2}
    clock.t += TTL + 1
    _write_lease(tmp_path, "b", 2, 1)
    assert reader.leased_steps() == {2}


def test_heartbeat_bumps_the_beat_and_survives_a_transient_error(tmp_path: Path) -> None:
    _commit(CheckpointLayout(tmp_path), 1)
    with FileLease(tmp_path, 1, heartbeat_s=0.01) as lease:
        _until(lambda: lease.beats >= 2, "two heartbeats")
        blocker = lease.path.parent / ".lock"           # the purge lock every beat takes
        blocker.unlink()
        blocker.mkdir()                                  # a real OSError (EISDIR) on every beat while it is there
        _until(lambda: lease.failed_beats >= 1, "a failing beat")
        stuck, failed = lease.beats, lease.failed_beats
        _until(lambda: lease.failed_beats >= failed + 2, "more failing beats")
        assert lease.beats == stuck and json.loads(lease.path.read_text())["beat"] == stuck
        blocker.rmdir()
        _until(lambda: json.loads(lease.path.read_text())["beat"] >= stuck + 2, "beating again after the error")
        assert lease._thread is not None and lease._thread.is_alive()
    assert not lease.path.exists()


def test_heartbeat_ends_when_the_lease_file_is_removed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _commit(CheckpointLayout(tmp_path), 1)
    caplog.set_level(logging.WARNING, logger="raytrain_ckpt.checkpoint.storage.leases")
    with FileLease(tmp_path, 1, heartbeat_s=0.01) as lease:
        lease.path.unlink()                              # what a reader does to a stale lease
        assert lease._thread is not None
        lease._thread.join(timeout=30)
        assert not lease._thread.is_alive() and not lease.path.exists()   # not written back
    assert "no longer protected" in caplog.text


_EXPORTER = """
import sys, threading
from raytrain_ckpt.checkpoint.storage.leases import FileLease
with FileLease(sys.argv[1], 1, heartbeat_s=0.02):
    print("leased", flush=True)
    threading.Event().wait()
"""


def test_a_killed_exporters_lease_stops_pinning_after_ttl_of_the_readers_clock(tmp_path: Path) -> None:
    _commit(CheckpointLayout(tmp_path), 1)
    p = subprocess.Popen([sys.executable, "-c", _EXPORTER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "leased"
        clock = Clock()
        reader = LeaseFiles(tmp_path, ttl_s=TTL, clock=clock)
        (path,) = (tmp_path / LEASE_DIR).glob("*.json")
        for _ in range(3):                               # alive: it pins however far the reader's clock runs
            beat = json.loads(path.read_text())["beat"]
            assert reader.leased_steps() == {1}
            clock.t += TTL + 1
            _until(lambda: json.loads(path.read_text())["beat"] != beat, "the exporter's next beat")
            assert reader.leased_steps() == {1}
        os.utime(path, (time.time() + 3600,) * 2)        # whatever its file time says
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    assert reader.leased_steps() == {1}                  # the last beat seen now starts its ttl
    clock.t += TTL - 1
    assert reader.leased_steps() == {1}
    clock.t += 2
    assert reader.leased_steps() == set() and not path.exists()


HOLD_RUN_LOCK = """
import sys, time
from raytrain_ckpt.checkpoint.storage.runlock import run_lock
with run_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def _hold_run_lock(root: Path) -> subprocess.Popen:
    """Another process holding the run lock of ``root`` (as a running job's driver does)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_RUN_LOCK, str(root)], stdout=subprocess.PIPE, text=True,
                              cwd=REPO)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_run_on_a_job_root_is_refused_until_the_first_dies(tmp_path: Path) -> None:
    from raytrain_ckpt.checkpoint.errors import RootInUse
    from raytrain_ckpt.checkpoint.storage.runlock import run_lock

    root = tmp_path / "job"
    holder = _hold_run_lock(root)
    try:
        with pytest.raises(RootInUse, match=rf"another run of this job is training into {root} \(pid {holder.pid} "):
            with run_lock(root, wait_s=0.3):
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with run_lock(root, wait_s=5.0):              # the kernel dropped the dead holder's lock
        with pytest.raises(RootInUse):            # and this holder excludes others in its own process too
            with run_lock(root, wait_s=0.0):
                pass
    with run_lock(tmp_path / "other-job", wait_s=0.0), run_lock(root, wait_s=0.0):
        pass                                      # released; other roots never contend


def test_a_link_planted_at_the_run_lock_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    """A symbolic or hard link at ``.run.lock`` (to a committed shard, to a user's file) is never
    written through: the run is refused as a usage error naming the file, the target keeps its bytes."""
    from raytrain_ckpt.checkpoint.errors import RootInUse
    from raytrain_ckpt.checkpoint.storage.runlock import RUN_LOCK, run_lock

    victim = tmp_path / "shard.distcp"
    victim.write_bytes(b"committed bytes")
    for kind, plant in (("symbolic link", os.symlink), ("2 names (hard links)", os.link)):
        root = tmp_path / f"job-{kind.split()[0]}"
        root.mkdir()
        plant(victim, root / RUN_LOCK)
        with pytest.raises(RootInUse, match=rf"{root / RUN_LOCK} is a (file with )?{re.escape(kind)}.*remove"):
            with run_lock(root, wait_s=0.0):
                pass
        assert victim.read_bytes() == b"committed bytes"
    dangling = tmp_path / "job-dangling"
    dangling.mkdir()
    os.symlink(tmp_path / "created-elsewhere", dangling / RUN_LOCK)
    with pytest.raises(RootInUse):
        with run_lock(dangling, wait_s=0.0):
            pass
    assert not (tmp_path / "created-elsewhere").exists()


def test_files_the_root_holds_are_replaced_or_refused_never_written_through_a_link(tmp_path: Path) -> None:
    """``replace_file`` (the group file, leases, probes) replaces a link planted at the name
    instead of following it; ``open_own_file`` (the purge lock, a manifest put back) refuses one."""
    from raytrain_ckpt.checkpoint.storage.leases import purge_lock
    from raytrain_ckpt.checkpoint.errors import NotOwnFile
    from raytrain_ckpt.checkpoint.storage.posix import PosixStorage, replace_file

    victim = tmp_path / "victim"
    victim.write_bytes(b"committed bytes")
    root = tmp_path / "job"
    (root / "leases").mkdir(parents=True)
    os.symlink(victim, root / ".group.json")
    replace_file(root / ".group.json", b"{}")
    assert not (root / ".group.json").is_symlink() and (root / ".group.json").read_bytes() == b"{}"
    assert sorted(p.name for p in root.iterdir()) == [".group.json", "leases"]  # no temporary left behind
    os.symlink(victim, root / "leases" / ".lock")
    with pytest.raises(NotOwnFile, match="symbolic link"):
        with purge_lock(root):
            pass
    os.link(victim, root / "MANIFEST.json")
    with pytest.raises(NotOwnFile, match="hard links"):
        PosixStorage().write_bytes(root / "MANIFEST.json", b"{}")
    assert victim.read_bytes() == b"committed bytes"


def test_the_run_lock_knows_when_its_root_moved_or_its_file_went(tmp_path: Path) -> None:
    """An ``flock`` belongs to the file: a root moved away (or its lock file removed or replaced)
    leaves this run holding a lock a second run never sees. The lock object says so, and a second
    run is no longer refused, which is why the driver stops the first on it."""
    from raytrain_ckpt.checkpoint.storage.runlock import RUN_LOCK, run_lock

    root = tmp_path / "job"
    with run_lock(root, wait_s=0.0) as lock:
        assert lock is not None and lock.lost_problem() is None
        os.rename(root, tmp_path / "moved")
        problem = lock.lost_problem()
        assert problem is not None and f"root {root} was moved" in problem and "stopped" in problem
        with run_lock(root, wait_s=0.0) as second:  # what the driver stops the first run for
            assert second.lost_problem() is None
        assert lock.lost_problem() is not None  # a new root with a new lock file is not this run's
    with run_lock(root, wait_s=0.0) as lock:
        (root / RUN_LOCK).unlink()  # removed by hand
        assert lock.lost_problem() is not None
