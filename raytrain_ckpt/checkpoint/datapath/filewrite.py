"""Writing one rank's DCP shard files to a local (POSIX) file system in one pass over the bytes.

DCP's ``FileSystemWriter`` makes four passes over every tensor byte staged in the writer:
it clones each staged view (its storage is the whole staging buffer, and ``torch.save``
saves whole storages), ``torch.save`` computes the zip CRC-32 of the clone, writes it
through a Python stream, and the writer then read each file back for the manifest's CRC-32C.

Here each item is serialised with ``torch.save`` straight into the file: the tensor is a view
whose storage is exactly its slot of the staging buffer (no clone), ``torch.save`` hands its
bytes over as a memoryview of that buffer, and the sink (``ChecksumSink``) checksums each chunk (CRC-32C,
which covers every byte of the file: zip headers, pickles, data and padding) and hands it to the
device with ``O_DIRECT`` (``_DirectFileSink``: no page cache to fill, write back and drop; a file
system without ``O_DIRECT`` gets ``os.write`` through the cache): the whole 4 KiB blocks of a
tensor of 1 MiB or more straight from the staging buffer, everything else copied into a
page-aligned buffer first, while it is still in the cache. For that, zero bytes go before such a
tensor's item so that its bytes start at a file offset that agrees with their address modulo
4096 (a multiple of 4096 for a staging slot, which starts on a page). Small records (zip
headers, the pickle) are gathered and written together. The sink also notes where each chunk it
wrote from the caller's memory lies and the file's CRC around it (``RankFiles.spans``): the
staging buffer's own CRC-32C follows from them (``crc.region_crc``) without reading the buffer
again.

The files are plain DCP: the same names, the same items in the same order in the same files,
each item the bytes ``FileSystemWriter`` writes for it, and a ``WriteResult``/``_StorageInfo``
(offset, length) for each, read by ``dcp.load`` and ``format_utils``. Two differences in the
bytes: an item of a large tensor may start up to 4095 bytes later (zeros before it, which no
reader reads: DCP reads each item at its recorded offset), and the zip records carry no CRC-32
(``torch.serialization.set_crc32_options(False)``, a format ``torch.load`` reads); the
manifest's CRC-32C over every byte of every file is what proves a file intact, and it is
verified before anything is loaded.

Errors are raised, never dropped (DCP's helper threads drop theirs): ENOSPC or EIO from a
write or an fsync fails the rank's save.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import io
import mmap
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import crc32c as _crc32c
import torch
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _split_by_size_and_type, _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from raytrain_ckpt.checkpoint.format.crc import Span, address_of

__all__ = ["ChecksumSink", "OpenFile", "Phases", "RankFiles", "write_files", "write_rank_files"]

_CHUNK = 2 << 20
"""Bytes checksummed then written per system call: small enough to still be in the cache for the
write's copy, large enough that the call overhead does not count."""
_GATHER = 64 << 10
"""Writes below this size (zip headers, pickles) are gathered and written together."""
_DIRECT_ALIGN = 4096
"""File offsets, lengths and buffer addresses of ``O_DIRECT`` writes are multiples of this
(enough for devices with 512-byte and 4 KiB logical blocks)."""
_BOUNCE = 8 << 20
"""Bytes gathered in a page-aligned buffer per ``O_DIRECT`` write (a multiple of ``_DIRECT_ALIGN``)."""
_KEEP_BOUNCE = 8
"""Aligned buffers kept for the next save (a fresh mapping faults every page in again): two per
file being written, four files at once."""
_IN_PLACE = 1 << 20
"""A tensor's bytes from this size on are placed in the file at an offset that agrees with their
memory address modulo ``_DIRECT_ALIGN`` (zero bytes before the item), and ``O_DIRECT`` writes
their whole blocks straight from that memory. Smaller ones are copied into the aligned buffer:
a copy that small costs less than the zeros and the segment of its own it would save."""
_IN_FLIGHT = 2
"""Writes handed to a file's I/O thread and not yet done, at most (besides the one being gathered)."""
_SEGMENTS = 256
"""Segments (in-place runs and aligned-buffer pieces) per write, at most (``IOV_MAX`` is 1024)."""

