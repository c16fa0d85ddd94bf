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

from raytrain_ckpt.checkpoint.layout import file_crc32
from raytrain_ckpt.checkpoint.staging import StagedPlanner, TensorSlot, allocate_buffer, map_buffer, slot_views
from raytrain_ckpt.faults import maybe_inject
from raytrain_ckpt.metrics import WriterMetrics

logger = logging.getLogger(__name__)

__all__ = ["CheckpointWriter", "PersistRequest", "buffer_prefix", "shm_dir"]


def buffer_prefix(job: str, root: str) -> str:
    """Names a job's staging files in /dev/shm. The checkpoint root is part of it: two jobs
    of the same name writing to different directories on one node must not share buffers (the
    end of one would unlink the other's)."""
    digest = hashlib.sha1(root.encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', job)}-{digest}"


def shm_dir() -> Path:
    """Where staging buffers live: /dev/shm when present (RAM-backed), else the temp dir."""
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


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

    def __init__(self, job: str, root: str, coordinator: Any, io_threads: int = 1, nice: int = 10) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self.prefix = buffer_prefix(job, root)
        self.coordinator = coordinator
        # Persisting is background work: let the training processes win the cores.
        os.nice(nice)
        self.io_threads = io_threads
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="rtc-writer")
        self._jobs: dict[tuple[int, int], Future] = {}
        self._running: dict[tuple[int, int], PersistRequest] = {}
        self._tmp: dict[tuple[int, int], str] = {}
        self._buffers: dict[str, int] = {}
        self._newest_attempt = 0
        self.metrics = WriterMetrics(job, ray.get_runtime_context().get_node_id()[:12])

    def allocate(self, rank: int, attempt: int, nbytes: int) -> str:
        """Create the rank's staging file for this attempt (reused across its saves).

        A restarted group gets new files: a write handed off by the previous attempt may still
        be reading its old buffer, which is unlinked once that write is done.
        """
        path = shm_dir() / f"rtc-{self.prefix}-a{attempt}-rank{rank}.buf"
        allocate_buffer(path, nbytes)
        self._buffers[str(path)] = attempt
        self._newest_attempt = max(self._newest_attempt, attempt)
        busy = {j.buffer_path for j in self._running.values()}
        for old, a in list(self._buffers.items()):
            if a < self._newest_attempt and old not in busy:
                self._unlink(old)
        return str(path)

    def release_all(self) -> None:
        """Unlink every staging file of this job on this node (the job is over), including those
        a previous incarnation of this actor created."""
        for p in shm_dir().glob(f"rtc-{self.prefix}-a*-rank*.buf"):
            self._unlink(str(p))

    def _unlink(self, path: str) -> None:
        Path(path).unlink(missing_ok=True)
        self._buffers.pop(path, None)

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
        t0 = time.monotonic()
        tmp = Path(self._tmp.pop((req.rank, req.step)))
        staged: dict[str, Any] = slot_views(map_buffer(Path(req.buffer_path), req.buffer_bytes), req.slots)
        staged.update(pickle.loads(req.objects))
        writer = FileSystemWriter(tmp, thread_count=self.io_threads, sync_files=True, overwrite=False)
        writer.set_up_storage_writer(False, rank=req.rank)
        maybe_inject("persist", req.rank, req.step, req.attempt)
        results = writer.write_data(req.plan, StagedPlanner(staged)).wait()
        t_write = time.monotonic() - t0
        prefix = req.plan.storage_data.prefix
        files = {p.name: {"size": p.stat().st_size, "crc32": file_crc32(p)}
                 for p in tmp.iterdir() if p.name.startswith(prefix)}
        info = {**req.info, "persist_s": time.monotonic() - t0, "write_s": t_write}
        self.metrics.wrote(req.rank, sum(f["size"] for f in files.values()), info["persist_s"])
        return ray.get(self.coordinator.report.remote(req.step, req.rank, req.attempt, req.plan_id,
                                                      results, files, info))
