"""A DCP tensor chunk read without an unpickler.

DCP writes each tensor chunk as its own ``torch.save`` blob (a zip: ``data.pkl``, ``data/<key>``,
``byteorder``, ...) and hands it to ``torch.load(weights_only=True)``, which runs an unpickler
over whatever opcodes the file holds. Here the ``data.pkl`` of a chunk is instead *parsed*, by a
strict whitelist of the one shape ``torch.save`` gives a single tensor:

    _rebuild_tensor_v2((storage, <XStorage>, key, "cpu", numel) as a persistent id, offset,
                       size, stride, requires_grad, OrderedDict())
    _rebuild_tensor_v3(... the same with an UntypedStorage of numel bytes ..., dtype)

Protocol-2 opcodes only, a memo of at most 256 entries, at most 64 KiB: anything else is refused
as "not a tensor chunk", so the parse is linear in the header and allocates nothing from a number
the file gives. The tensor is then a strided view over the bytes of its ``data/<key>`` record,
checked to hold every element the view reaches. ``parse_chunk`` needs no torch (``verify``
checks every chunk's header with it); ``load_chunk`` builds the tensor.
"""

from __future__ import annotations

import functools
import io
import struct
import threading
import zipfile
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint, TensorHeaderRefused
from raytrain_ckpt.checkpoint.format.prescan import ZIP_ERRORS, stored_member

__all__ = ["CHUNK_PARSES", "MAX_HEADER", "ChunkHeader", "ChunkParses", "FileSlice", "load_chunk", "parse_chunk",
           "parse_tensor_pickle"]

MAX_HEADER = 64 << 10
"""Largest ``data.pkl`` of one tensor chunk (a 64-dimensional tensor's is about 1 KiB)."""

_TYPED = {"DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16", "LongStorage": "int64",
          "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
          "BoolStorage": "bool", "BFloat16Storage": "bfloat16", "ComplexDoubleStorage": "complex128",
          "ComplexFloatStorage": "complex64"}
"""``torch.<X>Storage`` -> the dtype of its elements (``torch.storage._dtype_to_storage_type_map``)."""

_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
             "bool": 1, "bfloat16": 2, "complex128": 16, "complex64": 8, "uint16": 2, "uint32": 4, "uint64": 8,
             "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
             "float8_e8m0fnu": 1, "complex32": 4}
"""Bytes per element of each dtype a chunk may hold."""


@dataclass(frozen=True)
class ChunkHeader:
    """What a chunk's ``data.pkl`` says: its dtype and the strided view of its storage record."""

    dtype: str
    key: str
    nbytes: int
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


_STORAGE, _ODICT, _REBUILD2, _REBUILD3 = "storage", "odict", "rebuild_v2", "rebuild_v3"


def _global(module: str, name: str) -> tuple:
    if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3"):
        return ("g", _REBUILD2 if name.endswith("v2") else _REBUILD3)
    if module == "collections" and name == "OrderedDict":
        return ("g", _ODICT)
    if module == "torch" and name in _TYPED:
        return ("g", "typed", _TYPED[name])
    if module == "torch.storage" and name == "UntypedStorage":
        return ("g", "typed", "uint8")
    if module == "torch" and name in _ITEMSIZE:
        return ("g", "dtype", name)
    raise TensorHeaderRefused(f"refers to {module}.{name}")


def _int(value: Any, what: str) -> int:
    if type(value) is not int or not 0 <= value < 1 << 62:
        raise TensorHeaderRefused(f"has {what} that is not a size")
    return value


def _dims(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or len(value) > 64:
        raise TensorHeaderRefused(f"has {what} that is not a tuple of at most 64 sizes")
    return tuple(_int(v, what) for v in value)


def _persistent(pid: Any) -> tuple:
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], tuple)
            and pid[1][:2] == ("g", "typed") and isinstance(pid[2], str) and len(pid[2]) <= 32 and pid[3] == "cpu"):
        raise TensorHeaderRefused("has a persistent id that is not a cpu storage")
    return (_STORAGE, pid[1][2], pid[2], _int(pid[4], "a storage length"))


