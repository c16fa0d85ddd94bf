"""The CheckpointActor's step registry: every step it knows and the phase each one is in.

A step is committed (its manifest), in flight (an ``InFlightStep``: which ranks handed off,
which reported) or aborted (why). ``phase_of`` and ``inflight`` derive the ``StepPhase``
from those facts, the one place that does: ``status``, the metrics and the CLI read it.
The run's failed saves outlive the actor in ``FAILED_FILE`` (``FailedSavesFile``), written only
when a save fails and read back by a restarted actor of the same run.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from raytrain_ckpt.checkpoint.records import FailedSaves, GroupLayout, InFlight, RankReport, StepPhase, WriterRef
from raytrain_ckpt.checkpoint.format.manifest import Manifest
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.checkpoint.storage.posix import read_small_file
from raytrain_ckpt.common.events import printable
from raytrain_ckpt.checkpoint.roles.metrics import CheckpointMetrics
from raytrain_ckpt.checkpoint.errors import StepAborted

logger = logging.getLogger(__name__)

__all__ = ["FAILED_FILE", "FailedSavesFile", "InFlightStep", "SaveFailures", "StepRegistry", "inflight_phase"]

SETTLE_CHECK_S = 0.5
"""How often ``settle`` asks the writers of a step in flight whether they still hold its hand-offs."""
WRITER_QUERY_S = 5.0
"""How long ``settle`` waits for a writer's answer; one that does not answer is waited for as before."""


def inflight_phase(planning: bool, handed_off: int, written: int, world_size: int) -> StepPhase:
    """The phase of a step in flight from what the CheckpointActor knows of it."""
    if written >= world_size:
        return StepPhase.COMMITTING
    if handed_off >= world_size:
        return StepPhase.WRITING
    if planning and handed_off == 0:
        return StepPhase.PLANNING
    return StepPhase.STAGING


@dataclass
class SaveFailures:
    """Failed saves as ``status``, the metrics and the job's end report them: a job whose saves
    keep failing must say so. Counted per step (every rank of a failed step reports it)."""

    total: int = 0
    consecutive: int = 0
    """Failed saves since the last commit."""
    last_step: int | None = None
    last_error: str | None = None

    def failed(self, step: int, reason: str) -> None:
        self.total += 1
        self.consecutive += 1
        self.last_step, self.last_error = step, reason

    def committed(self) -> None:
        self.consecutive = 0

    def record(self) -> FailedSaves:
        return FailedSaves(self.total, self.consecutive, self.last_step, self.last_error)


FAILED_FILE = ".failed-saves.json"
"""The run's failed saves, under the job's root beside ``.group.json`` (not a step: nothing scans
it): written when a save fails, read when an actor of the same run starts (Ray restarted it, or
the driver moved it off a draining node), so that the job's end still sees them."""
RECORD_WAIT_S = 2.0
"""How long an abort waits for the record of its failure to be written (it goes on after that)."""
MAX_FAILED_BYTES = 64 << 10
"""The most of ``FAILED_FILE`` a starting actor reads; a larger file is ignored (logged)."""
FAILED_KEPT, REASON_CHARS = 32, 1000
"""The newest failed steps the file names, and how much of each reason it keeps."""
_STEP_KEY = re.compile(r"[0-9]{1,12}")


def _count(value: object) -> int:
    if type(value) is not int or not 0 <= value < 1 << 53:
        raise ValueError(f"not a count: {str(value)[:40]}")
    return value


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError("not a text")
    return printable(value[:REASON_CHARS])


def _refuse(name: str) -> None:
    raise ValueError(f"{name} is not a number")


