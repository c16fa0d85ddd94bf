"""Staging: copy a rank's checkpoint tensors into host buffers that outlive the rank.

The buffer is a file in ``/dev/shm`` created by the node's CheckpointWriter; the trainer maps
it (``mmap``, shared) and fills it, the writer maps the same file and persists it. Allocated
once per layout and reused for every save. How the file is created, checked before it is
mapped, and tied to a live owner is ``checkpoint/datapath/buffers.py``.

* CPU: ``SharedMemoryStaging`` copies on a background thread (``copy_`` releases the GIL), so
  the copy overlaps the next forward/backward.
* CUDA: ``PinnedCudaStaging`` page-locks the same mapping with ``cudaHostRegister`` and
  issues non-blocking device-to-host copies on a side stream.

Either way ``wait()`` must return before the optimizer mutates the parameters; the trainer
calls it right before ``optimizer.step()``.

The buffer's first bytes (``StageProgress``, ``checkpoint/datapath/progress.py``) say how far the
copy has got, so that the writer, handed the save as the copy starts, writes each tensor as soon
as it is in the buffer.
"""

from __future__ import annotations

import abc
import ctypes
import hashlib
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex

from raytrain_ckpt.checkpoint.datapath.buffers import OwnedBuffer, open_buffer
from raytrain_ckpt.checkpoint.datapath.progress import StageProgress

__all__ = [
    "PinnedCudaStaging",
    "SharedMemoryStaging",
    "StagedPlanner",
    "Staging",
    "TensorSlot",
    "allocate_buffer",
    "copy_bytes",
    "map_buffer",
    "map_slots",
    "map_whole",
    "Populate",
    "plan_slots",
    "populate_of",
    "populate_range",
    "prefault",
    "slot_views",
    "views_of",
]

_ALIGN = 64
_HEADER = 64
"""Bytes at the start of every staging buffer before its first slot: the copy's ``StageProgress``."""
_PAGE = 4096
_PAGE_ALIGNED_FROM = 1 << 20
"""Slots of this size on start on a page boundary: the writer writes their whole blocks to the
file with ``O_DIRECT`` straight from the buffer, at file offsets that are then multiples of 4096
too (``filewrite.IN_PLACE``); smaller ones are packed at ``_ALIGN``."""


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives in the staging buffer."""

    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def plan_slots(tensors: dict[str, torch.Tensor]) -> tuple[list[TensorSlot], int]:
    """Aligned byte ranges for each tensor, in key order, after the buffer's ``StageProgress``
    header; returns (slots, total bytes)."""
    slots, offset = [], _HEADER
    for fqn, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        align = _PAGE if nbytes >= _PAGE_ALIGNED_FROM else _ALIGN
        offset = -(-offset // align) * align
        slots.append(TensorSlot(fqn, t.dtype, tuple(t.shape), offset, nbytes))
        offset += nbytes
    return slots, max(-(-offset // _ALIGN) * _ALIGN, _ALIGN)


def layout_key(slots: list[TensorSlot], object_keys: list[str]) -> str:
    """Identity of a layout: same key, same buffer and the same DCP plan."""
    h = hashlib.sha256()
    for s in slots:
        h.update(f"{s.fqn}|{s.dtype}|{s.shape}|{s.offset};".encode())
    h.update("|".join(sorted(object_keys)).encode())
    return h.hexdigest()[:16]


def allocate_buffer(path: Path, nbytes: int) -> OwnedBuffer:
    """Create the shared-memory file ``path`` (exclusively, mode 0600) and own it until ``remove()``.

    Raises StagingFileError when the name is taken by anything but an orphaned buffer of ours
    (see ``checkpoint/datapath/buffers.py``).
    """
    return OwnedBuffer.create(path, nbytes)


def map_buffer(path: Path, nbytes: int, keep: int = 1) -> torch.Tensor:
    """A uint8 tensor over the first ``nbytes`` of the file, shared with every process that maps it.

    The file is checked before it is mapped (no symlink; a regular file of ours, mode 0600,
    large enough); raises StagingFileError otherwise. The process's last ``keep`` mappings are
    kept and returned again for the same file (device and inode) and size: a rank that survives
    a restart and is given its buffers back stages into pages it has mapped already, where a new
    mapping would fault in every page again (``prefault``). A kept mapping holds the file's
    memory until the process has mapped ``keep`` other buffers, or exits, as the rank's staging
    did (a rank with ``checkpoint.memory_copies`` buffers keeps that many).
    """
    fd = open_buffer(path, nbytes)
    try:
        st = os.fstat(fd)
        key = (st.st_dev, st.st_ino, nbytes)
        kept = next((k for k in _kept if k.key == key), None)
        if kept is None:
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            # The tensor holds a reference to the mapping, which is unmapped when the last view goes.
            buffer = torch.frombuffer(mapping, dtype=torch.uint8)
            kept = _Kept(key, buffer, Populate(buffer))
    finally:
        os.close(fd)  # the mapping keeps the file alive
    others = [k for k in _kept if k is not kept]
    _kept[:] = others[max(0, len(others) - (keep - 1)):] + [kept]  # the newest ``keep``, this one last
    return kept.buffer


@dataclass(frozen=True)
class _Kept:
    key: tuple[int, int, int]
    """(device, inode, bytes) of the mapped file."""
    buffer: torch.Tensor
    populate: Populate


_kept: list[_Kept] = []
"""This process's last ``map_buffer`` mappings, the newest last."""


