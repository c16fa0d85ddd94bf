"""The resume timeline: which step an attempt starts from, and the steps a new start moves aside.

``acquire`` picks and verifies the step to load and leases it; ``begin`` does so for the run's
first attempt and refuses a start that would move aside a step an export holds;
``start_timeline``, once every rank loaded the start, moves the committed steps not on the new
timeline to ``step-N.abandoned-<id>`` (and the damaged ones ``acquire`` skipped to
``step-N.invalid-<id>``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable
from pathlib import Path

from raytrain_ckpt.checkpoint.records import ResumePoint
from raytrain_ckpt.checkpoint.roles.retainer import Retainer
from raytrain_ckpt.checkpoint.roles.steps import StepRegistry
from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint
from raytrain_ckpt.checkpoint.format.names import EntryKind
from raytrain_ckpt.common.locations import is_uri
from raytrain_ckpt.checkpoint.format.unpickling import vouching
from raytrain_ckpt.checkpoint.format.verify import Verify, verify_step
from raytrain_ckpt.checkpoint.storage.backends import open_storage
from raytrain_ckpt.checkpoint.storage.commit import protocol_for
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout

logger = logging.getLogger(__name__)

UNREADABLE_RETRY_S = 1.0
"""How long the resume plan waits before reading again a step whose read failed."""

__all__ = ["ResumeTimeline"]


class ResumeTimeline:
    """Starting points and the timeline they begin; see the module docstring."""

    def __init__(self, layout: CheckpointLayout, storage_options: dict, steps: StepRegistry,
                 retainer: Retainer) -> None:
        self.layout, self.storage_options, self.steps, self.retainer = layout, storage_options, steps, retainer
        self._skipped: set[int] = set()
        """Steps ``acquire`` dropped for failing verification (still on disk under their step-N name)."""
        self.on_pass: Callable[[list[str]], None] | None = None
        """Called with the scan keys of each step the resume plan's check passed (``seals.py``)."""

    async def acquire(self, holder: str, resume: str, verify: Verify) -> ResumePoint | None:
        """Pick and verify the checkpoint to resume from, newest valid first, and lease it.

        ``resume`` is ``latest``, ``none``, a step number or a path to a step directory.
        With ``latest`` a candidate that fails verification is skipped with a warning naming it; a
        step asked for by number or path that fails raises InvalidCheckpoint (starting anywhere
        else, say at step 0, would hide that the run did not continue from it).
        """
        if resume == "none":
            return None
        committed = self.steps.committed
        if resume not in ("latest",) and not resume.isdigit():
            try:
                return await asyncio.to_thread(self._point, resume if is_uri(resume) else Path(resume), verify)
            except InvalidCheckpoint as exc:
                raise InvalidCheckpoint(f"checkpoint.resume={resume}: the step does not verify ({exc}); name "
                                        "another step, or use latest for the newest valid one") from None
        candidates = sorted(committed, reverse=True)
        if resume.isdigit():
            candidates = [int(resume)] if int(resume) in committed else []
            if not candidates:
                raise InvalidCheckpoint(f"checkpoint.resume={resume}: no committed step {resume} in "
                                        f"{self.layout.root} (have {sorted(committed)})")
        for step in candidates:
            try:
                point = await self._verified(self.layout.step_dir(step), verify)
            except InvalidCheckpoint as exc:
                committed.pop(step, None)
                if resume.isdigit():  # the step asked for, not "the newest that verifies": no fallback
                    raise InvalidCheckpoint(f"checkpoint.resume={resume}: step {step} does not verify ({exc}); "
                                            f"name another step (committed: {sorted(committed)}), or use "
                                            "latest for the newest valid one") from None
                logger.warning("not resuming from step %d: %s; trying the previous one", step, exc)
                self._skipped.add(step)
                continue
            self.retainer.leases[holder] = step
            return point
        return None

    async def begin(self, holder: str, resume: str, verify: Verify) -> ResumePoint | None:
        """Acquire the run's starting point (see ``acquire``); ``start_timeline`` makes it the head
        of the timeline once every rank has loaded it.

        Refuses (InvalidCheckpoint) a start that would have to move aside a step an export holds.
        """
        point = await self.acquire(holder, resume, verify)
        head = self._head_of(point.step if point else None, point.path if point else None)
        await asyncio.to_thread(self._check_unleased, [s for s in self.steps.committed if s > head], resume)
        return point

    async def start_timeline(self, step: int | None, path: str | None, resume: str) -> None:
        """Every rank loaded the run's starting point (``step`` at ``path``; None: a fresh start):
        make it the head of the timeline.

        Every committed step of this root that is not on the new timeline is moved aside to
        ``step-N.abandoned-<id>``: the steps newer than a step of this root, or all of them when
        the run starts fresh or from another root's step. Otherwise retention would delete the
        new run's steps (it keeps the highest numbers), a new step would meet an old one of the
        same number, and a restart would resume the abandoned run. Not before the ranks loaded
        the start: a start that fails (a checkpoint of another model shape) leaves this root's
        timeline as it was. The driver passes the start back, so an actor restarted meanwhile
        moves the same steps.
        """
        await asyncio.to_thread(self._abandon_after, self._head_of(step, path), resume)

    def release(self, holder: str) -> None:
        self.retainer.leases.pop(holder, None)

    def _head_of(self, step: int | None, path: str | None) -> int:
        """The step of this root a run starts from, -1 when it starts fresh or from another root."""
        if step is None or path is None or not self._same(path, self.layout.step_dir(step)):
            return -1
        return step

    def _same(self, a: str, b: Path | str) -> bool:
        return self.layout.protocol.same_path(a, b)

    def _abandon_after(self, head: int, resume: str) -> None:
        with self.retainer.one_pass():  # a retention pass on another thread forgets steps too
            self._abandon_after_locked(head, resume)

    def _abandon_after_locked(self, head: int, resume: str) -> None:
        self._set_damaged_aside(head)
        # what the guard certified after the head was on the old timeline: a step of that number
        # the new timeline commits is not certified, and must not take the head's protection
        self.retainer.told_certified = [s for s in self.retainer.told_certified if s <= head]
        committed = self.steps.committed
        newer = [s for s in sorted(committed) if s > head]
        if not newer:
            return
        with self.retainer.purge_lock():  # an exporter holds its step by a lease file
            self._check_unleased(newer, resume, locked=True)
            tag = uuid.uuid4().hex[:8]
            moved = [self.layout.storage.name(self.layout.abandon(s, tag)) for s in newer]
        for s in newer:
            committed.pop(s, None)
        logger.warning("checkpoint.resume=%s starts a new timeline%s: %d newer committed step(s) moved aside, "
                       "kept and never loaded: %s", resume, f" at step {head}" if head >= 0 else "", len(moved),
                       ", ".join(moved))

    def _check_unleased(self, steps: list[int], resume: str, locked: bool = False) -> None:
        """Raise InvalidCheckpoint when an export holds one of ``steps`` (the steps a new timeline moves aside)."""
        if not steps:
            return
        with contextlib.nullcontext() if locked else self.retainer.purge_lock():
            leased = sorted(set(steps) & self.retainer.file_leased_steps())
        if leased:
            raise InvalidCheckpoint(f"checkpoint.resume={resume}: step(s) {leased} are being exported and "
                                    "would be moved aside; wait for the export to finish and start again")

    def _set_damaged_aside(self, head: int) -> None:
        """Move the damaged steps newer than ``head`` that ``acquire`` skipped to ``step-N.invalid-<id>``.

        They are off the new timeline too. Left as ``step-N``, a rebuilt registry (sizes only)
        would count a step whose damage only its checksum shows, and this timeline's retention
        would delete it.

        A skipped step that is committed again (a save of its number since: ``acquire`` took the
        damaged one out of the registry, only a commit puts the number back) is not the damaged
        one: it is left to the timeline's moves like any committed step.
        """
        committed = self.steps.committed
        for step in sorted(s for s in self._skipped if s > head and s not in committed):
            if self.layout.is_committed_name(step):
                self.layout.set_aside(self.layout.step_dir(step), EntryKind.INVALID,
                                      "not intact, skipped on resume" + (f"; the run continues from step {head}"
                                                                         if head >= 0 else ""))
        self._skipped.clear()

    async def _verified(self, path: Path | str, verify: Verify) -> ResumePoint:
        """``_point``, asked once more after a read that failed (an NFS ``EIO``/``ESTALE``, a 5xx):
        that says nothing of the step, and a step skipped for it would leave the timeline."""
        try:
            return await asyncio.to_thread(self._point, path, verify)
        except InvalidCheckpoint as exc:
            if "unreadable" not in str(exc):
                raise
            logger.warning("reading %s failed (%s); reading it again in %gs", path, exc, UNREADABLE_RETRY_S)
        await asyncio.sleep(UNREADABLE_RETRY_S)
        return await asyncio.to_thread(self._point, path, verify)

    def _point(self, path: Path | str, verify: Verify) -> ResumePoint:
        """Verify a step, which may live on another storage than this root (``checkpoint.resume``)."""
        same = protocol_for(path) is type(self.layout.protocol)
        storage = self.layout.storage if same else open_storage(path, self.storage_options if is_uri(path) else None)
        with vouching(every=True) as keys:
            m = verify_step(path, verify, storage)
        if keys and self.on_pass is not None:
            self.on_pass(keys)
        return ResumePoint(m.step, str(path), m.world_size, m.samples_seen, keys[-1] if keys else None)
