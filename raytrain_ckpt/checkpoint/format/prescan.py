"""The work a pickle would make its reader do, measured before it is loaded.

A restricted unpickler stops a pickle from running code, not from running forever: a pickle
refers back to objects it built (its memo), so 500 bytes can describe a tuple nested 60 deep
whose every level holds the level below twice. Building it is cheap; hashing it (as a dict key,
a set element), comparing it or printing it walks 2^60 nodes. ``check_pickle`` runs the pickle's
opcodes on a stack of sizes instead of objects (no object is built, no global is resolved) and
refuses, before any unpickler sees the bytes, one that exceeds a ``PickleBudget``:

- ``max_bytes``: the pickle's length (it is read whole into memory);
- ``max_opcodes``: the number of opcodes run;
- ``max_expanded``: the size of the largest object with every shared reference expanded, and the
  total size of every key hashed while loading (dict keys, set members, a call's arguments);
- ``max_depth``: how deeply containers nest (hashing, comparing and printing recurse).

A container that is changed after a reference to it was taken (a structure that contains
itself) is refused too: DCP metadata, optimizer state and model state dicts never are, and its
expanded size could not be known when it was first referred to. Lengths the pickle declares
(strings, bytes, frames) are checked against the bytes that follow, so nothing is allocated from
a declared length either.

``check_torch_save`` applies the same check to the ``data.pkl`` of a ``torch.save`` file (its
zip format) before ``torch.load(weights_only=True)`` reads it: DCP's non-tensor entries, an
optimizer entry read by ``export --with-optimizer``, a file given to ``import``.

The budgets are far above any real checkpoint's (a 1,024-rank job's metadata is a few hundred
thousand nodes); ``RAYTRAIN_CKPT_PICKLE_BUDGET`` raises them all by a factor where one is not.
"""

from __future__ import annotations

import io
import struct
import zipfile
from dataclasses import dataclass, replace
from typing import BinaryIO

from raytrain_ckpt.checkpoint.errors import BadEnvironment, InvalidCheckpoint
from raytrain_ckpt.checkpoint.format import sandbox, scancache
from raytrain_ckpt.common.gcpause import collector_paused

__all__ = ["ATOM", "BUDGET_ENV", "read_limits_problem", "DEFAULT_BUDGET", "FRAME", "PROTO", "SYNC_EVERY", "ZIP_ERRORS", "PickleBudget",
           "check_pickle", "check_torch_save", "opcode_at", "read_bounded", "scan_pickle", "stored_member",
           "torch_save_pickle"]

ZIP_ERRORS = (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error, NotImplementedError)
"""What ``zipfile`` raises on a damaged archive (``NotImplementedError``: a record claiming a zip
version or a compression it does not read)."""

BUDGET_ENV = "RAYTRAIN_CKPT_PICKLE_BUDGET"
"""A factor (e.g. ``4``) that multiplies every ``PickleBudget`` limit but the depth."""


@dataclass(frozen=True)
class PickleBudget:
    """The most work one pickle read from a checkpoint or an input file may ask for."""

    max_bytes: int = 1 << 30
    """Length of one pickle, read whole (a 1,024-rank 70B job's ``.metadata`` is ~100 MB)."""
    max_opcodes: int = 50_000_000
    """Opcodes run (a real pickle has one per ~5 bytes)."""
    max_expanded: int = 50_000_000
    """Nodes of the largest object, shared references expanded; also the total size of hashed keys."""
    max_depth: int = 200
    """Containers nested in one another (DCP metadata nests about 8 deep)."""

    def scaled(self) -> PickleBudget:
        """This budget times ``$RAYTRAIN_CKPT_PICKLE_BUDGET`` (unset: unchanged)."""
        factor = sandbox.env_factor(BUDGET_ENV, 1.0, 1e6)
        if factor is None:
            return self
        return replace(self, max_bytes=int(self.max_bytes * factor), max_opcodes=int(self.max_opcodes * factor),
                       max_expanded=int(self.max_expanded * factor))


DEFAULT_BUDGET = PickleBudget()


