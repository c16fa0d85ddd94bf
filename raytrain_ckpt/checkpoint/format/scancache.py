"""Pickles already pre-scanned and found within budget, remembered by their content.

The pre-scan (``prescan.py``) runs in Python at several times the cost of the parse it guards,
and ``ls``, ``verify``, ``status --watch`` and a resume read the same ``.metadata`` files again and
again. Its verdict depends only on the pickle's bytes and the budget, so a scan that passed is
remembered under the SHA-256 of both (hashing runs at C speed, about 1 ms a megabyte): in this
process, and between commands as a line of ``$XDG_CACHE_HOME/raytrain_ckpt/scanned/verdicts``
(else ``~/.cache/...``), a log each command appends its passes to in one write and reads from
where it last stopped. One file, not a file per verdict: a first ``ls`` of 1,000 steps created
2,000 files, which took longer than the checks they remembered. Past ``LOG_MAX_BYTES`` a new log
replaces it (a verdict lost only means a scan). Only passes are kept: a refused pickle is
scanned again, so its message names its limit each time. A changed byte is another digest. The
directory is trusted only when it is the user's own: ``raytrain_ckpt/`` and ``scanned/`` are
created ``0700`` (parents too, where this creates them) and checked with ``lstat`` before each
use (a real directory, owned by this uid, writable by no one else); the log is opened
``O_NOFOLLOW`` and must be a regular file of this uid that no one else may write. Anything else is
ignored (said at debug level) and the scan runs. The key also covers the checking code (a new
version scans again) and, for a ``.metadata``, the step's file names and sizes it was checked
against; a ``.metadata`` whose whole check passed is then not even unpickled again.
``RAYTRAIN_CKPT_SCAN_CACHE=0`` leaves the directory alone (the in-process part stays); any error
writing or reading it only means the scan runs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
from pathlib import Path

__all__ = ["CACHE_ENV", "forget", "passed_before", "remember_in_process", "remember_pass", "remember_passes"]

CACHE_ENV = "RAYTRAIN_CKPT_SCAN_CACHE"
"""``0`` keeps the scan verdicts in memory only, not under the user's cache directory."""

log = logging.getLogger(__name__)

_SEEN: set[str] = set()
_SEEN_MAX = 1 << 18
"""Keys this process holds at most (about 30 MB): more than a full log holds (``LOG_MAX_BYTES``
plus the slack read past it, 65 bytes a line), so reading the log never drops what it read."""

LOG = "verdicts"
"""The log of passed keys in the cache directory: one 64-digit hex key a line, appended."""
LOG_MAX_BYTES = 8 << 20
"""Past this size (about 129,000 verdicts) the next append puts a new log in its place."""
_LOG_SLACK = 1 << 20
_KEY = re.compile(r"[0-9a-f]{64}")
_READ: dict[str, tuple[tuple[int, int] | None, int, set[str] | None]] = {}
"""Per log path: the file (device, inode) and how far this process has read it, into which set."""


_CHECKERS = ("prescan.py", "unpickling.py", "chunks.py", "manifest.py", "names.py", "scancache.py")
_checker: str | None = None


def _checker_digest() -> str:
    """The checking code itself: a verdict of another version of it is never reused."""
    global _checker
    if _checker is None:
        h = hashlib.sha256()
        for name in _CHECKERS:
            h.update((Path(__file__).parent / name).read_bytes())
        _checker = h.hexdigest()
    return _checker


def digest(data: bytes, context: str) -> str:
    """The key of ``data`` checked in ``context`` (the check, its budget and what it was checked
    against), by this version of the checking code."""
    h = hashlib.sha256(_checker_digest().encode())
    h.update(context.encode())
    h.update(b"\0")
    h.update(data)
    return h.hexdigest()


def _directory() -> Path | None:
    if os.environ.get(CACHE_ENV, "").strip() == "0":
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    if not os.path.isabs(base):
        return None
    return Path(base) / "raytrain_ckpt" / "scanned"


