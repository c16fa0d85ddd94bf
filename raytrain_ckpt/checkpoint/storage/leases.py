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

import fcntl
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout, InvalidCheckpoint
from raytrain_ckpt.checkpoint.storage.backends import (Location, NotOwnFile, Storage, is_uri, object_filesystem, open_own_file,
                                              open_storage, replace_file)

logger = logging.getLogger(__name__)

__all__ = ["HEARTBEAT_S", "LEASE_DIR", "LEASE_TTL_S", "RUN_LOCK", "FileLease", "LeaseFiles", "ObjectRunLock",
           "RootInUse", "file_leased_steps", "purge_lock", "run_lock"]

LEASE_DIR = "leases"
LEASE_TTL_S = 60.0
"""A lease file whose beat a reader has not seen change for this long (by the reader's clock) is
stale (its holder died) and no longer protects its step."""
HEARTBEAT_S = 5.0
"""How often a holder bumps its lease file's beat."""
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+\.json$")


def _root(root: Location) -> Location:
    return str(root).rstrip("/") if is_uri(root) else Path(root)


@contextmanager
def purge_lock(root: Location) -> Iterator[None]:
    """Exclusive lock over taking leases and purging steps under ``root`` (blocks until held).
    Nothing on an object store: the order of operations stands in for it (module docstring)."""
    if is_uri(root):
        yield
        return
    d = Path(root) / LEASE_DIR
    d.mkdir(parents=True, exist_ok=True)
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
        self.root, self.ttl_s, self._clock = _root(root), ttl_s, clock
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
            body = json.loads(storage.read_bytes(path).decode("utf-8"))
            out[name] = (int(body["step"]), int(body.get("beat", 0)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            # Removed right now, or garbage: it protects nothing.
            logger.debug("ignoring lease file %s: %s", path, exc)
    return out


class FileLease:
    """Hold step ``step`` under ``root`` against retention; a context manager.

    Raises InvalidCheckpoint on entry when the step is no longer there (retention got it first).
    """

    def __init__(self, root: Location, step: int, holder: str = "export", heartbeat_s: float = HEARTBEAT_S,
                 options: dict[str, Any] | None = None) -> None:
        self.root, self.step, self.heartbeat_s = _root(root), step, heartbeat_s
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
        # Replaced whole (rename), so a reader never sees half a file.
        body = json.dumps({"step": self.step, "beat": beat, "pid": os.getpid(), "host": socket.gethostname()})
        if not isinstance(self.path, Path):
            self.storage.write_bytes(self.path, body.encode("utf-8"))  # one PUT: whole or absent
            return
        replace_file(self.path, body.encode("utf-8"))

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


RUN_LOCK = ".run.lock"
"""``<checkpoint root>/.run.lock``: flock'ed by the driver of the run that trains the job."""


class RootInUse(ValueError):
    """Another run of the same job is training into the same checkpoint root. A user mistake
    (exit code 2), raised before anything starts."""


class FileRunLock:
    """The run lock on a file system, held by an open descriptor of ``<root>/.run.lock``.

    The kernel's ``flock`` belongs to the file, not to its name: moving the root away, or
    deleting or replacing the lock file, leaves this run holding a lock no second run sees, and
    the second run would train into the same root. ``lost_problem`` notices (the name no longer
    leads to the locked file), and the driver stops this run."""

    def __init__(self, fd: int, path: Path) -> None:
        self.path = path
        st = os.fstat(fd)
        self._identity = (st.st_dev, st.st_ino)

    def lost_problem(self) -> str | None:
        """Why this run must stop (its root's lock file is no longer the one it holds), or None."""
        try:
            st = os.lstat(self.path)
            if (st.st_dev, st.st_ino) == self._identity:
                return None
        except OSError:
            pass
        return (f"checkpoint.dir: this job's root {self.path.parent} was moved, or its run lock {self.path} removed "
                "or replaced, while this run trained; a second run could take the root over, so this run stopped "
                "(put the root back, or run again to resume from the newest valid step under checkpoint.dir)")


@contextmanager
def run_lock(root: Location, wait_s: float = 3.0, options: dict[str, Any] | None = None,
             ttl_s: float = LEASE_TTL_S, beat_s: float = HEARTBEAT_S) -> Iterator[ObjectRunLock | FileRunLock | None]:
    """Held for a whole run: a second run of the same job on the same root is refused.

    Two runs at once would interleave their steps under one timeline (the newest step of either
    is what the next start resumes), refuse each other's commits of the same step number, each
    one's start removes the other's saves in flight as leftovers, and each one's retention
    deletes the other's steps. On a file system the kernel drops the lock when the holder dies
    however it dies, so a crashed driver never blocks its resubmission (``wait_s`` covers its
    last moments). A root the driver cannot create the file in (its machine does not mount the
    storage) is not locked. The lock object's ``lost_problem`` says when the root moved away or
    its lock file was removed (``FileRunLock``) or another run took an S3 root over. On S3 the lock is an object written with conditional requests
    (``ObjectRunLock``; ``options``: ``checkpoint.storage_options``); other object stores are
    not locked (a warning says so).
    """
    if is_uri(root):
        with _object_run_lock(str(root), options or {}, ttl_s, beat_s) as lock:
            yield lock
        return
    path = Path(str(root).removeprefix("file://")) / RUN_LOCK
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = open_own_file(path, os.O_RDWR | os.O_CREAT)  # unbuffered: nothing to flush at close
    except NotOwnFile as exc:  # planted: the lock's holder line would be written into whatever it names
        raise RootInUse(f"checkpoint.dir: {path} is {exc.strerror}; a run locks its root only in a file of its "
                        f"own: remove {path} (the next run creates it)") from None
    except OSError as exc:
        logger.info("checkpoint root %s: not locked for this run (%s)", path.parent, exc)
        yield
        return
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder = os.pread(fd, 300, 0).decode(errors="replace").strip() or "a process that wrote nothing yet"
                    raise RootInUse(f"checkpoint.dir: another run of this job is training into {path.parent} "
                                    f"({holder}); two runs would mix their steps in one timeline: wait for it to "
                                    "end, or set name or checkpoint.dir to train separately") from None
                time.sleep(0.1)
        try:  # who holds it, for the refusal's message; a full disk leaves it empty, the lock holds
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                          f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}".encode(), 0)
        except OSError:
            pass
        yield FileRunLock(fd, path)
    finally:
        os.close(fd)  # drops the lock


@contextmanager
def _object_run_lock(root: str, options: dict[str, Any], ttl_s: float, beat_s: float) -> Iterator[ObjectRunLock | None]:
    if root.split("://", 1)[0] not in ("s3", "s3a"):
        logger.warning("checkpoint root %s: no run lock on this store (only S3 has one): two runs of this job on "
                       "it at once would mix their steps", root)
        yield None
        return
    lock = ObjectRunLock(f"{root.rstrip('/')}/{RUN_LOCK}", object_filesystem(root, options), ttl_s, beat_s)
    lock.acquire()
    try:
        yield lock
    finally:
        lock.release()


class ObjectRunLock:
    """The run lock on S3: the object ``<root>/.run.lock``, created with ``If-None-Match: *`` (the
    store refuses it while the object exists), rewritten every ``beat_s`` with ``If-Match`` on
    the ETag this holder last wrote, deleted with ``If-Match`` at the end.

    A lock object found at start is live when the store wrote it less than ``ttl_s`` ago: its
    age is the store's ``Date`` of the reply minus the object's ``Last-Modified``, both the
    store's clock, so no two machines' clocks are compared. A live one refuses the run at once
    (RootInUse); an older one is a holder that died without deleting it (a driver killed, its
    machine gone) and is taken over with ``If-Match`` on its ETag, so of two runs taking it over
    at once one wins. A refused write whose own first try was applied (its reply lost, a retry
    refused) is recognised by the holder's id and beat in the object and kept. A renewal refused
    by another holder's write means another run took the root over (this driver stalled past
    ``ttl_s``): that is logged as an error and ``lost`` is set (the driver stops the job). A lock
    object removed by hand is written again.

    A store that ignores the conditions would let two runs hold it: the create is tried twice,
    and a second success says so in a warning (the lock then only names its holder).
    """

    def __init__(self, uri: str, fs: Any, ttl_s: float, beat_s: float) -> None:
        self.uri, self.fs, self.ttl_s, self.beat_s = uri, fs, ttl_s, beat_s
        self.bucket, self.key, _ = fs.split_path(uri)
        self.holder = (f"pid {os.getpid()} on {socket.gethostname()}, since "
                       f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
        self.id = uuid.uuid4().hex
        self.beat = 0
        self.etag: str | None = None
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _call(self, method: str, **kwargs: Any) -> Any:
        try:
            return self.fs.call_s3(method, Bucket=self.bucket, Key=self.key, **kwargs)
        except OSError:
            raise
        except Exception as exc:  # botocore's connection and credential errors are not OSErrors
            raise OSError(f"{type(exc).__name__}: {exc}") from exc

    def _put(self, **condition: str) -> str:
        body = json.dumps({"holder": self.holder, "id": self.id, "beat": self.beat}).encode()
        return self._call("put_object", Body=body, **condition)["ETag"]

    def _root(self) -> str:
        return self.uri.rsplit("/", 1)[0]

    def acquire(self) -> None:
        try:
            self._acquire()
        except OSError as exc:
            raise RootInUse(f"checkpoint.dir: could not take this job's run lock {self.uri} ({exc}); check the "
                            "store's endpoint and credentials (checkpoint.storage_options)") from None
        self._thread = threading.Thread(target=self._beat, name="rtc-run-lock", daemon=True)
        self._thread.start()

    def _acquire(self) -> None:
        for _ in range(8):  # each pass ends in a write that lost a race to another start
            try:
                self.etag = self._put(IfNoneMatch="*")
                break
            except OSError as exc:
                if not _refused(exc):
                    raise
            try:
                head = self._call("head_object")
            except FileNotFoundError:
                continue  # released meanwhile
            body = self._body()
            if body.get("id") == self.id:  # this create's own first try, its reply lost
                self.etag = head["ETag"]
                break
            age = _age_s(head)
            holder = str(body.get("holder", "a holder whose lock could not be read"))
            if age < self.ttl_s:
                raise RootInUse(f"checkpoint.dir: another run of this job is training into {self._root()} "
                                f"({holder}; its lock was renewed {age:.0f} s ago); two runs would mix their steps "
                                f"in one timeline: wait for it to end (a run that died without releasing it lets go "
                                f"{self.ttl_s - age:.0f} s from now), or set name or checkpoint.dir to train "
                                "separately")
            try:
                self.etag = self._put(IfMatch=head["ETag"])
                logger.warning("checkpoint root %s: took over the run lock of %s, not renewed for %.0f s",
                               self._root(), holder, age)
                break
            except OSError as exc:
                if not _refused(exc):
                    raise
        else:
            raise RootInUse(f"checkpoint.dir: other runs of this job keep taking {self.uri} over; start one at a time")
        try:
            self.etag = self._put(IfNoneMatch="*")
            logger.warning("checkpoint root %s: the store ignores conditional writes (If-None-Match): its run "
                           "lock does not keep a second run out", self._root())
        except OSError as exc:
            if not _refused(exc):
                raise

    def _body(self) -> dict[str, Any]:
        try:
            out = json.loads(self.fs.cat_file(self.uri))
            return out if isinstance(out, dict) else {}
        except (OSError, ValueError):
            return {}

    def _beat(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                if not self.renew():
                    return
            except Exception as exc:  # noqa: BLE001 - a renewal that failed oddly is retried, never ends the lock
                self._retry(exc)

    def renew(self) -> bool:
        """Rewrite the lock with the next beat; False once another run has taken it over."""
        self.beat += 1
        try:
            try:
                self.etag = self._put(IfMatch=self.etag or "")
            except FileNotFoundError:  # removed by hand: write it again, unless another run did first
                self.etag = self._put(IfNoneMatch="*")
                logger.warning("run lock %s: it was removed while this run held it; written again", self.uri)
            return True
        except OSError as exc:
            if not _refused(exc):
                return self._retry(exc)
        body = self._body()
        if body.get("id") == self.id and body.get("beat") == self.beat:  # this write's first try was applied
            try:
                self.etag = self._call("head_object")["ETag"]
            except OSError as exc:
                return self._retry(exc)
            return True
        return self._taken_over(body)

    def _retry(self, exc: BaseException) -> bool:
        logger.warning("run lock %s: renewal failed (%s), tried again in %.0f s", self.uri, exc, self.beat_s)
        return True

    def _taken_over(self, body: dict[str, Any]) -> bool:
        logger.error("checkpoint root %s: another run (%s) took this job's root over: this driver did not renew its "
                     "lock for %.0f s; stopping this run", self._root(), body.get("holder", "unknown"), self.ttl_s)
        self.lost.set()
        return False

    def lost_problem(self) -> str | None:
        """Why this run must stop (another run took the root over), or None while the lock holds."""
        if not self.lost.is_set():
            return None
        return (f"checkpoint.dir: another run took this job's root over (this driver did not renew its run lock "
                f"{self.uri} for {self.ttl_s:.0f} s); this run stopped so that the two do not mix their steps")

    def release(self, join_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(join_s)
            if self._thread.is_alive():  # a renewal stuck in the store's timeouts: the TTL frees the lock
                logger.warning("run lock %s: not released (a renewal is still waiting for the store); the next "
                               "run takes it over %.0f s after its last renewal", self.uri, self.ttl_s)
                return
        if self.lost.is_set() or self.etag is None:
            return
        try:
            self._call("delete_object", IfMatch=self.etag)
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("run lock %s: not released (%s); the next run takes it over %.0f s after its last "
                           "renewal", self.uri, exc, self.ttl_s)


def _refused(exc: OSError) -> bool:
    """Whether an s3fs error is the store refusing a conditional request (412, or 409 for two at once)."""
    response = getattr(exc.__cause__, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return isinstance(exc, FileExistsError) or code in ("PreconditionFailed", "ConditionalRequestConflict") \
        or status in (409, 412)


def _age_s(head: dict[str, Any]) -> float:
    """Seconds since the store wrote the object, by the store's clock (its reply's Date)."""
    date = head.get("ResponseMetadata", {}).get("HTTPHeaders", {}).get("date")
    if not date:
        return 0.0  # no Date: judged live, as a just-written lock is
    return (parsedate_to_datetime(date) - head["LastModified"]).total_seconds()
