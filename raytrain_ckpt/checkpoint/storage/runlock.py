"""The run lock: one run at a time trains into a job's checkpoint root.

::

    <checkpoint root>/.run.lock     flock'ed by the driver of the run that trains the job (a file system)
                                    an object written with conditional requests, renewed by beats (S3)

Two runs at once would interleave their steps under one timeline, refuse each other's commits,
remove each other's saves in flight as leftovers and delete each other's steps. On a file
system the kernel drops the lock when its holder dies; on S3 a lock not renewed for
``LEASE_TTL_S`` (judged by the store's own clock) is taken over. See ``run_lock``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

from raytrain_ckpt.checkpoint.format.names import Location
from raytrain_ckpt.checkpoint.storage.commit import protocol_for
from raytrain_ckpt.checkpoint.storage.leases import HEARTBEAT_S, LEASE_TTL_S
from raytrain_ckpt.checkpoint.storage.objects import object_filesystem
from raytrain_ckpt.checkpoint.errors import NotOwnFile
from raytrain_ckpt.checkpoint.storage.posix import open_own_file
from raytrain_ckpt.checkpoint.errors import RootInUse

logger = logging.getLogger(__name__)

__all__ = ["RUN_LOCK", "FileRunLock", "ObjectRunLock", "run_lock"]

RUN_LOCK = ".run.lock"
"""``<checkpoint root>/.run.lock``: flock'ed by the driver of the run that trains the job."""


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
    if not protocol_for(root).file_locks:
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
