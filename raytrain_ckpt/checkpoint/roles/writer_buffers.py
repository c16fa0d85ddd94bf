"""The node writer's staging buffers: which rank and attempt each belongs to, which are reused,
mapped ahead, unlinked, and which committed step each still holds.

A plain class the ``CheckpointWriter`` owns (``roles/writer.py``); the buffer files themselves
are ``checkpoint/datapath/buffers.py``'s, their layout ``checkpoint/datapath/staging.py``'s.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raytrain_ckpt.checkpoint.datapath.buffers import is_leased, OwnedBuffer

from raytrain_ckpt.checkpoint.errors import StagingFileError
from raytrain_ckpt.checkpoint.datapath.filewrite import RankFiles
from raytrain_ckpt.checkpoint.datapath.staging import allocate_buffer, layout_key, map_whole, populate_range, views_of
from raytrain_ckpt.checkpoint.format.crc import address_of, region_crc
from raytrain_ckpt.checkpoint.records import CommittedCopy, PersistRequest

logger = logging.getLogger(__name__)

__all__ = ["Mapped", "WriterBuffers"]


@dataclass
class _Held:
    """A staging buffer this writer owns (holding its ownership lock), and whose it is now."""

    buffer: OwnedBuffer
    rank: int
    attempt: int
    copy: int = 0
    """Which of the rank's ``checkpoint.memory_copies`` buffers it is."""
    record: CommittedCopy | None = None
    """The step it holds, as written from it (None: nothing written from it since it was last staged into)."""


@dataclass(frozen=True)
class Mapped:
    """A staging buffer as the writer maps it: the whole file, its address, and a view per slot."""

    whole: memoryview
    address: int
    views: dict[str, Any]


