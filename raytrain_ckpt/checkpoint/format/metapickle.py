"""``.metadata`` pickled in pieces whose bytes are known, so that a save whose byte items alone
moved rewrites only their entries.

DCP's writer pickles ``Metadata`` in one call (protocol 4). Two things tie every byte of that
pickle to every entry before it: the memo (each object pickled is numbered in order, and later
references name the number) and protocol 4's frames (the stream is cut into 64 KiB frames at
opcode boundaries, so one entry a byte longer moves every later boundary). Splicing a new entry
into those bytes would mean walking the whole stream again. This module writes the same
``Metadata`` so that the splice is exact instead:

- protocol 2: no frames; a memo number is written explicitly where an object is stored;
- one C pickler writes every piece (``Pickler.dump`` per piece, its memo kept across pieces), so
  a piece refers back to objects of earlier pieces as one pickle would; the pieces are joined
  under hand-written glue (the ``Metadata`` object, its state dict, the storage dict and their
  ``SETITEMS``), which is never memoized, so no number the pickler gives is taken twice;
- the storage entries are ordered tensors first, then byte items (DCP's ``finish`` orders them
  by rank; a dict's order means nothing to a reader), and each byte item's value
  (``_StorageInfo``) is its own piece, whose position in the file is kept (``Entry``).

A byte item's value refers back only to objects pickled before it (its class, its field names,
its file name) and stores itself and its state dict under numbers that do not depend on its
offset or length: ints are never memoized. So when only a byte item's offset and length change,
the new file is the old one with that value's two int opcodes re-encoded (``splice``): every
other byte, memo number and reference is unchanged. Re-encoding follows CPython's ``save_long``
(``BININT1``/``BININT2``/``BININT``, else ``LONG1``), and ``tests/unit/test_metapickle.py``
checks the result byte for byte against a full ``build`` of the same results.

The pieces are the same bytes one ``Pickler.dump(metadata, protocol=2)`` of the same objects would
write, save for the glue's omitted memo numbers, the storage dict's order and the state's order
(the storage dict first); the file loads as DCP's own does (``FileSystemReader.read_metadata``,
``metadata.SafeUnpickler``).
"""

from __future__ import annotations

import bisect
import io
import pickle
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, StorageMeta

from raytrain_ckpt.common.gcpause import collector_paused

__all__ = ["Entry", "MetadataPickle", "build", "splice"]

_PAIRS_PER_BATCH = 500
"""Storage entries per ``SETITEMS`` (CPython batches 1,000 items; the reader's stack holds a batch)."""

_MARK, _SETITEMS, _EMPTY_DICT, _NEWOBJ_NO_ARGS, _BUILD, _STOP = b"(", b"u", b"}", b")\x81", b"b", b"."
_ARG_BYTES = {op: n for ops, n in ((b")(}]Nstu\x81\x85\x86\x87\x88\x89aebR02", 0), (b"hq", 1), (b"jr", 4),
                                      (b"G", 8)) for op in ops}
"""Opcodes of protocol 2 with an argument of fixed length (the walk of ``_ints`` knows no other but
the length-prefixed strings and the ints themselves)."""
_LEN_BYTES = {ord("X"): 4, ord("B"): 4, ord("T"): 4, ord("U"): 1, ord("C"): 1}
"""Opcodes whose argument is a length (of this many bytes, little-endian) and that many bytes."""
_INT_BYTES = {ord("K"): 1, ord("M"): 2, ord("J"): 4}
_LONG1 = 0x8A


@dataclass
class Entry:
    """Where a byte item's storage value lies in the file, and what it encodes."""

    pos: int
    """Offset in the file of the value's first opcode."""
    code: bytes
    """The value's opcodes (its references to earlier objects included)."""
    info: Any
    """The ``_StorageInfo`` they encode."""


@dataclass
class MetadataPickle:
    """A ``.metadata`` file and the byte items' entries in it."""

    data: bytes
    entries: dict[MetadataIndex, Entry]
    count: int
    """Storage entries in the file (fewer than the results when two ranks wrote one key)."""