def read_limits_problem() -> str | None:
    """What is wrong with ``$RAYTRAIN_CKPT_PICKLE_BUDGET`` or ``$RAYTRAIN_CKPT_READ_LIMITS`` (None:
    both unset or in range): checked before a command reads a checkpoint or a job starts, so a
    typo there is a usage error, not every step refused as invalid (and moved aside by a resume)."""
    try:
        DEFAULT_BUDGET.scaled()
        sandbox.DEFAULT_LIMITS.scaled()
    except BadEnvironment as exc:
        return str(exc)
    return None

SYNC_EVERY = 64
"""The scan notes where every 64th opcode starts (a power of two)."""

# Opcode classes (by the opcode's byte value), the frequent ones first.
_MEMOIZE, _ATOM_LEN1, _ATOM_FIXED, _GET1, _MARK, _TUPLE_N, _EMPTY_MUT, _EMPTY_TUPLE, _SETITEMS, _BUILD, \
    _REDUCE, _NEWOBJ, _APPENDS, _ATOM_LEN4, _ATOM_LEN8, _ATOM_LINE, _GET4, _GET_LINE, _PUT1, _PUT4, _PUT_LINE, \
    _POP, _POP_MARK, _DUP, _FROM_MARK, _APPEND, _SETITEM, _ADDITEMS, _NEWOBJ_EX, _OBJ, _INST, _STACK_GLOBAL, \
    _BINPERSID, _STOP, _SKIP, _BAD = range(36)


def _table() -> tuple[list[int], list[int]]:
    kind = [_BAD] * 256
    arg = [0] * 256
    variable = {"len1": _ATOM_LEN1, "len4": _ATOM_LEN4, "len8": _ATOM_LEN8, "line": _ATOM_LINE}
    atoms = {"I": "line", "J": 4, "K": 1, "M": 2, "L": "line", "\x8a": "len1", "\x8b": "len4", "S": "line",
             "T": "len4", "U": "len1", "B": "len4", "C": "len1", "\x8e": "len8", "\x96": "len8", "\x97": 0, "N": 0,
             "\x88": 0, "\x89": 0, "V": "line", "\x8c": "len1", "X": "len4", "\x8d": "len8", "F": "line", "G": 8,
             "\x82": 1, "\x83": 2, "\x84": 4, "P": "line"}
    for code, shape in atoms.items():
        if isinstance(shape, str):
            kind[ord(code)] = variable[shape]
        else:
            kind[ord(code)], arg[ord(code)] = _ATOM_FIXED, shape
    others = {"(": _MARK, "0": _POP, "1": _POP_MARK, "2": _DUP, "p": _PUT_LINE, "q": _PUT1, "r": _PUT4,
              "\x94": _MEMOIZE, "g": _GET_LINE, "h": _GET1, "j": _GET4, "]": _EMPTY_MUT, "}": _EMPTY_MUT,
              "\x8f": _EMPTY_MUT, ")": _EMPTY_TUPLE, "\x85": _TUPLE_N, "\x86": _TUPLE_N, "\x87": _TUPLE_N,
              "t": _FROM_MARK, "l": _FROM_MARK, "d": _FROM_MARK, "\x91": _FROM_MARK, "a": _APPEND, "e": _APPENDS,
              "s": _SETITEM, "u": _SETITEMS, "\x90": _ADDITEMS, "b": _BUILD, "R": _REDUCE, "\x81": _NEWOBJ,
              "\x92": _NEWOBJ_EX, "o": _OBJ, "i": _INST, "c": _ATOM_LINE, "\x93": _STACK_GLOBAL,
              "Q": _BINPERSID, ".": _STOP, "\x80": _SKIP, "\x95": _SKIP, "\x98": _SKIP}
    for code, k in others.items():
        kind[ord(code)] = k
    arg[0x80], arg[0x95] = 1, 8  # PROTO's version, FRAME's length (the frame's bytes follow as opcodes)
    arg[0x85], arg[0x86], arg[0x87] = 1, 2, 3  # TUPLE1..3: the items they take
    return kind, arg


