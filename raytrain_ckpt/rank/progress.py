"""Every rank's progress, read one node at a time.

The controller's poll used to make one ``progress`` call per rank: at 4096 ranks, 4096 actor
calls a round (2.3 s, against half of ``fault_tolerance.poll_interval_s``), most of it the
driver submitting them. Instead each rank writes its progress, at every change, to a small file
in its node's shared memory (``ProgressFile``: JSON, replaced atomically, about 50 us), and the
poll asks one rank per node (``TrainWorker.node_progress``), which reads its node's files:
one call per node (the driver's ``control/pollcalls.py``).

What a file cannot say is asked of the rank itself, in the same round: a file missing, of
another attempt or rank, or of a process that is gone (a rank still starting, a stale file of
an earlier run), a rank whose file counts rollbacks (the records themselves stay in the rank),
and every rank of a node whose asked rank failed to answer. A rank's death is seen by its
``run()`` ref, as before; a rank whose answer does not come within the poll's timeout is missing
from the round, as before. A file (about 200 bytes, one per run and rank on a node) is
overwritten by the next attempt's rank and removed when the rank's run ends (the rank answers
for itself then). A rank killed while it trains (a stopped or failed job) leaves its file; the
next rank to start on the node removes every file whose process is gone.

A file is keyed by the run's identity (``run_id``, minted once by the driver of each run), not
by the job's name: two runs of one name on a node (a sweep over ``checkpoint.dir``) never read
each other's progress. The folder is used only when it is ours (``common/privatedir.py``: created 0700,
checked on an open descriptor for owner, mode and links); one that is not is refused with a
warning naming it, and every rank of the node is then asked directly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from raytrain_ckpt.common.events import NodeProgress, Progress
from raytrain_ckpt.common.privatedir import UntrustedFolder, open_private, read_small, temp_writer, write_atomic

logger = logging.getLogger(__name__)

__all__ = ["ProgressFile", "PublishedProgress", "node_batches", "read_node"]

_PLAIN = [f.name for f in fields(Progress) if f.name != "rollbacks"]


def _dir() -> Path:
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"rtc-progress-{os.getuid()}"


_RUN = re.compile(r"[0-9a-f]{8,64}")
_LIMIT = 4096
"""A progress record is about 200 bytes; a larger file is not one we wrote."""


def _name(run_id: str, rank: int) -> str:
    """A rank's file in the folder: the run's identity (hex, minted by the driver) and the rank."""
    if not _RUN.fullmatch(run_id):
        raise ValueError(f"run id {run_id!r}: expected 8-64 lowercase hex digits (uuid4().hex)")
    return f"{run_id}.rank{rank}.json"


class ProgressFile:
    """A rank's progress as its node's other ranks read it (``read_node``)."""

    def __init__(self, run_id: str, attempt: int, rank: int) -> None:
        self.attempt, self.rank = attempt, rank
        self.name = _name(run_id, rank)
        self.path = _dir() / self.name
        self._broken = False
        self._swept = False

    def show(self, progress: Progress, rollbacks: int) -> None:
        """Write ``progress`` (and how many rollbacks this attempt made) for the node to read. A
        run that ended ("done", "failed", or "preempted": stopped by a drain notice or a SIGTERM such as
        `ray job stop`'s) removes the file instead (and the folder once empty): the
        rank answers for itself from then on, and a job's end leaves nothing in shared memory."""
        if self._broken:
            return
        if progress.phase in ("done", "failed", "preempted"):
            self._remove()
            return
        record = {k: getattr(progress, k) for k in _PLAIN}
        record |= {"attempt": self.attempt, "rank": self.rank, "pid": os.getpid(), "rollbacks": rollbacks}
        try:
            for last in (False, True):  # once more if a rank that ended removed the folder meanwhile
                try:
                    with open_private(self.path.parent) as folder:
                        write_atomic(folder, self.name, json.dumps(record).encode())
                        if not self._swept:
                            self._swept = True
                            _sweep(folder)
                    break
                except FileNotFoundError:
                    if last:
                        raise
        except OSError as exc:  # a full or missing /dev/shm, or a folder not ours: the poll asks this rank itself
            self._broken = True
            logger.warning("rank %d: progress not shared with the node (%s); the poll asks this rank directly",
                           self.rank, exc)

    def _remove(self) -> None:
        with contextlib.suppress(OSError):
            with open_private(self.path.parent, create=False) as folder:
                os.unlink(self.name, dir_fd=folder)
            self.path.parent.rmdir()  # fails while another rank's file is there


def _sweep(folder: int) -> None:
    """Remove the files of ranks whose process is gone (a rank killed while it trained): each run
    has its own names, so no later run overwrites them. A temporary file of a rank killed while
    it wrote goes too."""
    for name in os.listdir(folder):
        pid = temp_writer(name)
        if pid is None and not name.endswith(".json"):
            continue
        try:
            pid = pid if pid is not None else int(json.loads(read_small(folder, name, _LIMIT))["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being replaced, or not a record: left alone
        if not _alive(pid):
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=folder)


class PublishedProgress:
    """For ``TrainWorker``: every assignment of ``_progress`` or ``_rollbacks`` is also written to
    the rank's ``ProgressFile`` (set ``_progress_file`` first; None: not shared, as for a spare)."""

    _progress_file: ProgressFile | None = None

    @property
    def _progress(self) -> Progress:
        return self.__dict__["_shown_progress"]

    @_progress.setter
    def _progress(self, progress: Progress) -> None:
        self.__dict__["_shown_progress"] = progress
        self._share()

    @property
    def _rollbacks(self) -> tuple[Any, ...]:
        return self.__dict__.get("_shown_rollbacks", ())

    @_rollbacks.setter
    def _rollbacks(self, rollbacks: tuple[Any, ...]) -> None:
        self.__dict__["_shown_rollbacks"] = rollbacks
        self._share()

    def _shown(self) -> Progress:
        """The progress the rank's file shows (``TrainWorker`` adds an eviction's deadline)."""
        return self._progress

    def _share(self) -> None:
        if self._progress_file is not None and "_shown_progress" in self.__dict__:
            self._progress_file.show(self._shown(), len(self._rollbacks))


def _alive(pid: int) -> bool:
    if pid <= 0:  # (0 and -1 would name process groups)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: not one of ours
        return False
    return True


def read_node(run_id: str, attempt: int, ranks: Sequence[int]) -> NodeProgress:
    """The progress of ``ranks`` (all on this node) of ``attempt`` of the run ``run_id``, from
    their files; every rank is asked directly when the folder is not ours."""
    out, ask = {}, []
    try:
        with open_private(_dir(), create=False) as folder:
            for rank in ranks:
                progress = _read(folder, run_id, attempt, rank)
                if progress is None:
                    ask.append(rank)
                else:
                    out[rank] = progress
    except UntrustedFolder as exc:
        logger.warning("node progress not read (%s); every rank is asked directly", exc)
        return NodeProgress({}, list(ranks))
    except OSError:  # no folder: no rank wrote one yet
        return NodeProgress({}, list(ranks))
    return NodeProgress(out, ask)


def _read(folder: int, run_id: str, attempt: int, rank: int) -> Progress | None:
    try:
        record = json.loads(read_small(folder, _name(run_id, rank), _LIMIT))
    except (OSError, ValueError):
        return None
    return _progress_of(record, attempt, rank)


def _progress_of(record: Any, attempt: int, rank: int) -> Progress | None:
    """The progress a file's record shows for ``rank`` of ``attempt``; None when it cannot say
    (another attempt or rank, rollbacks, a process that is gone, or a record of another shape)."""
    try:
        if (record["attempt"], record["rank"]) != (attempt, rank) or record["rollbacks"] \
                or not _alive(int(record["pid"])):
            return None
        return Progress(**{k: record[k] for k in _PLAIN})
    except (KeyError, TypeError, ValueError):  # not a record this version wrote: the rank answers itself
        return None


def node_batches(ranks: Sequence[int], nodes: Sequence[str]) -> list[list[int]]:
    """``ranks`` grouped by node (``nodes[rank]``), in rank order; one group per rank when the
    nodes are unknown."""
    if len(nodes) <= max(ranks, default=-1):
        return [[r] for r in ranks]
    by_node: dict[str, list[int]] = {}
    for r in ranks:
        by_node.setdefault(nodes[r], []).append(r)
    return list(by_node.values())
