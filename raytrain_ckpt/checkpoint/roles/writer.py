"""CheckpointWriter: one Ray actor per node that owns the staging buffers and persists them.

Trainers map the writer's shared-memory files, copy their state in, and hand the step over
with ``accept()`` as the copy starts. The writer writes the rank's DCP shard files with its own
threads straight from the buffer, each tensor as soon as the copy has reached it
(``staging.StageProgress``), checksumming them as it writes (``checkpoint/datapath/filewrite.py``,
``O_DIRECT``), fsyncs them and reports to the CheckpointActor. Once the copy is complete the
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
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from raytrain_ckpt.checkpoint.datapath.buffers import OwnedBuffer, StagingFileError, is_leased, shm_dir, sweep_orphans
from raytrain_ckpt.checkpoint.storage.dcp import UploadingWriter
from raytrain_ckpt.checkpoint.datapath.filewrite import RankFiles, write_rank_files
from raytrain_ckpt.checkpoint.format.crc import address_of, region_crc
from raytrain_ckpt.checkpoint.records import RankReport, SaveTimings, TrainingPoint, WriterRef
from raytrain_ckpt.checkpoint.recovery.memcopy import CommittedCopy
from raytrain_ckpt.checkpoint.storage.probe import NodeProbe, local_root, probe_name
from raytrain_ckpt.checkpoint.datapath.replica import ReplicaEndpoint
from raytrain_ckpt.checkpoint.datapath.staging import (StagedPlanner, StageProgress, StagingAborted, TensorSlot, allocate_buffer,
                                              layout_key, map_whole, populate_range, views_of)
from raytrain_ckpt.checkpoint.storage.backends import is_transient, is_uri, object_filesystem, replace_file, retry_transient
from raytrain_ckpt.checkpoint.datapath.upload import is_s3, upload_rank_files
from raytrain_ckpt.faults import adopt_fault_env, maybe_inject
from raytrain_ckpt.logs import setup_logging
from raytrain_ckpt.metrics import WriterMetrics

logger = logging.getLogger(__name__)

__all__ = ["CheckpointWriter", "PersistRequest", "buffer_prefix", "check_written", "shm_dir"]


def buffer_prefix(job: str, root: str) -> str:
    """Names a job's staging files in /dev/shm. The checkpoint root is part of it: two jobs
    of the same name writing to different directories on one node must not share buffers (the
    end of one would unlink the other's)."""
    digest = hashlib.sha1(root.encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', job)}-{digest}"


def check_written(plan: SavePlan, results: list[WriteResult], sizes: dict[str, int]) -> None:
    """Raise OSError unless every planned write has a result whose bytes are all in its file.

    DCP's I/O threads other than the caller's drop their exceptions (ENOSPC, EIO): what they
    failed to write is then missing from ``results`` and its file is short. The local writer
    (``filewrite``) raises instead; this check stays as the last line before a report. Without this check
    the short file's real size and CRC-32 would go into the manifest of a step that cannot load.
    ``sizes``: file name -> bytes on disk, for the files of this rank.
    """
    missing = {item.index for item in plan.items} - {r.index for r in results}
    if missing or len(results) != len(plan.items):
        raise OSError(f"{len(missing)} of {len(plan.items)} planned writes have no result ({len(results)} results): "
                      "an I/O thread failed (disk full? I/O error? see the writer's log)")
    for r in results:
        where = r.storage_data
        size, end = sizes.get(where.relative_path, -1), where.offset + where.length
        if size < end:
            raise OSError(f"{where.relative_path}: {size} bytes on disk, the write of {r.index.fqn} ends at {end}")


@dataclass
class _Held:
    """A staging buffer this writer owns (holding its ownership lock), and whose it is now."""

    buffer: OwnedBuffer
    rank: int
    attempt: int
    copy: int = 0
    """Which of the rank's ``checkpoint.memory_copies`` buffers it is."""
    record: CommittedCopy | None = None
    """The step it holds, as written from it (None: nothing written from it since it was last staged into)."""


@dataclass(frozen=True)
class _Mapped:
    """A staging buffer as the writer maps it: the whole file, its address, and a view per slot."""

    whole: memoryview
    address: int
    views: dict[str, Any]


@dataclass(frozen=True)
class PersistRequest:
    """One rank's staged step, handed from the trainer to its node's writer."""

    step: int
    rank: int
    attempt: int
    plan_id: str
    buffer_path: str
    buffer_bytes: int
    slots: list[TensorSlot]
    objects: bytes
    """Pickled non-tensor entries of the flat state dict (small: counters, scheduler, RNG)."""
    plan: SavePlan
    info: dict[str, float]
    """stage_s, samples_seen, tokens_seen: recorded in the manifest."""
    token: int = 0
    """The save's name in the buffer's ``StageProgress``: the request was sent as the copy began,
    and the writer waits for each tensor's bytes to be staged before writing them (0: the copy was
    complete before the request was sent)."""


class CheckpointWriter(ReplicaEndpoint):
    """Per-node writer actor (threaded actor; writes run on its own thread pool). It also holds
    and sends peer replicas (``checkpoint/datapath/replica.py``)."""

    def __init__(self, job: str, root: str, coordinator: Any, io_threads: int = 1, nice: int = 10,
                 storage_options: dict[str, Any] | None = None, memory_copies: int = 1,
                 replica_mb_per_s: float | None = None, fault_env: dict[str, str] | None = None) -> None:
        setup_logging()
        adopt_fault_env(fault_env)  # an argument, not a runtime_env: see TrainWorker.__init__
        self.memory_copies = memory_copies
        """With 2, every written step's buffer is checksummed and recorded (``committed_copy``)."""
        self.prefix = buffer_prefix(job, root)
        self.root = root
        self.remote = is_uri(root)
        """An object store: shards are uploaded from the staging buffer (``_upload``)."""
        self.storage_options = dict(storage_options or {})
        self.coordinator = coordinator
        # Persisting is background work: let the training processes win the cores.
        os.nice(nice)
        self.io_threads = io_threads
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="rtc-writer")
        self._jobs: dict[tuple[int, int], Future] = {}
        self._running: dict[tuple[int, int], PersistRequest] = {}
        self._tmp: dict[tuple[int, int], str] = {}
        self._buffers: dict[str, _Held] = {}
        self._views: dict[str, tuple[tuple, _Mapped]] = {}
        """path -> (layout, the buffer mapped): mapped once, not on every save (page faults cost CPU)."""
        self._premapped: dict[str, tuple[int, memoryview]] = {}
        """path -> (bytes, mapping) of a buffer mapped ahead of its first write (``_reserve``)."""
        self._lock = threading.Lock()
        """Orders allocate() (which hands buffers to attempts) against accept() (which checks them)."""
        self._newest_attempt = 0
        self._last_phases: dict[int, dict[str, float]] = {}
        self.metrics = WriterMetrics(job, ray.get_runtime_context().get_node_id()[:12])
        # Buffers of writers that died (this job's previous incarnation, a job whose driver was
        # killed) hold RAM until someone removes them; a live writer's buffers are left alone.
        sweep_orphans(shm_dir())
        self._init_replicas(shm_dir(), replica_mb_per_s)

    def write_probe(self, nonce: str) -> NodeProbe | None:
        """Write this node's shared-storage probe under the root (see checkpoint/storage/probe.py);
        None for an object-store root, which needs none."""
        local = local_root(self.root)
        if local is None:
            return None
        node_id = ray.get_runtime_context().get_node_id()
        path = Path(local) / probe_name(node_id, nonce)
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, node_id.encode("ascii"))
        return NodeProbe(node_id, ray.util.get_node_ip_address(), path.name)

    def remove_probe(self, name: str) -> None:
        """Remove this node's probe (only this node can: its disk may be private)."""
        local = local_root(self.root)
        if local is not None:
            (Path(local) / name).unlink(missing_ok=True)

    def allocate(self, rank: int, attempt: int, nbytes: int, copy: int = 0) -> str:
        """The rank's staging file number ``copy`` for this attempt (reused across its saves).

        A restarted group reuses the previous attempt's buffer of the rank (its pages are
        allocated already: the first save after a restart costs what any save costs) unless
        a write is still reading it or a process of the old attempt still leases it; then it
        gets a new file. Older attempts' buffers are unlinked once a write of the newest attempt
        is done (by then its ranks have claimed what they reuse) and nothing reads them.
        """
        with self._lock:
            path = self._held_for(rank, attempt, copy) or self._reusable(rank, attempt)
            if path is None:
                suffix = f"-c{copy}" if copy else ""
                path = str(shm_dir() / f"rtc-{self.prefix}-a{attempt}-rank{rank}{suffix}.buf")
                self._buffers[path] = _Held(allocate_buffer(Path(path), nbytes), rank, attempt, copy)
                if copy:  # not staged into before the next save: allocate and map its memory meanwhile
                    self._pool.submit(self._reserve, path, self._buffers[path].buffer, nbytes)
            else:  # the same attempt with a new layout, or a new attempt reusing the rank's buffer
                held = self._buffers[path]
                if held.record is not None and held.record.nbytes != nbytes:
                    held.record = None  # a new layout: what it held is no longer a copy of anything
                held.buffer.resize(nbytes)
                self._premapped.pop(path, None)  # a mapping past a shrunk file's end would fault on access
                held.attempt, held.copy = attempt, copy
            self._newest_attempt = max(self._newest_attempt, attempt)
            return path

    def _reserve(self, path: str, buffer: OwnedBuffer, nbytes: int) -> None:
        """Allocate a new buffer's memory off the trainer's path: otherwise the first copy into it
        (the second save of an attempt) pays for allocating every page while it overlaps a
        training step. Only for a buffer nobody stages into yet: a page fault in a range being
        allocated waits for the allocation, which runs at the writer's low priority.

        Then map it here, every page populated in one call: the write from it (that second save)
        would otherwise take a page fault per 4 KiB page while it reads (65,536 per 256 MiB,
        about 0.2 s more persist time at the writer's priority). The call runs without the GIL
        (``populate_range``): the first save's writes are running in this process meanwhile."""
        try:
            buffer.reserve()
            whole = map_whole(Path(path), nbytes)  # populated without the GIL: writes run beside it
            populate_range(address_of(whole), nbytes)
        except OSError as exc:  # visible here first; the save that stages into it meets the same shortage
            logger.warning("staging buffer %s: could not allocate its memory ahead: %s", buffer.path, exc)
            return
        except StagingFileError as exc:  # gone or resized meanwhile: the write maps it itself
            logger.debug("staging buffer %s not mapped ahead: %s", path, exc)
            return
        with self._lock:
            if path in self._buffers:
                self._premapped[path] = (nbytes, whole)

    def _busy(self) -> set[str]:
        return {j.buffer_path for j in self._running.values()}

    def _held_for(self, rank: int, attempt: int, copy: int) -> str | None:
        return next((p for p, h in self._buffers.items()
                     if (h.rank, h.attempt, h.copy) == (rank, attempt, copy)), None)

    def _reusable(self, rank: int, attempt: int) -> str | None:
        """An older attempt's buffer of ``rank`` that no write reads and no live process stages into."""
        busy = self._busy()
        for path, held in self._buffers.items():
            if held.rank == rank and held.attempt < attempt and path not in busy and not is_leased(Path(path)):
                return path
        return None

    def release_all(self) -> None:
        """Unlink every staging file this writer owns (the job is over), and any orphan: those a
        previous incarnation of this actor created are orphans since it died."""
        for path in list(self._buffers):
            self._unlink(path)
        self._release_replicas()
        sweep_orphans(shm_dir())

    def _unlink(self, path: str) -> None:
        self._views.pop(path, None)
        self._premapped.pop(path, None)
        held = self._buffers.pop(path, None)
        if held is not None:
            held.buffer.remove()

    def accept(self, req: PersistRequest, opened: list[ray.ObjectRef] | None = None) -> None:
        """Take over a step being staged and start writing it; returns once the CheckpointActor
        knows this writer holds it.

        From this return on, and once the trainer's copy is complete (``req.token``), the step no
        longer depends on the trainer process. A trainer whose copy fails or that goes away before
        its copy is complete loses the step: the write stops and the step is aborted.

        ``opened``: the trainer's call opening the step (``CheckpointActor.open_step``, made while
        it planned and started its copy). With its reply, the step's temporary directory, the
        write starts at once, while the actor is told of the hand-off; without one (the call
        failed: the actor was restarting, the step was aborted) it starts after that.
        """
        tmp = self._opened(opened)
        key = (req.rank, req.step)
        with self._lock:
            held = self._buffers.get(req.buffer_path)
            if held is None or held.attempt != req.attempt:
                # A late hand-off of an earlier attempt: its buffer was given to a newer one (or is gone).
                raise StagingFileError(f"step {req.step} rank {req.rank}: staging buffer {req.buffer_path} no longer "
                                       f"belongs to attempt {req.attempt}; this save is dropped")
            held.record = None  # the trainer staged over whatever it held
            self._running[key] = req
        if tmp is not None:
            self._start(req, tmp)
        try:
            me = ray.get_runtime_context()
            registered = ray.get(self.coordinator.accepted.remote(req.step, req.rank, req.attempt,
                                                                  WriterRef(me.current_actor, me.get_node_id())))
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

    @staticmethod
    def _opened(opened: list[ray.ObjectRef] | None) -> str | None:
        if not opened:
            return None
        try:
            return ray.get(opened[0])
        except Exception as exc:  # the hand-off's own call to the actor says what is wrong, if anything
            logger.debug("opening the step ahead failed: %s", exc)
            return None

    def holds(self, rank: int, step: int) -> bool:
        """Whether this writer still has rank ``rank``'s hand-off of ``step`` to write and report.
        False once it was reported, failed, or was lost with a previous incarnation of this actor."""
        with self._lock:
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
            with self._lock:
                self._running.pop((req.rank, req.step), None)
                self._drop_stale(req)

    def _copy_for_replica(self, req: PersistRequest) -> None:
        try:
            self._after_write(req.rank, req.step)
        except Exception as exc:  # the step is written: a missing replica only means storage is the fallback
            logger.warning("no replica of rank %d step %d: %s", req.rank, req.step, exc)

    def _drop_stale(self, done: PersistRequest) -> None:
        """Unlink older attempts' buffers nobody reads, once the write ``done`` no longer reads its own.

        Only after a write of the newest attempt (or of the buffer's own old attempt): unlinking
        as soon as a new attempt appears would free a buffer its next rank is about to reuse.
        """
        busy = self._busy()
        for path, held in list(self._buffers.items()):
            stale = held.attempt < self._newest_attempt and path not in busy
            if stale and (done.attempt == self._newest_attempt or path == done.buffer_path):
                self._unlink(path)

    def _persist(self, req: PersistRequest) -> str:
        if self.remote:
            return self._upload(req)
        t0 = time.monotonic()
        tmp = Path(self._tmp.pop((req.rank, req.step)))
        mapped = self._mapped(req)
        staged = {**mapped.views, **pickle.loads(req.objects)}
        maybe_inject("persist", req.rank, req.step, req.attempt)
        ready = self._ready(req, mapped)
        written = write_rank_files(tmp, req.plan, StagedPlanner(staged, ready).resolve_data, self.io_threads)
        check_written(req.plan, written.results, {p.name: p.stat().st_size for p in tmp.iterdir()})
        self._staged(req, mapped)
        self._record(req, staged, mapped, written)
        t_write = time.monotonic() - t0
        return self._report(req, written, t0, t_write)

    @staticmethod
    def _wait_staged(req: PersistRequest, mapped: _Mapped, end: int) -> StageProgress:
        """Block until the trainer's copy of ``req`` has reached ``end`` (StagingAborted if it never will)."""
        progress = StageProgress(mapped.address, mapped.whole)
        progress.wait(req.token, end, lambda: is_leased(Path(req.buffer_path)))
        return progress

    def _ready(self, req: PersistRequest, mapped: _Mapped) -> Callable[[str], None] | None:
        """For a request sent as its copy began: a wait, per tensor, for the copy to have reached it."""
        if not req.token:
            return None
        ends = {s.fqn: s.offset + s.nbytes for s in req.slots}

        def ready(fqn: str) -> None:
            if fqn in ends:
                self._wait_staged(req, mapped, ends[fqn])
        return ready

    def _staged(self, req: PersistRequest, mapped: _Mapped) -> None:
        """Wait until the whole buffer is staged (the plan may leave slots to other ranks; the memory
        copy and the replica are the whole buffer), and add the copy's time to ``stage_s``."""
        if req.token:
            progress = self._wait_staged(req, mapped, req.buffer_bytes)
            req.info["stage_s"] = req.info.get("stage_s", 0.0) + progress.copy_s()

    def _report(self, req: PersistRequest, written: RankFiles, t0: float, t_write: float) -> str:
        """Record the write's phases and metrics and report the rank's files to the CheckpointActor."""
        phases = {k: round(v, 6) for k, v in vars(written.phases).items()}
        info = {**req.info, **phases, "persist_s": time.monotonic() - t0, "write_s": t_write}
        self.metrics.wrote(req.rank, sum(f["size"] for f in written.files.values()), info["persist_s"])
        t_report = time.monotonic()
        i = req.info
        point = TrainingPoint(int(i.get("samples_seen", 0)), int(i.get("tokens_seen", 0)), i.get("loss"),
                              i.get("eval_loss"))
        timings = SaveTimings(info["stage_s"], info["persist_s"], t_write, tuple(phases.items()))
        out = ray.get(self.coordinator.report.remote(RankReport(req.step, req.rank, req.attempt, req.plan_id,
                                                                written.results, written.files, point, timings)))
        self._last_phases[req.rank] = {**phases, "report_s": time.monotonic() - t_report}
        return out

    def _mapped(self, req: PersistRequest) -> _Mapped:
        layout = (req.buffer_bytes, tuple(req.slots))
        cached = self._views.get(req.buffer_path)
        if cached is None or cached[0] != layout:
            with self._lock:
                ahead = self._premapped.pop(req.buffer_path, None)
            whole = ahead[1] if ahead is not None and ahead[0] == req.buffer_bytes else \
                map_whole(Path(req.buffer_path), req.buffer_bytes)
            cached = (layout, _Mapped(whole, address_of(whole), views_of(whole, req.slots)))
            self._views[req.buffer_path] = cached
        return cached[1]

    def _record(self, req: PersistRequest, staged: dict[str, Any], mapped: _Mapped, written: RankFiles) -> None:
        """Remember the buffer as the copy of ``req.step`` (with ``memory_copies`` >= 2), before the
        step is reported, so a committed step's copy is always recorded first.

        The buffer's CRC-32C comes from the checksums the write took of the chunks it wrote
        straight from the buffer (``crc.region_crc``): only the bytes no write covered (slot
        padding, slots the plan gave to another rank) are read again. So the record says what
        was written, and costs no second pass over the buffer on the way to the report.
        """
        if self.memory_copies < 2:
            return
        objects = [k for k in staged if k not in {s.fqn for s in req.slots}]
        crc = region_crc(mapped.whole, mapped.address, written.spans)
        copy = CommittedCopy(req.step, req.rank, layout_key(req.slots, objects), req.buffer_bytes, list(req.slots),
                             req.objects, crc, req.buffer_path,
                             {name: {"size": f["size"], "crc32c": f["crc32c"]} for name, f in written.files.items()},
                             ray.get_runtime_context().get_node_id())
        with self._lock:
            held = self._buffers.get(req.buffer_path)
            if held is not None and held.attempt == req.attempt:
                held.record = copy

    def committed_copy(self, rank: int, step: int | None = None) -> CommittedCopy | None:
        """The copy of rank ``rank``'s step ``step`` on this node (default: the newest committed
        step, asked of the CheckpointActor), or None. Not verified here: see ``memcopy``."""
        if step is None:
            step = ray.get(self.coordinator.latest_committed.remote())
            if step is None:
                return None
        with self._lock:
            return next((h.record for h in self._buffers.values()
                         if h.rank == rank and h.record is not None and h.record.step == step), None)

    def forget_copy(self, rank: int, step: int) -> None:
        """Drop the record of rank ``rank``'s copy of ``step``: the rank refused it (its bytes no
        longer checksum), so no later restart is offered it again."""
        with self._lock:
            for held in self._buffers.values():
                if held.rank == rank and held.record is not None and held.record.step == step:
                    held.record = None

    def usage(self) -> dict[str, Any]:
        """CPU seconds this writer process has used (user, system) and, per rank, the phases of its
        last write: for benchmarks and diagnosis."""
        r = resource.getrusage(resource.RUSAGE_SELF)
        return {"user_s": r.ru_utime, "system_s": r.ru_stime, "last": dict(self._last_phases)}

    # --- object stores ---------------------------------------------------------------------

    def _upload(self, req: PersistRequest) -> str:
        """Stream the rank's shards from the staging buffer to the object store, checksummed on
        the way out; the whole rank is uploaded again on a transient error (the buffer is intact)."""
        t0 = time.monotonic()
        dest = self._tmp.pop((req.rank, req.step))
        mapped = self._mapped(req)
        staged = {**mapped.views, **pickle.loads(req.objects)}
        maybe_inject("persist", req.rank, req.step, req.attempt)
        ready = self._ready(req, mapped)
        written = retry_transient(lambda: self._upload_once(req, dest, staged, ready),
                                  f"upload of rank {req.rank} step {req.step}",
                                  on_retry=lambda exc: self.metrics.retried(req.rank), transient=_retryable)
        self._staged(req, mapped)
        self._record(req, staged, mapped, written)
        t_write = time.monotonic() - t0
        maybe_inject("uploaded", req.rank, req.step, req.attempt)
        return self._report(req, written, t0, t_write)

    def _upload_once(self, req: PersistRequest, dest: str, staged: dict[str, Any],
                     ready: Callable[[str], None] | None) -> RankFiles:
        fs = object_filesystem(dest, self.storage_options)
        planner = StagedPlanner(staged, ready)
        if is_s3(fs):  # parts in parallel from the staging buffer (checkpoint/datapath/upload.py)
            written = upload_rank_files(fs, dest, req.plan, planner.resolve_data, self.io_threads)
        else:
            writer = UploadingWriter(dest, self.storage_options, self.io_threads)
            writer.set_up_storage_writer(False, rank=req.rank)
            written = RankFiles(results=writer.write_data(req.plan, planner).wait(), files=writer.files)
        check_written(req.plan, written.results, {name: f["size"] for name, f in written.files.items()})
        prefix = req.plan.storage_data.prefix
        written.files = {n: f for n, f in written.files.items() if n.startswith(prefix)}
        return written


def _retryable(exc: BaseException) -> bool:
    """Upload errors worth another try: transient ones, and a write that an I/O thread dropped
    (DCP loses those threads' exceptions, so check_written's OSError may hide a transient one)."""
    if isinstance(exc, (FileNotFoundError, PermissionError, StagingAborted)):
        return False
    return is_transient(exc) or isinstance(exc, OSError)