_KIND, _ARG = _table()
_HASHED_FROM_MARK = {ord("d"): 2, 0x91: 1}  # DICT hashes every other item (keys), FROZENSET every one
_ATOM_NODE = (1, 0, 0)
_MUTABLE, _SHARED = 1, 2
"""Node flags. A node is [expanded size, depth, flags] (a list while it may still change)."""


def _Refused(what: str) -> InvalidCheckpoint:  # noqa: N802 - raised like a class
    """Over budget: ``what`` the pickle would make its reader do (``check_pickle`` names the file)."""
    return InvalidCheckpoint(what)


def read_bounded(f: BinaryIO, where: str, budget: PickleBudget = DEFAULT_BUDGET) -> bytes:
    """All of ``f``, refused if longer than ``budget.max_bytes`` (nothing larger is read)."""
    budget = budget.scaled()
    data = f.read(budget.max_bytes + 1)
    if len(data) > budget.max_bytes:
        raise InvalidCheckpoint(f"{where} is over {budget.max_bytes} bytes, more than a pickle read from a "
                                f"checkpoint may be (raise it with {BUDGET_ENV}=<factor>)")
    return data


def check_pickle(data: bytes, where: str, budget: PickleBudget = DEFAULT_BUDGET) -> None:
    """Refuse the pickle ``data`` (called ``where`` in messages) if loading it would exceed ``budget``;
    a pass is remembered by content (``scancache.py``).

    Raises:
        InvalidCheckpoint: Over budget (naming the limit and ``RAYTRAIN_CKPT_PICKLE_BUDGET``), or
            not a well-formed pickle.
    """
    data = bytes(data)
    key = scancache.digest(data, repr(budget.scaled()))
    if scancache.passed_before(key):
        return
    scan_pickle(data, where, budget)
    scancache.remember_pass(key)


def scan_pickle(data: bytes, where: str, budget: PickleBudget = DEFAULT_BUDGET,
                sync: list[int] | None = None) -> tuple[int, int]:
    """``check_pickle`` without remembering: what the reader process (``sandbox.py``) runs first.
    Returns where its STOP opcode ends (bytes after it are never read) and how many opcodes ran;
    ``sync``, if given, gets the start of every ``SYNC_EVERY``-th opcode (``scandiff.py`` walks
    the opcodes from there)."""
    budget = budget.scaled()
    if len(data) > budget.max_bytes:
        raise InvalidCheckpoint(f"{where} is over {budget.max_bytes} bytes, more than a pickle read from a "
                                f"checkpoint may be (raise it with {BUDGET_ENV}=<factor>)")
    try:
        with collector_paused():  # the stack of sizes holds an object or two per opcode, none in a cycle
            return _run(data, budget) if sync is None else _run(data, budget, sync)
    except InvalidCheckpoint as exc:
        raise InvalidCheckpoint(f"{where} would {exc}; refused before loading it (a checkpoint is data; raise "
                                f"the limits with {BUDGET_ENV}=<factor> if this file is genuine)") from None
    except (IndexError, KeyError, ValueError, TypeError, AttributeError) as exc:
        raise InvalidCheckpoint(f"{where} is unreadable (not a well-formed pickle: "
                                f"{type(exc).__name__} at its opcodes)") from None


def _combine(children: list, budget: PickleBudget, mutable: bool) -> list | tuple:
    size, depth = 1, 0
    for c in children:
        size += c[0]
        if c[1] > depth:
            depth = c[1]
    if size > budget.max_expanded:
        raise _Refused(f"build an object of over {budget.max_expanded} nodes once its shared references are "
                       "expanded")
    if depth + 1 > budget.max_depth:
        raise _Refused(f"nest containers over {budget.max_depth} deep")
    return [size, depth + 1, _MUTABLE] if mutable else (size, depth + 1, 0)