Resolve = Callable[[WriteItem], "torch.Tensor | io.BytesIO"]


@dataclass
class Phases:
    """Seconds spent per phase of a write (summed over I/O threads)."""

    serialize_s: float = 0.0
    write_calls_s: float = 0.0
    checksum_s: float = 0.0
    fsync_s: float = 0.0
    cpu_s: float = 0.0
    """CPU seconds (user + system) of the threads that wrote, over the whole write."""

    def add(self, other: Phases) -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class RankFiles:
    """What writing a rank's items produced: DCP's write results and the manifest's file entries."""

    results: list[WriteResult] = field(default_factory=list)
    files: dict[str, dict[str, int]] = field(default_factory=dict)
    """File name -> {"size", "crc32c"} of the bytes as written."""
    phases: Phases = field(default_factory=Phases)
    spans: list[Span] = field(default_factory=list)
    """The memory the large writes came from (tensor bytes, in place) with the file's CRC-32C
    around each chunk: ``crc.region_crc`` derives a staging buffer's CRC-32C from them without
    reading what they cover again."""


class ChecksumSink(io.RawIOBase):
    """The stream ``torch.save`` writes into: CRC-32C over every byte, handed on in chunks of at
    most ``_CHUNK`` bytes to ``_put`` (a file descriptor here, multipart parts in ``upload.py``)."""

    def __init__(self, phases: Phases) -> None:
        super().__init__()
        self.phases = phases
        self.position = 0
        self.crc = 0
        self._pending = bytearray()
        self.error: Exception | None = None
        """The first write error: torch.save replaces it with a RuntimeError about a short file."""
        self.spans: list[Span] = []
        """Where each chunk written straight from the caller's memory was, and the CRC around it."""
        self.item_start = 0
        """File offset of the item being written (after the zero bytes placed before it, if any)."""
        self.owner: torch.Tensor | None = None
        """The tensor whose item is being written: its storage is the memory ``torch.save`` hands
        over, kept alive by whatever writes from it later (``_DirectFileSink``)."""

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position + len(self._pending)

    def begin_item(self, owner: torch.Tensor | None = None) -> None:
        """The next bytes start an item (every earlier byte has been flushed); ``owner``: its tensor."""
        assert not self._pending, "an item starts after the previous one is flushed"
        self.item_start, self.owner = self.position, owner

    def owns(self, address: int, length: int) -> bool:
        """Whether ``length`` bytes at ``address`` are the storage of ``owner`` (memory it keeps alive)."""
        if self.owner is None:
            return False
        storage = self.owner.untyped_storage()
        return storage.data_ptr() <= address and address + length <= storage.data_ptr() + storage.nbytes()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes < _GATHER:
            self._pending += view
        else:
            address = address_of(view)
            self._place(view, address)
            self.flush()
            self._write(view, address)
        return view.nbytes

    def _place(self, view: memoryview, address: int) -> None:
        """Before the first bytes of a large tensor's storage: zero bytes ahead of its item (whose
        records so far are all still gathered) so that the storage's file offset and its memory
        address agree modulo ``_DIRECT_ALIGN`` (DCP records each item's offset and length, so
        bytes between items are never read)."""
        owner = self.owner
        if (owner is None or view.nbytes < _IN_PLACE or self.position != self.item_start
                or address != owner.untyped_storage().data_ptr()):
            return
        pad = (address - self.tell()) % _DIRECT_ALIGN
        if pad:
            self._pending[0:0] = bytes(pad)
            self.item_start += pad

    def flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, bytearray()
            self._write(memoryview(pending))

    def _write(self, view: memoryview, address: int | None = None) -> None:
        if self.error is not None:
            raise self.error
        try:
            self._write_chunks(view, address)
        except Exception as exc:
            self.error = exc
            raise

    def _write_chunks(self, view: memoryview, address: int | None) -> None:
        for start in range(0, view.nbytes, _CHUNK):
            chunk = view[start:start + _CHUNK]
            t0 = time.perf_counter()
            before, self.crc = self.crc, _crc32c.crc32c(chunk, self.crc)
            t1 = time.perf_counter()
            if address is None:
                self._put(chunk)
            else:
                self.spans.append(Span(address + start, chunk.nbytes, before, self.crc))
                self._put_in_place(chunk, address + start)
            self.phases.checksum_s += t1 - t0
            self.phases.write_calls_s += time.perf_counter() - t1
        self.position += view.nbytes

    def _put(self, chunk: memoryview) -> None:
        """Hand ``chunk`` on; raise when it cannot be."""
        raise NotImplementedError

    def _put_in_place(self, chunk: memoryview, address: int) -> None:
        """``_put`` a chunk of the caller's memory (at ``address``, unchanged until the write is
        done and kept alive by ``owner``): a sink may write it from there."""
        self._put(chunk)


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


