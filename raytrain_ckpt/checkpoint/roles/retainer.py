"""Retention with leases: after each commit, delete what the policy lets go, never a leased step.

A step is held by a lease of an attempt loading it (``leases``: holder -> step, in memory) or
of an exporter outside the job (a lease file, judged live by the actor's clock: see
``storage/leases.py``). Deletes run under the lease lock of a POSIX root; on an object store
``layout.delete`` re-checks the leases after removing the manifest.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Callable, Iterator

from raytrain_ckpt.checkpoint.format.manifest import Manifest
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy, newest_certified
from raytrain_ckpt.checkpoint.roles.steps import StepRegistry
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout, LeftoverWatch
from raytrain_ckpt.checkpoint.storage.leases import LeaseFiles, purge_lock
from raytrain_ckpt.checkpoint.roles.metrics import CheckpointMetrics

logger = logging.getLogger(__name__)

__all__ = ["Retainer", "out_of_space"]


def out_of_space(reason: str) -> bool:
    """Whether a failed save's reason is a full file system (ENOSPC, as the writer reports it)."""
    return os.strerror(errno.ENOSPC) in reason or "ENOSPC" in reason


class Retainer:
    """Applies ``RetentionPolicy`` to the registry's committed steps, honouring leases."""

    def __init__(self, layout: CheckpointLayout, retention: RetentionPolicy, steps: StepRegistry,
                 metrics: CheckpointMetrics, leftover_grace_s: float) -> None:
        self.layout, self.retention, self.steps, self.metrics = layout, retention, steps, metrics
        self.leases: dict[str, int] = {}
        """holder -> the step it loads (an attempt's lease, ``CheckpointActor.acquire``)."""
        self.lease_files = LeaseFiles(layout.root, storage=layout.storage)
        """Exporters' leases, judged live by our own clock (see leases.py)."""
        self.purge_errors = 0
        """Retention deletes that failed (logged); the commits they followed stand."""
        self.told_certified: list[int] = []
        """Every step the training guard reported certified (``CheckpointActor.certify``; the newest
        64): one it called certified that never committed (its save lost after it began) must not
        take the protection from the one before it."""
        self._one_pass = threading.Lock()
        """Held by a retention pass and by a new timeline's moves (``one_pass``): each forgets steps
        from the registry on a thread of its own."""
        self.leftovers = LeftoverWatch(leftover_grace_s)
        """Uncommitted entries (an aborted step a slow writer kept uploading into), judged by our clock."""

    @contextlib.contextmanager
    def purge_lock(self) -> Iterator[None]:
        """The lease lock of a POSIX root; nothing on an object store (``delete`` re-checks there)."""
        with purge_lock(self.layout.root):
            yield

    @contextlib.contextmanager
    def one_pass(self) -> Iterator[None]:
        """One pass over the committed steps at a time: a retention pass, or the moves of a new
        timeline (``ResumeTimeline.start_timeline``). Each decides from the registry and the
        storage and then forgets steps; interleaved, one forgot a step the other was still
        forgetting (a KeyError that failed the new timeline)."""
        with self._one_pass:
            yield

    def file_leased_steps(self) -> set[int]:
        return self.lease_files.leased_steps()

    def _still_unleased(self, step: int) -> Callable[[], bool] | None:
        """Object store (no lease lock): the re-check ``layout.delete`` makes after removing the manifest."""
        if self.layout.protocol.file_locks:
            return None
        return lambda: step not in self.file_leased_steps()

    def purge(self) -> None:
        """Apply retention (after a commit, a newer certified step, a save out of space). Never
        raises: the commit it follows is durable; an error is logged and counted, and the next
        pass tries again. One pass at a time (they run on threads of the actor)."""
        with self.one_pass():
            self._purge()

    def _purge(self) -> None:
        try:
            # Under the lease lock: an exporter outside the job either sees its step gone or we see its lease file.
            with self.purge_lock():
                self._drop_missing()
                # a copy (one C call, atomic under the GIL): the event loop registers commits while this
                # thread decides, and iterating the registry itself then raised mid-pass
                committed = dict(self.steps.committed)
                leased = [*self.leases.values(), *self.file_leased_steps()]
                doomed = self.retention.to_delete(committed, leased, self.steps.pending,
                                                  {s: m.metrics() for s, m in committed.items()},
                                                  self._newest_certified(committed))
                removed = [step for step in doomed if self._delete(step)]
        except Exception as exc:  # see the docstring: retention is retried, the commit stands
            self.purge_errors += 1
            logger.error("retention failed (%d failure(s) so far), steps kept for now: %s", self.purge_errors, exc)
            return
        if removed:
            logger.info("retention removed step(s) %s", removed)
            self.metrics.purged(len(removed))
        self._remove_stale_leftovers()

    def _newest_certified(self, committed: dict[int, Manifest] | None = None) -> int | None:
        """The newest certified step that is committed (``committed``, default the registry's
        steps): as the manifests record it, or as the trainers reported it since (``certify``),
        whichever is newer."""
        committed = dict(self.steps.committed) if committed is None else committed
        recorded = newest_certified({s: m.certified_step for s, m in committed.items()})
        told = max((s for s in self.told_certified if s in committed), default=None)
        return max((s for s in (recorded, told) if s is not None), default=None)

    def _remove_stale_leftovers(self) -> None:
        """After retention: remove entries that never committed and stayed unchanged for
        ``checkpoint.leftover_grace_s`` (never a step in flight). Never raises, like ``purge``."""
        try:
            self.layout.remove_stale_leftovers(self.leftovers, [p.tmp for p in list(self.steps.pending.values())],
                                               set(self.steps.committed))
        except Exception as exc:  # the next commit's pass tries again; nothing committed is touched
            self.purge_errors += 1
            logger.error("could not remove uncommitted leftovers (%d failure(s) so far): %s", self.purge_errors, exc)

    def _delete(self, step: int) -> bool:
        """Delete one committed step; a failure is logged and counted, and the step stays registered."""
        try:
            if not self.layout.delete(step, self._still_unleased(step)):
                return False  # an exporter leased it meanwhile (object store): kept, deleted by a later pass
        except FileNotFoundError:
            logger.warning("checkpoint step %d vanished from %s (removed by hand?); dropped from the registry",
                           step, self.layout.root)
        except OSError as exc:  # retried after the next commit; the step is still registered and on disk
            self.purge_errors += 1
            logger.error("retention could not delete step %d (%d failure(s) so far): %s", step, self.purge_errors, exc)
            return False
        self.steps.committed.pop(step, None)
        return True

    def _drop_missing(self) -> None:
        """Forget committed steps whose directory is gone: retention must count what is on disk."""
        for step in sorted(dict(self.steps.committed)):
            if not self.layout.is_committed_name(step):
                logger.warning("checkpoint step %d vanished from %s (removed by hand?); dropped from the registry",
                               step, self.layout.root)
                self.steps.committed.pop(step, None)