def _reduce(fn: Any, args: Any) -> Any:
    if fn == ("g", _ODICT) and args == ():
        return (_ODICT,)
    if fn not in (("g", _REBUILD2), ("g", _REBUILD3)) or not isinstance(args, tuple):
        raise TensorHeaderRefused("calls something other than torch's tensor rebuild")
    v3 = fn[1] == _REBUILD3
    if len(args) != (7 if v3 else 6) or not (isinstance(args[0], tuple) and args[0][:1] == (_STORAGE,)):
        raise TensorHeaderRefused("rebuilds a tensor from arguments torch.save never writes")
    _, dtype, key, numel = args[0]
    if args[4] not in (True, False) or args[5] != (_ODICT,):
        raise TensorHeaderRefused("rebuilds a tensor with hooks or flags torch.save never writes")
    if v3:
        if dtype != "uint8" or not (isinstance(args[6], tuple) and args[6][:2] == ("g", "dtype")):
            raise TensorHeaderRefused("rebuilds a tensor of an untyped storage without its dtype")
        dtype, nbytes = args[6][2], numel
    else:
        nbytes = numel * _ITEMSIZE[dtype]
    return ChunkHeader(dtype, key, nbytes, _int(args[1], "an offset"), _dims(args[2], "a size"),
                       _dims(args[3], "a stride"))


def _line(data: bytes, pos: int) -> tuple[str, int]:
    end = data.find(b"\n", pos, pos + 128)
    if end < 0:
        raise TensorHeaderRefused("has a global name over 128 bytes")
    return data[pos:end].decode("ascii"), end + 1


def _run(data: bytes) -> Any:  # noqa: C901 - one opcode loop over a fixed whitelist
    stack: list = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    pos = 0
    while True:
        op = data[pos]
        pos += 1
        if op == 0x80:  # PROTO
            if data[pos] != 2:
                raise TensorHeaderRefused("is not of pickle protocol 2, which torch.save writes")
            pos += 1
        elif op == 0x63:  # GLOBAL
            module, pos = _line(data, pos)
            name, pos = _line(data, pos)
            stack.append(_global(module, name))
        elif op in (0x71, 0x72):  # BINPUT, LONG_BINPUT
            width = 1 if op == 0x71 else 4
            key = int.from_bytes(data[pos:pos + width], "little")
            pos += width
            if key >= 256 or not stack:
                raise TensorHeaderRefused("uses a memo torch.save never writes")
            memo[key] = stack[-1]
        elif op in (0x68, 0x6A):  # BINGET, LONG_BINGET
            width = 1 if op == 0x68 else 4
            stack.append(memo[int.from_bytes(data[pos:pos + width], "little")])
            pos += width
        elif op == 0x28:  # MARK
            marks.append(len(stack))
        elif op == 0x74:  # TUPLE
            at = marks.pop()
            items = tuple(stack[at:])
            del stack[at:]
            stack.append(items)
        elif op == 0x29:  # EMPTY_TUPLE
            stack.append(())
        elif op in (0x85, 0x86, 0x87):  # TUPLE1..3
            n = op - 0x84
            if len(stack) - (marks[-1] if marks else 0) < n:
                raise TensorHeaderRefused("has a tuple of missing items")
            items = tuple(stack[-n:])
            del stack[-n:]
            stack.append(items)
        elif op in (0x58, 0x8C):  # BINUNICODE, SHORT_BINUNICODE
            width = 4 if op == 0x58 else 1
            n = int.from_bytes(data[pos:pos + width], "little")
            pos += width
            if n > 256 or pos + n > len(data):
                raise TensorHeaderRefused("has a string over 256 bytes")
            stack.append(data[pos:pos + n].decode("utf-8"))
            pos += n
        elif op in (0x4B, 0x4D, 0x4A):  # BININT1, BININT2, BININT
            width = {0x4B: 1, 0x4D: 2, 0x4A: 4}[op]
            if pos + width > len(data):
                raise TensorHeaderRefused("ends inside a number")
            stack.append(int.from_bytes(data[pos:pos + width], "little", signed=op == 0x4A))
            pos += width
        elif op == 0x8A:  # LONG1
            n = data[pos]
            if n > 9 or pos + 1 + n > len(data):
                raise TensorHeaderRefused("has a number over 9 bytes")
            stack.append(int.from_bytes(data[pos + 1:pos + 1 + n], "little", signed=True))
            pos += 1 + n
        elif op in (0x88, 0x89):  # NEWTRUE, NEWFALSE
            stack.append(op == 0x88)
        elif op == 0x51:  # BINPERSID
            stack[-1] = _persistent(stack[-1])
        elif op == 0x52:  # REDUCE
            args = stack.pop()
            stack[-1] = _reduce(stack[-1], args)
        elif op == 0x2E:  # STOP
            if len(stack) != 1 or marks or not isinstance(stack[0], ChunkHeader):
                raise TensorHeaderRefused("does not hold exactly one tensor")
            return stack[0]
        else:
            raise TensorHeaderRefused(f"has the opcode {op:#x}, which torch.save never writes for a tensor")
        if len(stack) > 256 or len(marks) > 64:
            raise TensorHeaderRefused("nests deeper than a tensor's header")