OpenFile = Callable[[str, Phases], AbstractContextManager[ChecksumSink]]
"""Opens one file of a rank by name for writing; the file is durable once the context exits cleanly."""


def write_rank_files(directory: Path, plan: SavePlan, resolve: Resolve, threads: int = 1) -> RankFiles:
    """Write the items of ``plan`` (one rank's central plan) into ``directory``, fsynced.

    Splits the items into ``threads`` files exactly as ``FileSystemWriter(thread_count=threads)``
    does, so file names, offsets and lengths are the ones DCP records. ``resolve`` maps a write
    item to its data (``SavePlanner.resolve_data``). Files are created exclusively: an existing
    file is an error, never overwritten.
    """
    return write_files(plan, resolve, threads, lambda name, phases: _local_file(directory / name, phases))


def write_files(plan: SavePlan, resolve: Resolve, threads: int, open_file: OpenFile) -> RankFiles:
    """``write_rank_files`` into whatever ``open_file`` opens (a local file, an object upload)."""
    prefix = plan.storage_data.prefix
    buckets = [(f"{prefix}{i}{DEFAULT_SUFFIX}", bucket)
               for i, bucket in enumerate(_split_by_size_and_type(threads, plan.items))]
    out = RankFiles()
    if threads == 1:
        parts = [_write_file(open_file, name, items, resolve) for name, items in buckets]
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="rtc-filewrite") as pool:
            parts = list(pool.map(lambda b: _write_file(open_file, b[0], b[1], resolve), buckets))
    for part in parts:
        out.results += part.results
        out.files.update(part.files)
        out.phases.add(part.phases)
        out.spans += part.spans
    return out


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
        """File offset of the next write's first byte (a multiple of ``_DIRECT_ALIGN``)."""
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
        head = -position % _DIRECT_ALIGN
        body = max(chunk.nbytes - head, 0) // _DIRECT_ALIGN * _DIRECT_ALIGN
        last = self.segments[-1] if self.in_place and self.filled == self.open else None
        extends = last is not None and not head and last[0] + last[1] == address
        if (not body or not self.direct or (address + head) % _DIRECT_ALIGN or not (extends or body >= _IN_PLACE)
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
        """Close the current buffer's open segment (a multiple of ``_DIRECT_ALIGN`` unless the file ends)."""
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
            aligned = total // _DIRECT_ALIGN * _DIRECT_ALIGN if self.direct else 0
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
            if n == 0 or n % _DIRECT_ALIGN:  # refused or short: the rest goes through the page cache
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


def _write_file(open_file: OpenFile, name: str, items: list[WriteItem], resolve: Resolve) -> RankFiles:
    """One DCP file: byte items first, then tensors, in plan order (``_write_files_from_queue``'s order)."""
    out = RankFiles()
    cpu0 = time.thread_time()
    with _zip_crc_off(), open_file(name, out.phases) as sink:
        ordered = ([i for i in items if i.type == WriteItemType.BYTE_IO]
                   + [i for i in items if i.type != WriteItemType.BYTE_IO])
        for item in ordered:
            out.results.append(_write_item(sink, name, item, resolve))
    out.files[name] = {"size": sink.position, "crc32c": sink.crc}
    out.spans += sink.spans
    out.phases.cpu_s += time.thread_time() - cpu0
    return out


def _write_item(sink: ChecksumSink, name: str, item: WriteItem, resolve: Resolve) -> WriteResult:
    t0 = time.perf_counter()
    io_before = sink.phases.write_calls_s + sink.phases.checksum_s
    data = resolve(item)
    if item.type == WriteItemType.BYTE_IO:
        assert isinstance(data, io.BytesIO), f"{item.index.fqn}: a byte item resolved to {type(data).__name__}"
        sink.begin_item()
        sink.write(data.getbuffer())
    else:
        assert isinstance(data, torch.Tensor), f"{item.index.fqn}: a tensor item resolved to {type(data).__name__}"
        tensor = _exact_storage(data)
        sink.begin_item(tensor)
        try:
            torch.save(tensor, sink)
        except RuntimeError:
            if sink.error is not None:  # the real cause (ENOSPC, EIO), not torch's "unexpected pos"
                raise sink.error from None
            raise
    sink.flush()
    sink.owner = None
    offset = sink.item_start
    length = sink.position - offset
    io_spent = sink.phases.write_calls_s + sink.phases.checksum_s - io_before
    sink.phases.serialize_s += time.perf_counter() - t0 - io_spent
    return WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length))


