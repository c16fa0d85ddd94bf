"""On-disk layout of a job's checkpoints and the commit protocol that makes a step valid.

::

    <checkpoint.dir>/<job name>/
        step-00000040/                     committed: DCP shards, .metadata, manifest.json
        step-00000050.tmp-1a2b3c/          being written (or left over by a crash; removed on start)
        step-00000030.invalid-9f8e7d6c/    a torn step-N moved aside by a re-save of N or a resume (kept, never loaded)
        step-00000060.abandoned-5a4b3c2d/  a step of an abandoned timeline moved aside (kept, never loaded)

This module is the one owner of those names: ``step_name`` writes them, ``parse_entry`` reads
them, and only an entry of kind ``committed`` can ever be a valid step.

A step directory is valid only if ``manifest.json`` parses into a valid ``Manifest``, names
this step, and every file it lists is a regular file with the recorded size (and checksum when
verifying checksums; ``.metadata``, which is unpickled on load, is always checksummed). The
manifest is written and fsynced last inside the temporary directory, which is then renamed
atomically and the parent fsynced: a reader sees either no ``step-N`` or a complete one.

Object stores (``s3://``, ``gs://``, ``memory://``; see ``storage.py``) have no rename, so the
same rules hold through another order of writes:

- **commit**: shards and ``.metadata`` are written in place under ``step-N/``; the manifest is
  written LAST, in one PUT, and is the commit marker. A ``step-N/`` without a manifest is an
  uncommitted leftover (a writer killed mid-upload, a save that aborted): it never verifies, so
  it is never loaded, and it is removed when the next run starts (``remove_leftover_tmp``), when
  a save of N reuses the prefix (``new_tmp_dir``), or, in a long run, once nothing under it has
  changed for ``checkpoint.leftover_grace_s`` (``remove_stale_leftovers``; a writer on another
  node may still be uploading into an aborted step, so it is not removed at once).
- **delete** (retention): the manifest first, then the objects: a crash in between leaves a
  manifest-less leftover, never a torn step that looks committed.
- **move aside** (``set_aside``, ``abandon``): rename by copy: every object is copied to
  ``step-N.<kind>-<id>/``, its manifest last, and only then is the source deleted, manifest
  first. At every moment the step is committed under one of the two names (or both): a
  committed step is never lost.
- ``.tmp-`` entries do not occur (nothing is staged for a rename). Exporters' lease objects
  live under ``leases/`` as on POSIX; without a lock, ``delete`` re-reads them after removing the
  manifest and puts the manifest back if a lease on the step appeared (see ``leases.py``).

Leftovers in a long run: an entry that never committed (``step-N/`` without a manifest on an
object store, ``step-N.tmp-<id>`` on POSIX) and is not in flight is removed by the
CheckpointActor after each commit once ``LeftoverWatch`` has seen it unchanged (same files,
sizes and modification times) for ``grace_s`` of the actor's own monotonic clock. The store's
timestamps are only compared with themselves, never with a local clock, so clock skew between
the store and the node cannot make a fresh upload look old.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Collection, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from raytrain_ckpt.checkpoint.format.manifest import (MANIFEST, FileEntry, InvalidCheckpoint, Manifest, UnsafeCheckpoint,
                                               checksum_name, describe_file, file_crc32)
from raytrain_ckpt.checkpoint.storage.backends import Location, Storage, open_storage

logger = logging.getLogger(__name__)

__all__ = [
    "MANIFEST",
    "CheckpointLayout",
    "Entry",
    "EntryKind",
    "InvalidCheckpoint",
    "LEFTOVER_GRACE_S",
    "LeftoverWatch",
    "Manifest",
    "UnsafeCheckpoint",
    "describe_file",
    "file_crc32",
    "fsync_dir",
    "parse_entry",
    "step_name",
]

_ENTRY_RE = re.compile(r"step-([0-9]{8,})(?:\.([a-z]+)-([0-9a-f]+))?")

Verify = Literal["size", "checksum"]
_VERIFY_THREADS = min(4, os.cpu_count() or 1)
"""Files of one step checksummed at once."""


MAX_MANIFEST_BYTES = 64 << 20
"""Largest manifest.json read: a manifest lists each file in about 80 bytes, so even 100,000 ranks
stay far below; a bigger file in a step directory is refused before it is read into memory."""
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


class EntryKind(enum.Enum):
    """What a ``step-N[.<kind>-<id>]`` entry under a job's checkpoint root is."""

    COMMITTED = "committed"
    """``step-N``: committed, if it verifies."""
    TMP = "tmp"
    """``step-N.tmp-<id>``: being written, or left by a crash or an interrupted delete."""
    INVALID = "invalid"
    """``step-N.invalid-<id>``: a step-N that did not verify, moved aside by a re-save of N or a resume past it."""
    ABANDONED = "abandoned"
    """``step-N.abandoned-<id>``: a step of a timeline that was abandoned (a resume from an older
    step), moved aside so the new timeline can reuse the number."""

    @property
    def is_loadable(self) -> bool:
        """Only a committed entry can be loaded; every moved-aside kind is listed, never loaded."""
        return self is EntryKind.COMMITTED


