"""Each committed step checked as a restart's resume plan checks it, right after its commit.

A restart's resume plan (``ResumeTimeline.acquire``) verifies the newest step before the ranks
load it: the sizes of its files, then its ``.metadata`` in the reader process (the pre-scan, the
restricted decode, the chunk layout against the manifest's sizes). That last part is O(items):
8.5 s at 64 ranks of 70B on a cold reader. Its pass is remembered by content
(``format/scancache.py``: in this process, and in the user's cache directory of this node), so this
class runs the same check on a thread of the CheckpointActor as soon as a step commits, while
training goes on. The commit and the trainers never wait for it; a restart that comes after it
reads only the sizes, and the CRC-32C and SHA-256 of ``.metadata``. A restart that comes while it
runs waits for it rather than doing it a second time beside it (``wait``, for as long as the
reader process may take over that file, plus a minute to read it).

A save whose ``.metadata`` (by its manifest entry: size and CRC-32C, as this actor wrote it) and
file sizes are the last passed step's (what most saves are: the coordinator copies the last
``.metadata`` when the ranks' results repeat, ``repeats.py``) is not read again: the pass of those
bytes is already remembered. Only a restart that asks for sizes waits (a ``checksum`` one parses
every chunk itself, which is never remembered).

A step the check refuses is said at once, as a warning naming the step and the reason, rather
than first when a restart skips it and loses the steps since the one before: its files are intact,
but a restart would not resume from it (say, a ``.metadata`` past the reader's budget, which
``RAYTRAIN_CKPT_PICKLE_BUDGET`` raises). Only the newest step is checked: a commit while a check
runs replaces the step waiting for one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

from raytrain_ckpt.checkpoint.format.manifest import MANIFEST, Manifest
from raytrain_ckpt.checkpoint.format.sandbox import decode_deadline_s
from raytrain_ckpt.checkpoint.format.unpickling import vouching
from raytrain_ckpt.checkpoint.format.verify import metadata_problem
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout

logger = logging.getLogger(__name__)

__all__ = ["READ_ALLOWANCE_S", "ResumeCheck"]

READ_ALLOWANCE_S = 60.0
"""What a restart waiting for the check allows for reading ``.metadata``, beside its decode's own
deadline (``sandbox.decode_deadline_s``)."""


class ResumeCheck:
    """Checks the newest committed step's ``.metadata`` off the save path (see the module docstring)."""

    def __init__(self, layout: CheckpointLayout, committed: Mapping[int, Manifest],
                 on_pass: Callable[[list[str]], None] | None = None) -> None:
        """``on_pass(keys)``: a step's check passed with these scan keys (``seals.SealedChecks.add``)."""
        self.layout, self._committed, self._on_pass = layout, committed, on_pass
        self._lock = threading.Lock()
        self._next: int | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._last_pass: tuple | None = None
        self._bound_s = READ_ALLOWANCE_S
        self.passed: list[int] = []
        """The steps whose check passed, oldest first (the last 16)."""
        self.refused: dict[int, str] = {}
        """Committed steps a restart would not resume from, and why (the last 16)."""
        self.took_s: float | None = None
        """Seconds the last check took (``bench/scale.py``)."""

    def committed(self, step: int) -> None:
        """``step`` was just committed: check it on this object's thread (started if idle)."""
        manifest = self._committed.get(step)
        if manifest is not None and ".metadata" in manifest.files:
            self._bound_s = READ_ALLOWANCE_S + decode_deadline_s(manifest.files[".metadata"].size)
        with self._lock:
            self._next = step
            if not self._idle.is_set():
                return  # the running thread takes it next
            self._idle.clear()
        try:
            threading.Thread(target=self._run, name="resume-check", daemon=True).start()
        except RuntimeError as exc:  # no thread to be had (the process's limit, its shutdown)
            with self._lock:
                self._next = None
                self._idle.set()
            logger.warning("step %d is not checked ahead of a restart (%s); a restart checks it itself", step, exc)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until no check runs, at most ``timeout_s`` (default: as long as the running check
        may take); whether none does."""
        return self._idle.wait(self._bound_s if timeout_s is None else timeout_s)

    def _run(self) -> None:
        while True:
            with self._lock:
                step, self._next = self._next, None
                if step is None:
                    self._idle.set()
                    return
            t0 = time.perf_counter()
            try:
                self._check(step)
                self.took_s = time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001 - a warm-up only: the restart checks in full anyway
                logger.warning("the check of step %d ahead of a restart failed (%s: %s); a restart checks it itself",
                               step, type(exc).__name__, exc)

    def _check(self, step: int) -> None:
        manifest = self._committed.get(step)
        if manifest is None or ".metadata" not in manifest.files:
            return  # deleted by retention or moved aside meanwhile
        entry = manifest.files[".metadata"]
        key = (entry.size, entry.checksum, tuple(sorted((n, e.size) for n, e in manifest.files.items())))
        if key == self._last_pass:
            self._keep(self.passed, step)
            return
        path = self.layout.step_dir(step)
        with vouching(every=True) as keys:
            problem = metadata_problem(self.layout.storage, path, manifest)
        if problem is None:
            self._last_pass = key
            self._keep(self.passed, step)
            if self._on_pass is not None:
                self._on_pass(keys)
        elif step in self._committed and self.layout.storage.is_file(self.layout.storage.join(path, MANIFEST)):
            # (retention and a new timeline take the manifest out of the step's place before they
            # forget the step: a file they removed while it was read is not the step's problem)
            self.refused[step] = problem
            while len(self.refused) > 16:
                del self.refused[min(self.refused)]
            logger.warning("step %d is committed, but a restart would not resume from it: %s", step, problem)

    @staticmethod
    def _keep(steps: list[int], step: int) -> None:
        steps.append(step)
        del steps[:-16]