def parse_tensor_pickle(data: bytes, where: str) -> ChunkHeader:
    """The tensor the ``data.pkl`` bytes ``data`` describe, parsed by the whitelist (no unpickler).

    Raises:
        InvalidCheckpoint: Naming ``where`` and what is not a tensor as ``torch.save`` writes one.
    """
    if len(data) > MAX_HEADER:
        raise InvalidCheckpoint(f"{where}: its data.pkl is {len(data)} bytes, over the {MAX_HEADER} of a tensor "
                                "chunk's header: not a tensor chunk")
    try:
        return _run(data)
    except TensorHeaderRefused as exc:
        raise InvalidCheckpoint(f"{where} is not a tensor chunk as torch.save writes one: its data.pkl {exc}; "
                                "refused without unpickling it") from None
    except (IndexError, KeyError, ValueError, TypeError, UnicodeDecodeError) as exc:
        raise InvalidCheckpoint(f"{where} is not a tensor chunk as torch.save writes one: its data.pkl is "
                                f"malformed ({type(exc).__name__}); refused without unpickling it") from None


def _span(header: ChunkHeader) -> int:
    """Bytes of the storage the view reaches (0 for an empty tensor)."""
    if any(s == 0 for s in header.size):
        return 0
    last = header.offset + sum((s - 1) * st for s, st in zip(header.size, header.stride))
    return (last + 1) * _ITEMSIZE[header.dtype]


def _open(f: BinaryIO, where: str) -> tuple[zipfile.ZipFile, ChunkHeader, zipfile.ZipInfo]:
    try:
        archive = zipfile.ZipFile(f)
        infos = {i.filename: i for i in archive.infolist()}
    except ZIP_ERRORS as exc:
        raise InvalidCheckpoint(f"{where} is not a torch.save blob ({exc})") from None
    pickles = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1 or len(infos) > 16:
        raise InvalidCheckpoint(f"{where} is not a torch.save blob of one tensor")
    prefix = pickles[0][:-len("data.pkl")]
    try:
        header = parse_tensor_pickle(stored_member(archive, infos[pickles[0]]), where)
        order = infos.get(prefix + "byteorder")
        if order is not None and stored_member(archive, order) != b"little":
            raise InvalidCheckpoint(f"{where} holds big-endian bytes, which this project never writes")
    except ZIP_ERRORS as exc:
        raise InvalidCheckpoint(f"{where} is not a torch.save blob ({exc})") from None
    record = infos.get(f"{prefix}data/{header.key}")
    if record is None or record.file_size != header.nbytes or _span(header) > header.nbytes:
        raise InvalidCheckpoint(f"{where}: its tensor reaches past its {header.nbytes}-byte storage record "
                                "(or the record is missing or of another size)")
    return archive, header, record


def parse_chunk(f: BinaryIO, where: str) -> ChunkHeader:
    """The header of the tensor chunk blob ``f`` (seekable, starting at the blob), checked against
    its storage record; torch-free. Raises InvalidCheckpoint naming ``where``. A ``FileSlice``
    whose blob reads as one parsed before is not parsed again (``ChunkParses``)."""
    if isinstance(f, FileSlice):
        return CHUNK_PARSES.parse(f, where)
    archive, header, _ = _open(f, where)
    archive.close()
    return header


