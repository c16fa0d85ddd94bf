"""The run's checks of its own steps, sealed, so that a CheckpointActor of the same run started
anywhere does not check them again.

The actor checks each step it commits as a restart's resume plan would (``resumecheck.py``), and
the pass is remembered by content in its process and in the user's cache directory of its node
(``format/scancache.py``). Ray restarts a crashed actor on any node, and the driver moves it off a
draining one: there neither holds the pass, and the first resume plan paid the whole check again,
O(items) (8.6 s at 64 ranks of 70B, a cold reader; minutes at 4096).

The keys of each pass (the SHA-256 of the checking code, the budget, the step's file sizes and
the bytes of ``.metadata``) are kept in ``<root>/.checked-sealed``, each with an HMAC-SHA256 under
a key the driver makes for the run and hands only to its actor (an argument Ray keeps for the
actor's restarts; never written to storage). An actor started with that key takes each line whose
seal holds as a pass, in its own process only. A line anyone else wrote, or one of another run,
does not verify and is ignored; a pass names bytes, so a file changed since the check has another
key and is checked as before. The file is bounded (``MAX_LINES`` newest keys, read up to
``MAX_BYTES``) and read as text; nothing in it is executed or unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import threading
from collections import OrderedDict

from raytrain_ckpt.checkpoint.format import scancache
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.checkpoint.storage.posix import read_small_file

logger = logging.getLogger(__name__)

__all__ = ["MAX_BYTES", "MAX_LINES", "SEALS_FILE", "SealedChecks"]

SEALS_FILE = ".checked-sealed"
MAX_LINES = 64
"""The newest keys the file keeps, a line each (a pass is two: the check's and the decode's)."""
MAX_BYTES = 64 << 10
_LINE = re.compile(r"([0-9a-f]{64}) ([0-9a-f]{64})")
_DOMAIN = b"raytrain_ckpt sealed check v1\0"


class SealedChecks:
    """``SEALS_FILE`` of the run whose secret is ``secret`` (see the module docstring)."""

    def __init__(self, layout: CheckpointLayout, secret: bytes) -> None:
        self.layout, self._secret = layout, secret
        self.path = layout.storage.join(layout.root, SEALS_FILE)
        self._lines: OrderedDict[str, str] = OrderedDict()
        """Key -> its line, the newest last (``MAX_LINES`` at most)."""
        self._lock = threading.Lock()

    def _seal(self, key: str) -> str:
        return hmac.new(self._secret, _DOMAIN + key.encode("ascii"), hashlib.sha256).hexdigest()

    def load(self) -> int:
        """Take this run's sealed passes as passed in this process; how many. Never raises: a
        missing, damaged or foreign file only means the checks run."""
        storage = self.layout.storage
        try:
            if not storage.is_file(self.path):
                return 0
            data = read_small_file(storage, self.path, MAX_BYTES)
        except OSError as exc:
            logger.info("sealed checks not read from %s (%s): steps are checked again", self.path, exc)
            return 0
        except ValueError as exc:
            logger.warning("ignoring %s: %s", self.path, exc)
            return 0
        good = []
        for line in data.decode("ascii", "replace").splitlines()[-2 * MAX_LINES:]:
            m = _LINE.fullmatch(line)
            if m is not None and hmac.compare_digest(m.group(2), self._seal(m.group(1))):
                good.append(m.group(1))
        with self._lock:
            self._keep(good, self._lines)
        scancache.remember_in_process(good)
        if good:
            logger.info("%d check(s) of this run's steps taken from %s", len(good), self.path)
        return len(good)

    def add(self, keys: list[str]) -> None:
        """Seal the keys of a pass and rewrite the file (the newest ``MAX_LINES`` kept). Never
        raises: a pass not sealed only means a later actor checks again."""
        keys = [k for k in keys if re.fullmatch(r"[0-9a-f]{64}", k)]
        if not keys:
            return
        with self._lock:
            if all(k in self._lines for k in keys):
                return  # sealed already (the same .metadata committed again)
            lines = OrderedDict(self._lines)
            self._keep(keys, lines)
            data = "".join(f"{line}\n" for line in lines.values()).encode("ascii")
            try:
                self.layout.protocol.replace_small_file(self.path, data)
            except Exception as exc:  # noqa: BLE001 - see the docstring
                logger.warning("could not seal this run's check in %s (%s): an actor started elsewhere checks "
                               "the step again", self.path, exc)
                return  # not sealed: the next pass of these keys tries again
            self._lines = lines

    def _keep(self, keys: list[str], lines: OrderedDict[str, str]) -> None:
        for k in keys:
            lines.pop(k, None)
            lines[k] = f"{k} {self._seal(k)}"
        while len(lines) > MAX_LINES:
            lines.popitem(last=False)
