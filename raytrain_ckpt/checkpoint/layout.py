"""On-disk layout of a job's checkpoints and the commit protocol that makes a step valid.

::

    <checkpoint.dir>/<job name>/
        step-00000040/                     committed: DCP shards, .metadata, manifest.json
        step-00000050.tmp-1a2b3c/          being written (or left over by a crash; removed on start)
        step-00000030.invalid-9f8e7d6c/    a torn step-N moved aside by a re-save of N (kept, never loaded)
        step-00000060.abandoned-5a4b3c2d/  a step of an abandoned timeline moved aside (kept, never loaded)

This module is the one owner of those names: ``step_name`` writes them, ``parse_entry`` reads
them, and only an entry of kind ``committed`` can ever be a valid step.

A step directory is valid only if ``manifest.json`` parses into a valid ``Manifest``, names
this step, and every file it lists is a regular file with the recorded size (and checksum when
verifying checksums; ``.metadata``, which is unpickled on load, is always checksummed). The
manifest is written and fsynced last inside the temporary directory, which is then renamed
atomically and the parent fsynced: a reader sees either no ``step-N`` or a complete one.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from raytrain_ckpt.checkpoint.manifest import (MANIFEST, FileEntry, InvalidCheckpoint, Manifest, UnsafeCheckpoint,
                                               checksum_file, checksum_name, describe_file, file_crc32)

logger = logging.getLogger(__name__)

__all__ = [
    "MANIFEST",
    "CheckpointLayout",
    "Entry",
    "EntryKind",
    "InvalidCheckpoint",
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


class EntryKind(enum.Enum):
    """What a ``step-N[.<kind>-<id>]`` entry under a job's checkpoint root is."""

    COMMITTED = "committed"
    """``step-N``: committed, if it verifies."""
    TMP = "tmp"
    """``step-N.tmp-<id>``: being written, or left by a crash or an interrupted delete."""
    INVALID = "invalid"
    """``step-N.invalid-<id>``: a step-N that did not verify, moved aside by a re-save of N."""
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


def check_file(path: Path, want: FileEntry, checksum: bool,
               progress: Callable[[int], None] | None = None) -> str | None:
    """The problem of one listed file against its manifest entry, or None."""
    name = path.name
    if path.is_symlink() or not path.is_file():
        _advance(progress, want.size)
        return f"{name} is missing" if not path.is_symlink() else f"{name} is a symlink, not a file the save wrote"
    size = path.stat().st_size
    if size != want.size:
        _advance(progress, want.size)
        return f"{name} has {size} bytes, the manifest says {want.size} (truncated or overwritten)"
    if not checksum:
        _advance(progress, want.size)
        return None
    algorithm, value = want.checksum
    if checksum_file(path, algorithm, progress) != value:
        return f"{name} fails its {checksum_name(algorithm)} check (corrupt)"
    return None


def _metadata_problems(path: Path) -> Iterator[str]:
    from raytrain_ckpt.checkpoint.unpickling import check_metadata_file  # loading's verdict, without torch

    try:
        check_metadata_file(path / ".metadata")
    except InvalidCheckpoint as exc:
        yield str(exc).replace(f"{path}/", "", 1)


def _advance(progress: Callable[[int], None] | None, n: int) -> None:
    if progress is not None:
        progress(n)


