"""A local or shared-mount directory as checkpoint storage: atomic rename, fsync for durability,
and the files this code writes under a root never written through a link planted at their name."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from raytrain_ckpt.checkpoint.format.manifest import Checksum, checksum_file
from raytrain_ckpt.checkpoint.format.names import Location
from raytrain_ckpt.checkpoint.errors import NotOwnFile

__all__ = ["PosixStorage", "fsync_dir", "open_own_file", "read_small_file", "replace_file"]


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_own_file(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags)`` for a file under a checkpoint root that this code creates or
    rewrites in place (locks, a manifest put back): never through a link planted at the name.
    Raises NotOwnFile for a symbolic link, a file with more than one name, or not a regular file."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotOwnFile(errno.ELOOP, "a symbolic link, which is never written through", str(path)) from None
        raise
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_nlink <= 1:
        return fd
    os.close(fd)
    what = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"a file with {st.st_nlink} names (hard links)"
    raise NotOwnFile(errno.EPERM, f"{what}, which is never written through", str(path))


def replace_file(path: Path, data: bytes, durable: bool = False) -> None:
    """Replace ``path`` with a file holding ``data``, whole: written under a new name of its own
    (created exclusively, so no planted link is followed) and renamed over ``path`` (a link at
    ``path`` is replaced, not followed). ``durable``: fsync the file before the rename."""
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk: created, not written; leave nothing behind
        tmp.unlink(missing_ok=True)
        raise


class PosixStorage:
    """A local or shared-mount directory: atomic rename, fsync for durability."""


    def join(self, base: Location, *names: str) -> Path:
        return Path(base).joinpath(*names)

    def name(self, path: Location) -> str:
        return Path(path).name

    def listdir(self, path: Location) -> list[str]:
        p = Path(path)
        return sorted(c.name for c in p.iterdir()) if p.is_dir() else []

    def is_dir(self, path: Location) -> bool:
        return Path(path).is_dir()

    def is_file(self, path: Location) -> bool:
        """A regular file, not a symlink: a step holds only files its save wrote."""
        p = Path(path)
        return p.is_file() and not p.is_symlink()

    def size(self, path: Location) -> int | None:
        return Path(path).stat().st_size if self.is_file(path) else None

    def read_bytes(self, path: Location) -> bytes:
        return Path(path).read_bytes()

    def write_bytes(self, path: Location, data: bytes) -> None:
        """Write and fsync the file (the caller fsyncs its directory when the name must be durable);
        never through a link planted at the name (``open_own_file``)."""
        fd = open_own_file(Path(path), os.O_WRONLY | os.O_CREAT)
        with os.fdopen(fd, "wb") as f:
            f.truncate(0)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def open_read(self, path: Location) -> IO[bytes]:
        return open(path, "rb")

    def read_at_most(self, path: Location, n: int) -> bytes:
        """The first ``n`` bytes of a file: never through a link, never blocked on a FIFO or a
        device planted at its name (``open_own_file``: non-blocking, a regular file or NotOwnFile)."""
        fd = open_own_file(Path(path), os.O_RDONLY)
        try:
            chunks, left = [], n
            while left > 0 and (chunk := os.read(fd, left)):
                chunks.append(chunk)
                left -= len(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def makedirs(self, path: Location) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    def remove_tree(self, path: Location) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def remove_file(self, path: Location) -> None:
        Path(path).unlink(missing_ok=True)

    def copy_file(self, src: Location, dst: Location) -> None:
        shutil.copyfile(src, dst)

    def put_file(self, local: Path, dst: Location) -> None:
        self.makedirs(Path(dst).parent)
        shutil.copyfile(local, dst)

    def checksum(self, path: Location, algorithm: Checksum, progress: Callable[[int], None] | None = None) -> int:
        return checksum_file(Path(path), algorithm, progress)

    def snapshot(self, path: Location) -> frozenset[tuple[str, int, str]]:
        """(name, size, mtime) of every file under ``path``: compared with a later snapshot, it
        tells whether anything is still writing there (the mtime is only compared with itself)."""
        out = set()
        for f in Path(path).rglob("*"):
            try:
                st = f.lstat()
            except FileNotFoundError:
                continue  # removed while listing
            out.add((str(f.relative_to(path)), st.st_size, str(st.st_mtime_ns)))
        return frozenset(out)


def read_small_file(storage: Any, path: Location, limit: int) -> bytes:
    """A small file this code keeps under a checkpoint root (``.group.json``, ``.failed-saves.json``,
    ``.checked-sealed``, a lease), read once and bounded (``read_at_most``: at most ``limit + 1``
    bytes). Raises ValueError for a file of more than ``limit`` bytes."""
    data = storage.read_at_most(path, limit + 1)
    if len(data) > limit:
        raise ValueError(f"over the {limit} bytes it may be")
    return data
