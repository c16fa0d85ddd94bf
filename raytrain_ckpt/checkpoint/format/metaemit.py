"""``.metadata`` written from arrays: every chunk and storage entry a fixed template with its
ints filled in, so that a file of millions of entries is a few numpy fills and a join.

``metapickle.build`` pickles DCP's ``Metadata`` objects, about 15 µs an entry at thousands of
ranks (the C pickler walks four objects an entry; the results were unpickled into those objects
first). Here the file is laid out so that no entry's bytes depend on anything but its own values:

- a prelude stores every class, field name, tensor name and file name once in the memo, under
  numbers this module gives in order (``LONG_BINPUT`` then ``POP``), and every entry refers to
  them with ``LONG_BINGET`` (always four bytes);
- every int of an entry is ``LONG1`` of eight bytes (the unpickler takes any length; a fixed one
  makes each entry's template of fixed width);
- the few values that are not entries (a tensor's properties, the planner data, the storage meta,
  a byte item's key) are pickled by the C pickler in ``fast`` mode: no memo, so none of its
  numbers collides with this module's.

So an entry's position in the file is computable, and moving a byte item (a new offset or length)
is an overwrite of its two eight-byte ints: no byte of the file moves (``EmittedFile.splice``).

The file loads with DCP's reader (``metadata.SafeUnpickler``) and this project's
(``format/metadata.load_metadata``) into a ``Metadata`` equal to the one ``metapickle.build``
writes from the same plan and results (``tests/unit/test_metaemit.py``).

The coordinator writes every ``.metadata`` this way (``roles/metadatafile.py``): the tensors'
chunks from the plan's arrays (``PlanArrays``, made once per plan) and the storage entries from the
ranks' results as numbers (``format/rankresults.py``), so a first commit at 4096 ranks of 70B
(8.88 M chunks and as many storage entries, 1.78 GB) is a few numpy operations per rank and the
fill and write of its rows, a block at a time into one reused buffer (measured by
``bench/scale.py --numbers --commit``). From objects the same file took about 15 µs an entry each
way (unpickling the results, pickling the file).
"""

from __future__ import annotations

import io
import pickle
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

__all__ = ["ByteItem", "EmittedFile", "PlanArrays", "StorageRun", "TensorChunks", "emit", "from_ranks"]

_BATCH = 500
"""Items per ``APPENDS``/``SETITEMS`` (as ``metapickle``: the reader's stack holds a batch)."""

_MARK, _POP, _SETITEMS, _APPENDS, _EMPTY_DICT, _EMPTY_LIST = b"(", b"0", b"u", b"e", b"}", b"]"
_NEWOBJ = b")\x81"
_BUILD, _TUPLE, _TUPLE1, _REDUCE, _STOP = b"b", b"t", b"\x85", b"R", b"."
_LONG8 = b"\x8a\x08"


def _get(i: int) -> bytes:
    return b"j" + struct.pack("<I", i)


def _fast(obj: Any) -> bytes:
    """``obj``'s opcodes with no memo (``Pickler.fast``): nothing it writes takes a number."""
    out = io.BytesIO()
    p = pickle.Pickler(out, protocol=2)
    p.fast = True
    p.dump(obj)
    return out.getvalue()[2:-1]


@dataclass
class TensorChunks:
    """One tensor of ``state_dict_metadata``: its chunks as arrays of shape (chunks, dims)."""

    fqn: str
    properties: Any
    size: tuple[int, ...]
    offsets: np.ndarray
    sizes: np.ndarray


@dataclass
class StorageRun:
    """Storage entries of tensor chunks of one number of dims, in the file's order: entry ``i``
    is ``MetadataIndex(fqns[fqn[i]], offsets[i], index[i])`` ->
    ``_StorageInfo(files[file[i]], at[i], length[i])``."""

    fqn: np.ndarray
    offsets: np.ndarray
    index: np.ndarray
    file: np.ndarray
    at: np.ndarray
    length: np.ndarray


