"""Peer replicas: each node's writer keeps a copy of another node's committed shards in RAM.

After a step commits, a node's writer sends each of its ranks' committed copies (the bytes of
the copy plus its descriptor) to one other node's writer, the node's **peer**. When a node is
lost, the ranks placed on a replacement node are restored from the replica on the surviving
peer; storage is the fallback. Four pieces, each small and testable without Ray (the writer's
side that calls Ray, ``Replication``, is ``checkpoint/roles/replication.py``):

* ``ring_peers``: which node holds whose replica. Nodes are sorted by id and each sends to the
  next one around the ring. Losing a node only moves the replica of the node that sent to it
  (every other pair stays). With one node there is no peer: replication is off.
* ``send_replica``: streams a copy in chunks through a ``put`` callable (a Ray call to the
  peer's writer), paced to ``max_mb_per_s`` so it never competes with training for the network
  or the cores. It runs on the writer's own threads, after the commit: off the training path.
* ``ReplicaStore``: the receiving side. Each replica lives in a staging-buffer file of its own
  (``checkpoint/datapath/buffers.py``: created exclusively, 0600, owned by the live writer, swept when
  the writer dies). A replica becomes visible only after all its bytes arrived and their
  CRC-32C equals the sender's; then the older replica of that source rank is removed: only the
  newest committed step per source rank is kept.
* ``Replica``: the descriptor of a held replica. ``copy`` is the source's committed-copy
  descriptor with ``path`` pointing at this node's file, so it loads like a local copy.

A replica that fails its checksum is never made visible; the sender's error says why, and the
step is still committed on storage, so nothing is lost.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import crc32c as _crc32c

from raytrain_ckpt.checkpoint.datapath.buffers import OwnedBuffer, open_buffer
from raytrain_ckpt.checkpoint.records import Replica
from raytrain_ckpt.checkpoint.errors import ReplicaError

logger = logging.getLogger(__name__)

__all__ = ["CHUNK_BYTES", "CommittedBytes", "Pacer", "ReplicaStore",
           "read_chunks", "ring_peers", "send_replica"]

CHUNK_BYTES = 8 << 20
"""Bytes per chunk sent to the peer: large enough to amortise a Ray call, small enough to pace."""


class CommittedBytes(Protocol):
    """What replication needs of a committed copy (``checkpoint/memcopy.CommittedCopy`` has it)."""

    step: int
    rank: int
    nbytes: int
    path: str


def ring_peers(nodes: list[str]) -> dict[str, str]:
    """Node -> the node that holds its replica: the next one in sorted order, around the ring.

    Empty with fewer than two distinct nodes (replication is off: no node to copy to).
    """
    ring = sorted(set(nodes))
    if len(ring) < 2:
        return {}
    return {node: ring[(i + 1) % len(ring)] for i, node in enumerate(ring)}


class Pacer:
    """Sleeps so that bytes sent never run ahead of ``max_mb_per_s`` (None: no limit)."""

    def __init__(self, max_mb_per_s: float | None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate = None if max_mb_per_s is None else max_mb_per_s * 1e6
        self.clock, self.sleep = clock, sleep
        self.start = clock()
        self.sent = 0

    def account(self, nbytes: int) -> float:
        """Record ``nbytes`` sent; sleep until the rate allows more. Returns the seconds slept."""
        self.sent += nbytes
        if self.rate is None:
            return 0.0
        ahead = self.sent / self.rate - (self.clock() - self.start)
        if ahead > 0:
            self.sleep(ahead)
            return ahead
        return 0.0


def read_chunks(path: str, nbytes: int, chunk_bytes: int = CHUNK_BYTES):
    """Yield ``(offset, bytes)`` of the first ``nbytes`` of a buffer file, checked like any buffer."""
    fd = open_buffer(Path(path), nbytes)
    try:
        for offset in range(0, nbytes, chunk_bytes):
            data = os.pread(fd, min(chunk_bytes, nbytes - offset), offset)
            if not data:
                raise ReplicaError(f"{path}: ends at {offset} bytes, expected {nbytes}")
            yield offset, data
    finally:
        os.close(fd)


def send_replica(copy: CommittedBytes, begin: Callable[[Any], None],
                 put: Callable[[int, int, int, bytes], None], finish: Callable[[int, int, int], Replica],
                 pacer: Pacer, chunk_bytes: int = CHUNK_BYTES) -> Replica:
    """Stream ``copy`` to a peer: ``begin(copy)`` (the descriptor), ``put(rank, step, offset, data)``
    per chunk, then ``finish(rank, step, crc32c)`` which verifies and returns the held replica.

    The CRC-32C is taken of the bytes as they are read here, so the peer checks what arrived
    against what left.
    """
    begin(copy)
    crc = 0
    for offset, data in read_chunks(copy.path, copy.nbytes, chunk_bytes):
        crc = _crc32c.crc32c(data, crc)
        put(copy.rank, copy.step, offset, data)
        pacer.account(len(data))
    recorded = getattr(copy, "crc32c", None)
    if recorded is not None and recorded != crc:
        # the source changed under the send: finishing with a wrong CRC makes the peer drop it
        crc = recorded
    return finish(copy.rank, copy.step, crc)


@dataclass
class _Incoming:
    """A replica being received: its file, bytes received so far and their running CRC."""

    buffer: OwnedBuffer
    source_node: str
    copy: Any
    received: int = 0
    crc: int = 0


class ReplicaStore:
    """The replicas one writer holds for other nodes' ranks, in its own buffer files.

    Chunks must arrive in order (``send_replica`` sends them so); a gap or an overlap fails
    the replica. Thread-safe: chunks of different ranks arrive on different threads.
    """

    def __init__(self, directory: Path, prefix: str) -> None:
        self.directory, self.prefix = Path(directory), prefix
        self._held: dict[int, tuple[Replica, OwnedBuffer]] = {}
        self._incoming: dict[tuple[int, int], _Incoming] = {}
        self._lock = threading.Lock()

    def _path(self, rank: int, step: int) -> Path:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", self.prefix)
        return self.directory / f"rtc-{safe}-replica-rank{rank}-step{step}.buf"

    def begin(self, source_node: str, copy: Any) -> None:
        """Start receiving ``copy`` (its descriptor; ``copy.nbytes`` bytes follow)."""
        key = (copy.rank, copy.step)
        with self._lock:
            # A send of this rank cut short (its sender died, a retry of the same step) is over
            # once a new one begins: only one replica per rank is ever being received.
            for k in [k for k in self._incoming if k[0] == copy.rank]:
                self._incoming.pop(k).buffer.remove()
            held = self._held.get(copy.rank)
            if held is not None and held[0].step >= copy.step:
                raise ReplicaError(f"rank {copy.rank}: a replica of step {held[0].step} is held, "
                                   f"step {copy.step} is not newer")
            buffer = OwnedBuffer.create(self._path(copy.rank, copy.step), copy.nbytes)
            self._incoming[key] = _Incoming(buffer, source_node, copy)

    def put(self, rank: int, step: int, offset: int, data: bytes) -> None:
        """Write one chunk; it must start where the previous one ended."""
        with self._lock:
            inc = self._incoming.get((rank, step))
        if inc is None:
            raise ReplicaError(f"rank {rank} step {step}: no replica is being received")
        if offset != inc.received or offset + len(data) > inc.copy.nbytes:
            self.abort(rank, step)
            raise ReplicaError(f"rank {rank} step {step}: chunk at {offset} (+{len(data)}) does not follow "
                               f"the {inc.received} bytes received of {inc.copy.nbytes}")
        fd = open_buffer(inc.buffer.path, inc.copy.nbytes)
        try:
            os.pwrite(fd, data, offset)
        finally:
            os.close(fd)
        inc.received += len(data)
        inc.crc = _crc32c.crc32c(data, inc.crc)

    def finish(self, rank: int, step: int, crc32c: int) -> Replica:
        """Verify the received bytes against the sender's CRC-32C and make the replica the rank's
        newest; the older one is removed. Raises ReplicaError (and drops the bytes) on a mismatch."""
        with self._lock:
            inc = self._incoming.pop((rank, step), None)
        if inc is None:
            raise ReplicaError(f"rank {rank} step {step}: no replica is being received")
        problem = (f"{inc.received} of {inc.copy.nbytes} bytes arrived" if inc.received != inc.copy.nbytes else
                   f"CRC-32C {inc.crc:08x} of the bytes received, {crc32c:08x} sent" if inc.crc != crc32c else "")
        if problem:
            inc.buffer.remove()
            raise ReplicaError(f"replica of rank {rank} step {step} from node {inc.source_node[:12]} "
                               f"dropped: {problem}")
        replica = Replica(inc.source_node, step, rank, inc.copy.nbytes, crc32c,
                          dataclasses.replace(inc.copy, path=str(inc.buffer.path)))
        with self._lock:
            old = self._held.get(rank)
            if old is not None and old[0].step > step:  # a newer one finished first: keep it
                inc.buffer.remove()
                return old[0]
            self._held[rank] = (replica, inc.buffer)
        if old is not None:
            old[1].remove()
        return replica

    def abort(self, rank: int, step: int) -> None:
        """Drop a replica being received (a failed send)."""
        with self._lock:
            inc = self._incoming.pop((rank, step), None)
        if inc is not None:
            inc.buffer.remove()

    def held(self) -> list[Replica]:
        """Every verified replica held, one per source rank."""
        with self._lock:
            return [r for r, _ in self._held.values()]

    def get(self, rank: int, step: int) -> Replica | None:
        """The verified replica of ``rank`` at ``step``, or None."""
        with self._lock:
            held = self._held.get(rank)
        return held[0] if held is not None and held[0].step == step else None

    def check(self, replica: Replica) -> None:
        """Re-read a held replica and raise ReplicaError unless its bytes still match its CRC-32C."""
        crc = 0
        for _, data in read_chunks(replica.path, replica.nbytes):
            crc = _crc32c.crc32c(data, crc)
        if crc != replica.crc32c:
            raise ReplicaError(f"replica of rank {replica.rank} step {replica.step} at {replica.path}: CRC-32C "
                               f"{crc:08x}, recorded {replica.crc32c:08x}")

    def remove_all(self) -> None:
        """Unlink every replica file (the job is over)."""
        with self._lock:
            held, incoming = list(self._held.values()), list(self._incoming.values())
            self._held, self._incoming = {}, {}
        for _, buffer in held:
            buffer.remove()
        for inc in incoming:
            inc.buffer.remove()