class WriterBuffers:
    """The staging buffers one writer owns, keyed by path. ``lock`` orders ``allocate`` (which
    hands buffers to attempts) against the writer's ``accept`` (which checks them)."""

    def __init__(self, directory: Path, prefix: str, node_id: str, pool: ThreadPoolExecutor) -> None:
        self.directory, self.prefix, self.node_id, self._pool = directory, prefix, node_id, pool
        self.held: dict[str, _Held] = {}
        self._views: dict[str, tuple[tuple, Mapped]] = {}
        """path -> (layout, the buffer mapped): mapped once, not on every save (page faults cost CPU)."""
        self._premapped: dict[str, tuple[int, memoryview]] = {}
        """path -> (bytes, mapping) of a buffer mapped ahead of its first write (``_reserve``)."""
        self.lock = threading.Lock()
        self.newest_attempt = 0

    def allocate(self, rank: int, attempt: int, nbytes: int, copy: int, busy: set[str]) -> str:
        """The rank's staging file number ``copy`` for this attempt; ``busy``: the buffers writes are
        reading now. A restarted group reuses the previous attempt's buffer of the rank unless a
        write is still reading it or a process of the old attempt still leases it; then it gets a
        new file. Older attempts' buffers are unlinked once a write of the newest attempt is done
        (by then its ranks have claimed what they reuse) and nothing reads them."""
        with self.lock:
            path = self._held_for(rank, attempt, copy) or self._reusable(rank, attempt, busy)
            if path is None:
                suffix = f"-c{copy}" if copy else ""
                # the node in the name: a rank whose group moved to another node's writer in the same
                # attempt (a replica group's heal) meets no file of its old writer where nodes share /dev/shm
                path = str(self.directory / f"rtc-{self.prefix}-{self.node_id[:8]}-a{attempt}-rank{rank}{suffix}.buf")
                self.held[path] = _Held(allocate_buffer(Path(path), nbytes), rank, attempt, copy)
                if copy:  # not staged into before the next save: allocate and map its memory meanwhile
                    self._pool.submit(self._reserve, path, self.held[path].buffer, nbytes)
            else:  # the same attempt with a new layout, or a new attempt reusing the rank's buffer
                held = self.held[path]
                if held.record is not None and held.record.nbytes != nbytes:
                    held.record = None  # a new layout: what it held is no longer a copy of anything
                held.buffer.resize(nbytes)
                self._premapped.pop(path, None)  # a mapping past a shrunk file's end would fault on access
                held.attempt, held.copy = attempt, copy
            self.newest_attempt = max(self.newest_attempt, attempt)
            return path

    def _reserve(self, path: str, buffer: OwnedBuffer, nbytes: int) -> None:
        """Allocate a new buffer's memory off the trainer's path: otherwise the first copy into it
        (the second save of an attempt) pays for allocating every page while it overlaps a
        training step. Only for a buffer nobody stages into yet: a page fault in a range being
        allocated waits for the allocation, which runs at the writer's low priority.

        Then map it here, every page populated in one call: the write from it (that second save)
        would otherwise take a page fault per 4 KiB page while it reads (65,536 per 256 MiB,
        about 0.2 s more persist time at the writer's priority). The call runs without the GIL
        (``populate_range``): the first save's writes are running in this process meanwhile."""
        try:
            buffer.reserve()
            whole = map_whole(Path(path), nbytes)  # populated without the GIL: writes run beside it
            populate_range(address_of(whole), nbytes)
        except OSError as exc:  # visible here first; the save that stages into it meets the same shortage
            logger.warning("staging buffer %s: could not allocate its memory ahead: %s", buffer.path, exc)
            return
        except StagingFileError as exc:  # gone or resized meanwhile: the write maps it itself
            logger.debug("staging buffer %s not mapped ahead: %s", path, exc)
            return
        with self.lock:
            if path in self.held:
                self._premapped[path] = (nbytes, whole)

    def _held_for(self, rank: int, attempt: int, copy: int) -> str | None:
        return next((p for p, h in self.held.items() if (h.rank, h.attempt, h.copy) == (rank, attempt, copy)), None)

    def _reusable(self, rank: int, attempt: int, busy: set[str]) -> str | None:
        """An older attempt's buffer of ``rank`` that no write reads and no live process stages into."""
        for path, held in self.held.items():
            if held.rank == rank and held.attempt < attempt and path not in busy and not is_leased(Path(path)):
                return path
        return None

    def unlink_all(self) -> None:
        for path in list(self.held):
            self.unlink(path)

    def unlink(self, path: str) -> None:
        self._views.pop(path, None)
        self._premapped.pop(path, None)
        held = self.held.pop(path, None)
        if held is not None:
            held.buffer.remove()

    def drop_stale(self, done: PersistRequest, busy: set[str]) -> None:
        """Unlink older attempts' buffers nobody reads, once the write ``done`` no longer reads its own.

        Only after a write of the newest attempt (or of the buffer's own old attempt): unlinking
        as soon as a new attempt appears would free a buffer its next rank is about to reuse.
        """
        for path, held in list(self.held.items()):
            stale = held.attempt < self.newest_attempt and path not in busy
            if stale and (done.attempt == self.newest_attempt or path == done.buffer_path):
                self.unlink(path)

    def mapped(self, req: PersistRequest) -> Mapped:
        layout = (req.buffer_bytes, tuple(req.slots))
        cached = self._views.get(req.buffer_path)
        if cached is None or cached[0] != layout:
            with self.lock:
                ahead = self._premapped.pop(req.buffer_path, None)
            whole = ahead[1] if ahead is not None and ahead[0] == req.buffer_bytes else \
                map_whole(Path(req.buffer_path), req.buffer_bytes)
            cached = (layout, Mapped(whole, address_of(whole), views_of(whole, req.slots)))
            self._views[req.buffer_path] = cached
        return cached[1]

    def record(self, req: PersistRequest, staged: dict[str, Any], mapped: Mapped, written: RankFiles) -> None:
        """Remember the buffer as the copy of ``req.step`` (with ``memory_copies`` >= 2), before the
        step is reported, so a committed step's copy is always recorded first.

        The buffer's CRC-32C comes from the checksums the write took of the chunks it wrote
        straight from the buffer (``crc.region_crc``): only the bytes no write covered (slot
        padding, slots the plan gave to another rank) are read again. So the record says what
        was written, and costs no second pass over the buffer on the way to the report.
        """
        objects = [k for k in staged if k not in {s.fqn for s in req.slots}]
        crc = region_crc(mapped.whole, mapped.address, written.spans)
        copy = CommittedCopy(req.step, req.rank, layout_key(req.slots, objects), req.buffer_bytes, list(req.slots),
                             req.objects, crc, req.buffer_path,
                             {name: {"size": f["size"], "crc32c": f["crc32c"]} for name, f in written.files.items()},
                             self.node_id)
        with self.lock:
            held = self.held.get(req.buffer_path)
            if held is not None and held.attempt == req.attempt:
                held.record = copy

    def copy_of(self, rank: int, step: int) -> CommittedCopy | None:
        """The recorded copy of rank ``rank``'s ``step`` on this node, or None."""
        with self.lock:
            return next((h.record for h in self.held.values()
                         if h.rank == rank and h.record is not None and h.record.step == step), None)

    def copies_of(self, step: int) -> list[CommittedCopy]:
        """The recorded copies of ``step`` of every rank on this node."""
        with self.lock:
            return [h.record for h in self.held.values() if h.record is not None and h.record.step == step]

    def forget(self, rank: int, step: int) -> None:
        with self.lock:
            for held in self.held.values():
                if held.rank == rank and held.record is not None and held.record.step == step:
                    held.record = None