class _Pieces:
    """One C pickler over a sink that keeps each ``dump``'s bytes: ``piece(obj)`` is ``obj``'s
    opcodes (without the ``PROTO`` header and ``STOP``) in the context of every earlier piece."""

    def __init__(self) -> None:
        self._out: list[bytes] = []
        self._pickler = pickle.Pickler(self, protocol=2)

    def write(self, data: bytes) -> None:
        # (one call per dump, but for a string or bytes over 64 KiB, which the pickler writes apart)
        self._out.append(bytes(data))

    def _dump(self, obj: Any) -> bytes:
        self._out.clear()
        self._pickler.dump(obj)
        return b"".join(self._out)

    def piece(self, obj: Any) -> bytes:
        return self._dump(obj)[2:-1]

    def run(self, flat: tuple) -> bytes:
        """The opcodes of ``flat``'s elements one after another (``flat`` has at least 4): the
        tuple's ``MARK`` and ``TUPLE`` and the memo number it took are cut off (a number that the
        file then never stores: nothing refers to it, and an unpickler's memo allows gaps)."""
        out = self._dump(flat)
        # the probe is stored under the number after the tuple's, and says how long that one is
        probe = self._dump({})
        # PROTO(2) MARK(1) elements TUPLE(1) PUT STOP(1)
        return out[3:len(out) - 2 - _put_len_before(probe)]


def _put_len_before(probe: bytes) -> int:
    """The length of the ``PUT`` that stored the object memoized just before ``probe`` (a dumped
    empty dict: ``PROTO 2``, ``EMPTY_DICT``, ``BINPUT n`` or ``LONG_BINPUT n``, ``STOP``)."""
    number = probe[4] if len(probe) == 6 else int.from_bytes(probe[4:8], "little")
    return 2 if number - 1 < 256 else 5


def _int_code(value: int) -> bytes:
    """``value``'s opcode as CPython's pickler writes it at protocol 2."""
    if 0 <= value <= 0xFF:
        return b"K" + value.to_bytes(1, "little")
    if 0 <= value <= 0xFFFF:
        return b"M" + value.to_bytes(2, "little")
    if -(1 << 31) <= value < (1 << 31):
        return b"J" + value.to_bytes(4, "little", signed=True)
    data = pickle.encode_long(value)
    assert len(data) < 256, value  # LONG1: any offset a file can have
    return b"\x8a" + len(data).to_bytes(1, "little") + data


def _storage_entries(metadata: Metadata, results: list[list[Any]]) -> tuple[list[tuple], list[tuple]]:
    """The storage dict DCP's ``finish`` builds (a later rank's entry for a key wins), split into
    tensor entries and byte-item entries, each in DCP's order."""
    storage: dict[MetadataIndex, Any] = {}
    for rank_results in results:
        for wr in rank_results:
            storage[wr.index] = wr.storage_data
    kinds = metadata.state_dict_metadata
    tensors, byte_items = [], []
    for key, value in storage.items():
        (byte_items if isinstance(kinds.get(key.fqn), BytesStorageMetadata) else tensors).append((key, value))
    return tensors, byte_items


def build(metadata: Metadata, results: list[list[Any]], version: str | None,
          storage_meta: StorageMeta | None) -> MetadataPickle:
    """``.metadata`` of ``metadata`` (the global plan's) finished with every rank's write results,
    as DCP's ``finish`` would set ``storage_data``, ``version`` and ``storage_meta``; with the
    cyclic collector paused (as ``planchecks.global_plan``): the pickler's memo keeps a few new
    objects per entry alive, none of them cyclic, and each full collection would walk every live
    object of the process."""
    with collector_paused():
        return _build(metadata, results, version, storage_meta)


def _build(metadata: Metadata, results: list[list[Any]], version: str | None,
           storage_meta: StorageMeta | None) -> MetadataPickle:
    tensors, byte_items = _storage_entries(metadata, results)
    count = len(tensors) + len(byte_items)
    # The storage entries first: the C pickler sizes each dump's buffer by the largest dump so far,
    # so the tensor entries of the plan (one large piece) go last, after the many small pieces.
    state = {"storage_data": None, **vars(metadata)}
    state.update(version=version, storage_meta=storage_meta)
    p = _Pieces()
    out = io.BytesIO()
    out.write(b"\x80\x02" + p.piece(Metadata) + _NEWOBJ_NO_ARGS + _EMPTY_DICT + _MARK)
    entries: dict[MetadataIndex, Entry] = {}
    for name, value in state.items():
        out.write(p.piece(name))
        if name != "storage_data":
            out.write(p.piece(value))
            continue
        out.write(_EMPTY_DICT)
        for at in range(0, len(tensors), _PAIRS_PER_BATCH):
            out.write(_MARK + _pairs(p, tensors[at:at + _PAIRS_PER_BATCH]) + _SETITEMS)
        for at in range(0, len(byte_items), _PAIRS_PER_BATCH):
            out.write(_MARK)
            for key, info in byte_items[at:at + _PAIRS_PER_BATCH]:
                out.write(p.piece(key))
                code = p.piece(info)
                entries[key] = Entry(out.tell(), code, info)
                out.write(code)
            out.write(_SETITEMS)
    out.write(_SETITEMS + _BUILD + _STOP)
    return MetadataPickle(out.getvalue(), entries, count)


