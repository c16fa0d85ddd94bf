"""Pickles already pre-scanned and found within budget, remembered by their content.

The pre-scan (``prescan.py``) runs in Python at several times the cost of the parse it guards,
and ``ls``, ``verify``, ``status --watch`` and a resume read the same ``.metadata`` files again and
again. Its verdict depends only on the pickle's bytes and the budget, so a scan that passed is
remembered under the SHA-256 of both (hashing runs at C speed, about 1 ms a megabyte): in this
process, and between commands as an empty file named by that digest under
``$XDG_CACHE_HOME/raytrain_ckpt/scanned/`` (else ``~/.cache/...``). Only passes are kept: a refused
pickle is scanned again, so its message names its limit each time. A changed byte is another
digest. The directory is the user's own (made ``0700``): whoever can plant a file there can replace
the program too. The key also covers the checking code (a new version scans again) and, for a
``.metadata``, the step's file names and sizes it was checked against; a ``.metadata`` whose whole
check passed is then not even unpickled again. ``RAYTRAIN_CKPT_SCAN_CACHE=0`` leaves the directory alone (the in-process part
stays); any error writing or reading it only means the scan runs.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["CACHE_ENV", "passed_before", "remember_pass"]

CACHE_ENV = "RAYTRAIN_CKPT_SCAN_CACHE"
"""``0`` keeps the scan verdicts in memory only, not under the user's cache directory."""

_SEEN: set[str] = set()
_SEEN_MAX = 100_000


_CHECKERS = ("prescan.py", "unpickling.py", "chunks.py", "manifest.py", "scancache.py")
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


def passed_before(key: str) -> bool:
    """Whether a pickle with this key passed its scan before (here, or in an earlier command)."""
    if key in _SEEN:
        return True
    where = _directory()
    try:
        found = where is not None and (where / key[:2] / key).is_file()
    except OSError:
        found = False
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
        (where / key[:2]).mkdir(mode=0o700, parents=True, exist_ok=True)
        (where / key[:2] / key).touch(mode=0o600)
    except OSError:
        pass


def _remember_here(key: str) -> None:
    if len(_SEEN) >= _SEEN_MAX:
        _SEEN.clear()
    _SEEN.add(key)
