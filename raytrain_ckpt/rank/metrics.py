"""The rank's metrics (each TrainWorker): training progress after every step, the stall each save
cost, the training guard's rollbacks. Names and help texts: ``observe/metrics.py``'s ``METRICS``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raytrain_ckpt.observe import metrics as exported

if TYPE_CHECKING:
    from raytrain_ckpt.rank.trainer import StepReport

__all__ = ["TrainerMetrics"]


class TrainerMetrics:
    """Per rank: training progress after every step, and the stall each save cost."""

    def __init__(self, job: str, rank: int) -> None:
        self.job, self.rank = job, rank
        self._tags = {"job": job, "rank": str(rank)}
        self._saves = 0

    def after_step(self, report: StepReport, ckpt: Any | None) -> None:
        """Record ``report``; with checkpointing, the stall of a save made at this step
        (what ``save()`` blocked the training thread: flatten, planning, a busy previous save)."""
        exported.record("train_step", report.step, self._tags)
        exported.record("train_step_seconds", report.step_time_s, self._tags)
        exported.record("train_tokens_per_second", report.tokens_per_s, self._tags)
        if report.loss is not None and self.rank == 0:
            exported.record("train_loss", report.loss, {"job": self.job})
        if report.eval_loss is not None and self.rank == 0:
            exported.record("eval_loss", report.eval_loss, {"job": self.job})
        if ckpt is None:
            return
        stats = ckpt.stats
        if stats.saves > self._saves:
            self._saves = stats.saves
            exported.record("checkpoint_stall_seconds", stats.last_stall_s, self._tags)
            exported.record("checkpoint_last_stall_seconds", stats.last_stall_s, self._tags)

    def rolled_back(self, rollback: Any) -> None:
        """A rollback of the training guard (``guard.RollbackRecord``; None: the trip ended the job)."""
        if rollback is None or self.rank != 0:
            return
        exported.record("train_rollbacks_total", 1, {"job": self.job})
        exported.record("train_skipped_samples_total", rollback.samples[1] - rollback.samples[0], {"job": self.job})
