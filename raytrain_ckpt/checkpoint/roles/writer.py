"""CheckpointWriter: one Ray actor per node that owns the staging buffers and persists them.

Trainers map the writer's shared-memory files, copy their state in, and hand the step over
with ``accept()`` as the copy starts. The writer writes the rank's DCP shard files with its own
threads straight from the buffer, each tensor as soon as the copy has reached it
(``staging.StageProgress``), checksumming them as it writes (the ``ShardSink`` picked for the root,
``checkpoint/datapath/sink.py``), fsyncs them and reports to the CheckpointActor. Once the copy is complete the
trainer is out of the picture: a trainer that dies after it does not stop its step from being
committed; one that dies before it loses only that step, which the writer aborts.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import re
import resource
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ray
from ray.actor import ActorHandle

from raytrain_ckpt.checkpoint.datapath.buffers import is_leased, shm_dir, sweep_orphans

from raytrain_ckpt.checkpoint.errors import StagingFileError
from raytrain_ckpt.checkpoint.format.rankresults import RankResults, sharded_names
from raytrain_ckpt.checkpoint.datapath.filewrite import RankFiles, WriteProgress, WriteWatch
from raytrain_ckpt.checkpoint.datapath.progress import StageProgress
from raytrain_ckpt.checkpoint.errors import StagingAborted
from raytrain_ckpt.checkpoint.records import CommittedCopy, NodeProbe, PersistRequest, RankReport, Replica, SaveTimings, WriterRef, WriterUsage
from raytrain_ckpt.checkpoint.datapath.sink import ShardSink, pick_sink
from raytrain_ckpt.checkpoint.datapath.staging import StagedPlanner
from raytrain_ckpt.checkpoint.format.fingerprints import shard_sums
from raytrain_ckpt.checkpoint.roles.courier import NodeCourier
from raytrain_ckpt.checkpoint.roles.repeats import SentResults
from raytrain_ckpt.checkpoint.roles.replication import Replication
from raytrain_ckpt.checkpoint.roles.writer_buffers import Mapped, WriterBuffers
from raytrain_ckpt.checkpoint.storage.posix import replace_file
from raytrain_ckpt.checkpoint.storage.probe import local_root, probe_name
from raytrain_ckpt.common.faults import adopt_fault_env, maybe_inject
from raytrain_ckpt.common.logs import setup_logging
from raytrain_ckpt.checkpoint.roles.metrics import WriterMetrics

logger = logging.getLogger(__name__)

__all__ = ["CheckpointWriter", "buffer_prefix", "shm_dir"]


def buffer_prefix(job: str, root: str) -> str:
    """Names a job's staging files in /dev/shm. The checkpoint root is part of it: two jobs
    of the same name writing to different directories on one node must not share buffers (the
    end of one would unlink the other's)."""
    digest = hashlib.sha1(root.encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', job)}-{digest}"


def _write_node_probe(root: str, nonce: str) -> NodeProbe | None:
    local = local_root(root)
    if local is None:
        return None
    node_id = ray.get_runtime_context().get_node_id()
    path = Path(local) / probe_name(node_id, nonce)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, node_id.encode("ascii"))
    return NodeProbe(node_id, ray.util.get_node_ip_address(), path.name)


class CheckpointWriter:
    """Per-node writer actor (threaded actor; writes run on its own thread pool). Its buffers are
    ``WriterBuffers``; where the bytes go, its ``ShardSink``; peer replicas, its ``Replication``."""

    def __init__(self, job: str, root: str, coordinator: Any, io_threads: int = 1, nice: int = 10,
                 storage_options: dict[str, Any] | None = None, memory_copies: int = 1,
                 replica_mb_per_s: float | None = None, fault_env: dict[str, str] | None = None) -> None:
        setup_logging()
        adopt_fault_env(fault_env)  # an argument, not a runtime_env: see TrainWorker.__init__
        self.memory_copies = memory_copies
        """With 2, every written step's buffer is checksummed and recorded (``committed_copy``)."""
        self.root, self.storage_options, self.coordinator = root, dict(storage_options or {}), coordinator
        # Persisting is background work: let the training processes win the cores.
        os.nice(nice)
        self.io_threads = io_threads
        self._sink: ShardSink | None = None
        """Where the shards go, picked from the root at the first write (``datapath/sink.py``)."""
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="rtc-writer")
        self._jobs: dict[tuple[int, int], Future] = {}
        self._running: dict[tuple[int, int], PersistRequest] = {}
        self.writes = WriteWatch()
        self._tmp: dict[tuple[int, int], str] = {}
        self._last_phases: dict[int, dict[str, float]] = {}
        self._shards: dict[int, tuple[str, frozenset[str]]] = {}  # (``_sharded``)
        self._sent = SentResults()  # a rank's results that did not change go to the actor as a digest
        node_id = ray.get_runtime_context().get_node_id()
        # The node's ranks' hand-offs, reports and stalls go to the actor together (``courier.py``).
        # A batch of hand-offs and stalls alone is retried across a restart of the actor (``node_accepted``).
        self.courier = NodeCourier(
            lambda batch: ray.get((coordinator.node_report if batch.reports else coordinator.node_accepted).remote(batch)),
            lambda: WriterRef(ray.get_runtime_context().current_actor, node_id))
        prefix = buffer_prefix(job, root)
        self.buffers = WriterBuffers(shm_dir(), prefix, node_id, self._pool)
        self.metrics = WriterMetrics(job, node_id[:12])
        # Buffers of writers that died (this job's previous incarnation, a job whose driver was
        # killed) hold RAM until someone removes them; a live writer's buffers are left alone.
        sweep_orphans(shm_dir())
        self.replication = Replication(shm_dir(), prefix, node_id, coordinator, self.metrics, replica_mb_per_s,
                                       self.buffers.copy_of, self.buffers.copies_of)

    def write_probe(self, nonce: str) -> NodeProbe | None:
        """Write this node's shared-storage probe under the root (see checkpoint/storage/probe.py);
        None for an object-store root, which needs none."""
        return _write_node_probe(self.root, nonce)

    def remove_probe(self, name: str) -> None:
        """Remove this node's probe (only this node can: its disk may be private)."""
        local = local_root(self.root)
        if local is not None:
            (Path(local) / name).unlink(missing_ok=True)

    def allocate(self, rank: int, attempt: int, nbytes: int, copy: int = 0) -> str:
        """The rank's staging file number ``copy`` for this attempt, reused across its saves and,
        unless a write or an old process still holds it, across a restart (``WriterBuffers.allocate``:
        its pages are allocated already, so the first save after a restart costs what any save costs)."""
        self.courier.expect(attempt, rank)  # a rank of this node: its calls wait for one another's
        return self.buffers.allocate(rank, attempt, nbytes, copy, self._busy())

    def _busy(self) -> set[str]:
        return {j.buffer_path for j in self._running.values()}

    def release_all(self) -> None:
        """Unlink every staging file this writer owns (the job is over), and any orphan: those a
        previous incarnation of this actor created are orphans since it died."""
        self.buffers.unlink_all()
        self.replication.store.remove_all()
        sweep_orphans(shm_dir())

    def accept(self, req: PersistRequest, opened: list[ray.ObjectRef] | None = None) -> None:
        """Take over a step being staged and start writing it; returns once the CheckpointActor
        knows this writer holds it.

        From this return on, and once the trainer's copy is complete (``req.token``), the step no
        longer depends on the trainer process. A trainer whose copy fails or that goes away before
        its copy is complete loses the step: the write stops and the step is aborted.

        ``opened``: the trainer's call opening the step (``CheckpointActor.open_step``, made while
        it planned and started its copy). With its reply, the step's temporary directory, the
        write starts at once, while the actor is told of the hand-off with the node's other ranks'
        (``courier.py``); without one (the call failed: the actor was restarting, the step was
        aborted) it starts after that.
        """
        key = (req.rank, req.step)
        with self.buffers.lock:
            held = self.buffers.held.get(req.buffer_path)
            if held is None or held.attempt != req.attempt:
                # A late hand-off of an earlier attempt: its buffer was given to a newer one (or is gone).
                raise StagingFileError(f"step {req.step} rank {req.rank}: staging buffer {req.buffer_path} no longer "
                                       f"belongs to attempt {req.attempt}; this save is dropped")
            held.record = None  # the trainer staged over whatever it held
            self._running[key] = req
        if req.tier == "ram":  # a preemption's RAM tier: recorded in memory, storage and the actor untouched
            self._jobs[key] = self._pool.submit(_hold_in_ram, self, req)
            return
        tmp = _opened(opened)
        if tmp is not None:
            self._start(req, tmp)
        try:
            registered = self.courier.accepted(req.step, req.rank, req.attempt)
        except BaseException:
            if tmp is None:  # else the write started: it ends (its report is refused) and lets go itself
                self._running.pop(key, None)
            raise
        if tmp is None:
            self._start(req, registered)
        elif registered != tmp:  # aborted and opened again meanwhile: this write's report will be refused
            logger.warning("step %d rank %d: written into %s, but the step is now %s", req.step, req.rank, tmp,
                           registered)

    def _start(self, req: PersistRequest, tmp: str) -> None:
        """Start writing ``req`` into the step's temporary directory ``tmp`` on the pool."""
        key = (req.rank, req.step)
        self._tmp[key] = tmp
        self._jobs[key] = self._pool.submit(self._persist_and_forget, req)

    def record_stall(self, step: int, rank: int, seconds: float) -> None:
        """A rank's stall in the save of ``step``: to the actor with the node's next call."""
        self.courier.stall(step, rank, seconds)

    def holds(self, rank: int, step: int) -> bool:
        """Whether this writer still has rank ``rank``'s hand-off of ``step`` to write and report.
        False once it was reported, failed, or was lost with a previous incarnation of this actor."""
        with self.buffers.lock:
            return (rank, step) in self._running

    def wait(self, rank: int, step: int) -> str:
        """Block until rank ``rank``'s files of ``step`` are written and reported; re-raises a failure."""
        future = self._jobs.pop((rank, step))
        return future.result()

    def _persist_and_forget(self, req: PersistRequest) -> str:
        try:
            out = self._persist(req)
            self._copy_for_replica(req)
            return out
        except StagingAborted as exc:  # nobody will ask for this write: say so now
            reason = f"rank {req.rank}: {exc}"
            logger.warning("checkpoint step %d not written: %s", req.step, reason)
            self.coordinator.abort.remote(req.step, reason, req.attempt)
            raise
        finally:
            self.writes.end(req.rank, req.step)
            with self.buffers.lock:
                self._running.pop((req.rank, req.step), None)
                self.buffers.drop_stale(req, self._busy())

    def _copy_for_replica(self, req: PersistRequest) -> None:
        try:
            self.replication.after_write(req.rank, req.step)
        except Exception as exc:  # the step is written: a missing replica only means storage is the fallback
            logger.warning("no replica of rank %d step %d: %s", req.rank, req.step, exc)

    def _persist(self, req: PersistRequest) -> str:
        """Write the rank's shards from the staging buffer through the sink, record the buffer as
        the step's copy, and report."""
        t0 = time.monotonic()
        progress = self.writes.start(req.rank, req.step)
        dest = self._tmp.pop((req.rank, req.step))
        if self._sink is None:
            self._sink = pick_sink(self.root, self.storage_options, self.io_threads)
        mapped = self.buffers.mapped(req)
        staged = {**mapped.views, **pickle.loads(req.objects)}
        maybe_inject("persist", req.rank, req.step, req.attempt)
        planner = StagedPlanner(staged, _ready(req, mapped, progress))
        written = self._sink.write(dest, req.plan, planner, req.rank, req.step,
                                   on_retry=lambda: self.metrics.retried(req.rank), progress=progress)
        copy_s = _staged(req, mapped)
        if self.memory_copies >= 2:
            self.buffers.record(req, staged, mapped, written)
        t_write = time.monotonic() - t0
        if self._sink.fault_point is not None:
            maybe_inject(self._sink.fault_point, req.rank, req.step, req.attempt)
        sums = written.sums  # fingerprints, summed beside the CRC-32C as the bytes were written
        if sums is None:
            sums = shard_sums(mapped.views, {i.index.fqn for i in req.plan.items})
        return self._report(req, written, t0, t_write, req.stage_s + copy_s, sums)

    def _report(self, req: PersistRequest, written: RankFiles, t0: float, t_write: float, stage_s: float, sums: dict) -> str:
        """Record the write's phases and metrics and report the rank's files (and ``sums``) to the actor."""
        phases = {k: round(v, 6) for k, v in vars(written.phases).items()}
        timings = SaveTimings(stage_s=stage_s, persist_s=time.monotonic() - t0, write_s=t_write,
                              phases=tuple(phases.items()))
        self.metrics.wrote(req.rank, sum(f["size"] for f in written.files.values()), timings.persist_s)
        t_report = time.monotonic()
        results = RankResults.of(written.results, _sharded(self._shards, req))
        out = self._sent.send(RankReport(req.step, req.rank, req.attempt, req.plan_id, results,
                                         written.files, req.point, timings, sums), self.courier.report)
        self._last_phases[req.rank] = {**phases, "report_s": time.monotonic() - t_report}
        return out

    def committed_copy(self, rank: int, step: int | None = None) -> CommittedCopy | None:
        """The copy of rank ``rank``'s step ``step`` on this node (default: the newest committed
        step, asked of the CheckpointActor), or None. Not verified here: see ``memcopy``."""
        if step is None:
            step = ray.get(self.coordinator.latest_committed.remote())
            if step is None:
                return None
        return self.buffers.copy_of(rank, step)

    def forget_copy(self, rank: int, step: int) -> None:
        """Drop the record of rank ``rank``'s copy of ``step``: the rank refused it (its bytes no
        longer checksum), so no later restart is offered it again."""
        self.buffers.forget(rank, step)

    def write_stalls(self) -> dict[str, float]:
        """The driver's ping (``control/watch/silence.py``): each write in progress and how long it has moved no bytes."""
        return self.writes.stalls()

    def usage(self) -> WriterUsage:
        """CPU seconds this process has used (user, system) and each rank's last write's phases (benchmarks)."""
        r = resource.getrusage(resource.RUSAGE_SELF)
        return WriterUsage(r.ru_utime, r.ru_stime, dict(self._last_phases))

    # --- peer replicas (``roles/replication.py``) -------------------------------------------

    def set_peer(self, node_id: str | None, peer: ActorHandle | None) -> None:
        """Send replicas to ``peer`` (the writer on ``node_id``) from now on; None stops sending."""
        self.replication.set_peer(node_id, peer)

    def replica_begin(self, source_node: str, copy: CommittedCopy) -> None:
        self.replication.store.begin(source_node, copy)

    def replica_put(self, rank: int, step: int, offset: int, data: bytes) -> None:
        self.replication.store.put(rank, step, offset, data)

    def replica_finish(self, rank: int, step: int, crc32c: int) -> Replica:
        return self.replication.finish(rank, step, crc32c)

    def replicas_held(self) -> list[Replica]:
        """Every verified replica this writer holds (one per source rank, the newest step)."""
        return self.replication.store.held()

    def copies_held(self, step: int) -> list[Replica]:
        """The copies of ``step`` on this node: its own ranks' committed copies and its replicas."""
        return self.replication.copies_held(step)

    def replicate(self, copy: CommittedCopy, wait: bool = False) -> Replica | None:
        """Send ``copy`` (a committed copy of one of this node's ranks) to the peer, in the
        background; with ``wait``, block and return the peer's replica (None: no peer, or the
        send failed, logged)."""
        return self.replication.replicate(copy, wait)

    def push_replica(self, rank: int, step: int, to: ActorHandle, to_node: str) -> Replica:
        """Send the copy of ``rank`` at ``step`` held here (own or replica) to another writer: a
        rank restored on another node loads from there. Re-checked here first; returns the
        receiver's replica."""
        return self.replication.push(rank, step, to, to_node)

    def __repr__(self) -> str:  # the dashboard's actor list and log prefix: short and fixed (Ray computes it once)
        return f"CheckpointWriter({self.metrics.job if hasattr(self, 'metrics') else 'not started'})"


