"""Staging buffer files: created safely in a shared directory, tied to a live owner, swept when orphaned.

A staging buffer is a file ``rtc-*.buf`` in ``shm_dir()`` (``/dev/shm``: world-writable, names
predictable). Three rules keep it safe:

* **Created exclusively**: ``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0600. A name already taken (a
  planted symlink, a file someone else made) is never followed, truncated or adopted.
* **Opened checked**: a process mapping an existing buffer opens it with ``O_NOFOLLOW`` and
  requires a regular file, owned by our uid, mode 0600, at least the expected size.
* **Owned by a live process**: the creator keeps the file open with an exclusive ``flock`` for
  as long as the buffer exists and unlinks it before closing. The kernel drops the lock when
  the owner dies, however it dies (SIGKILL included), so a buffer whose lock can be taken is an
  orphan: the sweep (a writer starting, ``raytrain-ckpt clean-buffers``) removes it. A buffer
  whose owner is alive is never removed by anyone but its owner.

A fourth rule lets a restarted group reuse a buffer (its pages already allocated) instead of
creating one: **leased while mapped for staging**. A trainer holds an exclusive POSIX record
lock (``lockf``, a lock type independent of ``flock``) on the buffer for as long as it stages
into it (``BufferLease``); the kernel drops it when the trainer dies. The writer hands an older
attempt's buffer to a new attempt only when it can take that lock itself (``is_leased``), so a
process of the old attempt that is still alive is never staging into a buffer given to the new
one.

Between ``open(O_EXCL)`` and ``flock`` a sweeper could take the lock of a file that was just
created. Only a lock holder unlinks a buffer, and only while the name still points at the inode
it locked; the creator checks the same after taking its lock and creates again when its file
was swept from under it. So nothing is lost, and nothing live is removed.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from raytrain_ckpt.checkpoint.errors import StagingFileError, StagingNoSpace

logger = logging.getLogger(__name__)

__all__ = ["BUFFER_GLOB", "MIN_SHM_FREE", "SHM_DIR_ENV", "BufferLease", "Orphan", "OwnedBuffer", "is_leased",
           "no_space_line", "node_problem", "open_buffer", "shm_dir", "sweep_orphans"]

SHM_DIR_ENV = "RAYTRAIN_CKPT_SHM_DIR"
"""Environment variable naming another directory for staging buffers (read by each writer's process)."""
BUFFER_GLOB = "rtc-*.buf"
"""Every staging buffer's name matches this (the sweep looks at nothing else)."""
_MODE = 0o600
_CREATE_TRIES = 3
"""Creating a buffer again after a sweeper removed it mid-creation: bounded, it takes a racing sweep each time."""


def shm_dir() -> Path:
    """Where staging buffers live: ``$RAYTRAIN_CKPT_SHM_DIR`` when set, else /dev/shm when present
    (RAM-backed), else the temp dir."""
    if os.environ.get(SHM_DIR_ENV):
        return Path(os.environ[SHM_DIR_ENV])
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


MIN_SHM_FREE = 64 * 2**20
"""The least free space on the staging file system a node must have to get a rank (64 MiB)."""


def node_problem(shm: Path, root: str | None, min_free: int = MIN_SHM_FREE) -> str | None:
    """What is wrong with this node for a rank (None: healthy): the staging file system ``shm``
    short of ``min_free`` bytes, or the local checkpoint ``root`` not writable. The node health
    probe's checks (``control/watch/health.py``): here, where both the probe's task and a kept
    rank's process (``TrainWorker.node_problem``) can run them."""
    try:
        st = os.statvfs(shm)
    except OSError as exc:
        return f"the staging file system {shm} cannot be read: {exc}"
    free = st.f_bavail * st.f_frsize
    if free < min_free:
        return f"the staging file system {shm} has {free / 2**20:.0f} MiB free, under {min_free / 2**20:.0f} MiB"
    if root is not None:
        probe = Path(root) / f".health-{uuid.uuid4().hex[:12]}"
        try:
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            return f"the checkpoint root {root} cannot be written: {exc}"
    return None


@dataclass(frozen=True)
class Orphan:
    """A buffer whose owner is dead."""

    path: Path
    nbytes: int


class OwnedBuffer:
    """A buffer file this process created and holds the ownership lock of; ``remove()`` ends it."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd
        self._fd_lock = threading.Lock()
        """Orders ``reserve`` (another thread) against ``resize`` and ``remove``: it must neither see a
        size that is about to shrink (it would grow the file back) nor a descriptor being closed."""

    @classmethod
    def create(cls, path: Path, nbytes: int) -> OwnedBuffer:
        """Create ``path`` exclusively (mode 0600, ``nbytes`` long) and take its ownership lock.

        An orphan at ``path`` (ours, owner dead) is removed first. Raises StagingFileError when
        the name is taken by anything else: a symlink, another user's file, a file with other
        permissions, or a buffer whose owner is alive.
        """
        path = Path(path)
        for _ in range(_CREATE_TRIES):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, _MODE)
            except FileExistsError:
                if _remove_if_orphan(path) is None and os.path.lexists(path):
                    raise StagingFileError(_taken(path)) from None
                continue
            # The umask may have cleared bits of 0600; a buffer is exactly owner read/write.
            os.fchmod(fd, _MODE)
            fcntl.flock(fd, fcntl.LOCK_EX)
            if _same_file(fd, path):
                os.ftruncate(fd, nbytes)
                try:
                    _back(fd, path, nbytes)
                except BaseException:
                    path.unlink(missing_ok=True)  # ours and locked: nobody else has it
                    os.close(fd)
                    raise
                return cls(path, fd)
            os.close(fd)  # a sweep removed our fresh file before we locked it: create it again
        raise StagingFileError(_taken(path))

    def resize(self, nbytes: int) -> None:
        """Grow or shrink the buffer (a new layout reusing the same name); grown, its memory is
        allocated in full first (raises StagingNoSpace, the buffer left as it was)."""
        with self._fd_lock:
            before = os.fstat(self._fd).st_size
            os.ftruncate(self._fd, nbytes)
            if nbytes > before:
                try:
                    _back(self._fd, self.path, nbytes)
                except BaseException:
                    os.ftruncate(self._fd, before)
                    raise

    def reserve(self) -> None:
        """Allocate the file's memory now (``posix_fallocate`` of its current size; it never grows
        the file), so that the first copy into the buffer takes no allocating page faults.
        Raises OSError (ENOSPC: the shared-memory file system is full)."""
        with self._fd_lock:
            if self._fd >= 0:
                os.posix_fallocate(self._fd, 0, os.fstat(self._fd).st_size)

    def remove(self) -> None:
        """Unlink the file, then drop the lock (in that order: a named buffer is never unlocked)."""
        with self._fd_lock:
            if self._fd < 0:
                return
            if _same_file(self._fd, self.path):
                self.path.unlink()
            os.close(self._fd)
            self._fd = -1


def _back(fd: int, path: Path, nbytes: int) -> None:
    """Allocate every page of the file's first ``nbytes`` now, before any trainer maps it: a
    mapping of a sparse file on a full tmpfs is a SIGBUS at the first store into a page the file
    system cannot supply, in every rank, at every restart. Raises StagingNoSpace (one line: the
    file system, the bytes needed and free) when they cannot all be allocated."""
    if nbytes <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT, errno.EFBIG):
            raise StagingNoSpace(no_space_line(path.parent, nbytes)) from None
        raise


def no_space_line(directory: Path, nbytes: int) -> str:
    """The one line a save that found no room for its staging buffer fails with."""
    try:
        st = os.statvfs(directory)
        room = f"{st.f_bavail * st.f_frsize / 1e6:.1f} MB free of {st.f_blocks * st.f_frsize / 1e6:.1f} MB"
    except OSError:
        room = "its free space unknown"
    return (f"no room for a {nbytes / 1e6:.1f} MB staging buffer in {directory} (the file system mounted at "
            f"{_mount_point(directory)}, {room}): this save fails, training continues; give it more room (docker "
            f"--shm-size, a larger tmpfs) or point {SHM_DIR_ENV} at a larger RAM-backed directory")


def _mount_point(directory: Path) -> Path:
    path = Path(os.path.abspath(directory))
    try:
        dev = path.stat().st_dev
        while path.parent != path and path.parent.stat().st_dev == dev:
            path = path.parent
    except OSError:
        pass
    return path


def open_buffer(path: Path, nbytes: int) -> int:
    """Open an existing buffer for mapping; returns a read-write fd the caller closes.

    Raises StagingFileError unless ``path`` is a regular file (not a symlink), owned by our uid,
    mode 0600 and at least ``nbytes`` long (mapping past its end would crash on access).
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        what = "is a symlink" if exc.errno == errno.ELOOP else f"cannot be opened ({exc.strerror})"
        raise StagingFileError(f"staging buffer {path} {what}; it must be a file created by the "
                               "job's CheckpointWriter") from None
    st = os.fstat(fd)
    problem = _not_ours(st) or (f"holds {st.st_size} bytes, expected {nbytes}" if st.st_size < nbytes else "")
    if problem:
        os.close(fd)
        raise StagingFileError(f"staging buffer {path} {problem}; refusing to map it (only files the job's "
                               "CheckpointWriter created are mapped)")
    return fd


