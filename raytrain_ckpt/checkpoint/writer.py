"""CheckpointWriter: one Ray actor per node that owns the staging buffers and persists them.

Trainers map the writer's shared-memory files, copy their state in, and hand the step over
with ``persist()``. From then on the trainer is out of the picture: the writer writes the
rank's DCP shard files with its own threads, fsyncs them, checksums them and reports to the
CheckpointActor. A trainer that dies after the hand-off does not stop its step from being
committed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from raytrain_ckpt.checkpoint.buffers import OwnedBuffer, shm_dir, sweep_orphans
from raytrain_ckpt.checkpoint.dcp_storage import UploadingWriter
from raytrain_ckpt.checkpoint.layout import describe_file
from raytrain_ckpt.checkpoint.staging import StagedPlanner, TensorSlot, allocate_buffer, map_buffer, slot_views
from raytrain_ckpt.checkpoint.storage import is_transient, is_uri, retry_transient
from raytrain_ckpt.faults import maybe_inject
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
    failed to write is then missing from ``results`` and its file is short. Without this check
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


class CheckpointWriter:
    """Per-node writer actor (threaded actor; writes run on its own thread pool)."""

    def __init__(self, job: str, root: str, coordinator: Any, io_threads: int = 1, nice: int = 10,
                 storage_options: dict[str, Any] | None = None) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.prefix = buffer_prefix(job, root)
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
        self._buffers: dict[str, tuple[OwnedBuffer, int]] = {}
        """path -> (the buffer, held with its ownership lock; the attempt it was allocated for)"""
        self._newest_attempt = 0
        self.metrics = WriterMetrics(job, ray.get_runtime_context().get_node_id()[:12])
        # Buffers of writers that died (this job's previous incarnation, a job whose driver was
        # killed) hold RAM until someone removes them; a live writer's buffers are left alone.
        sweep_orphans(shm_dir())

    def allocate(self, rank: int, attempt: int, nbytes: int) -> str:
        """Create the rank's staging file for this attempt (reused across its saves).

        A restarted group gets new files: a write handed off by the previous attempt may still
        be reading its old buffer, which is unlinked once that write is done.
        """
        path = shm_dir() / f"rtc-{self.prefix}-a{attempt}-rank{rank}.buf"
        held = self._buffers.get(str(path))
        if held is None:
            self._buffers[str(path)] = (allocate_buffer(path, nbytes), attempt)
        else:  # a new layout in the same attempt
            held[0].resize(nbytes)
        self._newest_attempt = max(self._newest_attempt, attempt)
        busy = {j.buffer_path for j in self._running.values()}
        for old, (_, a) in list(self._buffers.items()):
            if a < self._newest_attempt and old not in busy:
                self._unlink(old)
        return str(path)

    def release_all(self) -> None:
        """Unlink every staging file this writer owns (the job is over), and any orphan: those a
        previous incarnation of this actor created are orphans since it died."""
        for path in list(self._buffers):
            self._unlink(path)
        sweep_orphans(shm_dir())

    def _unlink(self, path: str) -> None:
        held = self._buffers.pop(path, None)
        if held is not None:
            held[0].remove()

    def accept(self, req: PersistRequest) -> None:
        """Take over a staged step and start writing it; returns as soon as the request is held here.

        From this return on the step no longer depends on the trainer process.
        """
        self._tmp[(req.rank, req.step)] = ray.get(self.coordinator.accepted.remote(req.step, req.rank, req.attempt))
        self._running[(req.rank, req.step)] = req
        self._jobs[(req.rank, req.step)] = self._pool.submit(self._persist_and_forget, req)

    def wait(self, rank: int, step: int) -> str:
        """Block until rank ``rank``'s files of ``step`` are written and reported; re-raises a failure."""
        future = self._jobs.pop((rank, step))
        return future.result()

    def _persist_and_forget(self, req: PersistRequest) -> str:
        try:
            return self._persist(req)
        finally:
            self._running.pop((req.rank, req.step), None)
            if req.attempt < self._newest_attempt:
                self._unlink(req.buffer_path)

    def _persist(self, req: PersistRequest) -> str:
        if self.remote:
            return self._upload(req)
        t0 = time.monotonic()
        tmp = Path(self._tmp.pop((req.rank, req.step)))
        staged: dict[str, Any] = slot_views(map_buffer(Path(req.buffer_path), req.buffer_bytes), req.slots)
        staged.update(pickle.loads(req.objects))
        writer = FileSystemWriter(tmp, thread_count=self.io_threads, sync_files=True, overwrite=False)
        writer.set_up_storage_writer(False, rank=req.rank)
        maybe_inject("persist", req.rank, req.step, req.attempt)
        results = writer.write_data(req.plan, StagedPlanner(staged)).wait()
        check_written(req.plan, results, {p.name: p.stat().st_size for p in tmp.iterdir()})
        t_write = time.monotonic() - t0
        prefix = req.plan.storage_data.prefix
        files = {p.name: describe_file(p)
                 for p in tmp.iterdir() if p.name.startswith(prefix)}
        info = {**req.info, "persist_s": time.monotonic() - t0, "write_s": t_write}
        self.metrics.wrote(req.rank, sum(f["size"] for f in files.values()), info["persist_s"])
        return ray.get(self.coordinator.report.remote(req.step, req.rank, req.attempt, req.plan_id,
                                                      results, files, info))

    # --- object stores ---------------------------------------------------------------------

    def _upload(self, req: PersistRequest) -> str:
        """Stream the rank's shards from the staging buffer to the object store, checksummed on
        the way out; the whole rank is uploaded again on a transient error (the buffer is intact)."""
        t0 = time.monotonic()
        dest = self._tmp.pop((req.rank, req.step))
        staged: dict[str, Any] = slot_views(map_buffer(Path(req.buffer_path), req.buffer_bytes), req.slots)
        staged.update(pickle.loads(req.objects))
        maybe_inject("persist", req.rank, req.step, req.attempt)
        files, results = retry_transient(lambda: self._upload_once(req, dest, staged),
                                         f"upload of rank {req.rank} step {req.step}",
                                         on_retry=lambda exc: self.metrics.retried(req.rank), transient=_retryable)
        t_write = time.monotonic() - t0
        maybe_inject("uploaded", req.rank, req.step, req.attempt)
        info = {**req.info, "persist_s": time.monotonic() - t0, "write_s": t_write}
        self.metrics.wrote(req.rank, sum(f["size"] for f in files.values()), info["persist_s"])
        return ray.get(self.coordinator.report.remote(req.step, req.rank, req.attempt, req.plan_id,
                                                      results, files, info))

    def _upload_once(self, req: PersistRequest, dest: str, staged: dict[str, Any]) -> tuple[dict, list]:
        writer = UploadingWriter(dest, self.storage_options, self.io_threads)
        writer.set_up_storage_writer(False, rank=req.rank)
        results = writer.write_data(req.plan, StagedPlanner(staged)).wait()
        check_written(req.plan, results, {name: f["size"] for name, f in writer.files.items()})
        prefix = req.plan.storage_data.prefix
        return {n: f for n, f in writer.files.items() if n.startswith(prefix)}, results


def _retryable(exc: BaseException) -> bool:
    """Upload errors worth another try: transient ones, and a write that an I/O thread dropped
    (DCP loses those threads' exceptions, so check_written's OSError may hide a transient one)."""
    if isinstance(exc, (FileNotFoundError, PermissionError)):
        return False
    return is_transient(exc) or isinstance(exc, OSError)