@dataclass(frozen=True)
class Entry:
    """A parsed entry name."""

    step: int
    kind: EntryKind
    name: str


def step_name(step: int, kind: EntryKind = EntryKind.COMMITTED, tag: str = "") -> str:
    """``step-00000040``, or ``step-00000040.<kind>-<tag>`` for the other kinds."""
    base = f"step-{step:08d}"
    return base if kind is EntryKind.COMMITTED else f"{base}.{kind.value}-{tag}"


def parse_entry(name: str) -> Entry | None:
    """The step and kind of a directory entry name; None for anything that is not a step entry.

    Only the canonical spelling counts (``step-00000040``, not ``step-40``), so one step has
    one committed name.
    """
    m = _ENTRY_RE.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    if m.group(1) != f"{step:08d}":
        return None
    if m.group(2) is None:
        return Entry(step, EntryKind.COMMITTED, name)
    try:
        kind = EntryKind(m.group(2))
    except ValueError:
        return None
    return Entry(step, kind, name) if kind is not EntryKind.COMMITTED else None


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_file(storage: Storage, path: Location, want: FileEntry, checksum: bool,
               progress: Callable[[int], None] | None = None) -> str | None:
    """The problem of one listed file against its manifest entry, or None."""
    name = storage.name(path)
    size = storage.size(path)
    if size is None:
        _advance(progress, want.size)
        if isinstance(path, Path) and path.is_symlink():
            return f"{name} is a symlink, not a file the save wrote"
        if isinstance(path, Path) and path.exists():
            return f"{name} is not a regular file (a directory, FIFO, socket or device), not a file the save wrote"
        return f"{name} is missing"
    if size != want.size:
        _advance(progress, want.size)
        return f"{name} has {size} bytes, the manifest says {want.size} (truncated or overwritten)"
    if not checksum:
        _advance(progress, want.size)
        return None
    algorithm, value = want.checksum
    if storage.checksum(path, algorithm, progress) != value:
        return f"{name} fails its {checksum_name(algorithm)} check (corrupt)"
    return None


def _metadata_problems(storage: Storage, path: Location, files: Collection[str]) -> Iterator[str]:
    from raytrain_ckpt.checkpoint.format.unpickling import check_metadata_stream  # loading's verdict, without torch

    where = storage.join(path, ".metadata")
    try:
        with storage.open_read(where) as f:
            check_metadata_stream(f, str(where), files)
    except InvalidCheckpoint as exc:
        yield str(exc).replace(f"{path}/", "", 1)
    except OSError as exc:
        yield f".metadata is unreadable ({exc})"


def _advance(progress: Callable[[int], None] | None, n: int) -> None:
    if progress is not None:
        progress(n)


