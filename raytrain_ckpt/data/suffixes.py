"""File suffixes read as text by ``data.source: text``, the listing of an input directory, and
the one way a file found in a user's directory is opened: regular files only (torch-free: the
spec checks paths with them)."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Collection
from pathlib import Path
from typing import BinaryIO

__all__ = ["TEXT_SUFFIXES", "input_files", "not_regular", "open_regular"]

TEXT_SUFFIXES: frozenset[str] = frozenset({".txt", ".md", ".rst", ".py", ".yaml", ".toml", ".json"})

NOT_REGULAR = ("is not a regular file (a FIFO, device, socket or broken link), and reading it could block or "
               "fail")


def not_regular(path: Path) -> str | None:
    """Why ``path`` is not read as a file (``NOT_REGULAR``, or the OS's reason), or None for a
    regular file. A link to a regular file is one (``os.stat`` follows it, as ``open`` would)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        return f"cannot be looked up ({exc.strerror or exc})"
    return None if stat.S_ISREG(mode) else NOT_REGULAR


def open_regular(path: Path) -> BinaryIO:
    """``open(path, "rb")`` that never blocks on a FIFO or a device: opened non-blocking, checked
    with ``fstat`` (the file opened, not the name looked up before), then made blocking again.

    Raises:
        ValueError: Not a regular file (named with its path).
        OSError: It cannot be opened.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} {NOT_REGULAR}")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def input_files(root: Path, suffixes: Collection[str]) -> list[Path]:
    """The files with one of ``suffixes`` (lower-cased) below ``root``, sorted.

    Raises:
        ValueError: One of them is not a regular file (a FIFO, a device, a socket, a link to
            nothing): reading a FIFO blocks until someone writes to it, so it is refused by its
            name, never opened. Or a directory below ``root`` (or ``root``) cannot be listed.
    """
    def unreadable(err: OSError) -> None:  # a directory not listed would drop its files without a word
        if err.errno == errno.ENOTDIR:  # the input itself is a FIFO, a device, a socket
            raise ValueError(f"{err.filename} {NOT_REGULAR}; give a file or a directory")
        raise ValueError(f"{err.filename}: cannot be listed ({err.strerror}); fix its permissions or leave it out")

    files = []
    for top, dirs, names in os.walk(root, onerror=unreadable):  # links to directories are not followed
        for p in (Path(top) / n for n in names):
            if p.suffix.lower() not in suffixes or p.is_dir():
                continue
            if not p.is_file():  # (is_file follows a link: a link to a regular file is read)
                raise ValueError(f"{p} {NOT_REGULAR}; remove it from the input directory")
            files.append(p)
    return sorted(files)
