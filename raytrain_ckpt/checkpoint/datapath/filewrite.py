"""Writing one rank's DCP shard files in one pass over the bytes, into any ``ChecksumSink``.

DCP's ``FileSystemWriter`` makes four passes over every tensor byte staged in the writer:
it clones each staged view (its storage is the whole staging buffer, and ``torch.save``
saves whole storages), ``torch.save`` computes the zip CRC-32 of the clone, writes it
through a Python stream, and the writer then read each file back for the manifest's CRC-32C.

Here each item is serialised with ``torch.save`` straight into the file: the tensor is a view
whose storage is exactly its slot of the staging buffer (no clone), ``torch.save`` hands its
bytes over as a memoryview of that buffer, and the sink (``ChecksumSink``) checksums each chunk (CRC-32C,
which covers every byte of the file: zip headers, pickles, data and padding) and hands it to the
device with ``O_DIRECT`` (``localfile.py``'s direct sink: no page cache to fill, write back and drop; a file
system without ``O_DIRECT`` gets ``os.write`` through the cache): the whole 4 KiB blocks of a
tensor of 1 MiB or more straight from the staging buffer, everything else copied into a
page-aligned buffer first, while it is still in the cache. For that, zero bytes go before such a
tensor's item so that its bytes start at a file offset that agrees with their address modulo
4096 (a multiple of 4096 for a staging slot, which starts on a page). Small records (zip
headers, the pickle) are gathered and written together. The sink also notes where each chunk it
wrote from the caller's memory lies and the file's CRC around it (``RankFiles.spans``): the
staging buffer's own CRC-32C follows from them (``crc.region_crc``) without reading the buffer
again.

The files are plain DCP: the same names, the same items in the same files, each item the bytes
``FileSystemWriter`` writes for it, and a ``WriteResult``/``_StorageInfo`` (offset, length) for
each, read by ``dcp.load`` and ``format_utils``. Three differences in the layout, none of which a
reader sees (DCP reads each item at its recorded offset): a file's byte items come after its
tensors (DCP writes them first; see ``_write_file``), an item of a large tensor may start up to
4095 bytes later (zeros before it), and the zip records carry no CRC-32
(``torch.serialization.set_crc32_options(False)``, a format ``torch.load`` reads); the
manifest's CRC-32C over every byte of every file is what proves a file intact, and it is
verified before anything is loaded.

Errors are raised, never dropped (DCP's helper threads drop theirs): ENOSPC or EIO from a
write or an fsync fails the rank's save.

This module is the part every destination shares: the items of a plan split into files as DCP
splits them, each serialised into a ``ChecksumSink`` that a destination provides
(``localfile.py``: a local file, fsynced; ``upload.py``: S3 parts).
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field

import crc32c as _crc32c
import torch
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _split_by_size_and_type, _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from raytrain_ckpt.checkpoint.format.crc import Span, address_of
from raytrain_ckpt.checkpoint.format.tensorsums import ShardSums, SumsAccumulator, merge_rows, tensor_sums

__all__ = ["DIRECT_ALIGN", "IN_PLACE", "ChecksumSink", "OpenFile", "Phases", "RankFiles", "Resolve", "WriteProgress",
           "WriteWatch", "write_files"]

_CHUNK = 2 << 20
"""Bytes checksummed then written per system call: small enough to still be in the cache for the
write's copy, large enough that the call overhead does not count."""
_GATHER = 64 << 10
"""Writes below this size (zip headers, pickles) are gathered and written together."""
DIRECT_ALIGN = 4096
"""File offsets, lengths and buffer addresses of ``O_DIRECT`` writes are multiples of this
(enough for devices with 512-byte and 4 KiB logical blocks)."""
IN_PLACE = 1 << 20
"""A tensor's bytes from this size on are placed in the file at an offset that agrees with their
memory address modulo ``DIRECT_ALIGN`` (zero bytes before the item), and ``O_DIRECT`` writes
their whole blocks straight from that memory. Smaller ones are copied into the aligned buffer:
a copy that small costs less than the zeros and the segment of its own it would save."""

Resolve = Callable[[WriteItem], "torch.Tensor | io.BytesIO"]