def _grow(node: list | tuple, children: list, budget: PickleBudget) -> None:
    """Add ``children`` to the container ``node`` (APPEND, SETITEM, BUILD, ...)."""
    flags = node[2]
    if not flags & _MUTABLE:
        raise TypeError("adds items to an object that cannot take them")
    if flags & _SHARED:
        raise _Refused("change an object after referring to it (a structure that contains itself)")
    grown = _combine(children, budget, True)
    node[0] += grown[0] - 1
    if node[0] > budget.max_expanded:
        raise _Refused(f"build an object of over {budget.max_expanded} nodes once its shared references are "
                       "expanded")
    if grown[1] > node[1]:
        node[1] = grown[1]


def _line_end(data: bytes, pos: int) -> int:
    nl = data.find(b"\n", pos, pos + 65536)
    if nl < 0:
        raise ValueError("an unterminated line")
    return nl + 1


_ATOMS = frozenset({_ATOM_LEN1, _ATOM_FIXED, _ATOM_LEN4, _ATOM_LEN8, _ATOM_LINE})
"""Opcodes that push one atom and do nothing else: the scan treats any two of them alike."""
ATOM, FRAME, PROTO = 1, 2, 3
_ONE_LINE = frozenset({_GET_LINE, _PUT_LINE})
_TWO_LINES = frozenset({_INST})


def opcode_at(data: bytes, start: int) -> tuple[int, int]:
    """(its effect, where it ends) of the opcode at ``start``, reading its argument as ``_run``
    does; IndexError or ValueError where its argument runs past ``data``. Two opcodes of the same
    nonzero effect move the scan's state alike whatever their arguments: ``ATOM`` (one atom pushed),
    ``FRAME`` (nothing but the count of opcodes: its argument is skipped, its bytes run as
    opcodes), ``PROTO`` (likewise, at the start); 0 for any other."""
    op = data[start]
    kind, pos = _KIND[op], start + 1
    if kind == _ATOM_LEN1:
        end = pos + 1 + data[pos]
    elif kind == _ATOM_FIXED or kind == _SKIP:
        end = pos + _ARG[op]
    elif kind == _ATOM_LEN4 or kind == _ATOM_LEN8:
        width = 4 if kind == _ATOM_LEN4 else 8
        if pos + width > len(data):
            raise IndexError("a length past the end")
        end = pos + width + int.from_bytes(data[pos:pos + width], "little")
    elif kind == _ATOM_LINE or kind in _ONE_LINE or kind in _TWO_LINES:
        end = _line_end(data, pos)
        if op == 0x63 or kind in _TWO_LINES:  # GLOBAL, INST: module and name
            end = _line_end(data, end)
    elif kind == _GET1 or kind == _PUT1:
        end = pos + 1
    elif kind == _GET4 or kind == _PUT4:
        end = pos + 4
    elif kind == _BAD:
        raise ValueError(f"an unknown opcode {op:#x}")
    else:
        end = pos
    if end > len(data):
        raise IndexError("an argument past the end")
    return ATOM if kind in _ATOMS else FRAME if op == 0x95 else PROTO if op == 0x80 else 0, end


