"""Peer replicas: each node's writer keeps a copy of another node's committed shards in RAM.

After a step commits, a node's writer sends each of its ranks' committed copies (the bytes of
the copy plus its descriptor) to one other node's writer, the node's **peer**. When a node is
lost, the ranks placed on a replacement node are restored from the replica on the surviving
peer; storage is the fallback. Four pieces, each small and testable without Ray:

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import crc32c as _crc32c

from raytrain_ckpt.checkpoint.datapath.buffers import OwnedBuffer, open_buffer

if TYPE_CHECKING:
    from raytrain_ckpt.metrics import WriterMetrics

logger = logging.getLogger(__name__)

__all__ = ["CHUNK_BYTES", "CommittedBytes", "Pacer", "Replica", "ReplicaEndpoint", "ReplicaError", "ReplicaStore",
           "read_chunks", "ring_peers", "send_replica"]

_COMMIT_WAIT_S = 600.0
"""How long a writer waits for a step it wrote to commit before giving up its replica."""
_SEND_THREADS = 2
"""Threads of a writer's replica sends (and their waits for the commit): their own pool, so a
wait never holds a thread that a write of the next step needs."""
CHUNK_BYTES = 8 << 20
"""Bytes per chunk sent to the peer: large enough to amortise a Ray call, small enough to pace."""


class ReplicaError(RuntimeError):
    """A replica that is incomplete, does not match its checksum, or is not held here."""


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


@dataclass(frozen=True)
class Replica:
    """A verified replica held by a node's writer."""

    source_node: str
    """The node whose writer sent it (where the rank's own copy was)."""
    step: int
    rank: int
    nbytes: int
    crc32c: int
    copy: Any
    """The source's committed-copy descriptor, its ``path`` replaced by this node's file."""

    @property
    def path(self) -> str:
        return self.copy.path


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


