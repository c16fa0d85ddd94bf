"""Pickles already pre-scanned and found within budget, remembered by their content.

The pre-scan (``prescan.py``) runs in Python at several times the cost of the parse it guards,
and ``ls``, ``verify``, ``status --watch`` and a resume read the same ``.metadata`` files again and
again. Its verdict depends only on the pickle's bytes and the budget, so a scan that passed is
remembered under the SHA-256 of both (hashing runs at C speed, about 1 ms a megabyte): in this
process, and between commands as an empty file named by that digest under
``$XDG_CACHE_HOME/raytrain_ckpt/scanned/`` (else ``~/.cache/...``). Only passes are kept: a refused
pickle is scanned again, so its message names its limit each time. A changed byte is another
digest. The directory is trusted only when it is the user's own: each of ``raytrain_ckpt/``,
``scanned/`` and the digest's folder is created ``0700`` (parents too, where this creates them) and
checked with ``lstat`` before use (a real directory, owned by this uid, writable by no one else);
a verdict file is opened ``O_NOFOLLOW`` and must be a regular file of this uid. Anything else is
ignored (said at debug level) and the scan runs. The key also covers the checking code (a new version scans again) and, for a
``.metadata``, the step's file names and sizes it was checked against; a ``.metadata`` whose whole
check passed is then not even unpickled again. ``RAYTRAIN_CKPT_SCAN_CACHE=0`` leaves the directory alone (the in-process part
stays); any error writing or reading it only means the scan runs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path

__all__ = ["CACHE_ENV", "passed_before", "remember_pass"]

CACHE_ENV = "RAYTRAIN_CKPT_SCAN_CACHE"
"""``0`` keeps the scan verdicts in memory only, not under the user's cache directory."""

log = logging.getLogger(__name__)

_SEEN: set[str] = set()
_SEEN_MAX = 100_000


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


def _trusted(where: Path, key: str) -> Path | None:
    """The key's folder when the cache and it are this user's own, else None (said at debug level)."""
    if not (_ours(where.parent) and _ours(where) and _ours(where / key[:2])):
        return None
    return where / key[:2]


def _verdict_is_ours(folder: Path, key: str) -> bool:
    try:
        fd = os.open(folder / key, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # missing, or a link (O_NOFOLLOW): no verdict
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        log.debug("scan verdict %s ignored: not a file of this user, or writable by others", folder / key)
        return False
    return True


def passed_before(key: str) -> bool:
    """Whether a pickle with this key passed its scan before (here, or in an earlier command whose
    verdict lies in a cache directory that only this user can write)."""
    if key in _SEEN:
        return True
    where = _directory()
    folder = _trusted(where, key) if where is not None else None
    found = folder is not None and _verdict_is_ours(folder, key)
    if found:
        _remember_here(key)
    return found


def remember_pass(key: str) -> None:
    """Record that the pickle with this key passed its scan."""
    _remember_here(key)
    where = _directory()
    if where is None:
        return
    try:
        _make_private(where / key[:2])
        folder = _trusted(where, key)
        if folder is None:
            return
        fd = os.open(folder / key, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        os.close(fd)
    except OSError:
        pass  # a verdict not kept only means the scan runs again next time


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
        _SEEN.clear()
    _SEEN.add(key)
