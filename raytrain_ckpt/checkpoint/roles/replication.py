"""The node writer's side of peer replication: a member of ``CheckpointWriter`` it delegates to.

A writer is both a sender and a receiver. As a sender, once a step it wrote for a rank
commits, it sends the rank's committed copy (the staging buffer that
``checkpoint.memory_copies: 2`` keeps intact until a newer step commits) to its peer. As a
receiver it holds its predecessor's ranks' replicas (``ReplicaStore``). Sends run on their own
threads after the commit, one rank at a time, paced: never on the training path. A send that
reads a buffer restaged meanwhile (a newer step committed) fails its CRC-32C at the peer and is
dropped; the newer step's send follows. The pieces that need no Ray (the ring, the pacing, the
store, the chunked send) are ``checkpoint/datapath/replica.py``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray
from ray.actor import ActorHandle

from raytrain_ckpt.checkpoint.datapath.replica import Pacer, ReplicaStore, send_replica

from raytrain_ckpt.checkpoint.errors import ReplicaError

from raytrain_ckpt.checkpoint.records import Replica
from raytrain_ckpt.checkpoint.roles.metrics import WriterMetrics

logger = logging.getLogger(__name__)

__all__ = ["Replication"]

_COMMIT_WAIT_S = 600.0
"""How long a writer waits for a step it wrote to commit before giving up its replica."""
_SEND_THREADS = 2
"""Threads of a writer's replica sends (and their waits for the commit): their own pool, so a
wait never holds a thread that a write of the next step needs."""


class Replication:
    """One writer's replicas: what it sends to its peer and what it holds for others.

    ``coordinator``: the CheckpointActor (asked whether a step committed); ``copy_of(rank, step)``
    and ``copies_of(step)``: this node's own committed copies, as the writer recorded them.
    """

    def __init__(self, directory: Path, prefix: str, node_id: str, coordinator: Any, metrics: WriterMetrics,
                 max_mb_per_s: float | None, copy_of: Callable[[int, int], Any | None],
                 copies_of: Callable[[int], list[Any]]) -> None:
        self.node_id, self.coordinator, self.metrics = node_id, coordinator, metrics
        self._copy_of, self._copies_of = copy_of, copies_of
        # The node in the names: nodes that share a /dev/shm (one machine) must not collide.
        self.store = ReplicaStore(directory, f"{prefix}-n{node_id[:8]}")
        self._peer: tuple[str, Any] | None = None
        self._rate = max_mb_per_s
        self._lock = threading.Lock()
        self._rank_locks: dict[int, threading.Lock] = {}
        self._newest_sent: dict[int, int] = {}
        self._send_pool = ThreadPoolExecutor(max_workers=_SEND_THREADS, thread_name_prefix="rtc-replica")

    def set_peer(self, node_id: str | None, peer: ActorHandle | None) -> None:
        with self._lock:
            self._peer = None if peer is None else (str(node_id), peer)
        logger.info("replicas of this node's ranks go to node %s", (node_id or "none (off)")[:12])

    def finish(self, rank: int, step: int, crc32c: int) -> Replica:
        replica = self.store.finish(rank, step, crc32c)
        logger.info("holding the replica of rank %d step %d from node %s (%.1f MB, CRC-32C verified)",
                    rank, step, replica.source_node[:12], replica.nbytes / 1e6)
        return replica

    def copies_held(self, step: int) -> list[Replica]:
        own = self._copies_of(step)
        return ([Replica(self.node_id, c.step, c.rank, c.nbytes, c.crc32c, c) for c in own]
                + [r for r in self.store.held() if r.step == step])

    def replicate(self, copy: Any, wait: bool = False) -> Replica | None:
        with self._lock:
            peer = self._peer
        if peer is None:
            return None
        future = self._send_pool.submit(self._send_logged, copy, self.node_id, peer)
        return future.result() if wait else None

    def push(self, rank: int, step: int, to: ActorHandle, to_node: str) -> Replica:
        held = next((c for c in self.copies_held(step) if c.rank == rank), None)
        if held is None:
            raise ReplicaError(f"no verified copy of rank {rank} step {step} is held on node {self.node_id[:12]}")
        self.store.check(held)
        return self._send(held.copy, held.source_node, (to_node, to))

    def after_write(self, rank: int, step: int) -> None:
        """Rank ``rank``'s files of ``step`` are written: with a peer, send its copy once the step commits."""
        with self._lock:
            if self._peer is None:
                return
        self._send_pool.submit(self._commit_and_send, rank, step)

    def _commit_and_send(self, rank: int, step: int) -> None:
        try:
            ray.get(self.coordinator.wait_committed.remote(step, _COMMIT_WAIT_S))
        except Exception as exc:  # aborted or never committed: nothing to replicate
            logger.info("no replica of rank %d step %d: the step did not commit (%s)", rank, step, exc)
            return
        with self._lock:
            lock = self._rank_locks.setdefault(rank, threading.Lock())
        with lock:  # one send per rank at a time; an older step whose turn comes late is skipped
            with self._lock:
                peer, newest = self._peer, self._newest_sent.get(rank, -1)
            copy = self._copy_of(rank, step)
            if peer is None or step <= newest or copy is None:
                return
            if self._send_logged(copy, self.node_id, peer) is not None:
                with self._lock:
                    self._newest_sent[rank] = max(step, self._newest_sent.get(rank, -1))

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
        node, handle = peer
        t0 = time.monotonic()
        replica = send_replica(
            copy, lambda c: ray.get(handle.replica_begin.remote(source_node, c)),
            lambda rank, step, offset, data: ray.get(handle.replica_put.remote(rank, step, offset, data)),
            lambda rank, step, crc: ray.get(handle.replica_finish.remote(rank, step, crc)),
            Pacer(self._rate))
        logger.info("replica of rank %d step %d sent to node %s: %.1f MB in %.2fs", copy.rank, copy.step,
                    node[:12], copy.nbytes / 1e6, time.monotonic() - t0)
        return replica