def _pairs(p: _Pieces, pairs: list[tuple]) -> bytes:
    if len(pairs) == 1:
        return p.piece(pairs[0][0]) + p.piece(pairs[0][1])
    return p.run(tuple(x for pair in pairs for x in pair))


def _respliced(entry: Entry, info: Any) -> bytes | None:
    """``entry``'s code with the offset and length of ``info`` in place of its own; None when
    anything else about the value changed (its file, its transforms) or its code is not the
    shape expected (two int opcodes, the old offset then the old length)."""
    old = entry.info
    if (type(info) is not type(old) or info.relative_path != old.relative_path
            or info.transform_descriptors != old.transform_descriptors):
        return None
    ints = _ints(entry.code)
    if ints is None or [arg for _, arg in ints] != [old.offset, old.length]:
        return None
    (at_offset, _), (at_length, _) = ints
    end_offset = at_offset + len(_int_code(old.offset))
    end_length = at_length + len(_int_code(old.length))
    code = entry.code
    return (code[:at_offset] + _int_code(info.offset) + code[end_offset:at_length] + _int_code(info.length)
            + code[end_length:])


def _ints(code: bytes) -> list[tuple[int, int]] | None:
    """(position, value) of each int opcode of ``code`` (a value's opcodes as ``_Pieces`` wrote
    them), walked by opcode; None at an opcode the C pickler does not write for such a value
    (the caller then builds in full). ``pickletools.genops`` walks the same at several times the
    cost, which a save of thousands of moved byte items paid per item."""
    ints, pos, end = [], 0, len(code)
    while pos < end:
        op = code[pos]
        n = _ARG_BYTES.get(op)
        if n is not None:
            pos += 1 + n
        elif op in _LEN_BYTES:
            k = _LEN_BYTES[op]
            pos += 1 + k + int.from_bytes(code[pos + 1:pos + 1 + k], "little")
        elif op in _INT_BYTES:
            k = _INT_BYTES[op]
            ints.append((pos, int.from_bytes(code[pos + 1:pos + 1 + k], "little", signed=op == 0x4A)))
            pos += 1 + k
        elif op == _LONG1:
            k = code[pos + 1] if pos + 1 < end else 0
            ints.append((pos, pickle.decode_long(code[pos + 2:pos + 2 + k])))
            pos += 2 + k
        elif op == 0x63:  # GLOBAL: module and name, each ended by a newline
            first = code.find(b"\n", pos + 1)
            pos = code.find(b"\n", first + 1) if first >= 0 else -1
            if pos < 0:
                return None
            pos += 1
        else:
            return None
    return ints if pos == end else None


def splice(prev: MetadataPickle, changed: dict[MetadataIndex, Any]) -> MetadataPickle | None:
    """The file ``build`` writes when the byte items in ``changed`` (key -> new ``_StorageInfo``)
    moved and nothing else did: ``prev``'s bytes with those values re-encoded. None when a key is
    not one of ``prev``'s byte items or its value changed in more than offset and length."""
    edits = []
    for key, info in changed.items():
        entry = prev.entries.get(key)
        if entry is None:
            return None
        code = _respliced(entry, info)
        if code is None:
            return None
        edits.append((entry.pos, key, code))
    edits.sort(key=lambda e: e[0])
    parts, at, shift = [], 0, 0
    entries = dict(prev.entries)
    moved: list[tuple[int, int]] = []  # (position in prev, shift from there on)
    for pos, key, code in edits:
        old = prev.entries[key]
        parts.append(memoryview(prev.data)[at:pos])
        parts.append(code)
        at = pos + len(old.code)
        entries[key] = Entry(pos + shift, code, changed[key])
        shift += len(code) - len(old.code)
        moved.append((at, shift))
    parts.append(memoryview(prev.data)[at:])
    if any(s for _, s in moved):
        starts = [start for start, _ in moved]
        for key, entry in entries.items():
            i = bisect.bisect_right(starts, entry.pos)
            if key not in changed and i and moved[i - 1][1]:
                entries[key] = Entry(entry.pos + moved[i - 1][1], entry.code, entry.info)
    return MetadataPickle(b"".join(parts), entries, prev.count)