def _exact_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when its storage holds exactly its bytes, else a minimal copy: ``torch.save``
    writes whole storages (the same rule as DCP's ``_SerialCpuLoader``)."""
    tensor = tensor.detach().cpu()
    if tensor.untyped_storage().size() != tensor.nbytes:
        tensor = tensor.clone()
    return tensor


_crc_lock = threading.Lock()
_crc_users = 0
_crc_saved = True
_crc_per_thread: bool | None = None
"""Whether torch's serialization settings are per thread (None: not known yet)."""


@contextmanager
def _zip_crc_off() -> Iterator[None]:
    """``torch.save`` without the zip CRC-32 in this thread while it writes.

    torch's serialization settings are per thread from torch 2.13 (a ``ContextVar``: a new
    thread starts from the default, so a setting made in another thread does not reach the
    thread that writes) and process-wide before it. Each writing thread turns the CRC off for
    itself; the value is put back by the thread itself where the setting is per thread, and by
    the last of the writes running at once where it is process-wide (an earlier one would turn
    it back on under the others). Which of the two holds is found out once (``_settings_per_thread``).
    """
    global _crc_users, _crc_saved, _crc_per_thread
    with _crc_lock:
        own = torch.serialization.get_crc32_options()
        if _crc_per_thread is None:
            _crc_per_thread = _settings_per_thread(own)
        if _crc_users == 0:
            _crc_saved = own
        _crc_users += 1
        torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        with _crc_lock:
            _crc_users -= 1
            if _crc_per_thread:
                torch.serialization.set_crc32_options(own)
            elif _crc_users == 0:
                torch.serialization.set_crc32_options(_crc_saved)


def _settings_per_thread(own: bool) -> bool | None:
    """Whether torch's serialization settings are per thread, from what other threads see: a new
    thread that reads another value than this one's (``own``), or this thread still reading its
    own after another turned the CRC off, means per thread; the setting reaching this thread
    means process-wide (it is then off everywhere, as the write needs anyway). None: the CRC is
    off here and in a new thread, which tells neither apart, and both are handled alike then."""
    def on_a_new_thread(fn: Callable[[], object]) -> None:
        thread = threading.Thread(target=fn)
        thread.start()
        thread.join()

    seen: list[bool] = []
    on_a_new_thread(lambda: seen.append(torch.serialization.get_crc32_options()))
    if seen[0] != own:
        return True
    if not own:
        return None
    on_a_new_thread(lambda: torch.serialization.set_crc32_options(False))
    return torch.serialization.get_crc32_options()