def _opened(opened: list[ray.ObjectRef] | None) -> str | None:
    if not opened:
        return None
    try:
        return ray.get(opened[0])
    except Exception as exc:  # the hand-off's own call to the actor says what is wrong, if anything
        logger.debug("opening the step ahead failed: %s", exc)
        return None


def _hold_in_ram(writer: CheckpointWriter, req: PersistRequest) -> str:
    """A RAM-tier save: once the copy is complete, record the buffer as the step's copy (its
    CRC-32C, no file) for ``roles/ramtier.py`` to push off a draining node; nothing is written."""
    try:
        t0 = time.monotonic()
        mapped = writer.buffers.mapped(req)
        copy_s = _staged(req, mapped)
        writer.buffers.record(req, {**mapped.views, **pickle.loads(req.objects)}, mapped, RankFiles())
        logger.warning("rank %d step %d held in RAM only (preemption, RAM tier): staged in %.2fs, recorded in "
                       "%.2fs", req.rank, req.step, req.stage_s + copy_s, time.monotonic() - t0)
        return "ram"
    finally:
        with writer.buffers.lock:
            writer._running.pop((req.rank, req.step), None)
            writer.buffers.drop_stale(req, writer._busy())


def _wait_staged(req: PersistRequest, mapped: Mapped, end: int) -> StageProgress:
    """Block until the trainer's copy of ``req`` has reached ``end`` (StagingAborted if it never will)."""
    progress = StageProgress(mapped.address, mapped.whole)
    progress.wait(req.token, end, lambda: is_leased(Path(req.buffer_path)))
    return progress