@dataclass
class Phases:
    """Seconds spent per phase of a write (summed over I/O threads)."""

    serialize_s: float = 0.0
    write_calls_s: float = 0.0
    checksum_s: float = 0.0
    sums_s: float = 0.0
    """Summing floating-point tensors for the manifest's fingerprints, each chunk after its CRC-32C."""
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
    sums: dict[str, ShardSums] | None = field(default_factory=dict)
    """Tensor name -> the sums of the floating-point items written (``format/tensorsums.py``), for
    the manifest's fingerprints; None where the writing path does not sum (the writer sums then)."""


class WriteProgress:
    """The bytes a rank's write has handed on so far and when they last moved: read from another
    thread (the writer's answer to the driver's poll) to tell a stuck write (a hung file system,
    an upload that never returns) from a slow one."""

    def __init__(self) -> None:
        self.bytes = 0
        self.moved_at = time.monotonic()

    def advance(self, nbytes: int) -> None:
        self.bytes += nbytes  # one writer thread per file; a lost update only delays the clock
        self.moved_at = time.monotonic()

    def still_for(self, now: float) -> float:
        """Seconds since the bytes last moved (since the write began, before the first)."""
        return max(0.0, now - self.moved_at)


class WriteWatch:
    """A writer's writes in progress, by (rank, step), and how long each has moved no bytes."""

    def __init__(self) -> None:
        self._writes: dict[tuple[int, int], WriteProgress] = {}

    def start(self, rank: int, step: int) -> WriteProgress:
        progress = self._writes[(rank, step)] = WriteProgress()
        return progress

    def end(self, rank: int, step: int) -> None:
        self._writes.pop((rank, step), None)

    def stalls(self) -> dict[str, float]:
        """``"rank R step S"`` -> seconds since that write last moved bytes (safe from any thread)."""
        now = time.monotonic()
        return {f"rank {r} step {s}": p.still_for(now) for (r, s), p in sorted(list(self._writes.items()))}


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
        over, kept alive by whatever writes from it later (``localfile``'s direct sink)."""
        self.progress: WriteProgress | None = None
        """Advanced by each chunk handed on (``write_files(progress=...)``)."""
        self._sums: SumsAccumulator | None = None
        self._summed = 0
        """Bytes of the owner's storage summed as they were checksummed."""

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position + len(self._pending)

    def begin_item(self, owner: torch.Tensor | None = None) -> None:
        """The next bytes start an item (every earlier byte has been flushed); ``owner``: its tensor."""
        assert not self._pending, "an item starts after the previous one is flushed"
        self.item_start, self.owner = self.position, owner
        self._sums = SumsAccumulator() if owner is not None and owner.is_floating_point() else None
        self._summed = 0

    def take_sums(self) -> ShardSums | None:
        """The sums of the item just written (None: not a floating-point tensor). Its chunks were
        summed beside their CRC-32C; a tensor small enough to be gathered with the item's records
        (or handed over in pieces that do not split at elements) is summed whole here."""
        owner, acc = self.owner, self._sums
        self._sums = None
        if owner is None or acc is None:
            return None
        if self._summed == owner.untyped_storage().nbytes():
            return acc.row()
        t0 = time.perf_counter()
        row = tensor_sums(owner)
        self.phases.sums_s += time.perf_counter() - t0
        return row

    def _sum_chunk(self, chunk: memoryview, address: int) -> None:
        """Sum the chunk of the owner's storage at ``address`` while it is in the cache."""
        owner, acc = self.owner, self._sums
        if owner is None or acc is None:
            return
        storage = owner.untyped_storage()
        size, offset = owner.element_size(), address - storage.data_ptr()
        if offset < 0 or offset + chunk.nbytes > storage.nbytes() or offset % size or chunk.nbytes % size:
            return
        t0 = time.perf_counter()
        flat = owner.as_strided((storage.nbytes() // size,), (1,), 0)
        acc.add(flat[offset // size:(offset + chunk.nbytes) // size])
        self._summed += chunk.nbytes
        self.phases.sums_s += time.perf_counter() - t0

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
        address agree modulo ``DIRECT_ALIGN`` (DCP records each item's offset and length, so
        bytes between items are never read)."""
        owner = self.owner
        if (owner is None or view.nbytes < IN_PLACE or self.position != self.item_start
                or address != owner.untyped_storage().data_ptr()):
            return
        pad = (address - self.tell()) % DIRECT_ALIGN
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
            self.phases.checksum_s += time.perf_counter() - t0
            if address is not None:
                self._sum_chunk(chunk, address + start)  # timed as sums_s
            t1 = time.perf_counter()
            if address is None:
                self._put(chunk)
            else:
                self.spans.append(Span(address + start, chunk.nbytes, before, self.crc))
                self._put_in_place(chunk, address + start)
            self.phases.write_calls_s += time.perf_counter() - t1
            if self.progress is not None:
                self.progress.advance(chunk.nbytes)
        self.position += view.nbytes

    def _put(self, chunk: memoryview) -> None:
        """Hand ``chunk`` on; raise when it cannot be."""
        raise NotImplementedError

    def _put_in_place(self, chunk: memoryview, address: int) -> None:
        """``_put`` a chunk of the caller's memory (at ``address``, unchanged until the write is
        done and kept alive by ``owner``): a sink may write it from there."""
        self._put(chunk)


OpenFile = Callable[[str, Phases], AbstractContextManager[ChecksumSink]]
"""Opens one file of a rank by name for writing; the file is durable once the context exits cleanly."""


def write_files(plan: SavePlan, resolve: Resolve, threads: int, open_file: OpenFile,
                progress: WriteProgress | None = None) -> RankFiles:
    """Write the items of ``plan`` (one rank's central plan) into whatever ``open_file`` opens (a
local file, an object upload).

    Splits the items into ``threads`` files exactly as ``FileSystemWriter(thread_count=threads)``
    does, so file names, items and lengths are the ones DCP records. ``resolve`` maps a write
    item to its data (``SavePlanner.resolve_data``). ``progress``: advanced as bytes are handed on.
    """
    prefix = plan.storage_data.prefix
    buckets = [(f"{prefix}{i}{DEFAULT_SUFFIX}", bucket)
               for i, bucket in enumerate(_split_by_size_and_type(threads, plan.items))]
    out = RankFiles()
    if threads == 1:
        parts = [_write_file(open_file, name, items, resolve, progress) for name, items in buckets]
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="rtc-filewrite") as pool:
            parts = list(pool.map(lambda b: _write_file(open_file, b[0], b[1], resolve, progress), buckets))
    for part in parts:
        out.results += part.results
        out.files.update(part.files)
        out.phases.add(part.phases)
        out.spans += part.spans
        for fqn, row in (part.sums or {}).items():
            out.sums[fqn] = merge_rows(out.sums.get(fqn), row)
    return out


def _write_file(open_file: OpenFile, name: str, items: list[WriteItem], resolve: Resolve,
                progress: WriteProgress | None = None) -> RankFiles:
    """One DCP file: tensors first, then byte items, each in plan order. DCP's
    ``_write_files_from_queue`` puts the byte items first; after the tensors, a byte item whose
    pickled length changed between saves (a counter that gained a digit) moves no tensor item, so
    the coordinator splices its entries into the last ``.metadata`` (``roles/metadatafile.py``)
    instead of building it again. Readers find every item by its recorded offset either way."""
    out = RankFiles()
    cpu0 = time.thread_time()
    with _zip_crc_off(), open_file(name, out.phases) as sink:
        sink.progress = progress
        ordered = ([i for i in items if i.type != WriteItemType.BYTE_IO]
                   + [i for i in items if i.type == WriteItemType.BYTE_IO])
        for item in ordered:
            out.results.append(_write_item(sink, name, item, resolve, out.sums))
    out.files[name] = {"size": sink.position, "crc32c": sink.crc}
    out.spans += sink.spans
    out.phases.cpu_s += time.thread_time() - cpu0
    return out


def _write_item(sink: ChecksumSink, name: str, item: WriteItem, resolve: Resolve,
                sums: dict[str, ShardSums]) -> WriteResult:
    """Write one item; a floating-point tensor's sums are added to ``sums`` under its name."""
    t0 = time.perf_counter()
    io_before = sink.phases.write_calls_s + sink.phases.checksum_s + sink.phases.sums_s
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
    row = sink.take_sums()
    if row is not None:
        sums[item.index.fqn] = merge_rows(sums.get(item.index.fqn), row)
    sink.owner = None
    offset = sink.item_start
    length = sink.position - offset
    io_spent = sink.phases.write_calls_s + sink.phases.checksum_s + sink.phases.sums_s - io_before
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
