"""The checkpoint roles' metrics: the CheckpointActor's (steps, phases, bytes, the work a failure
would lose) and each node's CheckpointWriter's (what it wrote and sent for each rank). Names and
help texts: ``observe/metrics.py``'s ``METRICS``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from raytrain_ckpt.checkpoint.records import InFlight, WorkAtRisk
from raytrain_ckpt.observe import metrics as exported
from raytrain_ckpt.observe.metrics import PHASES

if TYPE_CHECKING:
    from raytrain_ckpt.checkpoint.format.manifest import Manifest

__all__ = ["CheckpointMetrics", "WriterMetrics"]


class WriterMetrics:
    """Per node: what the writer wrote for each rank."""

    def __init__(self, job: str, node: str) -> None:
        self.job, self.node = job, node

    def wrote(self, rank: int, nbytes: int, seconds: float) -> None:
        tags = {"job": self.job, "rank": str(rank), "node": self.node}
        exported.record("checkpoint_rank_bytes_written_total", nbytes, tags)
        exported.record("checkpoint_rank_write_seconds", seconds, tags)

    def replicated(self, rank: int, step: int, nbytes: int, seconds: float) -> None:
        """Rank ``rank``'s copy of ``step`` reached the peer node, verified there."""
        tags = {"job": self.job, "rank": str(rank), "node": self.node}
        exported.record("checkpoint_replica_step", step, tags)
        exported.record("checkpoint_replica_seconds", seconds, tags)
        exported.record("checkpoint_replica_bytes_total", nbytes, tags)

    def replica_failed(self, rank: int) -> None:
        """A send of rank ``rank``'s copy to the peer node failed (the step stays committed on storage)."""
        exported.record("checkpoint_replica_failures_total", 1, {"job": self.job, "rank": str(rank), "node": self.node})

    def retried(self, rank: int) -> None:
        """An upload to an object store failed with a transient error and is tried again."""
        exported.record("checkpoint_rank_upload_retries_total", 1, {"job": self.job, "rank": str(rank), "node": self.node})


class CheckpointMetrics:
    """The CheckpointActor's view: steps, phases, bytes, and the work a failure would lose."""

    def __init__(self, job: str) -> None:
        self.job = job
        self._tags = {"job": job}
        self.train_step = 0
        """The newest training step the driver reported (``note_job``)."""
        self.started = time.time()
        self.commit_unix = 0.0
        self.committed_step = -1
        self._ranks: set[int] = set()

    def start(self, committed: dict[int, Manifest], failed_in_a_row: int = 0) -> None:
        """Publish what storage holds when the actor (re)starts; ``failed_in_a_row``: the failed
        saves since the last commit that an earlier actor of the run recorded."""
        if committed:
            newest = committed[max(committed)]
            self.committed_step, self.commit_unix = newest.step, newest.created_unix
        exported.record("checkpoint_committed_step", self.committed_step, self._tags)
        exported.record("checkpoint_last_commit_timestamp_seconds", self.commit_unix, self._tags)
        exported.record("checkpoint_consecutive_failed_saves", failed_in_a_row, self._tags)
        self.progress(InFlight(), 0)

    def progress(self, inflight: InFlight, world_size: int) -> None:
        """The in-flight step (None: none), its phase and each rank's progress (0, 1, 2)."""
        step, phase, ranks = inflight.step, inflight.phase_name, inflight.ranks
        values = list(ranks.values())
        self._inflight(step, phase, sum(v >= 1 for v in values), sum(v >= 2 for v in values))
        self._ranks |= set(range(world_size))
        for rank in sorted(self._ranks):
            exported.record("checkpoint_rank_progress", ranks.get(rank, 0), {**self._tags, "rank": str(rank)})

    def rank_moved(self, step: int, phase: str, handed_off: int, written: int, rank: int, value: int) -> None:
        """One rank of the in-flight step moved on: the counts and that rank's series only."""
        self._inflight(step, phase, handed_off, written)
        self._ranks.add(rank)
        exported.record("checkpoint_rank_progress", value, {**self._tags, "rank": str(rank)})

    def _inflight(self, step: int | None, phase: str, handed_off: int, written: int) -> None:
        exported.record("checkpoint_inflight_step", -1 if step is None else step, self._tags)
        for p in PHASES:
            exported.record("checkpoint_inflight_phase", int(p == phase), {**self._tags, "phase": p})
        exported.record("checkpoint_inflight_ranks", handed_off, {**self._tags, "stage": "handed_off"})
        exported.record("checkpoint_inflight_ranks", written, {**self._tags, "stage": "written"})

    def planned(self, seconds: float) -> None:
        exported.record("checkpoint_phase_seconds", seconds, {**self._tags, "phase": "plan"})

    def committed(self, manifest: Manifest) -> None:
        """A step committed: its phases, size and throughput; it is the new resume point."""
        for phase in ("stage", "write", "persist", "commit", "total"):
            if f"{phase}_s" in manifest.wall:
                exported.record("checkpoint_phase_seconds", manifest.wall[f"{phase}_s"], {**self._tags, "phase": phase})
        nbytes = manifest.total_bytes
        exported.record("checkpoint_last_bytes", nbytes, self._tags)
        exported.record("checkpoint_bytes_written_total", nbytes, self._tags)
        exported.record("checkpoint_commits_total", 1, self._tags)
        exported.record("checkpoint_consecutive_failed_saves", 0, self._tags)
        total = manifest.wall.get("total_s", 0.0)
        if total > 0:
            exported.record("checkpoint_throughput_bytes_per_second", nbytes / total, self._tags)
        if manifest.step >= self.committed_step:
            self.committed_step, self.commit_unix = manifest.step, manifest.created_unix
            exported.record("checkpoint_committed_step", manifest.step, self._tags)
            exported.record("checkpoint_last_commit_timestamp_seconds", manifest.created_unix, self._tags)
        self.at_risk()

    def aborted(self) -> None:
        exported.record("checkpoint_aborted_total", 1, self._tags)

    def interval(self, steps: int) -> None:
        """The interval ``interval_steps: auto`` chose."""
        exported.record("checkpoint_interval_steps", steps, self._tags)

    def save_failed(self, consecutive: int) -> None:
        """A step's save failed; ``consecutive``: failed saves since the last commit, this one included."""
        exported.record("checkpoint_failed_saves_total", 1, self._tags)
        exported.record("checkpoint_consecutive_failed_saves", consecutive, self._tags)

    def purged(self, count: int) -> None:
        exported.record("checkpoint_purged_total", count, self._tags)

    def at_risk(self, train_step: int | None = None) -> WorkAtRisk:
        """Seconds and steps since the newest commit; recorded and returned."""
        if train_step is not None:
            self.train_step = train_step
        since = self.commit_unix or self.started
        risk = WorkAtRisk(seconds=max(0.0, time.time() - since),
                          steps=max(0, self.train_step - max(self.committed_step, 0)))
        exported.record("work_at_risk_seconds", risk.seconds, self._tags)
        exported.record("work_at_risk_steps", risk.steps, self._tags)
        return risk
