"""How far the staging copy into a buffer has got: ``StageProgress``, in the buffer's first bytes.

The trainer writes it as its copy goes (``checkpoint/datapath/staging.py``); the node's writer,
handed the save as the copy starts, reads it and sleeps on it (a futex on the shared file
mapping) until each tensor it is about to write is in the buffer.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections.abc import Callable
from raytrain_ckpt.checkpoint.errors import StagingAborted

__all__ = ["StageProgress", "StagingAborted"]

_libc = ctypes.CDLL(None, use_errno=True)

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(os.uname().machine)
"""``futex(2)``'s system call number (``<asm/unistd.h>``); None elsewhere: waits poll."""
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (no FUTEX_PRIVATE_FLAG): the word is in a file mapping
_POLL_S = 0.0002
"""How often a wait looks at the progress where there is no futex."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_wait(address: int, seen: int, timeout_s: float) -> None:
    """Sleep until the 32-bit word at ``address`` is woken, no longer holds ``seen``, or
    ``timeout_s`` passes (the GIL is released meanwhile: ctypes calls drop it)."""
    if _SYS_FUTEX is None:
        time.sleep(min(_POLL_S, timeout_s))
        return
    ts = _Timespec(int(timeout_s), int((timeout_s % 1) * 1e9))
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_int(seen), ctypes.byref(ts), None, 0)


def _futex_wake(address: int) -> None:
    """Wake every thread (of any process) waiting on the 32-bit word at ``address``."""
    if _SYS_FUTEX is not None:
        _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, ctypes.c_int(0x7FFFFFFF), None, None, 0)


_STARTING = -2
"""The end word while ``StageProgress.begin`` switches the buffer to a new save."""


class StageProgress:
    """How far the staging copy into a buffer has got, kept in the buffer's first bytes
    (``staging._HEADER``, before its first slot).

    The trainer hands a save to the writer as its copy starts, not once it is done, so the
    writer's first writes overlap the copy (ARCHITECTURE, "The writer starts while the copy
    runs"). Three int64 words: the save's ``token`` (which save the other two are about), the end
    offset of the slots copied so far (``-1``: the copy failed), and the copy's duration in
    microseconds once it is complete. The trainer writes them in an order that lets the writer
    read them without a lock: the end is reset before the token is set, and the duration is
    set before the end reaches the buffer's size. Each word is one aligned 8-byte store or load;
    the copy's own stores are ordered before the end that announces them because a lock
    operation (the GIL, released and taken around the copy) lies between them in the trainer,
    and another between the load of the end and the reads of the bytes in the writer.

    The writer sleeps while it waits: in ``FUTEX_WAIT`` on the low 32 bits of the end word,
    which the trainer wakes after every store of the end (it polled every 0.2 ms before: about a
    tenth of a core while a copy ran, taken from the trainers at their busiest). The buffer is a
    shared file mapping, so the futex is the file's, shared by the two processes. The end is the
    last word the trainer stores for every change (``begin`` sets it to ``_STARTING`` before it
    sets the token and to 0 after), and the writer reads it before the other words: if it saw
    the final value it sees every store before it; if not, the kernel's compare finds the word
    changed or the wake after the store finds the writer asleep. Two ends whose low 32 bits are
    equal (a slot of exactly k x 4 GiB) cost at most a ``check_s`` of delay, never a lost save.
    """

    def __init__(self, address: int, owner: object) -> None:
        assert address % 8 == 0 and sys.byteorder == "little"  # the futex is the end word's low half
        self._owner = owner  # keeps the mapping alive
        self.words = (ctypes.c_int64 * 3).from_address(address)
        self._end_address = address + 8
        self._end_low = ctypes.c_int32.from_address(self._end_address)

    # --- the trainer ---
    def begin(self, token: int) -> None:
        self.words[1] = _STARTING  # a writer of the previous save reads "not this save's" meanwhile
        self.words[2] = 0
        self.words[0] = token
        self._publish(0)

    def advance(self, end: int) -> None:
        """The slots up to ``end`` are copied (``end`` short of the buffer's size: only ``done``
        says the whole buffer is, after the duration is in place)."""
        self._publish(end)

    def done(self, end: int, seconds: float) -> None:
        self.words[2] = max(0, int(seconds * 1e6))
        self._publish(end)

    def failed(self) -> None:
        self._publish(-1)

    def _publish(self, end: int) -> None:
        # The end last, the wake after it: the writer checksums the header with the buffer once it
        # reads the buffer's size there, and it sleeps on this word.
        self.words[1] = end
        _futex_wake(self._end_address)

    # --- the writer ---
    def staged(self, token: int) -> int | None:
        """Bytes copied so far by save ``token`` (-1: the copy failed); None while the buffer is
        not (yet) about that save."""
        if self.words[0] != token:
            return None
        end = self.words[1]
        return None if end == _STARTING else end

    def copy_s(self) -> float:
        """The copy's duration, once it is complete."""
        return self.words[2] / 1e6

    def wait(self, token: int, end: int, alive: Callable[[], bool], check_s: float = 0.01) -> float:
        """Block until save ``token`` has copied the bytes up to ``end``; returns the seconds waited.

        Raises StagingAborted when its copy failed, or when ``alive()`` (is the trainer still
        there? checked every ``check_s`` while waiting) says no and the copy is still short of ``end``.
        """
        t0 = last = time.monotonic()
        while True:
            seen = self._end_low.value  # before the other words: a store after this wakes the wait below
            staged = self.staged(token)
            if staged is not None and staged >= end:
                return time.monotonic() - t0
            if staged == -1:
                raise StagingAborted("the trainer's staging copy failed")
            now = time.monotonic()
            if now - last >= check_s:
                last = now
                if not alive():
                    staged = self.staged(token)  # it may have finished just before it went
                    if staged is not None and staged >= end:
                        return time.monotonic() - t0
                    raise StagingAborted(f"the trainer went away with {max(staged or 0, 0)} of the first {end} "
                                         "bytes staged")
            _futex_wait(self._end_address, seen, max(0.0, check_s - (time.monotonic() - last)))
