"""Decoding untrusted bytes where the kernel bounds what they may cost.

A pickle's cost is not what a model of its opcodes says: one ``LONG_BINPUT`` with a large index
makes CPython's unpickler size and zero a memo array of twice that index (9 bytes -> gigabytes),
and a dict whose keys all hash alike takes quadratic time to build. So every pickle that comes
from a checkpoint directory, an import file or a diagnostics folder is decoded first in a
*reader process*: a child of this one, started lazily once per process and reused, that before
each decode sets its own ``RLIMIT_AS`` (address space) to what it uses plus the decode's memory
budget and its ``RLIMIT_CPU`` to what it has used plus the decode's time budget; this process
waits for the answer no longer than a wall-clock deadline and kills the child past it. A decode
over its memory fails with ``MemoryError`` in the child, one over its CPU time is killed by the
kernel (``SIGXCPU``); either way the file is refused with ``InvalidCheckpoint`` naming it and the
limit, and the next decode starts a new child.

The child decodes with the same restricted unpicklers as loading (torch classes replaced by
inert stand-ins, so it never imports torch), after the opcode pre-scan (``prescan.py``, whose
refusals name their limits). A pickle that decoded within the budget there costs loading in this
process about as much, bounded by the same budget. Verdicts of passed decodes are remembered by
content (``scancache.py``), so a file read again costs no round trip.

``ReadLimits`` names the budget; ``RAYTRAIN_CKPT_READ_LIMITS=<factor>`` raises it for a genuine
file that needs more.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from raytrain_ckpt.checkpoint.errors import BadEnvironment, InvalidCheckpoint, ReaderGone, UnsafeCheckpoint

__all__ = ["DEFAULT_LIMITS", "LIMITS_ENV", "ReadLimits", "collect_decodes", "decode_deadline_s", "decode_in_sandbox",
           "start_reader", "submit_decodes"]

log = logging.getLogger(__name__)

LIMITS_ENV = "RAYTRAIN_CKPT_READ_LIMITS"
"""A factor (e.g. ``4``) that multiplies every ``ReadLimits`` budget."""


def env_factor(name: str, low: float, high: float) -> float | None:
    """The factor ``$name`` multiplies a budget by (unset: None); out of ``[low, high]`` or not a
    number is refused, naming the variable and the range."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        factor = float(raw)
    except ValueError:
        factor = 0.0
    if not low <= factor <= high:
        raise BadEnvironment(f"{name}={raw[:40]!r}: use a factor from {low:.15g} to {high:.15g}, or unset it")
    return factor


@dataclass(frozen=True)
class ReadLimits:
    """The most one decode of an untrusted file may cost the reader process."""

    memory_bytes: int = 512 << 20
    """Address space a decode may add, plus ``memory_per_byte`` times the file's length."""
    memory_per_byte: int = 48
    """Address space per byte decoded (a real ``.metadata`` builds about 10 bytes of objects per byte)."""
    cpu_s: float = 5.0
    """CPU seconds a decode may take, plus ``cpu_s_per_mb`` per megabyte decoded."""
    cpu_s_per_mb: float = 3.0
    """CPU seconds per megabyte (the pre-scan and the decode run at about 2 MB/s together)."""

    def scaled(self) -> ReadLimits:
        """These limits times ``$RAYTRAIN_CKPT_READ_LIMITS`` (unset: unchanged)."""
        factor = env_factor(LIMITS_ENV, 0.01, 1e4)
        if factor is None:
            return self
        return replace(self, memory_bytes=int(self.memory_bytes * factor), cpu_s=self.cpu_s * factor,
                       cpu_s_per_mb=self.cpu_s_per_mb * factor)

    def for_size(self, n: int) -> tuple[int, float]:
        """(memory bytes, CPU seconds) one decode of ``n`` bytes may take."""
        return self.memory_bytes + self.memory_per_byte * n, self.cpu_s + self.cpu_s_per_mb * n / 1e6


DEFAULT_LIMITS = ReadLimits()

_WALL_FACTOR, _WALL_SLACK_S = 3.0, 10.0
"""The parent's deadline: CPU budget times this plus this (a shared machine runs the child slower)."""