class Populate:
    """Populating one mapping's pages (``prefault``) once, on a thread of its own.

    ``start()`` begins it in the background: a rank's second staging buffer is first copied
    into by the save after the first, and populating it while the first save persists (about
    0.07 s of kernel time per 256 MiB) takes that off the second save's copy, which the optimizer
    step waits for. ``wait()`` starts it if nobody has and returns once it is done: the copy that
    needs it. The ``madvise`` call runs without the GIL (``ctypes``).
    """

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=prefault, args=(self.buffer,), name="rtc-populate", daemon=True)
                self._thread.start()

    def wait(self) -> None:
        self.start()
        assert self._thread is not None
        self._thread.join()


def populate_of(buffer: torch.Tensor) -> Populate:
    """The ``Populate`` of a mapping ``map_buffer`` keeps (shared by every staging of it), else a new one."""
    return next((k.populate for k in _kept if k.buffer is buffer), None) or Populate(buffer)


def slot_views(buffer: torch.Tensor, slots: list[TensorSlot]) -> dict[str, torch.Tensor]:
    """Typed, shaped views of each slot (no copy)."""
    out = {}
    for s in slots:
        raw = buffer[s.offset: s.offset + s.nbytes]
        out[s.fqn] = raw.view(s.dtype).view(s.shape) if s.nbytes else torch.empty(s.shape, dtype=s.dtype)
    return out


def map_slots(path: Path, nbytes: int, slots: list[TensorSlot]) -> dict[str, torch.Tensor]:
    """Typed, shaped views of each slot of the buffer file ``path`` whose storage is exactly the slot.

    What the writer serialises: ``torch.save`` of a ``slot_views`` view would write the whole
    buffer (its storage), and DCP would clone it first. Checked like ``map_buffer``.
    """
    return views_of(map_whole(path, nbytes), slots)


def map_whole(path: Path, nbytes: int) -> memoryview:
    """The first ``nbytes`` of the buffer file ``path``, mapped shared (checked like ``map_buffer``).

    Pages are mapped as they are first read. ``MAP_POPULATE`` would map them all in one call,
    but for a rank that then checksums the whole buffer that was slower, not faster: 0.057 s to
    populate 485 MiB plus 0.029 s to checksum, against 0.052 s for a checksum that faults as it
    reads (this VM, tmpfs).
    """
    fd = open_buffer(path, nbytes)
    try:
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return memoryview(mapping)


def views_of(whole: memoryview, slots: list[TensorSlot]) -> dict[str, torch.Tensor]:
    """``map_slots``'s views over a mapping from ``map_whole`` (each view's storage keeps it alive)."""
    out = {}
    for s in slots:
        if not s.nbytes:
            out[s.fqn] = torch.empty(s.shape, dtype=s.dtype)
            continue
        raw = torch.frombuffer(whole[s.offset: s.offset + s.nbytes], dtype=torch.uint8)
        out[s.fqn] = raw.view(s.dtype).view(s.shape)
    return out


_MADV_POPULATE_WRITE = 23
"""Linux 5.14+ (``<linux/mman.h>``); Python's ``mmap`` module names it only from 3.14 on."""
_libc = ctypes.CDLL(None, use_errno=True)

def prefault(buffer: torch.Tensor) -> bool:
    """Map every page of ``buffer`` (a shared mapping from ``map_buffer``) writable in one
    ``madvise(MADV_POPULATE_WRITE)`` call; returns whether the kernel did.

    A process that maps a staging buffer (a restarted rank mapping the buffer its predecessor
    used) otherwise takes a page fault per 4 KiB page on its first copy, 65,536 per 256 MiB,
    on the copy that overlaps its first step. Populating in one call walks the same pages
    without the fault round trips. A kernel without it (EINVAL) leaves the faults to the copy.
    """
    return populate_range(buffer.data_ptr(), buffer.numel())