class ReplicaEndpoint:
    """The CheckpointWriter's side of replication, mixed into it so Ray calls reach these methods.

    A writer is both a sender and a receiver. As a sender, once a step it wrote for a rank
    commits, it sends the rank's committed copy (``committed_copy``: the staging buffer that
    ``checkpoint.memory_copies: 2`` keeps intact until a newer step commits) to its peer. As a
    receiver it holds its predecessor's ranks' replicas (``ReplicaStore``). Sends run on the
    writer's own threads after the commit, one rank at a time, paced: never on the training path.
    A send that reads a buffer restaged meanwhile (a newer step committed) fails its CRC-32C at
    the peer and is dropped; the newer step's send follows.
    """

    _lock: threading.Lock
    _buffers: dict[str, Any]
    prefix: str
    coordinator: Any
    metrics: WriterMetrics

    def _init_replicas(self, directory: Path, max_mb_per_s: float | None) -> None:
        import ray

        self._node_id = ray.get_runtime_context().get_node_id()
        # The node in the names: nodes that share a /dev/shm (one machine) must not collide.
        self.replicas = ReplicaStore(directory, f"{self.prefix}-n{self._node_id[:8]}")
        self._peer: tuple[str, Any] | None = None
        self._replica_rate = max_mb_per_s
        self._replica_lock = threading.Lock()
        self._rank_locks: dict[int, threading.Lock] = {}
        self._newest_sent: dict[int, int] = {}
        self._send_pool = ThreadPoolExecutor(max_workers=_SEND_THREADS, thread_name_prefix="rtc-replica")

    def set_peer(self, node_id: str | None, peer: Any | None) -> None:
        """Send replicas to ``peer`` (the writer on ``node_id``) from now on; None stops sending."""
        with self._replica_lock:
            self._peer = None if peer is None else (str(node_id), peer)
        logger.info("replicas of this node's ranks go to node %s", (node_id or "none (off)")[:12])

    def replica_begin(self, source_node: str, copy: Any) -> None:
        self.replicas.begin(source_node, copy)

    def replica_put(self, rank: int, step: int, offset: int, data: bytes) -> None:
        self.replicas.put(rank, step, offset, data)

    def replica_finish(self, rank: int, step: int, crc32c: int) -> Replica:
        replica = self.replicas.finish(rank, step, crc32c)
        logger.info("holding the replica of rank %d step %d from node %s (%.1f MB, CRC-32C verified)",
                    rank, step, replica.source_node[:12], replica.nbytes / 1e6)
        return replica

    def replicas_held(self) -> list[Replica]:
        """Every verified replica this writer holds (one per source rank, the newest step)."""
        return self.replicas.held()

    def copies_held(self, step: int) -> list[Replica]:
        """The copies of ``step`` on this node: its own ranks' committed copies (``source_node`` is
        this node) and the replicas it holds for its predecessor's ranks."""
        with self._lock:
            own = [h.record for h in self._buffers.values() if h.record is not None and h.record.step == step]
        return ([Replica(self._node_id, c.step, c.rank, c.nbytes, c.crc32c, c) for c in own]
                + [r for r in self.replicas.held() if r.step == step])

    def replicate(self, copy: Any, wait: bool = False) -> Replica | None:
        """Send ``copy`` (a committed copy of one of this node's ranks) to the peer, in the
        background; with ``wait``, block and return the peer's replica (None: no peer, or the
        send failed, logged)."""
        with self._replica_lock:
            peer = self._peer
        if peer is None:
            return None
        future = self._send_pool.submit(self._send_logged, copy, self._node_id, peer)
        return future.result() if wait else None

    def push_replica(self, rank: int, step: int, to: Any, to_node: str) -> Replica:
        """Send the copy of ``rank`` at ``step`` held here (own or replica) to another writer: a
        rank restored on another node loads from there. Re-checked here first; returns the
        receiver's replica."""
        held = next((c for c in self.copies_held(step) if c.rank == rank), None)
        if held is None:
            raise ReplicaError(f"no verified copy of rank {rank} step {step} is held on node {self._node_id[:12]}")
        self.replicas.check(held)
        return self._send(held.copy, held.source_node, (to_node, to))

    def _after_write(self, rank: int, step: int) -> None:
        """Rank ``rank``'s files of ``step`` are written: with a peer, send its copy once the step commits."""
        with self._replica_lock:
            if self._peer is None:
                return
        self._send_pool.submit(self._commit_and_send, rank, step)

    def _commit_and_send(self, rank: int, step: int) -> None:
        import ray

        try:
            ray.get(self.coordinator.wait_committed.remote(step, _COMMIT_WAIT_S))
        except Exception as exc:  # aborted or never committed: nothing to replicate
            logger.info("no replica of rank %d step %d: the step did not commit (%s)", rank, step, exc)
            return
        with self._replica_lock:
            lock = self._rank_locks.setdefault(rank, threading.Lock())
        with lock:  # one send per rank at a time; an older step whose turn comes late is skipped
            with self._replica_lock:
                peer, newest = self._peer, self._newest_sent.get(rank, -1)
            copy = self.committed_copy(rank, step)
            if peer is None or step <= newest or copy is None:
                return
            if self._send_logged(copy, self._node_id, peer) is not None:
                with self._replica_lock:
                    self._newest_sent[rank] = max(step, self._newest_sent.get(rank, -1))

    def _release_replicas(self) -> None:
        self.replicas.remove_all()

    def _send_logged(self, copy: Any, source_node: str, peer: tuple[str, Any]) -> Replica | None:
        t0 = time.monotonic()
        try:
            replica = self._send(copy, source_node, peer)
        except Exception as exc:  # the step is committed on storage: a lost replica only costs recovery time
            logger.warning("replica of rank %d step %d not sent to node %s: %s", copy.rank, copy.step,
                           peer[0][:12], exc)
            self.metrics.replica_failed(copy.rank)
            return None
        self.metrics.replicated(copy.rank, copy.step, copy.nbytes, time.monotonic() - t0)
        return replica

    def _send(self, copy: Any, source_node: str, peer: tuple[str, Any]) -> Replica:
        import ray

        node, handle = peer
        t0 = time.monotonic()
        replica = send_replica(
            copy, lambda c: ray.get(handle.replica_begin.remote(source_node, c)),
            lambda rank, step, offset, data: ray.get(handle.replica_put.remote(rank, step, offset, data)),
            lambda rank, step, crc: ray.get(handle.replica_finish.remote(rank, step, crc)),
            Pacer(self._replica_rate))
        logger.info("replica of rank %d step %d sent to node %s: %.1f MB in %.2fs", copy.rank, copy.step,
                    node[:12], copy.nbytes / 1e6, time.monotonic() - t0)
        return replica
