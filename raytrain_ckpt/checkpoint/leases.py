"""Lease files: a step that a process outside the job (an export) is reading, kept from retention.

An exporter may run in another process, even on another machine, with no Ray connection to
the job's CheckpointActor. So the lease lives on the storage both already share::

    <checkpoint root>/leases/<holder>.json    {"step": N, "holder": ..., "pid": ..., "host": ...}
    <checkpoint root>/leases/.lock           flock'ed while a lease is taken and while purging

The CheckpointActor's retention never deletes a step named by a fresh lease file. A lease is
fresh while its file's mtime is within ``LEASE_TTL_S``; the holder touches it every
``HEARTBEAT_S``, so a crashed exporter pins its step for at most ``LEASE_TTL_S``.

The race between "decide to read step N" and "retention deletes N" is closed by the lock:
taking a lease writes the file and checks that the step still exists while holding it, and the
actor reads the lease files and deletes steps while holding it. Either the exporter sees the
step gone (and says so), or the actor sees the lease.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from raytrain_ckpt.checkpoint.layout import CheckpointLayout, InvalidCheckpoint

logger = logging.getLogger(__name__)

__all__ = ["HEARTBEAT_S", "LEASE_DIR", "LEASE_TTL_S", "FileLease", "file_leased_steps", "purge_lock"]

LEASE_DIR = "leases"
LEASE_TTL_S = 60.0
"""A lease file not touched for this long is stale (its holder died) and no longer protects its step."""
HEARTBEAT_S = 5.0
"""How often a holder touches its lease file."""
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+\.json$")


@contextmanager
def purge_lock(root: Path) -> Iterator[None]:
    """Exclusive lock over taking leases and purging steps under ``root`` (blocks until held)."""
    d = Path(root) / LEASE_DIR
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def file_leased_steps(root: Path, ttl_s: float = LEASE_TTL_S, now: float | None = None) -> set[int]:
    """Steps named by fresh lease files under ``root``. A stale one (its holder is gone) is removed;
    an unreadable one (being written right now) is skipped."""
    d = Path(root) / LEASE_DIR
    if not d.is_dir():
        return set()
    now = time.time() if now is None else now
    out: set[int] = set()
    for path in d.iterdir():
        if not _NAME_RE.match(path.name):
            continue
        try:
            age = now - path.stat().st_mtime
            step = int(json.loads(path.read_text(encoding="utf-8"))["step"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # Being written or removed right now, or garbage: it protects nothing.
            logger.debug("ignoring lease file %s: %s", path, exc)
            continue
        if age > ttl_s:
            logger.warning("removing stale lease %s on step %d (no heartbeat for %.0fs)", path.name, step, age)
            path.unlink(missing_ok=True)
            continue
        out.add(step)
    return out


class FileLease:
    """Hold step ``step`` under ``root`` against retention; a context manager.

    Raises InvalidCheckpoint on entry when the step is no longer there (retention got it first).
    """

    def __init__(self, root: Path, step: int, holder: str = "export", heartbeat_s: float = HEARTBEAT_S) -> None:
        self.root, self.step, self.heartbeat_s = Path(root), step, heartbeat_s
        self.path = self.root / LEASE_DIR / f"{holder}-{uuid.uuid4().hex[:8]}.json"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> FileLease:
        body = json.dumps({"step": self.step, "pid": os.getpid(), "host": socket.gethostname(),
                           "created_unix": time.time()})
        with purge_lock(self.root):
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(body, encoding="utf-8")
            os.rename(tmp, self.path)
            if not CheckpointLayout(self.root).step_dir(self.step).is_dir():
                self.path.unlink(missing_ok=True)
                raise InvalidCheckpoint(f"step {self.step} under {self.root} was removed (by retention?) before it "
                                        "could be leased; pick a newer step")
        self._thread = threading.Thread(target=self._beat, name="lease-heartbeat", daemon=True)
        self._thread.start()
        logger.debug("leased step %d under %s (%s)", self.step, self.root, self.path.name)
        return self

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
            except OSError as exc:  # removed under us: nothing left to keep fresh
                logger.warning("lease %s heartbeat failed: %s", self.path.name, exc)
                return

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.path.unlink(missing_ok=True)