def _run(data: bytes, budget: PickleBudget, sync: list[int] | None = None) -> tuple[int, int]:  # noqa: C901
    kind_of, arg_of = _KIND, _ARG  # (one opcode loop, kept flat for speed)
    note = ([] if sync is None else sync).append
    every = SYNC_EVERY - 1
    end = len(data)
    pos = 0
    ops = 0
    hashed = 0
    stack: list = []
    push = stack.append
    marks: list[int] = []
    memo: dict[int, list | tuple] = {}
    atom = _ATOM_NODE
    # Every branch reads past its argument only through ``data[pos]`` of the next opcode, which
    # raises IndexError past the end: a length pointing beyond the data is never trusted.
    while True:
        op = data[pos]
        pos += 1
        ops += 1
        if not ops & every:
            note(pos - 1)
        kind = kind_of[op]
        if kind == _MEMOIZE:
            memo[len(memo)] = stack[-1]
        elif kind == _ATOM_LEN1:
            pos += 1 + data[pos]
            push(atom)
        elif kind == _ATOM_FIXED:
            pos += arg_of[op]
            push(atom)
        elif kind == _GET1 or kind == _GET4 or kind == _GET_LINE:
            if kind == _GET1:
                node = memo[data[pos]]
                pos += 1
            elif kind == _GET4:
                node = memo[int.from_bytes(data[pos:pos + 4], "little")]
                pos += 4
            else:
                stop = _line_end(data, pos)
                node = memo[int(data[pos:stop - 1])]
                pos = stop
            if node[2] & _MUTABLE:
                node[2] |= _SHARED
            push(node)
        elif kind == _MARK:
            marks.append(len(stack))
        elif kind == _TUPLE_N:
            n = arg_of[op]
            if len(stack) - (marks[-1] if marks else 0) < n:
                raise IndexError("stack underflow")
            children = stack[-n:]
            del stack[-n:]
            push(_combine(children, budget, False))
        elif kind == _EMPTY_MUT:
            push([1, 1, _MUTABLE])
        elif kind == _EMPTY_TUPLE:
            push((1, 1, 0))
        elif kind == _SETITEMS or kind == _APPENDS or kind == _ADDITEMS:
            at = marks.pop()
            children = stack[at:]
            del stack[at:]
            if kind != _APPENDS:
                hashed += sum(c[0] for c in (children[0::2] if kind == _SETITEMS else children))
                if hashed > budget.max_expanded:
                    raise _Refused(f"hash over {budget.max_expanded} nodes (keys whose shared references expand)")
            _grow(stack[-1], children, budget)
        elif kind == _BUILD or kind == _APPEND or kind == _SETITEM:
            n = 2 if kind == _SETITEM else 1
            if len(stack) - (marks[-1] if marks else 0) < n + 1:
                raise IndexError("stack underflow")
            children = stack[-n:]
            del stack[-n:]
            if kind == _SETITEM:
                hashed += children[0][0]
                if hashed > budget.max_expanded:
                    raise _Refused(f"hash over {budget.max_expanded} nodes (keys whose shared references expand)")
            _grow(stack[-1], children, budget)
        elif kind == _REDUCE or kind == _NEWOBJ or kind == _NEWOBJ_EX:
            n = 3 if kind == _NEWOBJ_EX else 2
            if len(stack) - (marks[-1] if marks else 0) < n:
                raise IndexError("stack underflow")
            children = stack[-n:]
            del stack[-n:]
            hashed += sum(c[0] for c in children)  # a call may hash its arguments (set, frozenset)
            if hashed > budget.max_expanded:
                raise _Refused(f"hash over {budget.max_expanded} nodes (keys whose shared references expand)")
            push(_combine(children, budget, True))
        elif kind == _ATOM_LEN4 or kind == _ATOM_LEN8:
            width = 4 if kind == _ATOM_LEN4 else 8
            pos += width + int.from_bytes(data[pos:pos + width], "little")
            push(atom)
        elif kind == _ATOM_LINE:
            pos = _line_end(data, pos)
            if op == 0x63:  # GLOBAL: module and name
                pos = _line_end(data, pos)
            push(atom)
        elif kind == _PUT1 or kind == _PUT4 or kind == _PUT_LINE:
            if kind == _PUT1:
                key = data[pos]
                pos += 1
            elif kind == _PUT4:
                key = int.from_bytes(data[pos:pos + 4], "little")
                pos += 4
            else:
                stop = _line_end(data, pos)
                key = int(data[pos:stop - 1])
                pos = stop
            memo[key] = stack[-1]
        elif kind == _FROM_MARK or kind == _OBJ or kind == _INST:
            if kind == _INST:
                pos = _line_end(data, _line_end(data, pos))
            at = marks.pop()
            children = stack[at:]
            del stack[at:]
            step = 1 if kind != _FROM_MARK else _HASHED_FROM_MARK.get(op)
            if step:
                hashed += sum(c[0] for c in children[0::step])
                if hashed > budget.max_expanded:
                    raise _Refused(f"hash over {budget.max_expanded} nodes (keys whose shared references expand)")
            push(_combine(children, budget, op not in (0x74, 0x91)))  # all but TUPLE, FROZENSET may change
        elif kind == _STACK_GLOBAL:
            if len(stack) - (marks[-1] if marks else 0) < 2:
                raise IndexError("stack underflow")
            del stack[-2:]
            push(atom)
        elif kind == _POP:
            if len(stack) <= (marks[-1] if marks else 0):
                raise IndexError("stack underflow")
            stack.pop()
        elif kind == _POP_MARK:
            del stack[marks.pop():]
        elif kind == _DUP:
            node = stack[-1]
            if node[2] & _MUTABLE:
                node[2] |= _SHARED
            push(node)
        elif kind == _BINPERSID:
            stack[-1] = atom  # (torch's persistent ids name storages; its loader resolves them)
        elif kind == _SKIP:
            pos += arg_of[op]
        elif kind == _STOP:
            if len(stack) != 1 or marks or pos > end:
                raise ValueError("a pickle that does not end with one object")
            if ops > budget.max_opcodes:
                raise _Refused(f"run over {budget.max_opcodes} opcodes")
            return pos, ops
        else:
            raise ValueError(f"an unknown opcode {op:#x}")