class CheckpointLayout:
    """Names, scanning, verification and the atomic commit under one job's checkpoint root."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def step_dir(self, step: int) -> Path:
        return self.root / step_name(step)

    def new_tmp_dir(self, step: int) -> Path:
        """A fresh, empty directory to write ``step`` into."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / step_name(step, EntryKind.TMP, uuid.uuid4().hex[:12])
        path.mkdir()
        return path

    def entries(self) -> list[tuple[Entry, Path]]:
        """Every step entry of any kind, sorted by name; other files are ignored."""
        if not self.root.is_dir():
            return []
        out = []
        for path in sorted(self.root.iterdir(), key=lambda p: p.name):
            entry = parse_entry(path.name)
            if entry is not None:
                out.append((entry, path))
        return out

    def step_dirs(self) -> dict[int, Path]:
        """Every committed-name ``step-N`` entry (valid or not), by step."""
        return {e.step: path for e, path in self.entries() if e.kind.is_loadable}

    def remove_leftover_tmp(self) -> list[Path]:
        """Delete ``*.tmp-*`` directories left by saves that never committed."""
        removed = [path for e, path in self.entries() if e.kind is EntryKind.TMP]
        for path in removed:
            shutil.rmtree(path, ignore_errors=True)
        if removed:
            logger.warning("removed %d uncommitted checkpoint dir(s): %s", len(removed),
                           ", ".join(p.name for p in removed))
        return removed

    def read_manifest(self, path: Path) -> Manifest:
        """The validated manifest of a step directory; raises InvalidCheckpoint."""
        if not path.is_dir():
            raise InvalidCheckpoint(f"{path} is not a directory")
        mpath = path / MANIFEST
        if not mpath.is_file():
            raise InvalidCheckpoint(f"{path} has no {MANIFEST} (never committed)")
        try:
            text = mpath.read_text(encoding="utf-8")
            return Manifest.from_json(text)
        except (InvalidCheckpoint, OSError, UnicodeDecodeError) as exc:
            raise InvalidCheckpoint(f"{mpath} is unreadable: {exc}") from None

    def problems(self, path: Path, manifest: Manifest, level: Verify = "checksum",
                 progress: Callable[[int], None] | None = None) -> Iterator[str]:
        """Every problem of a step directory against its manifest, lazily (stop at the first to fail fast).

        ``.metadata`` is checksummed at every level and then read with the restricted unpickler:
        it is unpickled when the step is loaded, and a step whose metadata asks for code is invalid.
        """
        entry = parse_entry(path.name)
        if entry is None or not entry.kind.is_loadable or entry.step != manifest.step:
            yield f"{path.name} holds the manifest of step {manifest.step} (not its committed step-N name)"
        if ".metadata" not in manifest.files:
            yield "the manifest lists no .metadata"
        intact = True
        items = sorted(manifest.files.items())
        # Files are checked on a few threads (CRC-32C releases the GIL), results in manifest order.
        pool = ThreadPoolExecutor(max_workers=min(_VERIFY_THREADS, len(items) or 1))
        try:
            checks = pool.map(lambda item: check_file(path / item[0], item[1], level == "checksum" or
                                                      item[0] == ".metadata", progress), items)
            for problem in checks:
                if problem is not None:
                    intact = False
                    yield problem
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        if intact and ".metadata" in manifest.files:
            yield from _metadata_problems(path)

    def verify(self, path: Path, level: Verify = "checksum") -> Manifest:
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

    def commit(self, tmp: Path, manifest: Manifest) -> Path:
        """Write the manifest, fsync it, rename ``tmp`` to ``step-N`` and fsync the parent.

        An existing ``step-N`` that does not verify (a torn earlier attempt) is moved aside to
        ``step-N.invalid-<id>`` first; a valid one is never replaced.
        """
        for name, want in manifest.files.items():
            size = (tmp / name).stat().st_size if (tmp / name).is_file() else -1
            if size != want.size:
                raise InvalidCheckpoint(f"{tmp / name}: {size} bytes on disk, {want.size} reported; not committing")
        manifest.created_unix = time.time()
        mpath = tmp / MANIFEST
        with open(mpath, "w", encoding="utf-8") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(tmp)
        final = self.step_dir(manifest.step)
        if final.exists() or final.is_symlink():
            self._move_aside(final)
        os.rename(tmp, final)
        fsync_dir(self.root)
        return final

    def _move_aside(self, final: Path) -> None:
        try:
            self.verify(final, "checksum")  # rare: only when step-N already exists
        except InvalidCheckpoint as exc:
            self.set_aside(final, EntryKind.INVALID, str(exc))
            return
        raise FileExistsError(f"{final} is a valid checkpoint and is never overwritten")

    def set_aside(self, path: Path, kind: EntryKind, reason: str) -> Path:
        """Rename a committed-name entry to ``step-N.<kind>-<id>`` (durably): kept and listed, never loaded."""
        entry = parse_entry(path.name)
        assert entry is not None and entry.kind.is_loadable and not kind.is_loadable, (path, kind)
        aside = path.with_name(step_name(entry.step, kind, uuid.uuid4().hex[:8]))
        logger.warning("moving %s aside to %s: %s", path.name, aside.name, reason)
        os.rename(path, aside)
        fsync_dir(self.root)
        return aside

    def delete(self, step: int) -> None:
        """Remove a committed step: rename out of the step namespace first (durably), so a crash
        mid-delete leaves no torn step-N, only a ``.tmp-`` entry that the next start removes."""
        final = self.step_dir(step)
        doomed = final.with_name(step_name(step, EntryKind.TMP, uuid.uuid4().hex[:12]))
        os.rename(final, doomed)
        fsync_dir(self.root)
        shutil.rmtree(doomed, ignore_errors=True)

    def abandon(self, step: int, tag: str) -> Path:
        """Move committed ``step`` out of the step namespace to ``step-N.abandoned-<tag>``: kept
        on disk, never loaded, never purged (a run that resumed from an older step trains
        another timeline, whose steps must not meet this one's)."""
        final = self.step_dir(step)
        aside = final.with_name(f"{final.name}.abandoned-{tag}")
        os.rename(final, aside)
        fsync_dir(self.root)
        return aside
