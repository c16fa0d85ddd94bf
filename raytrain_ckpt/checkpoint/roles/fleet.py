"""A job's CheckpointWriters, one per node that hosts ranks: created on first use, probed for a
shared checkpoint root before their ranks get them, and pointed at their replication peers."""

from __future__ import annotations

import errno
import logging
import uuid
from typing import Any

import ray
from ray.exceptions import RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_ckpt.checkpoint.datapath.replica import ring_peers
from raytrain_ckpt.checkpoint.roles.names import NAMESPACE, ActorByName, actor_name, call_restarting, writer_name
from raytrain_ckpt.checkpoint.roles.writer import CheckpointWriter
from raytrain_ckpt.checkpoint.errors import StorageNotShared
from raytrain_ckpt.checkpoint.records import STALLED
from raytrain_ckpt.checkpoint.storage.probe import local_root, missing_probes, unshared_message
from raytrain_ckpt.spec import JobSpec

logger = logging.getLogger(__name__)

__all__ = ["PING_TIMEOUT_S", "WriterFleet"]

PING_TIMEOUT_S = 10.0
"""How long a restart waits for each CheckpointWriter and the CheckpointActor to answer a ping
before the new attempt reuses them (``WriterFleet.replace_silent``). One that does not answer (a
stopped process, a filesystem call holding every thread) is killed and Ray starts a fresh one in
its place. The same bound as a restart's query of a writer's in-memory copies."""


