"""The pre-scan's verdict of a pickle that differs from one that passed only in its atoms.

The ``.metadata`` files of one job's steps are the same pickle but for a few values: the save's
id and path, the offsets of byte items in their files. The pre-scan (``prescan.py``) never looks
at what an atom holds: every opcode that pushes one atom (an int, a string, bytes, a float, a
global's name) and does nothing else moves its stack of sizes the same way. So if a new file is a
passed file with some atoms replaced by other atoms (of any length), the scan of the new file
runs through the same states, opcode for opcode, and passes too. ``PassedScans`` keeps the few
files that passed last in this process (the reader process: an ``ls`` of 1,000 steps sends it
1,000 such files) and proves that relation by comparing bytes, never by a name:

- equal stretches are compared a block at a time (C ``memcmp``), at the offset the replaced atoms
  so far have shifted the new file by;
- at the first differing byte, the passed file's opcode holding it is found by walking from the
  nearest noted opcode start (the scan notes every ``SYNC_EVERY``-th); it must be an atom, the new
  file's opcode at the same place must be an atom whose argument lies inside the file, and the
  comparison goes on after both. FRAME opcodes are where the pickler split its output, so they
  move with the lengths: the scan skips a FRAME's argument and runs its bytes as opcodes, so a
  FRAME on one side only is stepped over (the count of opcodes, held to its budget, then differs
  by one);
- the files must end together, or differ only after the passed file's STOP (the scan never reads
  past it).

Anything else (a different opcode that is not an atom on both sides, a length past the end) runs
the full scan, whose verdict and message are then the file's. The decode and every check after
the scan always run in full: only the pre-scan's count of sizes is carried over.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from raytrain_ckpt.checkpoint.format.prescan import (DEFAULT_BUDGET, FRAME, SYNC_EVERY, PickleBudget, opcode_at,
                                                     scan_pickle)

__all__ = ["PassedScans"]

_BLOCK = 16 << 10
"""Bytes compared at a time while the files agree (after a difference: ``_SMALL_BLOCK``, doubling)."""
_SMALL_BLOCK = 256
_MAX_DIFFERENCES = 64
"""Differences allowed beyond one per ``SYNC_EVERY`` opcodes of the passed file (the cost of a
comparison stays below the scan's)."""


@dataclass
class _Passed:
    data: bytes
    sync: list[int]
    stop_end: int
    ops: int
    budget: PickleBudget


@dataclass
class PassedScans:
    """The last ``keep`` pickles of at most ``max_bytes`` that passed the pre-scan here; ``scan``
    judges a pickle by its difference from one of them, or scans it in full."""

    keep: int = 2
    max_bytes: int = 64 << 20
    full_scans: int = 0
    """How many ``scan`` calls ran the full pre-scan (the others were proved alike)."""
    _passed: list[_Passed] = field(default_factory=list)

    def scan(self, data: bytes, where: str, budget: PickleBudget = DEFAULT_BUDGET) -> None:
        """``prescan.scan_pickle(data, where, budget)``: the same verdict, the same message."""
        scaled = budget.scaled()  # (what the scan holds the file to; ``scan_pickle`` scales ``budget`` itself)
        for i, ref in enumerate(self._passed):
            if ref.budget == scaled and len(data) <= scaled.max_bytes and same_scan(ref, data):
                self._passed.insert(0, self._passed.pop(i))
                return
        self.full_scans += 1
        sync: list[int] = []
        stop_end, ops = scan_pickle(data, where, budget, sync)
        if len(data) <= self.max_bytes:
            self._passed.insert(0, _Passed(bytes(data), sync, stop_end, ops, scaled))
            del self._passed[self.keep:]


def _first_difference(a: bytes, b: bytes) -> int:
    """The index of the first byte where ``a`` and ``b`` differ (the shorter one's length if it is
    a prefix of the other)."""
    n = min(len(a), len(b))
    x = int.from_bytes(a[:n], "big") ^ int.from_bytes(b[:n], "big")
    return n if x == 0 else n - 1 - (x.bit_length() - 1) // 8


def _opcode_holding(ref: _Passed, at: int, known: int) -> tuple[int, int, int]:
    """(start, effect, end) of the passed file's opcode holding byte ``at`` (``prescan.opcode_at``),
    walked from the nearest noted start or from ``known``, an opcode start at or before ``at``."""
    k = bisect.bisect_right(ref.sync, at)
    start = max(ref.sync[k - 1] if k else 0, known)
    while True:
        effect, end = opcode_at(ref.data, start)
        if end > at:
            return start, effect, end
        start = end


def same_scan(ref: _Passed, data: bytes) -> bool:
    """Whether the pre-scan of ``data`` runs through the states of ``ref``'s (see the module)."""
    old, i, j = ref.data, 0, 0
    known = 0  # an opcode start in the passed file at or before i
    frames = 0  # FRAME opcodes the new file has more of: each one more opcode counted
    block = _BLOCK
    differences = _MAX_DIFFERENCES + ref.ops // SYNC_EVERY
    while True:
        a, b = old[i:i + block], data[j:j + block]
        if a == b:
            if not a:
                break  # both ended together
            i, j, block = i + len(a), j + len(b), min(block * 2, _BLOCK)
            continue
        at = i + _first_difference(a, b)
        if at >= ref.stop_end:
            break  # the same opcodes up to the passed file's STOP, where the scan ends
        differences -= 1
        if differences < 0:
            return False  # a file this unlike the passed one is scanned sooner than compared
        try:
            start, effect, end = _opcode_holding(ref, at, known)
            new_start = start + j - i
            new_effect, new_end = opcode_at(data, new_start)
        except (IndexError, ValueError):
            return False
        if effect == new_effect != 0:  # an atom for an atom (or a FRAME, PROTO for its like)
            i, j = end, new_end
        elif effect == FRAME:  # a frame the new file does not start here (its frames split elsewhere)
            i, j, frames = end, new_start, frames - 1
        elif new_effect == FRAME:
            i, j, frames = start, new_end, frames + 1
        else:
            return False
        known, block = i, _SMALL_BLOCK
    return ref.ops + frames <= ref.budget.max_opcodes