class ChunkParses:
    """Headers that parsed, each under the bytes its parse read (positions and contents) and the
    blob's length: the parse is a function of exactly those, since where it reads next depends
    only on what it read before. A blob is first read at the places a parse of a blob of its
    length read; if every byte there is the same, its parse would make the same reads, get the
    same bytes and return the same header, so that header is its own. The chunks of one layout
    (every rank's shard of a tensor, every step of a job) differ only in the tensor bytes, which
    the parse never reads: ``verify --checksum`` of a root parses each layout once, not each chunk.
    Bounded: ``entries`` headers, traces of at most ``max_trace`` bytes, ``shapes`` read patterns
    a length. Refusals are not kept (a refused blob is parsed each time), nor a parse any of whose
    reads got less than it asked for (a file shorter than its slice)."""

    def __init__(self, entries: int = 4096, max_trace: int = 4096, shapes: int = 4) -> None:
        self.entries, self.max_trace, self.shapes = entries, max_trace, shapes
        self.full_parses = 0
        self._headers: dict[tuple, ChunkHeader] = {}
        self._patterns: dict[int, list[tuple[tuple[int, int], ...]]] = {}
        self._files: dict[tuple[tuple[int, int], ...], tuple[tuple, tuple, bytes]] = {}
        self._file_bytes = 0
        self._files_lock = threading.Lock()

    def parse(self, f: FileSlice, where: str) -> ChunkHeader:
        """``parse_chunk(f, where)``."""
        return self._parse(f, where)[0]

    def parse_file(self, f: BinaryIO, chunks: Sequence[tuple[int, int]], where: Callable[[int], str]) -> None:
        """``parse_chunk`` of each chunk (offset, length) of the file ``f``, in the order given
        (raising for the first one refused, named by ``where(offset)``). The reads that confirmed
        every chunk's header are kept for the file's chunk list: a file with the same chunks that
        holds the same bytes at every one of those places (every step's file of one rank of a job)
        is confirmed by reading them as a few spans and comparing once, each chunk's parse being
        a function of exactly the bytes it read (see the class). A file read short compares
        unequal and is parsed chunk by chunk. Bounded: no read of more than ``_FILE_SPAN`` bytes
        (a chunk's reads near the next chunk's are one span up to that size, never the whole file),
        and the kept files cost at most what the kept headers may (``entries`` x ``max_trace``
        bytes, counting about 64 bytes a read for the plan); a file whose reads alone are more is
        not kept."""
        key = tuple(chunks)
        known = self._files.get(key)
        if known is not None and b"".join(_cut_reads(f, 0, known[0], known[1])) == known[2]:
            return
        budget = self.entries * self.max_trace
        reads: list[tuple[int, bytes]] | None = []
        cost = 64 * len(key)
        for offset, length in key:
            _, confirmed = self._parse(FileSlice(f, offset, length), where(offset))
            if confirmed is None or reads is None or cost > budget:
                reads = None  # (the remaining chunks are still parsed, for their verdicts)
                continue
            reads.extend((offset + pos, data) for pos, data in confirmed)
            cost += sum(64 + len(data) for _, data in confirmed)
        if not reads or cost > budget:
            return
        want = b"".join(data for _, data in reads)
        end = max(offset + length for offset, length in key)
        spans, cuts = _read_plan.__wrapped__(tuple((pos, len(data)) for pos, data in reads), end, _FILE_SPAN)
        with self._files_lock:
            if self._file_bytes + cost > budget:
                self._files.clear()
                self._file_bytes = 0
            self._files[key] = (spans, cuts, want)
            self._file_bytes += cost

    def _parse(self, f: FileSlice, where: str) -> tuple[ChunkHeader, tuple[tuple[int, bytes], ...] | None]:
        """The header, and the reads (position in the slice, bytes) it is a function of; None for
        those when the header is not kept."""
        n = f.length
        for pattern in tuple(self._patterns.get(n, ())):  # (threads of one verify may add to it)
            got = f.read_at(pattern)
            header = self._headers.get((n, pattern, got))
            if header is not None:
                return header, tuple(zip((pos for pos, _ in pattern), got))
        self.full_parses += 1
        trace: list[tuple[int, int, bytes]] = []
        archive, header, _ = _open(f.traced(trace), where)
        archive.close()
        # kept only if every read got all it asked for: a file shorter than its slice (a step whose
        # manifest's sizes lie) reads short, and a blob that agrees at those reads would parse other bytes
        if all(len(data) == asked for _, asked, data in trace) and sum(a for _, a, _ in trace) <= self.max_trace:
            pattern = tuple((pos, asked) for pos, asked, _ in trace)
            if len(self._headers) >= self.entries:
                self._headers.clear()
                self._patterns.clear()
            self._headers[(n, pattern, tuple(data for _, _, data in trace))] = header
            known = self._patterns.setdefault(n, [])
            if pattern not in known:
                known.insert(0, pattern)
                del known[self.shapes:]
            return header, tuple((pos, data) for pos, _, data in trace)
        return header, None