def _ready(req: PersistRequest, mapped: Mapped, progress: WriteProgress) -> Callable[[str], None]:
    """Before each item is handed to the write: for a request sent as its copy began, a wait for
    the copy to have reached it; then the write's progress moves (a writing path that counts no
    bytes of its own, DCP's fsspec writer, moves item by item)."""
    ends = {s.fqn: s.offset + s.nbytes for s in req.slots} if req.token else {}

    def ready(fqn: str) -> None:
        if fqn in ends:
            _wait_staged(req, mapped, ends[fqn])
        progress.advance(0)
    return ready


def _staged(req: PersistRequest, mapped: Mapped) -> float:
    """Wait until the whole buffer is staged (the plan may leave slots to other ranks; the memory
    copy and the replica are the whole buffer); returns the copy's own seconds (part of ``stage_s``)."""
    if not req.token:
        return 0.0
    return _wait_staged(req, mapped, req.buffer_bytes).copy_s()


def _sharded(shards: dict[int, tuple[str, frozenset[str]]], req: PersistRequest) -> frozenset[str]:
    """``sharded_names`` of the rank's plan (the names its reports share with other ranks'), kept
    per rank for its plan id."""
    held = shards.get(req.rank)
    if held is None or held[0] != req.plan_id:
        held = shards[req.rank] = (req.plan_id, sharded_names(req.plan))
    return held[1]