@dataclass
class ByteItem:
    key: Any
    """Its ``MetadataIndex``."""
    file: str
    at: int
    length: int


@dataclass
class EmittedFile:
    """The file as parts: ``head`` (everything before the byte items' storage entries: bytes, and
    the rows of the templates, filled only when written) and ``tail`` (those entries and the
    rest, small and mutable, where a splice writes)."""

    head: list[Any]
    tail_at: int
    """The file offset at which ``tail`` begins."""
    tail: bytearray
    byte_at: dict[Any, int] = field(default_factory=dict)
    """A byte item's key -> the file offset of its offset's eight bytes (its length's are
    ``_BYTE_LENGTH_AFTER`` bytes after them)."""

    @property
    def size(self) -> int:
        return self.tail_at + len(self.tail)

    @property
    def data(self) -> bytes:
        """The whole file in memory (``write_to`` streams it instead)."""
        out = io.BytesIO()
        self.write_to(out)
        return out.getvalue()

    def write_to(self, f: Any) -> None:
        """Write the file to ``f``: the rows filled a block at a time into one reused buffer."""
        buf = _Buffer()
        for part in self.head:
            if isinstance(part, _Rows):
                part.write_to(f, buf)
            else:
                f.write(part)
        f.write(self.tail)

    def splice(self, moved: dict[Any, tuple[int, int]]) -> bool:
        """Overwrite the offset and length of each byte item in ``moved`` (key -> (at, length));
        False (nothing written) when a key is not one of this file's byte items."""
        if any(key not in self.byte_at for key in moved):
            return False
        for key, (at, length) in moved.items():
            pos = self.byte_at[key] - self.tail_at
            self.tail[pos:pos + 8] = struct.pack("<q", at)
            pos += 8 + _BYTE_LENGTH_AFTER
            self.tail[pos:pos + 8] = struct.pack("<q", length)
        return True

    def moved(self, moves: dict[Any, tuple[int, int]]) -> EmittedFile | None:
        """A new file: this one with the byte items in ``moves`` spliced (this one unchanged; the
        rows of the tensors are shared); None when a key is not one of its byte items."""
        out = EmittedFile(self.head, self.tail_at, bytearray(self.tail), self.byte_at)
        return out if out.splice(moves) else None


_CLASSES = (Metadata, MetadataIndex, _StorageInfo, ChunkStorageMetadata, TensorStorageMetadata,
            BytesStorageMetadata, torch.Size)
_FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version", "properties",
           "size", "chunks", "offsets", "sizes", "fqn", "offset", "index", "relative_path", "length")
_BYTE_LENGTH_AFTER = 7
"""Bytes between a byte item's offset int and its length int: ``GET 'length'`` (five) and the
length's two-byte ``LONG1`` header."""


class _Memo:
    """The prelude: each class and string stored once, numbered in order."""

    def __init__(self) -> None:
        self.ids: dict[Any, int] = {}
        self.out = bytearray()

    def add(self, key: Any, code: bytes) -> None:
        if key not in self.ids:
            self.ids[key] = len(self.ids)
            self.out += code + b"r" + struct.pack("<I", self.ids[key]) + _POP

    def cls(self, c: type) -> None:
        self.add(c, f"c{c.__module__}\n{c.__qualname__}\n".encode())

    def text(self, s: str) -> None:
        data = s.encode("utf-8")
        self.add(("s", s), b"X" + struct.pack("<I", len(data)) + data)

    def get(self, key: Any) -> bytes:
        return _get(self.ids[key])

    def s(self, name: str) -> bytes:
        return _get(self.ids[("s", name)])


Part = bytes | str | tuple[str, str]
"""A template's part: fixed bytes, an eight-byte int column (its name), or ("u4", name): a
four-byte memo number column."""


def _dtype(parts: list[Part]) -> np.dtype:
    """A structured dtype of the parts in order, with no padding."""
    names, formats, offsets, at = [], [], [], 0
    for i, part in enumerate(parts):
        if isinstance(part, bytes):
            fmt, width = f"V{len(part)}", len(part)
        elif isinstance(part, tuple):
            fmt, width = "<u4", 4
        else:
            fmt, width = "<i8", 8
        names.append(f"f{i}"), formats.append(fmt), offsets.append(at)
        at += width
    return np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": at})