def populate_range(start: int, nbytes: int) -> bool:
    """``prefault`` of the ``nbytes`` mapped at address ``start`` (page-aligned), e.g. a mapping from
    ``map_whole``. Unlike ``MAP_POPULATE`` (Python's ``mmap`` holds the GIL through the whole
    call: 0.1 s per 256 MiB in which no other thread of the process runs), the ``madvise`` runs
    without the GIL."""
    page = mmap.PAGESIZE
    if start % page or nbytes == 0:
        return False
    length = (nbytes + page - 1) // page * page
    return _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_POPULATE_WRITE) == 0


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, as a ``memmove`` when both are plain CPU tensors of the same dtype and
    shape (a restore also copies into CUDA tensors: those go through ``copy_``). Both run without
    the GIL; libc's copy switches to non-temporal stores above a size it derives from the
    last-level cache each thread gets (well under a tensor's size on a many-core server), which
    saves the destination's read-for-ownership: 256 MiB in 0.022 s against 0.038 s for torch's
    copy loop, which never does (ARCHITECTURE, "The staging copy is a `memmove`")."""
    if _plain(dst) and _plain(src) and src.dtype == dst.dtype and src.shape == dst.shape:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.nbytes)
    else:
        dst.copy_(src)


def _plain(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes in memory are its values, in order: a contiguous dense CPU tensor with
    bytes of its own, without a lazy conjugate or negation bit. A subclass (a wrapper such as a
    quantised parameter's local shard, whose ``data_ptr`` is 0 or not its values), a tensor
    without bytes (empty, or an efficient zero tensor), a quantized tensor (its values are its
    bytes and its quantizer's scale, which ``copy_`` copies too) and a nested one go through
    ``copy_``, which knows them."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu" and t.layout == torch.strided
            and not t.is_quantized and not t.is_nested and t.is_contiguous() and not t.is_conj()
            and not t.is_neg() and not t._is_zerotensor() and t.nbytes > 0 and t.data_ptr() != 0)


class StagedPlanner(DefaultSavePlanner):
    """A DCP save planner that resolves write items from staged buffers (by FQN) instead of
    the live state dict: lets a process that never held the model write its shards.

    ``ready(fqn)``, when given, is called before an entry is handed out: the writer waits
    there for the staging copy to have reached it (``StageProgress``)."""

    def __init__(self, staged: dict[str, Any], ready: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self.staged = staged
        self.ready = ready

    def lookup_object(self, index: MetadataIndex) -> Any:
        if self.ready is not None:
            self.ready(index.fqn)
        return self.staged[index.fqn]


class Staging(Protocol):
    """Fill the buffer from live tensors without blocking the caller."""

    def start(self, sources: dict[str, torch.Tensor], on_done: Callable[[], None],
              midway: Callable[[], None] | None = None, token: int = 0,
              on_begin: Callable[[], None] | None = None) -> None:
        """Begin copying; ``on_done`` runs (on another thread) once the buffer holds the data.

        ``midway`` runs on the copying thread when about half of the tensors are copied (the
        ``staging`` fault-injection point). ``token`` names the save in the buffer's
        ``StageProgress``; ``on_begin`` runs on the copying thread right after the progress is
        reset for it and before the first byte is copied (the hand-off to the writer). It must not raise."""

    def wait(self) -> float:
        """Block until the copy finished; returns seconds spent blocked. Re-raises copy errors.

        ``on_done`` may still be running: the buffer is filled, the live tensors may change."""

    def finish(self) -> float:
        """Block until ``on_done`` returned too; returns seconds spent blocked. Re-raises errors
        of the copy and of ``on_done``. Called before the next ``start()``."""

    def warm(self) -> None:
        """Get the buffer ready for its first copy in the background, if that takes work (returns at once)."""


class _ThreadedStaging(abc.ABC):
    """The copy and then ``on_done`` (the hand-off to the writer, a round trip to another
    process) run on one thread; ``wait()`` returns once the copy is done, so the trainer's
    optimizer step does not wait for the hand-off, and ``finish()`` joins the thread."""

    def __init__(self, buffer: torch.Tensor, slots: list[TensorSlot]) -> None:
        self.buffer = buffer
        self.views = slot_views(buffer, slots)
        self.ends = [s.offset + s.nbytes for s in slots]
        """Where each slot ends, in the order of ``views`` (the order the copy goes in)."""
        self.progress = StageProgress(buffer.data_ptr(), buffer)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._copied = threading.Event()

    def start(self, sources: dict[str, torch.Tensor], on_done: Callable[[], None],
              midway: Callable[[], None] | None = None, token: int = 0,
              on_begin: Callable[[], None] | None = None) -> None:
        assert self._thread is None, "finish() the previous copy first"
        self._error = None
        self._copied = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(sources, on_done, midway or (lambda: None), token,
                                                                on_begin or (lambda: None)),
                                        name="rtc-staging", daemon=True)
        self._thread.start()

    def _run(self, sources: dict[str, torch.Tensor], on_done: Callable[[], None],
             midway: Callable[[], None], token: int, on_begin: Callable[[], None]) -> None:
        try:
            self.progress.begin(token)
            on_begin()
            t0 = time.monotonic()
            self._copy(sources, midway)
            self.progress.done(self.buffer.numel(), time.monotonic() - t0)
        except BaseException as exc:  # surfaced to the training thread by wait()
            self.progress.failed()  # a writer waiting for the copy gives the save up
            self._error = exc
            return
        finally:
            self._copied.set()
        try:
            on_done()
        except BaseException as exc:  # surfaced to the training thread by finish()
            self._error = exc

    def warm(self) -> None:
        """Nothing to do ahead by default."""

    @abc.abstractmethod
    def _copy(self, sources: dict[str, torch.Tensor], midway: Callable[[], None]) -> None:
        """Runs on the staging thread; returns once the buffer holds the data."""

    def wait(self) -> float:
        if self._thread is None:
            return 0.0
        t0 = time.monotonic()
        self._copied.wait()
        if self._error is not None:  # the copy failed (set before the event): the thread is ending
            self.finish()
        return time.monotonic() - t0

    def finish(self) -> float:
        if self._thread is None:
            return 0.0
        t0 = time.monotonic()
        self._thread.join()
        self._thread = None
        if self._error is not None:
            raise self._error
        return time.monotonic() - t0


class SharedMemoryStaging(_ThreadedStaging):
    """CPU: memcpy into the shared buffer on a background thread; before the first copy, the
    whole mapping is pre-faulted in one call (``prefault``), ahead of time when ``warm()`` was
    called, and once per mapping (``Populate``: a restarted rank's kept mapping is not walked again)."""

    def __init__(self, buffer: torch.Tensor, slots: list[TensorSlot]) -> None:
        super().__init__(buffer, slots)
        self._populate = populate_of(buffer)

    def warm(self) -> None:
        self._populate.start()

    def _copy(self, sources: dict[str, torch.Tensor], midway: Callable[[], None]) -> None:
        self._populate.wait()
        half, size = len(self.views) // 2, self.buffer.numel()
        with torch.no_grad():
            for i, ((fqn, dst), end) in enumerate(zip(self.views.items(), self.ends)):
                if i == half:
                    midway()
                copy_bytes(dst, sources[fqn])
                if end < size:  # the buffer's end is said by done(), after the duration
                    self.progress.advance(end)


class PinnedCudaStaging(_ThreadedStaging):
    """CUDA: page-lock the shared buffer once, D2H copies on a side stream.

    The copies are enqueued on the side stream after it waits for the current stream (so they
    see the finished optimizer step); the background thread only waits for the copy event
    before calling ``on_done``. The optimizer's kernels are ordered after the copies by
    ``wait()``, which makes the current stream wait on the same event.
    """

    def __init__(self, buffer: torch.Tensor, slots: list[TensorSlot], device: torch.device) -> None:
        super().__init__(buffer, slots)
        self.device = device
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {buffer.numel()} bytes failed with {err}")
        self._registered = True
        self.stream = torch.cuda.Stream(device=device)
        self._event: torch.cuda.Event | None = None

    def start(self, sources: dict[str, torch.Tensor], on_done: Callable[[], None],
              midway: Callable[[], None] | None = None, token: int = 0,
              on_begin: Callable[[], None] | None = None) -> None:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream), torch.no_grad():
            for fqn, dst in self.views.items():
                src = sources[fqn]
                dst.copy_(src, non_blocking=True)
                if src.is_cuda:
                    src.record_stream(self.stream)
            self._event = torch.cuda.Event()
            self._event.record(self.stream)
        super().start(sources, on_done, midway, token, on_begin)

    def _copy(self, sources: dict[str, torch.Tensor], midway: Callable[[], None]) -> None:
        assert self._event is not None
        midway()  # the copies are enqueued and (usually) still running
        self._event.synchronize()

    def wait(self) -> float:
        if self._event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._event)
        return super().wait()

    def close(self) -> None:
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self._registered = False