def _ours(path: Path) -> bool:
    """``path`` is a real directory (not a link) of this user that no one else may write to."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        log.debug("scan cache %s ignored: %s", path, "not a directory of this user, or writable by others "
                  f"(mode {stat.S_IMODE(st.st_mode):o}, owner {st.st_uid})")
        return False
    return True


def passed_before(key: str) -> bool:
    """Whether a pickle with this key passed its scan before (here, or in an earlier command whose
    verdict lies in a cache directory that only this user can write)."""
    if key in _SEEN:
        return True
    where = _directory()
    if where is None or not (_ours(where.parent) and _ours(where)):
        return False
    _read_log(where / LOG)
    return key in _SEEN


def remember_pass(key: str) -> None:
    """Record that the pickle with this key passed its scan."""
    remember_passes([key])


def remember_passes(keys: list[str]) -> None:
    """Record that the pickles with these keys passed their scans: one append to the log."""
    for key in keys:
        _remember_here(key)
    where = _directory()
    if where is None or not keys:
        return
    try:
        _make_private(where)
        if not (_ours(where.parent) and _ours(where)):
            return
        fd = os.open(where / LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        try:
            st = os.fstat(fd)
            if not _file_is_ours(st):
                log.debug("scan verdicts %s not kept: not a file of this user, or writable by others", where / LOG)
                return
            lines = "".join(f"{key}\n" for key in keys if _KEY.fullmatch(key)).encode()
            if st.st_size < LOG_MAX_BYTES:
                os.write(fd, lines)
                return
        finally:
            os.close(fd)
        # full: a new log in its place (a new inode: readers start it from its beginning; a verdict
        # lost only means a scan)
        fresh = where / f"{LOG}.{os.getpid()}.new"
        fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        try:
            os.write(fd, lines)
        finally:
            os.close(fd)
        os.replace(fresh, where / LOG)
    except OSError:
        pass  # a verdict not kept only means the scan runs again next time


def remember_in_process(keys: list[str]) -> None:
    """Record passes that a trusted party of this job vouched for, in this process only (never in
    the cache directory: that holds only what a process of this user checked itself)."""
    for key in keys:
        if _KEY.fullmatch(key):
            _remember_here(key)


def forget() -> None:
    """Forget what this process remembers (the cache directory keeps its verdicts): as a new
    command starts."""
    _SEEN.clear()
    _READ.clear()


def _file_is_ours(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _read_log(path: Path) -> None:
    """Take into ``_SEEN`` the verdicts other commands appended to the log since this process last
    read it (all of it the first time, or when it was begun again)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return  # missing, or a link (O_NOFOLLOW): no verdicts
    try:
        st = os.fstat(fd)
        if not _file_is_ours(st):
            log.debug("scan verdicts %s ignored: not a file of this user, or writable by others", path)
            return
        where = str(path)
        ino, offset, seen = _READ.get(where, (None, 0, None))
        if ino != (st.st_dev, st.st_ino) or seen is not _SEEN or st.st_size < offset:
            offset = 0  # another file, a log begun again, or this process's verdicts forgotten
        if st.st_size == offset:
            return
        os.lseek(fd, offset, os.SEEK_SET)
        data = os.read(fd, min(st.st_size, LOG_MAX_BYTES + _LOG_SLACK) - offset)
    finally:
        os.close(fd)
    whole = data.rfind(b"\n") + 1  # a line still being appended is read next time
    keys = [key for line in data[:whole].split(b"\n") if _KEY.fullmatch(key := line.decode("ascii", "replace"))]
    if len(_SEEN) + len(keys) > _SEEN_MAX:
        if offset:  # keep the log's verdicts rather than this process's: read it again from its start
            forget()
            _read_log(path)
            return
        forget()
    _SEEN.update(keys)
    _READ[where] = ((st.st_dev, st.st_ino), offset + whole, _SEEN)


def _make_private(path: Path) -> None:
    """``path`` and the parents this creates, each ``0700`` (an existing one is left as it is and
    then judged by ``_ours``)."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for p in reversed(missing):
        try:
            os.mkdir(p, 0o700)
        except FileExistsError:
            continue  # made at the same time by another command: judged by ``_ours`` before use
        os.chmod(p, 0o700)  # (mkdir's mode is reduced by the umask; 0700 is meant)


def _remember_here(key: str) -> None:
    if len(_SEEN) >= _SEEN_MAX:
        forget()
    _SEEN.add(key)