class _Rows:
    """``n`` rows of a template in batches of ``_BATCH`` (``MARK`` rows ``end``), filled only when
    written, a block of rows at a time into one reused buffer: the file's bytes are never all in
    memory, and no fresh memory is touched per block."""

    def __init__(self, parts: list[Part], columns: dict[str, np.ndarray], n: int, end: bytes) -> None:
        self.parts, self.columns, self.n, self.end = parts, columns, n, end
        self.dtype = _dtype(parts)
        self.nbytes = n * self.dtype.itemsize + -(-n // _BATCH) * (len(_MARK) + len(end))

    def _row(self) -> np.ndarray:
        row = np.zeros(self.dtype.itemsize, dtype=np.uint8)
        for name, part in zip(self.dtype.names, self.parts):
            if isinstance(part, bytes):
                at = self.dtype.fields[name][1]
                row[at:at + len(part)] = np.frombuffer(part, dtype=np.uint8)
        return row

    def write_to(self, f: Any, buf: _Buffer) -> None:
        one, row = self.dtype.itemsize, self._row()
        for start in range(0, self.n, _BLOCK):
            k = min(self.n, start + _BLOCK) - start
            raw = buf.take(k * one).reshape(k, one)
            raw[:] = row
            rows = raw.reshape(-1).view(self.dtype)
            for name, part in zip(self.dtype.names, self.parts):
                if not isinstance(part, bytes):
                    rows[name] = self.columns[part[1] if isinstance(part, tuple) else part][start:start + k]
            view = memoryview(raw).cast("B")
            for at in range(0, k, _BATCH):
                f.write(_MARK)
                f.write(view[at * one:min(k, at + _BATCH) * one])
                f.write(self.end)


class _Buffer:
    """One buffer reused for every block a file's rows are filled in."""

    def __init__(self) -> None:
        self._data = np.empty(0, dtype=np.uint8)

    def take(self, n: int) -> np.ndarray:
        if len(self._data) < n:
            self._data = np.empty(n, dtype=np.uint8)
        return self._data[:n]


_BLOCK = 200 * _BATCH
"""Rows filled at once."""


def _size_parts(m: _Memo, prefix: str, nd: int) -> list[Part]:
    """``torch.Size`` of ``nd`` ints from columns ``prefix0``..: ``Size((ints,))`` by ``REDUCE``."""
    parts: list[Part] = [m.get(torch.Size) + _MARK]
    for d in range(nd):
        parts += [_LONG8, f"{prefix}{d}"]
    return parts + [_TUPLE + _TUPLE1 + _REDUCE]


def _chunk_bytes(m: _Memo, t: TensorChunks) -> _Rows:
    k, nd = t.offsets.shape
    parts: list[Part] = [m.get(ChunkStorageMetadata) + _NEWOBJ + _EMPTY_DICT + _MARK + m.s("offsets")]
    parts += _size_parts(m, "o", nd) + [m.s("sizes")] + _size_parts(m, "z", nd) + [_SETITEMS + _BUILD]
    cols = {f"o{d}": t.offsets[:, d] for d in range(nd)} | {f"z{d}": t.sizes[:, d] for d in range(nd)}
    return _Rows(parts, cols, k, _APPENDS)


def _storage_bytes(m: _Memo, run: StorageRun, fqn_ids: np.ndarray, file_ids: np.ndarray) -> _Rows:
    n, nd = run.offsets.shape
    parts: list[Part] = [m.get(MetadataIndex) + _NEWOBJ + _EMPTY_DICT + _MARK + m.s("fqn") + b"j", ("u4", "F"),
                         m.s("offset")]
    parts += _size_parts(m, "o", nd)
    parts += [m.s("index") + _LONG8, "I", _SETITEMS + _BUILD,
              m.get(_StorageInfo) + _NEWOBJ + _EMPTY_DICT + _MARK + m.s("relative_path") + b"j", ("u4", "P"),
              m.s("offset") + _LONG8, "A", m.s("length") + _LONG8, "L", _SETITEMS + _BUILD]
    cols = {f"o{d}": run.offsets[:, d] for d in range(nd)}
    cols |= {"F": fqn_ids[run.fqn], "I": run.index, "P": file_ids[run.file], "A": run.at, "L": run.length}
    return _Rows(parts, cols, n, _SETITEMS)


def emit(tensors: list[TensorChunks], byte_fqns: list[str], fqns: list[str], files: list[str],
         runs: list[StorageRun], byte_items: list[ByteItem], planner_data: Any, storage_meta: Any,
         version: str | None) -> EmittedFile:
    """The ``.metadata`` of a plan's tensors and byte items (``state_dict_metadata`` in the order
    given: ``tensors`` then ``byte_fqns``) and of the ranks' storage (``runs`` then ``byte_items``)."""
    m = _Memo()
    for c in _CLASSES:
        m.cls(c)
    for f in _FIELDS:
        m.text(f)
    for name in (*fqns, *files):
        m.text(name)
    fqn_ids = np.array([m.ids[("s", s)] for s in fqns], dtype=np.int64)
    file_ids = np.array([m.ids[("s", s)] for s in files], dtype=np.int64)
    out = _Out()
    out += b"\x80\x02" + bytes(m.out) + m.get(Metadata) + _NEWOBJ + _EMPTY_DICT + _MARK
    out += m.s("state_dict_metadata") + _EMPTY_DICT
    for at in range(0, len(tensors), _BATCH):
        out += _MARK
        for t in tensors[at:at + _BATCH]:
            out += _key(m, t.fqn) + m.get(TensorStorageMetadata) + _NEWOBJ + _EMPTY_DICT + _MARK
            out += m.s("properties") + _fast(t.properties) + m.s("size") + _fast(torch.Size(t.size))
            out += m.s("chunks") + _EMPTY_LIST
            out += _chunk_bytes(m, t)
            out += _SETITEMS + _BUILD
        out += _SETITEMS
    for at in range(0, len(byte_fqns), _BATCH):
        out += _MARK
        for name in byte_fqns[at:at + _BATCH]:
            out += _key(m, name) + m.get(BytesStorageMetadata) + _NEWOBJ
        out += _SETITEMS
    out += m.s("planner_data") + _fast(planner_data)
    out += m.s("storage_data") + _EMPTY_DICT
    for run in runs:
        out += _storage_bytes(m, run, fqn_ids, file_ids)
    tail_at, tail, byte_at = out.length, bytearray(), {}
    for at in range(0, len(byte_items), _BATCH):
        tail += _MARK
        for item in byte_items[at:at + _BATCH]:
            tail += _fast(item.key) + m.get(_StorageInfo) + _NEWOBJ + _EMPTY_DICT + _MARK + m.s("relative_path")
            tail += _key(m, item.file) + m.s("offset") + _LONG8
            byte_at[item.key] = tail_at + len(tail)
            tail += struct.pack("<q", item.at) + m.s("length") + _LONG8 + struct.pack("<q", item.length)
            tail += _SETITEMS + _BUILD
        tail += _SETITEMS
    tail += m.s("storage_meta") + _fast(storage_meta) + m.s("version") + _fast(version)
    tail += _SETITEMS + _BUILD + _STOP
    return EmittedFile(out.parts, tail_at, tail, byte_at)


class _Out:
    """The file's parts in order (bytes, or rows filled when written), and their length so far."""

    def __init__(self) -> None:
        self.parts: list[Any] = []
        self.length = 0

    def __iadd__(self, data: bytes | _Rows) -> _Out:
        self.parts.append(data)
        self.length += data.nbytes if isinstance(data, _Rows) else len(data)
        return self


def _key(m: _Memo, name: str) -> bytes:
    key = ("s", name)
    if key in m.ids:
        return m.get(key)
    return _fast(name)