class FailedSavesFile:
    """The failed saves of run ``run_id`` on storage (``FAILED_FILE``). A file another run wrote is
    not this run's: ignored. Read as JSON (never unpickled), at most ``MAX_FAILED_BYTES``; a damaged
    file is logged and ignored. Written only when a save fails, off the event loop, the newest last."""

    def __init__(self, layout: CheckpointLayout, run_id: str, secret: bytes) -> None:
        """``secret``: the run's key (the actor's seal key): the file is the record and its HMAC,
        so a record anyone else wrote (the run id is in the file, no secret) is not taken."""
        self.layout, self.run_id, self._secret = layout, run_id, secret
        self.path = layout.storage.join(layout.root, FAILED_FILE)
        self._lock, self._asked, self._written = threading.Lock(), 0, 0

    def record(self, saves: SaveFailures, failed: dict[int, str], newest_commit_unix: float | None) -> bytes:
        """``newest_commit_unix``: the newest committed step's ``created_unix`` when the save failed
        (a newer one when the file is read: a commit came since, the failures are not in a row)."""
        kept = list(failed.items())[-FAILED_KEPT:]  # in the order they failed
        if newest_commit_unix is not None and not math.isfinite(newest_commit_unix):
            newest_commit_unix = None
        while True:
            body = json.dumps({"version": 1, "run": self.run_id, "total": saves.total,
                               "consecutive": saves.consecutive, "last_step": saves.last_step,
                               "last_error": (saves.last_error or "")[:REASON_CHARS],
                               "failed": {str(s): why[:REASON_CHARS] for s, why in kept},
                               "newest_commit_unix": newest_commit_unix}, allow_nan=False).encode()
            # within what ``read`` takes (JSON escapes a character into up to 6 bytes): the oldest
            # reasons go first, the counts stay
            if len(body) + 66 <= MAX_FAILED_BYTES or not kept:
                break
            kept = kept[1:]
        return body + b"\n" + self._mac(body).encode("ascii") + b"\n"

    def _mac(self, body: bytes) -> str:
        return hmac.new(self._secret, b"raytrain_ckpt failed saves v1\0" + body, hashlib.sha256).hexdigest()

    async def write(self, data: bytes) -> None:
        """Replace the file with ``data``; never raises (a save that failed stays failed; the
        storage that failed it may fail this too), says so in the log."""
        self._asked += 1
        await asyncio.to_thread(self._write, self._asked, data)

    def _write(self, asked: int, data: bytes) -> None:
        with self._lock:
            if asked < self._written:  # a newer record is on storage already
                return
            try:
                self.layout.protocol.replace_small_file(self.path, data)
            except Exception as exc:  # noqa: BLE001 - see write
                logger.warning("could not record the failed saves in %s (%s): an actor restarted before the next "
                               "failure is recorded would not report them", self.path, exc)
                return
            self._written = asked

    def read(self, committed: dict[int, Manifest]) -> tuple[SaveFailures, dict[int, str]] | None:
        """The failed saves this run's earlier actors recorded, as of ``committed`` (the steps on
        storage now); None when there are none (no file, another run's, or damaged: logged)."""
        storage = self.layout.storage
        try:
            if not storage.is_file(self.path):
                return None
            data = read_small_file(storage, self.path, MAX_FAILED_BYTES)
            body, _, mac = data.rstrip(b"\n").rpartition(b"\n")
            if not hmac.compare_digest(mac, self._mac(body).encode("ascii")):
                raise ValueError("not written by an actor of this run (its seal does not hold)")
            value = json.loads(body.decode("utf-8"), parse_constant=_refuse)
            if not isinstance(value, dict) or value.get("version") != 1:
                raise ValueError("not a record of failed saves")
            if value.get("run") != self.run_id:
                logger.info("%s holds another run's failed saves; not this run's", self.path)
                return None
            return self._parsed(value, committed)
        except (OSError, ValueError, TypeError, KeyError, RecursionError) as exc:
            logger.warning("ignoring %s: %s", self.path, str(exc)[:200] or type(exc).__name__)
            return None

    def _parsed(self, value: dict, committed: dict[int, Manifest]) -> tuple[SaveFailures, dict[int, str]]:
        failed = value["failed"]
        if not isinstance(failed, dict) or len(failed) > FAILED_KEPT or \
                not all(isinstance(k, str) and _STEP_KEY.fullmatch(k) for k in failed):
            raise ValueError("its failed steps are not step numbers")
        last = value["last_step"]
        newest = value["newest_commit_unix"]
        if newest is not None and (type(newest) not in (int, float) or not math.isfinite(newest)):
            raise ValueError("newest_commit_unix is not a time")
        saves = SaveFailures(_count(value["total"]), _count(value["consecutive"]),
                             None if last is None else _count(last), _text(value["last_error"]) or None)
        if any(newest is None or m.created_unix > newest for m in committed.values()):
            saves.committed()  # a commit came after the newest failure
        steps = {int(k): _text(why) for k, why in failed.items()}
        return saves, {s: why for s, why in steps.items() if s not in committed}