def check_torch_save(f: BinaryIO, where: str, budget: PickleBudget = DEFAULT_BUDGET) -> None:
    """The ``data.pkl`` of a ``torch.save`` file (its zip format; the older format, a stream of
    pickles, is refused: neither DCP nor ``export`` writes it) decoded in the reader process
    (``sandbox.py``: the pre-scan, then the structure built under the OS's memory and time
    limits), before ``torch.load(weights_only=True)`` reads it here. ``f`` is left at its start.

    Raises:
        InvalidCheckpoint: Not a zip-format ``torch.save`` file, or its pickle is over a budget.
    """
    name, data = torch_save_pickle(f, where, budget)
    key = scancache.digest(data, f"torch.save pickle {budget.scaled()!r}")
    if scancache.passed_before(key):
        return
    sandbox.decode_in_sandbox("pickle", data, f"{where} ({name})")
    scancache.remember_pass(key)


def torch_save_pickle(f: BinaryIO, where: str, budget: PickleBudget = DEFAULT_BUDGET) -> tuple[str, bytes]:
    """The name and bytes of the ``data.pkl`` record of the ``torch.save`` file ``f`` (left at its start)."""
    start = f.tell()
    try:
        try:
            archive = zipfile.ZipFile(f)
        except ZIP_ERRORS as exc:
            raise InvalidCheckpoint(f"{where} is not a torch.save file of the zip format ({exc}); the older "
                                    "format is not read") from None
        with archive:
            pickles = [i for i in archive.infolist() if i.filename == "data.pkl" or i.filename.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise InvalidCheckpoint(f"{where} holds {len(pickles)} data.pkl records, not one: not a torch.save "
                                        "file")
            info = pickles[0]
            limit = budget.scaled().max_bytes
            if info.file_size > limit:
                raise InvalidCheckpoint(f"{where}: its pickle is over {limit} bytes, more than a pickle read "
                                        f"from a checkpoint may be (raise it with {BUDGET_ENV}=<factor>)")
            try:
                return info.filename, stored_member(archive, info)
            except ZIP_ERRORS as exc:
                raise InvalidCheckpoint(f"{where}: its pickle is unreadable ({exc})") from None
    finally:
        f.seek(start)


def stored_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> bytes:
    """A stored (uncompressed) member's bytes, read past its local header. Not ``archive.open``:
    that checks the record's CRC-32, which the files this project writes leave out (a format
    ``torch.load`` reads; ``checkpoint/datapath/filewrite.py``)."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise zipfile.BadZipFile("its pickle record is compressed, which torch.save never does")
    fp = archive.fp
    assert fp is not None
    fp.seek(info.header_offset)
    header = fp.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise zipfile.BadZipFile("a record without its local header")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    fp.seek(info.header_offset + 30 + name_len + extra_len)
    data = fp.read(info.file_size)
    if len(data) != info.file_size:
        raise zipfile.BadZipFile("a record cut short")
    return data


def check_torch_save_bytes(data: bytes, where: str, budget: PickleBudget = DEFAULT_BUDGET) -> None:
    """``check_torch_save`` of bytes in memory."""
    check_torch_save(io.BytesIO(data), where, budget)
