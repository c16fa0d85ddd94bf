"""A job's checkpoint root: its step entries, scanning, the leftovers of saves that never
committed, and the commit of a step through the root's ``CommitProtocol``.

What a valid step is (names, manifest, verification) is ``format``'s; the order of writes that
makes one durable (a POSIX rename, or an object store's manifest written last) is ``commit.py``'s,
chosen once from the root. This class asks both and keeps no branch on the kind of storage.

Leftovers in a long run: an entry that never committed (``step-N/`` without a manifest on an
object store, ``step-N.tmp-<id>`` on POSIX) and is not in flight is removed by the
CheckpointActor after each commit once ``LeftoverWatch`` has seen it unchanged (same files,
sizes and modification times) for ``grace_s`` of the actor's own monotonic clock. The store's
timestamps are only compared with themselves, never with a local clock, so clock skew between
the store and the node cannot make a fresh upload look old. On an object store an uncommitted
``step-N/`` is also removed when the next run starts (``remove_leftover_tmp``) and when a save
of N reuses the prefix (``new_tmp_dir``); a writer on another node may still be uploading into
an aborted step, so a running job does not remove one at once.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Collection, Hashable
from typing import Any

from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint

from raytrain_ckpt.checkpoint.format.manifest import Manifest
from raytrain_ckpt.checkpoint.format.names import Entry, EntryKind, Location, parse_entry, step_name
from raytrain_ckpt.checkpoint.format.verify import Verify, read_manifest, verify_step, verify_steps
from raytrain_ckpt.checkpoint.storage.backends import Storage, open_storage
from raytrain_ckpt.checkpoint.storage.commit import commit_protocol

logger = logging.getLogger(__name__)

__all__ = ["CheckpointLayout", "LEFTOVER_GRACE_S", "LeftoverWatch"]

LEFTOVER_GRACE_S = 3600.0
"""Default ``checkpoint.leftover_grace_s``: how long an uncommitted entry must stay unchanged
before a running job removes it."""


class LeftoverWatch:
    """Which uncommitted entries have stayed unchanged for ``grace_s`` of this reader's clock.

    Stateful like ``leases.LeaseFiles``: "unchanged" is judged against what the same instance saw
    before, so one instance (the CheckpointActor's) must look every time. An entry seen for the
    first time, or seen changed, starts its grace period again.
    """

    def __init__(self, grace_s: float = LEFTOVER_GRACE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.grace_s, self._clock = grace_s, clock
        self._seen: dict[str, tuple[Hashable, float]] = {}
        """entry name -> (its snapshot, this reader's time when it last changed)"""

    def stale(self, snapshots: dict[str, Hashable]) -> list[str]:
        """The names among ``snapshots`` (entry name -> what is under it now) unchanged for ``grace_s``."""
        now = self._clock()
        self._seen = {name: seen for name, seen in self._seen.items() if name in snapshots}
        out = []
        for name, snap in sorted(snapshots.items()):
            last, changed_at = self._seen.get(name, (None, now))
            if snap != last:
                self._seen[name] = (snap, now)
            elif now - changed_at >= self.grace_s:
                out.append(name)
        return out


class CheckpointLayout:
    """Step entries, scanning and the commit under one job's checkpoint root.

    ``root`` is a local path (POSIX protocol: tmp dir + rename) or a URI (object-store
    protocol: manifest last); locations it hands out are ``Path`` objects on POSIX storage and
    URI strings on an object store.
    """

    def __init__(self, root: Location, storage: Storage | None = None,
                 options: dict[str, Any] | None = None) -> None:
        self.storage = storage if storage is not None else open_storage(root, options)
        self.protocol = commit_protocol(root, self.storage)
        self.root: Location = self.protocol.root

    @property
    def atomic(self) -> bool:
        """Whether a step commits by an atomic rename (POSIX); for reports: code asks ``protocol``."""
        return self.protocol.renames

    @property
    def name(self) -> str:
        """The last component of the root (the job name under checkpoint.dir)."""
        return self.storage.name(self.root)

    def step_dir(self, step: int) -> Location:
        return self.storage.join(self.root, step_name(step))

    def new_tmp_dir(self, step: int) -> Location:
        """A fresh, empty place to write ``step`` into.

        POSIX: a new ``step-N.tmp-<id>`` directory. Object store: ``step-N/`` itself, cleared
        of an uncommitted leftover; a torn committed step-N is moved aside first and a valid
        one is never written into (FileExistsError).
        """
        return self.protocol.new_tmp(step, self._move_aside)

    def entries(self) -> list[tuple[Entry, Location]]:
        """Every step entry of any kind, sorted by name; other files are ignored."""
        out = []
        for name in self.storage.listdir(self.root):
            entry = parse_entry(name)
            if entry is not None:
                out.append((entry, self.storage.join(self.root, name)))
        return out

    def step_dirs(self) -> dict[int, Location]:
        """Every committed-name ``step-N`` entry (valid or not), by step."""
        return {e.step: path for e, path in self.entries() if e.kind.is_loadable}

    def is_committed_name(self, step: int) -> bool:
        """Whether ``step-N`` exists (POSIX: the directory; object store: its manifest object)."""
        return self.protocol.is_committed(self.step_dir(step))

    def remove_leftover_tmp(self) -> list[Location]:
        """Delete what saves that never committed left: ``*.tmp-*`` directories (POSIX), and
        ``step-N/`` prefixes without a manifest (object store). Call it before any save starts."""
        removed = [path for _, path in self.uncommitted()]
        for path in removed:
            self.storage.remove_tree(path)
        if removed:
            logger.warning("removed %d uncommitted checkpoint dir(s): %s", len(removed),
                           ", ".join(self.storage.name(p) for p in removed))
        return removed

    def uncommitted(self, committed: Collection[int] = ()) -> list[tuple[Entry, Location]]:
        """Entries that never committed: ``*.tmp-*`` (POSIX) and manifest-less ``step-N/`` (object
        store; the steps in ``committed`` are known to have a manifest and are not asked)."""
        return self.protocol.uncommitted(self.entries(), committed)

    def remove_stale_leftovers(self, watch: LeftoverWatch, in_flight: Collection[Location],
                               committed: Collection[int] = ()) -> list[Location]:
        """Remove the uncommitted entries that ``watch`` judges unchanged for its grace period,
        never one of ``in_flight`` (the places this job's pending saves write to). ``committed``:
        steps known to be committed (spares one request each on an object store)."""
        busy = {str(p).rstrip("/") for p in in_flight}
        candidates = {self.storage.name(path): path for _, path in self.uncommitted(committed)
                      if str(path).rstrip("/") not in busy}
        snapshots = {name: self.storage.snapshot(path) for name, path in candidates.items()}
        doomed = [candidates[name] for name in watch.stale(snapshots)]
        for path in doomed:
            self.storage.remove_tree(path)
        if doomed:
            logger.warning("removed %d uncommitted checkpoint entr(ies) unchanged for %gs: %s", len(doomed),
                           watch.grace_s, ", ".join(self.storage.name(p) for p in doomed))
        return doomed

    def read_manifest(self, path: Location) -> Manifest:
        """The validated manifest of a step directory; raises InvalidCheckpoint."""
        return read_manifest(self.storage, path)

    def verify(self, path: Location, level: Verify = "checksum") -> Manifest:
        """Check a step directory against its manifest (``format.verify``); raises InvalidCheckpoint."""
        return verify_step(path, level, self.storage)

    def verify_many(self, paths: list[Location], level: Verify = "checksum",
                    progress: Callable[[int], None] | None = None) -> list[Manifest | InvalidCheckpoint]:
        """``verify`` of many step directories (their ``.metadata`` checks sent to the reader
        process together, ``format.verify.verify_steps``): a manifest or the error, per path."""
        return verify_steps(paths, level, self.storage, progress)

    def valid_steps(self, level: Verify = "size") -> dict[int, Manifest]:
        """Steps whose directories verify; invalid ones are logged and skipped."""
        steps = sorted(self.step_dirs().items())
        out = {}
        for (step, _), verdict in zip(steps, self.verify_many([path for _, path in steps], level)):
            if isinstance(verdict, InvalidCheckpoint):
                logger.warning("skipping checkpoint step %d: %s", step, verdict)
            else:
                out[step] = verdict
        return out

    def describe(self, path: Location) -> dict[str, int]:
        """The manifest entry of a stored file: its size and CRC-32C (read back)."""
        size = self.storage.size(path)
        if size is None:
            raise FileNotFoundError(path)
        return {"size": size, "crc32c": self.storage.checksum(path, "crc32c")}

    def _check_sizes(self, tmp: Location, manifest: Manifest) -> None:
        for name, want in manifest.files.items():
            size = self.storage.size(self.storage.join(tmp, name))
            if size != want.size:
                raise InvalidCheckpoint(f"{self.storage.join(tmp, name)}: {-1 if size is None else size} bytes "
                                        f"stored, {want.size} reported; not committing")

    def commit(self, tmp: Location, manifest: Manifest) -> Location:
        """POSIX: write the manifest, fsync it, rename ``tmp`` to ``step-N`` and fsync the parent.
        Object store: ``tmp`` is ``step-N`` itself; the manifest is written last, in one PUT.

        An existing ``step-N`` that does not verify (a torn earlier attempt) is moved aside to
        ``step-N.invalid-<id>`` first; a valid one is never replaced.
        """
        self._check_sizes(tmp, manifest)
        manifest.created_unix = time.time()
        return self.protocol.commit(tmp, self.step_dir(manifest.step), manifest, self._move_aside)

    def _move_aside(self, final: Location) -> None:
        try:
            self.verify(final, "checksum")  # rare: only when step-N already exists
        except InvalidCheckpoint as exc:
            self.set_aside(final, EntryKind.INVALID, str(exc))
            return
        raise FileExistsError(f"{final} is a valid checkpoint and is never overwritten")

    def set_aside(self, path: Location, kind: EntryKind, reason: str) -> Location:
        """Rename a committed-name entry to ``step-N.<kind>-<id>`` (durably): kept and listed, never loaded."""
        entry = parse_entry(self.storage.name(path))
        assert entry is not None and entry.kind.is_loadable and not kind.is_loadable, (path, kind)
        aside = self.storage.join(self.root, step_name(entry.step, kind, uuid.uuid4().hex[:8]))
        logger.warning("moving %s aside to %s: %s", self.storage.name(path), self.storage.name(aside), reason)
        self.protocol.move(path, aside)
        return aside

    def delete(self, step: int, still_doomed: Callable[[], bool] | None = None) -> bool:
        """Remove a committed step. POSIX: rename out of the step namespace first (durably), so a
        crash mid-delete leaves no torn step-N, only a ``.tmp-`` entry that the next start
        removes. Object store: the manifest first, then the objects (a leftover, removed on start).

        ``still_doomed`` (object store; POSIX callers hold the lease lock instead) is asked after
        the manifest is gone: False (a lease on the step appeared) puts the same manifest back
        and keeps the step. Returns whether the step was deleted.
        """
        return self.protocol.delete(step, self.step_dir(step), still_doomed)

    def abandon(self, step: int, tag: str) -> Location:
        """Move committed ``step`` out of the step namespace to ``step-N.abandoned-<tag>``: kept
        on disk, never loaded, never purged (a run that resumed from an older step trains
        another timeline, whose steps must not meet this one's)."""
        final = self.step_dir(step)
        aside = self.storage.join(self.root, step_name(step, EntryKind.ABANDONED, tag))
        self.protocol.move(final, aside)
        return aside