@dataclass
class InFlightStep:
    """A step being saved: its temporary directory and what its ranks did so far."""

    tmp: Path
    attempt: int
    started: float
    accepted: set[int] = field(default_factory=set)
    """Ranks whose staged data a writer holds: they will report unless the writer dies."""
    writers: dict[int, WriterRef] = field(default_factory=dict)
    """rank -> the writer holding its hand-off (what ``settle`` asks)."""
    reports: dict[int, RankReport] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    error: str | None = None
    committing: bool = False
    """Every rank reported and the commit runs (its thread renames the directory and writes the
    manifest): an abort now waits for its outcome rather than removing what it commits."""


class StepRegistry:
    """Committed, in-flight and aborted steps; opens, aborts and settles steps in flight."""

    def __init__(self, layout: CheckpointLayout, metrics: CheckpointMetrics, group: Callable[[], GroupLayout],
                 on_change: Callable[..., None], failures: FailedSavesFile | None = None) -> None:
        """``on_change(step, rank)``: rank ``rank`` of ``step`` moved on (handed off, reported);
        ``on_change()``: anything else changed (a step opened, committed, aborted). ``failures``:
        where the run's failed saves are kept across this actor's restarts (None: in memory only)."""
        self.layout, self.metrics, self._group, self._on_change = layout, metrics, group, on_change
        self.committed: dict[int, Manifest] = layout.valid_steps("size")
        self.pending: dict[int, InFlightStep] = {}
        self.failed: dict[int, str] = {}
        self._aborted: set[tuple[int, int]] = set()
        """(step, attempt) of every aborted save: a late hand-off of the same save cannot reopen it."""
        self.saves = SaveFailures()
        self._failures = failures
        carried = failures.read(self.committed) if failures is not None else None
        if carried is not None:
            self.saves, self.failed = carried
            logger.warning("checkpoint actor restarted: %d failed save(s) of this run so far, %d since the last "
                           "commit (newest: step %s: %s)", self.saves.total, self.saves.consecutive,
                           self.saves.last_step, self.saves.last_error)

    @property
    def world_size(self) -> int:
        return self._group().world_size

    def phase_of(self, step: int, planning: bool = False) -> StepPhase | None:
        """``step``'s phase (None: unknown here); ``planning``: its plans are being gathered."""
        if step in self.committed:
            return StepPhase.COMMITTED
        p = self.pending.get(step)
        if p is not None:
            return inflight_phase(planning, len(p.accepted), len(p.reports), self.world_size)
        if step in self.failed:
            return StepPhase.ABORTED
        return StepPhase.PLANNING if planning else None

    def inflight(self, planning: list[int]) -> InFlight:
        """The newest step in flight, its phase and each rank's progress (1 handed off, 2 written);
        ``planning``: the steps whose plans are being gathered."""
        if not self.pending:
            return InFlight(max(planning), StepPhase.PLANNING) if planning else InFlight()
        step = max(self.pending)
        p = self.pending[step]
        ranks = {r: 1 for r in p.accepted} | {r: 2 for r in p.reports}
        return InFlight(step, self.phase_of(step, step in planning), ranks)

    def rank_progress(self, step: int, rank: int) -> tuple[int, int, int] | None:
        """Of ``step`` in flight: how many ranks handed off, how many reported, and rank ``rank``'s
        progress (1 handed off, 2 written), without walking every rank; None when ``step`` is not in flight."""
        p = self.pending.get(step)
        if p is None:
            return None
        return len(p.accepted), len(p.reports), 2 if rank in p.reports else 1 if rank in p.accepted else 0

    def open_step(self, step: int, attempt: int) -> str:
        """The temporary directory every rank of ``step`` writes into (created on first call)."""
        if step in self.committed:
            raise StepAborted(f"step {step} is already committed")
        if (step, attempt) in self._aborted:
            # A rank whose hand-off comes after another rank's write of this save failed: without
            # this, it would open the step again and its final save would wait for a rank that
            # already gave up on it.
            raise StepAborted(f"step {step} was aborted: {self.failed.get(step, 'an earlier failure')}")
        p = self.pending.get(step)
        if p is None or p.error is not None:
            # No await between the lookup and the insert: concurrent callers must share one directory.
            p = InFlightStep(self.layout.new_tmp_dir(step), attempt, time.monotonic())
            self.pending[step] = p
            self.failed.pop(step, None)
        return str(p.tmp)

    def accepted(self, step: int, rank: int, attempt: int, writer: WriterRef | None) -> str:
        tmp = self.open_step(step, attempt)
        self.pending[step].accepted.add(rank)
        if writer is not None:
            self.pending[step].writers[rank] = writer
        self._on_change(step, rank)
        return tmp

    def in_flight(self, step: int, attempt: int | None = None) -> InFlightStep:
        """``step`` in flight (of ``attempt``, when given); raises StepAborted when it is not
        (aborted, not known since a restart, or saved now by another attempt: a write that outlived
        its attempt's abort, whose files are not the ones this attempt's ranks wrote)."""
        p = self.pending.get(step)
        if p is None or p.error is not None:
            raise StepAborted(f"step {step} is not in flight (aborted or the checkpoint actor restarted)")
        if attempt is not None and attempt != p.attempt:
            raise StepAborted(f"step {step}: a report of attempt {attempt}'s save, but attempt {p.attempt} is "
                              "saving it now (the earlier save was aborted)")
        return p

    def reported(self, report: RankReport) -> InFlightStep:
        """Record a rank's report; the step in flight it belongs to. A report of another attempt's
        save of the step (a write that outlived its attempt's abort) is refused: its files are not
        the ones this attempt's ranks wrote."""
        p = self.in_flight(report.step, report.attempt)
        p.reports[report.rank] = report
        self._on_change(report.step, report.rank)
        return p

    def commit_done(self, step: int, manifest: Manifest) -> None:
        """``step`` is committed: its manifest is registered, its waiters wake."""
        p = self.pending.pop(step, None)
        self.committed[step] = manifest
        self.saves.committed()
        if p is not None:
            p.done.set()
        self.metrics.committed(manifest)
        self._on_change()

    async def abort(self, step: int, reason: str, attempt: int | None = None) -> None:
        """Give up on an in-flight step (of ``attempt``, when the caller knows it): remove its
        temporary directory, remember why. A committed step is not undone, nor counted as a failed
        save: a rank whose writer's answer was lost after the commit (the writer stopped or
        replaced right then) gives up on a save that is already durable."""
        p = self.pending.get(step)
        if p is not None and attempt is not None and attempt != p.attempt:
            # a failure of an earlier attempt's save of this step (aborted already): not this save's
            self._aborted.add((step, attempt))
            logger.info("checkpoint step %d of attempt %d: a late failure of attempt %d's save of it ignored: %s",
                        step, p.attempt, attempt, reason)
            return
        if p is not None and p.committing:
            # Its commit runs on a thread: removing the directory now would race the rename (a
            # committed step missing files, or on an object store a manifest with no data), and
            # the step would be counted failed while it lands. Its outcome decides.
            logger.info("checkpoint step %d is being committed; a rank's failure waits for the commit: %s",
                        step, reason)
            await p.done.wait()
        if step in self.committed:
            logger.info("checkpoint step %d is committed; a late failure of a rank's hand-off ignored: %s",
                        step, reason)
            return
        p = self.pending.pop(step, None)  # (after a failed commit: popped already by the coordinator's abort)
        for a in {attempt, p.attempt if p is not None else None} - {None}:
            self._aborted.add((step, a))
        counted = step not in self.failed
        if counted:  # the first reason is the cause; later ranks only see the step gone
            self.failed[step] = reason
            self.saves.failed(step, reason)
            self.metrics.save_failed(self.saves.consecutive)
        if p is not None:
            p.error = reason
            p.done.set()
            await asyncio.to_thread(self.layout.storage.remove_tree, p.tmp)
            self.metrics.aborted()
            self._on_change()
        logger.warning("checkpoint step %d aborted: %s", step, reason)
        if counted and self._failures is not None:  # for an actor of this run started after this one
            newest = max((m.created_unix for m in list(self.committed.values())), default=None)
            write = asyncio.ensure_future(self._failures.write(self._failures.record(self.saves, self.failed, newest)))
            with contextlib.suppress(asyncio.TimeoutError):  # storage that just failed may hang: the abort does not
                await asyncio.wait_for(asyncio.shield(write), RECORD_WAIT_S)

    async def wait_committed(self, step: int, timeout_s: float | None) -> None:
        """Block until ``step`` is committed; raises StepAborted or TimeoutError."""
        if step in self.committed:
            return
        p = self.pending.get(step)
        if p is None:
            raise StepAborted(f"step {step} is not in flight: {self.failed.get(step, 'never started')}")
        await asyncio.wait_for(p.done.wait(), timeout_s)
        if step not in self.committed:
            raise StepAborted(f"step {step} aborted: {p.error}")

    async def settle(self, timeout_s: float) -> None:
        """Before a new attempt loads: finish what can finish, abort what cannot.

        A step some rank never handed to a writer can never commit (that trainer is gone):
        abort it now. A step every rank handed off is waited for, up to ``timeout_s``, unless
        the writer of a rank that has not reported no longer holds its hand-off (it died, with
        its node or alone, or its write failed): then it can never commit and is aborted at once.
        A writer that holds it, or does not answer, is waited for.
        """
        world = self.world_size
        for step, p in list(self.pending.items()):
            if len(p.accepted) < world:
                await self.abort(step, f"ranks {sorted(set(range(world)) - p.accepted)} never handed it off")
                continue
            deadline = time.monotonic() + timeout_s
            while not p.done.is_set():
                lost = await self._lost_hand_offs(step, p)
                if lost and not p.done.is_set():
                    await self.abort(step, f"the writer holding ranks {lost} died or failed before they reported")
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    await self.abort(step, f"not committed within {timeout_s:g}s of the restart")
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(p.done.wait(), min(left, SETTLE_CHECK_S))

    async def _lost_hand_offs(self, step: int, p: InFlightStep) -> list[int]:
        """Ranks of ``step`` not reported whose writer surely no longer holds them: its node is
        dead, Ray says the actor died, or it answers that it does not hold them (a restarted
        writer holds nothing of its previous incarnation). Unknown (no answer in time) is not lost."""
        import ray
        from ray.exceptions import ActorDiedError

        waiting = {r: w for r, w in p.writers.items() if r not in p.reports}
        if not waiting:
            return []
        alive = {n["NodeID"] for n in await asyncio.to_thread(ray.nodes) if n["Alive"]}
        lost = []
        for rank, writer in sorted(waiting.items()):
            if writer.node_id in alive:
                try:
                    if await asyncio.wait_for(writer.handle.holds.remote(rank, step), WRITER_QUERY_S):
                        continue
                except ActorDiedError:
                    pass
                except Exception as exc:  # restarting, unreachable or slow to answer: it may still report
                    logger.debug("writer of rank %d step %d did not answer: %s", rank, step, exc)
                    continue
            if rank not in p.reports:  # a report may have come in while we asked
                lost.append(rank)
        return lost