class BufferLease:
    """A trainer's claim on a buffer it stages into: an exclusive ``lockf`` lock on an fd kept open.

    POSIX record locks belong to the process and are dropped when it closes *any* fd of the
    file: take the lease after mapping the buffer (``map_buffer`` closes its fd), and release it
    before mapping the same file again.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._fd)
            raise StagingFileError(f"staging buffer {self.path} is still leased by another process (a rank of "
                                   "an earlier attempt that has not exited yet?); this save is dropped") from None

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # drops the lock
            self._fd = -1


def is_leased(path: Path) -> bool:
    """Whether some other live process holds a ``BufferLease`` on ``path`` (False when it is gone)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # EAGAIN/EACCES: held by another process
        return True
    finally:
        os.close(fd)  # also drops the probe's own lock
    return False


def sweep_orphans(directory: Path | None = None, dry_run: bool = False) -> list[Orphan]:
    """Remove every orphaned buffer in ``directory`` (default ``shm_dir()``), of any job of our uid.

    With ``dry_run`` nothing is removed; returns what was (or would be) removed.
    """
    out = []
    for path in sorted(Path(directory or shm_dir()).glob(BUFFER_GLOB)):
        orphan = _remove_if_orphan(path, dry_run)
        if orphan is not None:
            out.append(orphan)
    if out and not dry_run:
        logger.info("removed %d orphaned staging buffer(s), %.1f MB: %s", len(out),
                    sum(o.nbytes for o in out) / 1e6, ", ".join(o.path.name for o in out))
    return out