class CheckpointLayout:
    """Names, scanning, verification and the atomic commit under one job's checkpoint root.

    ``root`` is a local path (POSIX protocol: tmp dir + rename) or a URI (object-store
    protocol: manifest last); locations it hands out are ``Path`` objects on POSIX storage and
    URI strings on an object store.
    """

    def __init__(self, root: Location, storage: Storage | None = None,
                 options: dict[str, Any] | None = None) -> None:
        self.storage = storage if storage is not None else open_storage(root, options)
        self.atomic = self.storage.atomic_rename
        self.root: Location = Path(root) if self.atomic else str(root).rstrip("/")

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
        if not self.atomic:
            return self._clear_for_write(step)
        self.storage.makedirs(self.root)
        path = self.storage.join(self.root, step_name(step, EntryKind.TMP, uuid.uuid4().hex[:12]))
        Path(path).mkdir()
        return path

    def _clear_for_write(self, step: int) -> Location:
        final = self.step_dir(step)
        if self.storage.is_file(self.storage.join(final, MANIFEST)):
            self._move_aside(final)
        elif self.storage.is_dir(final):
            logger.warning("removing uncommitted leftover %s before writing step %d", final, step)
            self.storage.remove_tree(final)
        return final

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
        if self.atomic:
            return self.storage.is_dir(self.step_dir(step))
        return self.storage.is_file(self.storage.join(self.step_dir(step), MANIFEST))

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
        entries = self.entries()
        out = [(e, path) for e, path in entries if e.kind is EntryKind.TMP]
        if not self.atomic:
            out += [(e, path) for e, path in entries if e.kind.is_loadable and e.step not in committed
                    and not self.storage.is_file(self.storage.join(path, MANIFEST))]
        return out

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
        mpath = self.storage.join(path, MANIFEST)
        if not self.storage.is_file(mpath):
            if not self.storage.is_dir(path):
                raise InvalidCheckpoint(f"{path} is not a directory")
            raise InvalidCheckpoint(f"{path} has no {MANIFEST} (never committed)")
        size = self.storage.size(mpath)
        if size is not None and size > MAX_MANIFEST_BYTES:  # data, not trusted: never read a huge file whole
            raise InvalidCheckpoint(f"{mpath} is {size} bytes, more than any manifest holds "
                                    f"({MAX_MANIFEST_BYTES >> 20} MiB); it is not one this project wrote")
        try:
            text = self.storage.read_bytes(mpath).decode("utf-8")
            return Manifest.from_json(text)
        except (InvalidCheckpoint, OSError, UnicodeDecodeError) as exc:
            raise InvalidCheckpoint(f"{mpath} is unreadable: {exc}") from None

    def problems(self, path: Location, manifest: Manifest, level: Verify = "checksum",
                 progress: Callable[[int], None] | None = None) -> Iterator[str]:
        """Every problem of a step directory against its manifest, lazily (stop at the first to fail fast).

        ``.metadata`` is checksummed at every level and then read with the restricted unpickler:
        it is unpickled when the step is loaded, and a step whose metadata asks for code is invalid.
        """
        name = self.storage.name(path)
        entry = parse_entry(name)
        if entry is None or not entry.kind.is_loadable or entry.step != manifest.step:
            yield f"{name} holds the manifest of step {manifest.step} (not its committed step-N name)"
        if ".metadata" not in manifest.files:
            yield "the manifest lists no .metadata"
        intact = True
        items = sorted(manifest.files.items())
        # Files are checked on a few threads (CRC-32C releases the GIL), results in manifest order.
        pool = ThreadPoolExecutor(max_workers=min(_VERIFY_THREADS, len(items) or 1))
        try:
            checks = pool.map(lambda item: check_file(self.storage, self.storage.join(path, item[0]), item[1],
                                                      level == "checksum" or item[0] == ".metadata", progress), items)
            for problem in checks:
                if problem is not None:
                    intact = False
                    yield problem
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        if intact and ".metadata" in manifest.files:
            yield from _metadata_problems(self.storage, path, set(manifest.files))

    def verify(self, path: Location, level: Verify = "checksum") -> Manifest:
        """Check a step directory against its manifest; raises InvalidCheckpoint naming the first problem."""
        manifest = self.read_manifest(path)
        problem = next(self.problems(path, manifest, level), None)
        if problem is not None:
            raise InvalidCheckpoint(f"{path}: {problem}")
        return manifest

    def valid_steps(self, level: Verify = "size") -> dict[int, Manifest]:
        """Steps whose directories verify; invalid ones are logged and skipped."""
        out = {}
        for step, path in sorted(self.step_dirs().items()):
            try:
                out[step] = self.verify(path, level)
            except InvalidCheckpoint as exc:
                logger.warning("skipping checkpoint step %d: %s", step, exc)
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
        if not self.atomic:
            return self._commit_in_place(tmp, manifest)
        mpath = Path(tmp) / MANIFEST
        with open(mpath, "w", encoding="utf-8") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(Path(tmp))
        final = Path(self.step_dir(manifest.step))
        if final.exists() or final.is_symlink():
            self._move_aside(final)
        os.rename(tmp, final)
        fsync_dir(Path(self.root))
        return final

    def _commit_in_place(self, tmp: Location, manifest: Manifest) -> Location:
        final = self.step_dir(manifest.step)
        assert str(tmp) == str(final), (tmp, final)  # new_tmp_dir hands out step-N itself
        mpath = self.storage.join(final, MANIFEST)
        if self.storage.is_file(mpath):
            raise FileExistsError(f"{final} was committed by another save meanwhile; never overwritten")
        self.storage.write_bytes(mpath, manifest.to_json().encode("utf-8"))
        return final

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
        self._move(path, aside)
        return aside

    def _move(self, src: Location, dst: Location) -> None:
        """POSIX: one durable rename. Object store: copy every object, the manifest last, then
        delete the source, manifest first (see the module docstring)."""
        if self.atomic:
            os.rename(src, dst)
            fsync_dir(Path(self.root))
            return
        names = self.storage.listdir(src)
        for name in sorted(names, key=lambda n: n == MANIFEST):
            self.storage.copy_file(self.storage.join(src, name), self.storage.join(dst, name))
        self.storage.remove_file(self.storage.join(src, MANIFEST))
        self.storage.remove_tree(src)

    def delete(self, step: int, still_doomed: Callable[[], bool] | None = None) -> bool:
        """Remove a committed step. POSIX: rename out of the step namespace first (durably), so a
        crash mid-delete leaves no torn step-N, only a ``.tmp-`` entry that the next start
        removes. Object store: the manifest first, then the objects (a leftover, removed on start).

        ``still_doomed`` (object store; POSIX callers hold the lease lock instead) is asked after
        the manifest is gone: False (a lease on the step appeared) puts the same manifest back
        and keeps the step. Returns whether the step was deleted.
        """
        final = self.step_dir(step)
        if not self.atomic:
            if not self.storage.is_dir(final):
                raise FileNotFoundError(final)
            mpath = self.storage.join(final, MANIFEST)
            body = self.storage.read_bytes(mpath) if still_doomed is not None and self.storage.is_file(mpath) else None
            self.storage.remove_file(mpath)
            if still_doomed is not None and not still_doomed():
                if body is not None:
                    self.storage.write_bytes(mpath, body)
                logger.warning("step %d was leased while being deleted: its manifest is back, the step is kept", step)
                return False
            self.storage.remove_tree(final)
            return True
        doomed = Path(final).with_name(step_name(step, EntryKind.TMP, uuid.uuid4().hex[:12]))
        os.rename(final, doomed)
        fsync_dir(Path(self.root))
        shutil.rmtree(doomed, ignore_errors=True)
        return True

    def abandon(self, step: int, tag: str) -> Location:
        """Move committed ``step`` out of the step namespace to ``step-N.abandoned-<tag>``: kept
        on disk, never loaded, never purged (a run that resumed from an older step trains
        another timeline, whose steps must not meet this one's)."""
        final = self.step_dir(step)
        aside = self.storage.join(self.root, step_name(step, EntryKind.ABANDONED, tag))
        self._move(final, aside)
        return aside
