"""A rank's DCP shard files on a local (POSIX) file system: exclusive, fsynced, ``O_DIRECT``.

The bytes come from ``filewrite.write_files`` (one pass: ``torch.save`` into a ``ChecksumSink``,
CRC-32C as it goes); this module is where they land. ``_DirectFileSink`` hands them to the
device with ``O_DIRECT`` (no page cache to fill, write back and drop): the whole 4 KiB blocks of
a large tensor straight from the staging buffer, everything else through two reused
page-aligned buffers written by the file's own I/O thread while the next fills. A file system
without ``O_DIRECT`` gets ``os.write`` through the cache (``_FileSink``). Each file is fsynced,
its clean pages dropped from the cache, and its size checked against what was written.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.distributed.checkpoint.planner import SavePlan

from raytrain_ckpt.checkpoint.datapath.filewrite import (DIRECT_ALIGN, IN_PLACE, ChecksumSink, Phases, RankFiles,
                                                         Resolve, WriteProgress, write_files)
from raytrain_ckpt.checkpoint.format.crc import address_of

__all__ = ["write_rank_files"]

_BOUNCE = 8 << 20
"""Bytes gathered in a page-aligned buffer per ``O_DIRECT`` write (a multiple of ``DIRECT_ALIGN``)."""
_KEEP_BOUNCE = 8
"""Aligned buffers kept for the next save (a fresh mapping faults every page in again): two per
file being written, four files at once."""
_IN_FLIGHT = 2
"""Writes handed to a file's I/O thread and not yet done, at most (besides the one being gathered)."""
_SEGMENTS = 256
"""Segments (in-place runs and aligned-buffer pieces) per write, at most (``IOV_MAX`` is 1024)."""


class _FileSink(ChecksumSink):
    """Appends to the file descriptor ``fd``."""

    def __init__(self, fd: int, phases: Phases) -> None:
        super().__init__(phases)
        self.fd = fd

    def _put(self, chunk: memoryview) -> None:
        while chunk.nbytes:  # a write may be partial (a signal, a limit per call)
            done = os.write(self.fd, chunk)
            chunk = chunk[done:]

    def finish(self) -> None:
        """Write whatever is still held (gathered small records; the direct sink's aligned buffer)."""
        self.flush()

    def release(self) -> None:
        """Nothing to give back (the direct sink returns its aligned buffer)."""

    def drop_cache(self) -> None:
        """After fsync: the file's pages (clean now) leave the page cache, back to the free list,
        where the next save's writes find them (ARCHITECTURE, "A written shard leaves the page
        cache"). Advice only: a file system may ignore it."""
        try:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:  # the file is durable already (fsync); dropping its cache is an optimisation
            pass


def write_rank_files(directory: Path, plan: SavePlan, resolve: Resolve, threads: int = 1,
                     progress: WriteProgress | None = None) -> RankFiles:
    """Write the items of ``plan`` (one rank's central plan) into ``directory``, fsynced
    (``filewrite.write_files``). Files are created exclusively: an existing file is an error,
    never overwritten.
    """
    return write_files(plan, resolve, threads, lambda name, phases: _local_file(directory / name, phases), progress)


@contextmanager
def _local_file(path: Path, phases: Phases) -> Iterator[ChecksumSink]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        sink = _DirectFileSink(fd, phases) if _try_direct(fd) else _FileSink(fd, phases)
        try:
            yield sink
            sink.finish()
        finally:
            sink.release()
        t0 = time.perf_counter()
        os.fsync(fd)
        phases.fsync_s += time.perf_counter() - t0
        sink.drop_cache()
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size != sink.position:  # the sink counted what the kernel accepted; anything else is a bug
        raise OSError(f"{path.name}: {size} bytes on disk after writing {sink.position}")


def _try_direct(fd: int) -> bool:
    """Turn ``O_DIRECT`` on for ``fd``; False where the file system does not support it."""
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    return True