def _remove_if_orphan(path: Path, dry_run: bool = False) -> Orphan | None:
    """Unlink ``path`` if it is a buffer of ours whose owner is dead; None when it is not (or is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:  # gone, a symlink, or not ours to open: not an orphan of ours
        return None
    try:
        st = os.fstat(fd)
        if _not_ours(st):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # its owner is alive
            return None
        if not _same_file(fd, path):  # removed or replaced since we opened it
            return None
        if not dry_run:
            path.unlink()
        return Orphan(path, st.st_size)
    finally:
        os.close(fd)


def _not_ours(st: os.stat_result) -> str:
    """Why a buffer file with this stat was not created by us ("" when it could have been)."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symlink"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}, not {os.geteuid()}"
    if stat.S_IMODE(st.st_mode) != _MODE:
        return f"has mode {stat.S_IMODE(st.st_mode):o}, not 600"
    return ""


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _taken(path: Path) -> str:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"staging buffer {path} could not be created: it was removed {_CREATE_TRIES} times while creating it"
    why = _not_ours(st) or "is in use by a live process (another writer of the same job and directory?)"
    return (f"staging buffer {path} already exists and {why}; it was not created by this job's CheckpointWriter "
            f"and is left untouched. Remove it (or run `raytrain-ckpt clean-buffers` for orphans) and retry")