class WriterFleet:
    """The writers of a job, by node id."""

    def __init__(self, spec: JobSpec, root: str, actor: Any, env: dict[str, str]) -> None:
        self.spec, self.root, self.actor, self._env = spec, root, actor, env
        self.writers: dict[str, Any] = {}
        self._probed: set[str] | None = None
        """Nodes whose view of a local checkpoint root was probed (None: no preflight, or an object store)."""
        self._pings: dict[str, tuple[Any, float]] = {}
        """By process name: the ping in flight to it and when it was sent (``silences``)."""
        self._stalls: dict[str, dict[str, float]] = {}
        """By writer name: its writes in progress and how long each had moved no bytes, as it last answered."""

    def writer_for(self, node_id: str) -> Any:
        """The CheckpointWriter pinned to ``node_id`` (created on first use).

        A node that the start's preflight did not probe (it joined later: an autoscaler's or a
        replacement node, at a restart) is probed now, before its ranks get the writer.

        Raises:
            StorageNotShared: that node does not share a local checkpoint root.
        """
        if self._probed is not None and node_id not in self._probed:  # until a probe from it passes
            logger.info("node %s joined after the start: probing the checkpoint root from it", node_id[:12])
            self._probe([node_id])
        if node_id not in self.writers:
            self.writers[node_id] = self._new_writer(node_id)
        return self.writers[node_id]

    def _new_writer(self, node_id: str) -> Any:
        cls = ray.remote(CheckpointWriter)
        return cls.options(
            name=writer_name(self.spec.name, node_id), namespace=NAMESPACE, num_cpus=0,
            max_concurrency=64, max_restarts=-1, max_task_retries=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(self.spec.name, self.root, ActorByName(actor_name(self.spec.name)),
                 self.spec.checkpoint.writer_threads,
                 self.spec.checkpoint.writer_nice, self.spec.checkpoint.storage_options,
                 self.spec.checkpoint.memory_copies, self.spec.checkpoint.replication.max_mb_per_s, self._env)

    def _targets(self) -> list[tuple[str, Any]]:
        """Every writer and the actor, by the name failures and ``status`` give them."""
        targets = [(f"checkpoint writer on node {node[:12]}", w) for node, w in sorted(self.writers.items())]
        return [*targets, ("checkpoint actor", self.actor)]

    def silences(self, now: float) -> dict[str, float]:
        """While the job trains: how long each writer and the actor has left its ping unanswered
        (``control/watch/silence.py``), and each write whose bytes have not moved for a while, keyed
        ``"<writer>, its write of rank R step S"`` (``records.STALLED``). Never blocks: an answered
        ping (an error is an answer too) is dropped and a new one sent; a process with a ping in
        flight gets no second one. A writer's ping is its ``write_stalls()``: answered on its
        thread pool, so a writer whose write is stuck in the file system still answers it."""
        targets = dict(self._targets())
        for what, (ref, _) in list(self._pings.items()):
            if what not in targets or ray.wait([ref], timeout=0)[0]:
                del self._pings[what]
                self._stalls[what] = _answer(ref) if what in targets else {}
        for what, handle in targets.items():
            if what not in self._pings:
                ping = handle.__ray_ready__ if what == "checkpoint actor" else handle.write_stalls
                self._pings[what] = (ping.remote(), now)
        out = {what: now - sent for what, (_, sent) in self._pings.items()}
        for what, stalls in self._stalls.items():
            out.update({f"{what}{STALLED}{write}": s for write, s in stalls.items() if what in targets})
        return out

    def retire(self, node_id: str, timeout_s: float = PING_TIMEOUT_S) -> bool:
        """Stop the writer on ``node_id`` (a draining node that hosts no rank) and forget it: its
        staging buffers are released first (within ``timeout_s``), and no restart pings it or
        hands it to a rank once the node is gone. Returns whether there was one; a rank placed
        there later gets a new writer (``writer_for``)."""
        writer = self.writers.pop(node_id, None)
        if writer is None:
            return False
        try:
            ray.get(writer.release_all.remote(), timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - gone already, or stuck: it is stopped either way
            logger.warning("checkpoint writer on node %s: could not release its staging buffers: %s", node_id[:12], exc)
        ray.kill(writer, no_restart=True)
        if self._probed is not None:
            self._probed.discard(node_id)
        return True

    def replace_silent(self, timeout_s: float = PING_TIMEOUT_S, stalled: dict[str, float] | None = None) -> list[str]:
        """Ping every writer and the CheckpointActor (Ray's ``__ray_ready__``, run as one of their
        tasks); kill each one that does not answer within ``timeout_s``, so that Ray restarts it
        (``max_restarts=-1``: the handles the attempt gets stay valid), and wait for it to be back.
        ``stalled``: writes (``silences``' keys) past their budget: their writer is replaced too
        if they are still in progress and still have not moved (a new ``write_stalls`` answer).

        Without this a restart would hand its ranks a stopped writer, hang on the first save
        again, and blame the ranks. Returns one line per replacement (also logged).
        """
        self._pings.clear()
        self._stalls.clear()
        targets = self._targets()
        refs = [handle.__ray_ready__.remote() for _, handle in targets]
        answered, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)  # an error is an answer too
        why = {what: f"did not answer within {timeout_s:g}s" for (what, _), ref in zip(targets, refs)
               if ref not in answered}
        why.update(self._still_stalled(dict(targets), stalled or {}, timeout_s, set(why)))
        silent = [(what, handle) for what, handle in targets if what in why]
        for _, handle in silent:
            ray.kill(handle, no_restart=False)
        for what, handle in silent:  # back within start_timeout_s, as a new worker would be
            call_restarting(lambda h=handle: h.__ray_ready__.remote(), self.spec.fault_tolerance.start_timeout_s)
            logger.warning("%s %s: replaced", what, why[what])
        return [f"{what} {why[what]}: replaced" for what, _ in silent]

    def _still_stalled(self, targets: dict[str, Any], stalled: dict[str, float], timeout_s: float,
                       silent: set[str]) -> dict[str, str]:
        """Of the ``stalled`` writes (by ``silences`` key, with the budget they passed), those whose
        writer confirms them still unmoved: writer name -> why it is replaced."""
        out: dict[str, str] = {}
        for key, budget in sorted(stalled.items()):
            what, _, write = key.partition(STALLED)
            if what in silent or what in out or what not in targets:
                continue
            try:
                now = ray.get(targets[what].write_stalls.remote(), timeout=timeout_s)
            except Exception:  # noqa: BLE001 - no answer now: the ping above decides
                continue
            if now.get(write, 0.0) > budget:
                out[what] = f"moved no bytes of its write of {write} for {now[write]:.0f}s"
        return out

    def replicate_between(self, nodes: list[str]) -> dict[str, str]:
        """Point each rank-hosting node's writer at its peer (``ring_peers``); returns the ring.
        Empty when replication is off or the ranks share one node (logged)."""
        if self.spec.checkpoint.replication.mode == "off":
            return {}
        ring = ring_peers(nodes)
        if not ring:
            logger.info("checkpoint.replication: off, every rank runs on one node (no peer to hold a replica)")
        # Not waited for: a writer on a new node may still be starting, and nothing before the
        # attempt's first commit needs the peer (a restore reads copies, it sends none by ring).
        for node in sorted(set(nodes)):
            self.writer_for(node).set_peer.remote(ring.get(node), self.writer_for(ring[node]) if node in ring else None)
        if ring:
            logger.info("checkpoint.replication: %s", ", ".join(f"{a[:8]} -> {b[:8]}" for a, b in sorted(ring.items())))
        return ring

    def preflight(self) -> None:
        """Before anything trains: check that every node that may host a rank shares the
        checkpoint root with the CheckpointActor (checkpoint/storage/probe.py).

        Raises:
            StorageNotShared: some nodes write to a disk the actor cannot see; names them.
        """
        if local_root(self.root) is None:
            return
        self._probed = set()
        self._probe(_rank_nodes(self.spec))

    def _probe(self, nodes: list[str]) -> None:
        """The shared-storage probe from ``nodes`` (see ``preflight``); remembers them as probed."""
        for node in nodes:
            if node not in self.writers:
                self.writers[node] = self._new_writer(node)
        writers = [self.writers[node] for node in nodes]
        timeout = self.spec.fault_tolerance.start_timeout_s  # writers start like workers do
        nonce = uuid.uuid4().hex[:12]
        try:
            probes = ray.get([w.write_probe.remote(nonce) for w in writers], timeout=timeout)
        except RayTaskError as exc:
            if not isinstance(exc.cause, OSError):
                raise
            # a directory a node cannot write is a setup mistake like an unshared one: one line, exit 2
            fix = ("free space there or point checkpoint.dir at another filesystem (its committed steps stay)"
                   if exc.cause.errno in (errno.ENOSPC, errno.EDQUOT) else "make the path writable on every node")
            raise StorageNotShared(f"checkpoint.dir={self.spec.checkpoint.dir}: a node cannot write there "
                                   f"({exc.cause}); {fix}") from None
        try:
            seen = ray.get(self.actor.probes_seen.remote([p.name for p in probes]), timeout=timeout)
        finally:
            ray.get([w.remove_probe.remote(p.name) for w, p in zip(writers, probes)], timeout=timeout)
        missing = missing_probes(probes, set(seen.seen))
        if missing:
            raise StorageNotShared(unshared_message(str(self.spec.checkpoint.dir), missing, seen.node_id))
        assert self._probed is not None
        self._probed.update(nodes)
        logger.info("checkpoint root %s is shared by the %d node(s) that may host ranks", self.root, len(probes))


def _answer(ref: Any) -> dict[str, float]:
    """A writer's answer to its ping (``write_stalls``): an error, or an answer of another shape,
    counts as an answer with no write in progress."""
    try:
        out = ray.get(ref, timeout=0)
    except Exception:  # noqa: BLE001 - the process answered (with an error): it is not silent
        return {}
    return out if isinstance(out, dict) else {}


def _rank_nodes(spec: JobSpec) -> list[str]:
    """Ids of the alive nodes with room for at least one rank (a 0-CPU head hosts none)."""
    res = spec.resources
    need = {"CPU": res.cpus_per_worker, "GPU": res.gpus}
    return [n["NodeID"] for n in ray.nodes()
            if n["Alive"] and all(n["Resources"].get(k, 0.0) + 1e-9 >= v for k, v in need.items() if v > 0)]