_MAX_REPLY = 16 << 20
"""Largest answer read back from the reader process."""


class _Reader:
    """The reader process of this process: started on first use, restarted after a refusal that
    killed it, never shared with a forked child (which starts its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._owner = 0
        self._pending: _Batch | None = None

    def call(self, kind: str, data: bytes, where: str, args: dict[str, Any], limits: ReadLimits) -> Any:
        memory, cpu = limits.for_size(len(data))
        request = json.dumps({"kind": kind, "where": where, "args": args, "memory": memory, "cpu": cpu}).encode()
        with self._lock:
            self._settle()
            proc = self._running()
            try:
                proc.stdin.write(struct.pack("<IQ", len(request), len(data)) + request)
                proc.stdin.write(data)
                proc.stdin.flush()
                reply = self._reply(proc, cpu * _WALL_FACTOR + _WALL_SLACK_S)
            except (BrokenPipeError, OSError, ReaderGone):
                reply = None
            if reply is None:
                self._stop()
                raise _died(proc, where, memory, cpu) from None
            if reply.get("error") == "memory":
                self._stop()  # it exits after this answer: the next decode must not find it still exiting
        return _answer(reply, where, memory)

    def submit(self, kind: str, jobs: list[tuple[bytes, str, dict[str, Any]]], limits: ReadLimits) -> _Batch:
        """Send ``jobs`` to the reader process without waiting for its answers (``_Batch.results``)."""
        with self._lock:
            self._settle()
            batch = _Batch(self, kind, jobs, limits)
            self._pending = batch
            batch.send(self._running())
            return batch

    def busy(self) -> bool:
        """A batch of this reader is still unanswered (read before this reader sends more)."""
        return self._pending is not None

    def collect(self, batch: _Batch) -> list[Any]:
        with self._lock:
            if self._pending is batch:
                self._settle()
            return batch.results

    def _settle(self) -> None:
        """The answers of the batch sent last, read before anything else is sent."""
        batch, self._pending = self._pending, None
        if batch is not None:
            batch.receive()

    def start(self) -> None:
        """The reader process, started now (its start overlaps the caller's work); nothing to do
        while a batch is unanswered (its process is in use, or has answers to be read from it)."""
        with self._lock:
            if self._pending is None:
                self._running()

    def _running(self) -> subprocess.Popen:
        if self._proc is not None and (self._owner != os.getpid() or self._proc.poll() is not None):
            if self._owner == os.getpid():
                self._stop()
            self._proc = None  # a forked copy's handle: the child belongs to the parent process
        if self._proc is None:
            root = str(Path(__file__).resolve().parents[3])
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
            self._proc = subprocess.Popen(
                [sys.executable, "-c", "from raytrain_ckpt.checkpoint.format.sandbox_child import serve; serve()"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                close_fds=True, start_new_session=True)
            self._owner = os.getpid()
            log.debug("reader process %d started", self._proc.pid)
        return self._proc

    def _reply(self, proc: subprocess.Popen, wall_s: float) -> dict | None:
        deadline = time.monotonic() + wall_s
        head = _read_exact(proc, 4, deadline)
        (n,) = struct.unpack("<I", head)
        if n > _MAX_REPLY:
            raise ReaderGone()
        return json.loads(_read_exact(proc, n, deadline))

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.kill()
        except OSError:
            pass  # (it has exited already)
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass  # (a pipe to a dead child: nothing to flush)


class _Batch:
    """Decodes sent to the reader process back to back: each still under its own limits and
    deadline (counted from the answer before it), without a round trip between them. A decode
    that ends the process (a limit) is refused and the rest go to a fresh one."""

    def __init__(self, reader: _Reader, kind: str, jobs: list[tuple[bytes, str, dict[str, Any]]],
                 limits: ReadLimits) -> None:
        self.reader = reader
        self._kind, self._jobs, self._limits = kind, jobs, limits
        self.results: list[Any] = []
        self._writer: threading.Thread | None = None
        self._proc: subprocess.Popen | None = None

    def send(self, proc: subprocess.Popen) -> None:
        self._proc = proc
        parts = []
        for data, where, args in self._jobs[len(self.results):]:
            memory, cpu = self._limits.for_size(len(data))
            request = json.dumps({"kind": self._kind, "where": where, "args": args, "memory": memory,
                                  "cpu": cpu}).encode()
            parts += [struct.pack("<IQ", len(request), len(data)), request, data]
        # One write, made on a thread of its own (it blocks while the reader is behind, with the GIL
        # released): this thread goes on, the reader never waits for this one to be scheduled.
        self._writer = threading.Thread(target=_write, args=(proc, b"".join(parts)), daemon=True,
                                        name="raytrain-ckpt-reader-feed")
        self._writer.start()

    def receive(self) -> None:
        """Read every answer (each an answer or the checkpoint error it stands for), restarting
        the reader process after a decode that ended it. When the reader cannot be read or started
        again (the system refuses a process: ``EAGAIN``), every decode still unanswered is refused,
        never left out: a missing answer must not read as a pass."""
        try:
            self._receive()
        except Exception as exc:  # noqa: BLE001 - whatever it is, the unanswered files were not checked
            self.reader._stop()  # its later answers must not be taken for another batch's
            if self._writer is not None:
                self._writer.join()
            unanswered = self._jobs[len(self.results):]
            log.warning("reader process failed, %d decodes refused unchecked: %s", len(unanswered), exc)
            for _, where, _ in unanswered:
                self.results.append(InvalidCheckpoint(
                    f"{where}: not checked, the reader process failed ({type(exc).__name__}: {exc}); refused"))

    def _receive(self) -> None:
        while len(self.results) < len(self._jobs):
            # the process the jobs went to, even when it has exited since: its answers up to the
            # decode that ended it are still in its pipe (only after that one is a new one started)
            if self._writer is None or self._proc is None:
                self.send(self.reader._running())
            proc = self._proc
            data, where, _ = self._jobs[len(self.results)]
            memory, cpu = self._limits.for_size(len(data))
            try:
                reply = self.reader._reply(proc, cpu * _WALL_FACTOR + _WALL_SLACK_S)
            except (OSError, ValueError, ReaderGone):  # (ValueError: its pipe was closed here)
                reply = None
            if reply is None or reply.get("error") == "memory":
                self._end(proc)
                self.results.append(_died(proc, where, memory, cpu) if reply is None else _over_memory(where, memory))
                continue
            try:
                self.results.append(_answer(reply, where, memory))
            except (InvalidCheckpoint, UnsafeCheckpoint) as exc:
                self.results.append(exc)
        if self._writer is not None:
            self._writer.join()

    def _end(self, proc: subprocess.Popen) -> None:
        try:
            proc.kill()
        except OSError:
            pass  # (it has exited already)
        proc.wait()
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        self.reader._stop()


def _write(proc: subprocess.Popen, blob: bytes) -> None:
    try:
        proc.stdin.write(blob)
        proc.stdin.flush()
    except (OSError, ValueError):
        pass  # the process ended (a decode over its limits): ``_Batch.receive`` says which and goes on


def _read_exact(proc: subprocess.Popen, n: int, deadline: float) -> bytes:
    fd = proc.stdout.fileno()
    out = bytearray()
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            proc.kill()
            raise ReaderGone(timed_out=True)
        piece = os.read(fd, min(n - len(out), 1 << 20))
        if not piece:
            raise ReaderGone()
        out += piece
    return bytes(out)


def _died(proc: subprocess.Popen, where: str, memory: int, cpu: float) -> InvalidCheckpoint:
    code = proc.returncode
    if code in (-signal.SIGXCPU, -signal.SIGKILL) or code is None:
        return InvalidCheckpoint(f"{where}: decoding it ran over its time limit ({cpu:.0f} CPU seconds, "
                                 f"{cpu * _WALL_FACTOR + _WALL_SLACK_S:.0f} s wall); refused (a checkpoint is data; "
                                 f"raise the limits with {LIMITS_ENV}=<factor> if this file is genuine)")
    return _over_memory(where, memory, f" (the reader process exited with {code})")


def _over_memory(where: str, memory: int, detail: str = "") -> InvalidCheckpoint:
    return InvalidCheckpoint(f"{where}: decoding it needed over {memory >> 20} MiB of memory, its limit{detail}; "
                             f"refused (a checkpoint is data; raise the limits with {LIMITS_ENV}=<factor> if "
                             "this file is genuine)")


def _answer(reply: dict, where: str, memory: int) -> Any:
    if reply.get("ok"):
        return reply.get("result")
    error, message = reply.get("error"), str(reply.get("message", ""))[:4000]
    if error == "unsafe":
        raise UnsafeCheckpoint(message)
    if error == "memory":
        raise _over_memory(where, memory)
    raise InvalidCheckpoint(message or f"{where} is unreadable")


_READER = _Reader()
_SECOND = _Reader()
"""A second reader process, for a second batch in flight (``submit_decodes``): ``ls`` of a long
root checks two groups of ``.metadata`` at once while this process checks the next steps' files.
Each of the two keeps the limits of one decode."""


def decode_in_sandbox(kind: str, data: bytes, where: str, args: dict[str, Any] | None = None,
                      limits: ReadLimits = DEFAULT_LIMITS) -> Any:
    """Run the decode ``kind`` (``sandbox_child.KINDS``) of ``data`` (called ``where`` in messages)
    in the reader process, under ``limits`` scaled by ``$RAYTRAIN_CKPT_READ_LIMITS``; its result.

    Raises:
        UnsafeCheckpoint: The file refers to code.
        InvalidCheckpoint: The file is damaged, over a pre-scan budget, or over the memory or time
            limit of its decode (the message names the file and the limit).
    """
    return _READER.call(kind, data, where, args or {}, limits.scaled())


def submit_decodes(kind: str, jobs: list[tuple[bytes, str, dict[str, Any]]],
                   limits: ReadLimits = DEFAULT_LIMITS) -> _Batch:
    """``decode_in_sandbox`` of every ``(data, where, args)`` of ``jobs``, sent now and answered by
    ``collect_decodes`` (the caller works meanwhile): each answer is the result or the
    ``InvalidCheckpoint`` / ``UnsafeCheckpoint`` the decode raised. Each decode keeps its own limits.

    A batch goes to the reader process with no batch in flight: with one still in flight on the
    first, a second batch goes to a second process (on a machine of more than one CPU), so two
    run at once; with both busy, the first's batch is answered before this one is sent."""
    reader = _READER
    if _READER.busy() and (os.cpu_count() or 1) > 1 and not _SECOND.busy():
        reader = _SECOND
    return reader.submit(kind, jobs, limits.scaled())


def collect_decodes(batch: _Batch) -> list[Any]:
    """The answers of a ``submit_decodes`` batch, in its order."""
    return batch.reader.collect(batch)


def decode_deadline_s(n_bytes: int, limits: ReadLimits = DEFAULT_LIMITS) -> float:
    """The longest a decode of ``n_bytes`` may take on the wall clock before its reader is killed."""
    return limits.scaled().for_size(n_bytes)[1] * _WALL_FACTOR + _WALL_SLACK_S


def start_reader() -> None:
    """Start the reader process now, so that its start overlaps what the caller does before its
    first decode (``ls``, ``status``, ``verify``)."""
    _READER.start()


def _limit_self(memory: int, cpu: float) -> None:
    """In the reader process: at most ``memory`` more bytes of address space and ``cpu`` more CPU
    seconds from now (soft limits, raised again by ``_unlimit_self`` between decodes)."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    spent = used.ru_utime + used.ru_stime
    hard_cpu = resource.getrlimit(resource.RLIMIT_CPU)[1]
    soft_cpu = int(spent + cpu) + 1
    if hard_cpu != resource.RLIM_INFINITY:
        soft_cpu = min(soft_cpu, hard_cpu)
    resource.setrlimit(resource.RLIMIT_CPU, (soft_cpu, hard_cpu))
    hard_as = resource.getrlimit(resource.RLIMIT_AS)[1]
    soft_as = _address_space() + memory
    if hard_as != resource.RLIM_INFINITY:
        soft_as = min(soft_as, hard_as)
    resource.setrlimit(resource.RLIMIT_AS, (soft_as, hard_as))


def _unlimit_self() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (resource.getrlimit(resource.RLIMIT_AS)[1],) * 2)


def _address_space() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[0]) * resource.getpagesize()
