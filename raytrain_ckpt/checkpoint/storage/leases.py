"""Lease files: a step that a process outside the job (an export) is reading, kept from retention.

An exporter may run in another process, even on another machine, with no Ray connection to
the job's CheckpointActor. So the lease lives on the storage both already share::

    <checkpoint root>/leases/<holder>.json    {"step": N, "beat": B, "pid": ..., "host": ...}
    <checkpoint root>/leases/.lock           flock'ed while a lease is taken or beats, and while purging

The CheckpointActor's retention never deletes a step named by a live lease file. Liveness never
compares two machines' clocks: the holder rewrites its file with ``beat`` one higher every
``HEARTBEAT_S``, and a reader (``LeaseFiles``, kept by the actor) remembers, per file, the beat
it last saw and when it saw it change, on the reader's own monotonic clock. A file whose beat
has not changed for ``LEASE_TTL_S`` of that clock is stale: its holder died, and it is removed.
So a crashed exporter pins its step for at most ``LEASE_TTL_S`` after the reader last saw it
beat (or first saw it, for a reader that just started).

A heartbeat that fails (the shared file system hiccups) is retried at the next beat; only the
lease file being gone ends it (a reader judged it stale and removed it), and that is logged:
the step is no longer protected.

The race between "decide to read step N" and "retention deletes N" is closed by the lock:
taking a lease writes the file and checks that the step still exists while holding it, and the
actor reads the lease files and deletes steps while holding it. Either the exporter sees the
step gone (and says so), or the actor sees the lease.

Object stores (``s3://``...) have no lock. A lease is an object ``<root>/leases/<holder>.json``,
written whole by one PUT, and the same race is closed by the order of operations, given the
store's read-after-write consistency (S3, GCS): the exporter PUTs its lease, then checks that the
step's manifest exists; the actor deletes a step's manifest first, then reads the leases again,
and puts the manifest back (the same bytes, the objects untouched) if a lease on the step
appeared (``CheckpointLayout.delete``). If the exporter saw the manifest, its lease was written
before the manifest was deleted, so the actor's second read sees it and the step stays; if not,
the exporter says the step is gone. A heartbeat cannot check-and-write atomically there: a
holder stalled past the TTL may write its lease back after a reader removed it, which protects
a step that may be gone (harmless: the export's final check fails it). Liveness is judged the
same way on both (beats, the reader's clock).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import socket
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint, NotOwnFile
from raytrain_ckpt.checkpoint.format.names import Location
from raytrain_ckpt.checkpoint.storage.backends import Storage, open_storage
from raytrain_ckpt.checkpoint.storage.commit import protocol_for
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.checkpoint.storage.posix import open_own_file, read_small_file

logger = logging.getLogger(__name__)

__all__ = ["HEARTBEAT_S", "LEASE_DIR", "LEASE_TTL_S", "FileLease", "LeaseFiles", "file_leased_steps", "purge_lock"]

LEASE_DIR = "leases"
LEASE_TTL_S = 60.0
"""A lease file whose beat a reader has not seen change for this long (by the reader's clock) is
stale (its holder died) and no longer protects its step."""
HEARTBEAT_S = 5.0
"""How often a holder bumps its lease file's beat."""
LEASE_MAX_BYTES = 4096
"""The most of a lease file a reader takes (one is a line of JSON: step, beat, pid, host)."""
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+\.json$")


@contextmanager
def purge_lock(root: Location) -> Iterator[None]:
    """Exclusive lock over taking leases and purging steps under ``root`` (blocks until held).
    Nothing on an object store: the order of operations stands in for it (module docstring)."""
    if not protocol_for(root).file_locks:
        yield
        return
    d = Path(root) / LEASE_DIR
    d.mkdir(parents=True, exist_ok=True)
    if not stat.S_ISDIR(os.lstat(d).st_mode):  # a link planted at leases/ would take every lease file elsewhere
        raise NotOwnFile(errno.ELOOP, "not a directory of the checkpoint root (a symbolic link?), which is never "
                         "written through", str(d))
    fd = open_own_file(d / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


class LeaseFiles:
    """The lease files under one checkpoint root, as one reader sees them over time.

    Stateful: liveness is "the beat changed within ``ttl_s`` of this reader's ``clock``", so the
    same instance must read the leases every time (the CheckpointActor keeps one).
    """

    def __init__(self, root: Location, ttl_s: float = LEASE_TTL_S, clock: Callable[[], float] = time.monotonic,
                 storage: Storage | None = None) -> None:
        self.root, self.ttl_s, self._clock = protocol_for(root).spell(root), ttl_s, clock
        self.storage = storage if storage is not None else open_storage(self.root)
        self._seen: dict[str, tuple[int, float]] = {}
        """file name -> (the beat last read, this reader's time when it last changed)"""

    def leased_steps(self) -> set[int]:
        """Steps named by live lease files. A stale one is removed; an unreadable one (being
        replaced right now, or garbage) is skipped. Call it holding ``purge_lock``."""
        d = self.storage.join(self.root, LEASE_DIR)
        now = self._clock()
        read = _read_leases(self.storage, d)
        self._seen = {name: seen for name, seen in self._seen.items() if name in read}
        out: set[int] = set()
        for name, (step, beat) in read.items():
            last_beat, changed_at = self._seen.get(name, (None, now))
            if beat != last_beat:
                self._seen[name] = (beat, now)
            elif now - changed_at > self.ttl_s:
                logger.warning("removing stale lease %s on step %d (beat %d unchanged for %.0fs)", name, step,
                               beat, now - changed_at)
                self.storage.remove_file(self.storage.join(d, name))
                del self._seen[name]
                continue
            out.add(step)
        return out


def file_leased_steps(root: Location) -> set[int]:
    """Steps named by the lease files under ``root`` as a reader seeing them for the first time
    judges them: all live (staleness takes a ``LeaseFiles`` that watches them over time)."""
    return LeaseFiles(root).leased_steps()


def _read_leases(storage: Storage, d: Location) -> dict[str, tuple[int, int]]:
    """file name -> (step, beat) of every readable lease file in ``d``."""
    out = {}
    for name in storage.listdir(d):
        if not _NAME_RE.match(name):
            continue
        path = storage.join(d, name)
        try:
            # never through a link, never blocked on a FIFO, bounded (a lease is a line of JSON)
            data = read_small_file(storage, path, LEASE_MAX_BYTES)
            body = json.loads(data.decode("utf-8"))
            out[name] = (int(body["step"]), int(body.get("beat", 0)))
        except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
            # Removed right now, or garbage (a FIFO, a link, Infinity, deep nesting): it protects nothing.
            logger.debug("ignoring lease file %s: %s", path, exc)
    return out


class FileLease:
    """Hold step ``step`` under ``root`` against retention; a context manager.

    Raises InvalidCheckpoint on entry when the step is no longer there (retention got it first).
    """

    def __init__(self, root: Location, step: int, holder: str = "export", heartbeat_s: float = HEARTBEAT_S,
                 options: dict[str, Any] | None = None) -> None:
        self.root, self.step, self.heartbeat_s = protocol_for(root).spell(root), step, heartbeat_s
        self.layout = CheckpointLayout(self.root, options=options)
        self.storage = self.layout.storage
        self.path = self.storage.join(self.root, LEASE_DIR, f"{holder}-{uuid.uuid4().hex[:8]}.json")
        self.beats = 0
        """Heartbeats written so far (the ``beat`` in the file)."""
        self.failed_beats = 0
        """Heartbeats that failed (and were retried at the next one)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> FileLease:
        with purge_lock(self.root):
            self._write()
            if not self.layout.is_committed_name(self.step):  # after the write: see the module docstring
                self.storage.remove_file(self.path)
                raise InvalidCheckpoint(f"step {self.step} under {self.root} was removed (by retention?) before it "
                                        "could be leased; pick a newer step")
        self._thread = threading.Thread(target=self._beat, name="lease-heartbeat", daemon=True)
        self._thread.start()
        logger.debug("leased step %d under %s (%s)", self.step, self.root, self.storage.name(self.path))
        return self

    def _write(self, beat: int = 0) -> None:
        # Replaced whole (a rename, or one PUT), so a reader never sees half a file.
        body = json.dumps({"step": self.step, "beat": beat, "pid": os.getpid(), "host": socket.gethostname()})
        self.layout.protocol.replace_small_file(self.path, body.encode("utf-8"))

    def _bump(self) -> bool:
        """One heartbeat; False when the lease file is gone (a reader removed it as stale)."""
        with purge_lock(self.root):  # a reader removing the file and our rewrite never interleave
            if not self.storage.is_file(self.path):
                return False
            self._write(self.beats + 1)
        self.beats += 1
        return True

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                if not self._bump():
                    logger.warning("lease %s was removed (judged stale): step %d is no longer protected from "
                                   "retention", self.storage.name(self.path), self.step)
                    return
            except OSError as exc:  # transient (a shared file system hiccup): the next beat tries again
                self.failed_beats += 1
                logger.warning("lease %s heartbeat failed, retrying in %gs: %s", self.storage.name(self.path),
                               self.heartbeat_s, exc)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.storage.remove_file(self.path)
