"""A folder in a shared place (``/dev/shm``, ``/tmp``) used only when it is ours.

Anyone may create a name in ``/dev/shm``: another user can create our folder first (0777), or
put a link there, and whatever we then write through it lands where they chose. So a private
folder is created 0700 and, every time it is used, opened without following a link and checked
on the open descriptor (``fstat``): a directory, owned by this process's user, writable by
nobody else. Every file in it is then reached relative to that descriptor, so the folder that
was checked is the folder that is written, and a new file is created exclusively
(``O_CREAT|O_EXCL|O_NOFOLLOW``) under a name nobody else can predict before it is renamed into
place.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

__all__ = ["UntrustedFolder", "check_private", "open_private", "read_small", "write_atomic"]


class UntrustedFolder(OSError):
    """A shared folder we would use is not ours (owner, mode or a link): refused, never written."""


def check_private(st: os.stat_result, path: Path | str) -> None:
    """Refuse a folder that is not a directory owned by us and writable by us alone."""
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedFolder(f"{path}: not a directory (a link or a file is there); remove it")
    if st.st_uid != os.getuid():
        raise UntrustedFolder(f"{path}: owned by uid {st.st_uid}, not by this user (uid {os.getuid()}); "
                              "another user made it: remove it, it is not used")
    if st.st_mode & 0o022:
        raise UntrustedFolder(f"{path}: mode {stat.S_IMODE(st.st_mode):04o} lets others write in it; "
                              "remove it (it is made 0700), it is not used")


@contextlib.contextmanager
def open_private(path: Path, create: bool = True) -> Iterator[int]:
    """A descriptor of the private folder ``path`` (created 0700 when missing and ``create``),
    checked on the descriptor itself; FileNotFoundError when missing and not ``create``,
    UntrustedFolder when not ours."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        check_private(os.fstat(fd), path)
        yield fd
    finally:
        os.close(fd)


def write_atomic(folder: int, name: str, data: bytes) -> None:
    """Replace ``name`` in the folder open as ``folder`` with ``data``: written to a new file
    created exclusively (mode 0600, never through a link) and renamed over ``name``. A process
    killed before the rename leaves that file behind; ``temp_writer`` names its writer."""
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=folder)
        raise


def temp_writer(name: str) -> int | None:
    """The pid of the process whose ``write_atomic`` created the temporary file ``name`` (None:
    not such a file)."""
    parts = name.split(".")
    if not name.startswith(".") or len(parts) < 5 or parts[-1] != "tmp" or not parts[-3].isdigit():
        return None
    return int(parts[-3])


def read_small(folder: int, name: str, limit: int) -> bytes:
    """At most ``limit`` bytes of the regular file ``name`` in ``folder`` (never through a link);
    ValueError when it is larger or not a regular file."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError(f"{name}: not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{name}: over {limit} bytes")
    return data