CHUNK_PARSES = ChunkParses()
"""This process's parsed chunk headers (``verify``, ``ls --checksum``)."""


def load_chunk(f: BinaryIO, where: str) -> Any:
    """The tensor of the chunk blob ``f``: a strided view over its storage record's bytes."""
    import torch

    archive, header, record = _open(f, where)
    with archive:
        try:
            raw = stored_member(archive, record)
        except ZIP_ERRORS as exc:
            raise InvalidCheckpoint(f"{where}: its storage record is unreadable ({exc})") from None
    dtype = getattr(torch, header.dtype)
    if not raw:
        flat = torch.empty(0, dtype=dtype)
    else:
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype)
    return flat.as_strided(header.size, header.stride, header.offset)


_SPAN_GAP = 64 << 10
"""``FileSlice.read_at`` reads two reads at most this far apart as one span."""


_FILE_SPAN = 256 << 10
"""``ChunkParses.parse_file`` reads no span longer than this (but a single read that is)."""


@functools.lru_cache(maxsize=256)
def _read_plan(pattern: tuple[tuple[int, int], ...], length: int, cap: int = 0) -> tuple[tuple, tuple]:
    """For ``FileSlice.read_at`` of ``pattern`` in a slice of ``length`` bytes: the spans to read
    (start, end) and, per read of the pattern, (its span, where it starts and ends in the span's
    bytes). Each read is first clamped to the slice as ``readinto`` clamps it. With ``cap``, a read
    that would make its span longer than ``cap`` bytes starts a span of its own."""
    reads = sorted((max(0, pos), max(0, min(n, length - max(0, pos))), k) for k, (pos, n) in enumerate(pattern))
    spans: list[tuple[int, int]] = []
    cuts: list[tuple[int, int, int]] = [(0, 0, 0)] * len(pattern)
    for pos, n, k in reads:
        if not spans or pos > spans[-1][1] + _SPAN_GAP or (cap and pos + n - spans[-1][0] > cap):
            spans.append((pos, pos + n))
        else:
            spans[-1] = (spans[-1][0], max(spans[-1][1], pos + n))
        first = spans[-1][0]
        cuts[k] = (len(spans) - 1, pos - first, pos - first + n)
    return tuple(spans), tuple(cuts)


def _cut_reads(f: BinaryIO, start: int, spans: tuple, cuts: tuple) -> tuple[bytes, ...]:
    """The reads of a ``_read_plan`` (spans, cuts) of ``f`` from byte ``start`` on: each span read
    once, each read cut out of its span."""
    read = []
    for first, last in spans:
        f.seek(start + first)
        read.append(f.read(last - first))
    return tuple(read[span][a:b] for span, a, b in cuts)


class FileSlice(io.RawIOBase):
    """Bytes ``offset .. offset + length`` of the seekable binary stream ``f``, as a seekable stream."""

    def __init__(self, f: BinaryIO, offset: int, length: int,
                 trace: list[tuple[int, int, bytes]] | None = None) -> None:
        super().__init__()
        self._f, self._start, self._len, self._pos = f, offset, length, 0
        self._trace = trace

    @property
    def length(self) -> int:
        return self._len

    def traced(self, trace: list[tuple[int, int, bytes]]) -> FileSlice:
        """The same bytes, each read noted in ``trace`` as (position, bytes asked for, bytes read)."""
        return FileSlice(self._f, self._start, self._len, trace)

    def read_at(self, pattern: tuple[tuple[int, int], ...]) -> tuple[bytes, ...]:
        """The bytes at each (position, count) of ``pattern``, as a read of that count there returns
        them. Reads that lie near one another (a blob's local headers, its central directory) are
        one read of the span they cover, each cut out of it: the same bytes (a span that reaches
        past the file's end ends where the file does, as each read would), a few calls in place of
        one per read."""
        return _cut_reads(self._f, self._start, *_read_plan(pattern, self._len))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._len - self._pos))
        if n == 0:
            return 0
        self._f.seek(self._start + self._pos)
        data = self._f.read(n)
        buffer[:len(data)] = data
        if self._trace is not None:
            self._trace.append((self._pos, n, data))
        self._pos += len(data)
        return len(data)