class _DirectFileSink(_FileSink):
    """Writes through ``O_DIRECT`` in writes of about ``_BOUNCE`` bytes, each a ``pwritev`` of
    segments that follow each other in the file: the whole blocks of a large tensor's bytes straight
    from the caller's memory (the staging buffer), everything else (zip records, pickles, small
    tensors, the part of a tensor that is not whole blocks) copied into a page-aligned buffer
    first (ARCHITECTURE, "Shards are written with O_DIRECT", "Large tensors go to the device
    straight from the staging buffer").

    Writes go to the sink's own I/O thread in file order, one at a time, at most ``_IN_FLIGHT``
    queued, while the next is checksummed and gathered, so checksumming, serialising and copying
    overlap the device's time instead of adding to it (ARCHITECTURE, "A shard's device writes
    overlap its checksums and copies"). Two aligned buffers: one is filled while the other is
    written. The copy into a buffer is a ``memmove`` that runs without the GIL, so the writes of
    other ranks in the same process are not held up by it. A write from the caller's memory
    holds the item's tensor (``owner``) until it is done.

    The file's last bytes that do not fill an aligned block, and everything after a direct write
    the file system refused (EINVAL) or took only in part (a size limit), are written through the
    page cache with ``O_DIRECT`` turned off again: the error that write raises is the real one.
    """

    def __init__(self, fd: int, phases: Phases) -> None:
        super().__init__(fd, phases)
        self.bounces: list[mmap.mmap] = [_take_bounce(), _take_bounce()]
        self.views = [memoryview(b) for b in self.bounces]
        """(Slices of a memoryview keep the mapping exported until they are freed: a buffer is
        never closed here, only dropped when the pool is full.)"""
        self.addresses = [address_of(v) for v in self.views]
        self.writes: deque[tuple[Future, int | None]] = deque()
        """Writes handed to the I/O thread, oldest first, with the aligned buffer each reads (None:
        only the caller's memory)."""
        self.io = ThreadPoolExecutor(1, thread_name_prefix="rtc-direct")
        self.current = 0
        self.filled = 0
        """Bytes of the current aligned buffer in use."""
        self.open = 0
        """Where the current buffer's segment not yet closed starts (it ends at ``filled``)."""
        self.segments: list[list[int]] = []
        """The next write's closed segments, in file order: [memory address, length]."""
        self.in_place = False
        """Whether the last segment is the caller's memory (a later chunk may extend it)."""
        self.owners: list[torch.Tensor | None] = []
        """What keeps the next write's in-place segments alive."""
        self.offset = 0
        """File offset of the next write's first byte (a multiple of ``DIRECT_ALIGN``)."""
        self.gathered = 0
        """Bytes of the closed segments."""
        self.direct = True
        """Turned off (on the I/O thread) once the file system refuses a direct write."""
        self.failed = False
        """Set (on the I/O thread) once a write failed: later ones are not attempted."""

    def _put(self, chunk: memoryview) -> None:
        address = address_of(chunk) if chunk.nbytes else 0
        done = 0
        while done < chunk.nbytes:
            if self.filled == _BOUNCE:
                self._submit()
            n = min(chunk.nbytes - done, _BOUNCE - self.filled)
            ctypes.memmove(self.addresses[self.current] + self.filled, address + done, n)
            self.filled += n
            done += n

    def _put_in_place(self, chunk: memoryview, address: int) -> None:
        """Whole blocks of ``chunk`` at a file offset that agrees with ``address`` are written from
        ``address``; the bytes around them go through the aligned buffer."""
        position = self.offset + self.gathered + self.filled - self.open
        head = -position % DIRECT_ALIGN
        body = max(chunk.nbytes - head, 0) // DIRECT_ALIGN * DIRECT_ALIGN
        last = self.segments[-1] if self.in_place and self.filled == self.open else None
        extends = last is not None and not head and last[0] + last[1] == address
        if (not body or not self.direct or (address + head) % DIRECT_ALIGN or not (extends or body >= IN_PLACE)
                or not self.owns(address, chunk.nbytes)):
            self._put(chunk)
            return
        if head:
            self._put(chunk[:head])
        self._close()  # ends at a block boundary now
        if extends:  # head is 0 and nothing was gathered since: ``last`` is still the last segment
            last[1] += body
        else:
            self.segments.append([address + head, body])
        self.owners.append(self.owner)  # an extension may be another tensor's memory: it is held too
        self.in_place = True
        self.gathered += body
        if self.gathered >= _BOUNCE or len(self.segments) >= _SEGMENTS:
            self._submit()
        if head + body < chunk.nbytes:
            self._put(chunk[head + body:])

    def _close(self) -> None:
        """Close the current buffer's open segment (a multiple of ``DIRECT_ALIGN`` unless the file ends)."""
        if self.filled > self.open:
            self.segments.append([self.addresses[self.current] + self.open, self.filled - self.open])
            self.gathered += self.filled - self.open
            self.open = self.filled
            self.in_place = False

    def finish(self) -> None:
        """Write what is still gathered: the aligned part directly, the rest through the cache."""
        super().finish()
        t0 = time.perf_counter()
        self._submit()
        while self.writes:
            self.writes.popleft()[0].result()
        self.phases.write_calls_s += time.perf_counter() - t0

    def _submit(self) -> None:
        """Hand the gathered segments to the I/O thread as one write; when they include the current
        aligned buffer, go on with the other one (once its previous write is done)."""
        self._close()
        if self.segments:
            views = [memoryview((ctypes.c_ubyte * n).from_address(a)).cast("B") for a, n in self.segments]
            uses = self.current if self.filled else None
            self._hand(self.io.submit(self._drain, views, self.offset, self.owners), uses)
            self.offset += self.gathered
            self.segments, self.owners, self.gathered, self.in_place = [], [], 0, False
        if self.filled:
            self.current, self.filled, self.open = 1 - self.current, 0, 0
            self._wait(self.current)  # its previous write still reads it

    def _hand(self, write: Future, buffer: int | None) -> None:
        self.writes.append((write, buffer))
        while len(self.writes) > _IN_FLIGHT:
            self.writes.popleft()[0].result()

    def _wait(self, i: int) -> None:
        """Wait for aligned buffer ``i``'s write (and every write before it); re-raises their errors."""
        while any(buffer == i for _, buffer in self.writes):
            self.writes.popleft()[0].result()

    def _drain(self, views: list[memoryview], offset: int, owners: list[torch.Tensor | None]) -> None:
        """On the I/O thread: write ``views`` one after the other from ``offset`` (``owners`` keep
        the caller's memory among them alive until then)."""
        if self.failed:
            return  # an earlier write's error is raised to the writer
        cpu0 = time.thread_time()
        try:
            total = sum(v.nbytes for v in views)
            aligned = total // DIRECT_ALIGN * DIRECT_ALIGN if self.direct else 0
            done = self._write_direct(views, aligned, offset) if aligned else 0
            rest = _skip(views, done)
            if rest:
                self._buffered()
            while rest:
                n = os.pwritev(self.fd, rest, offset + done)
                rest, done = _skip(rest, n), done + n
        except BaseException:
            self.failed = True
            raise
        finally:
            self.phases.cpu_s += time.thread_time() - cpu0

    def _write_direct(self, views: list[memoryview], length: int, offset: int) -> int:
        """Write the first ``length`` bytes of ``views`` directly at ``offset``; returns how many were written."""
        done = 0
        while done < length:
            try:
                n = os.pwritev(self.fd, _take(_skip(views, done), length - done), offset + done)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                n = 0
            if n == 0 or n % DIRECT_ALIGN:  # refused or short: the rest goes through the page cache
                return done + n
            done += n
        return done

    def _buffered(self) -> None:
        if self.direct:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False

    def release(self) -> None:
        """Give the buffers back once no write reads them (also after a failure: the file is closed next)."""
        self.io.shutdown(wait=True)
        self.writes.clear()
        self.segments, self.owners = [], []
        for bounce in self.bounces:
            _give_bounce(bounce)
        self.bounces = []


def _skip(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` without their first ``n`` bytes."""
    out = []
    for v in views:
        if n >= v.nbytes:
            n -= v.nbytes
            continue
        out.append(v[n:] if n else v)
        n = 0
    return out


def _take(views: list[memoryview], n: int) -> list[memoryview]:
    """The first ``n`` bytes of ``views``."""
    out = []
    for v in views:
        if n <= 0:
            break
        out.append(v[:n] if n < v.nbytes else v)
        n -= v.nbytes
    return out


_bounces: list[mmap.mmap] = []
_bounce_lock = threading.Lock()


def _take_bounce() -> mmap.mmap:
    with _bounce_lock:
        while _bounces:
            bounce = _bounces.pop()
            if len(bounce) == _BOUNCE:
                return bounce
    return mmap.mmap(-1, _BOUNCE)  # anonymous: page-aligned


def _give_bounce(bounce: mmap.mmap) -> None:
    with _bounce_lock:
        if len(_bounces) < _KEEP_BOUNCE:
            _bounces.append(bounce)
