"""What the CheckpointActor reports: its ``ActorStatus``, the in-flight metrics, and the notes
others leave with it (each save's stall, the interval chosen, the measured costs, the job's state)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from raytrain_ckpt.checkpoint.policy.interval import IntervalDecision
from raytrain_ckpt.checkpoint.records import (ActorStatus, CommittedStep, GroupLayout, IntervalChoice, JobNote,
                                              SaveCosts)
from raytrain_ckpt.checkpoint.roles import bulletin
from raytrain_ckpt.checkpoint.roles.retainer import Retainer
from raytrain_ckpt.checkpoint.roles.steps import StepRegistry, inflight_phase
from raytrain_ckpt.checkpoint.roles.metrics import CheckpointMetrics

__all__ = ["StatusBoard"]

STALLS_KEPT = 64
"""Steps whose per-rank stalls are kept (only recent steps are shown)."""


class StatusBoard:
    """Progress reporting: metrics, ``raytrain-ckpt status``, the job's notes."""

    def __init__(self, job: str, root: str, steps: StepRegistry, retainer: Retainer, metrics: CheckpointMetrics,
                 group: Callable[[], GroupLayout], planning: Callable[[], list[int]],
                 refused: Callable[[], dict[int, str]] = dict) -> None:
        """``refused``: the committed steps a restart would not resume from (``ResumeCheck.refused``)."""
        self.job, self.root, self.steps, self.retainer, self.metrics = job, root, steps, retainer, metrics
        self._group, self._planning, self._refused = group, planning, refused
        self.stalls: dict[int, dict[int, float]] = {}
        self.job_info: JobNote | None = None
        self.interval: IntervalChoice | None = None
        """The newest ``interval_steps: auto`` decision (rank 0 reports each one)."""
        self.costs: SaveCosts | None = None

    def snapshot(self) -> ActorStatus:
        steps = self.steps
        return ActorStatus(
            root=self.root, job=self.job, world_size=self._group().world_size,
            committed=sorted(steps.committed), in_flight=sorted(steps.pending), failed=dict(steps.failed),
            purge_errors=self.retainer.purge_errors, failed_saves=steps.saves.record(),
            leases=dict(Counter(self.retainer.leases.values())),
            steps={s: CommittedStep(m.total_bytes, {**m.wall, **self.stall(s)}, m.created_unix)
                   for s, m in steps.committed.items()},
            inflight=steps.inflight(self._planning()), job_info=self.job_info, at_risk=self.metrics.at_risk(),
            interval=self.interval,
            resume_refused={s: why for s, why in self._refused().items() if s in steps.committed})

    def progress(self, step: int | None = None, rank: int | None = None) -> None:
        """Publish the in-flight step's phase and ranks; ``step``, ``rank``: only that rank of the
        newest step in flight moved, so only its series and the counts are published (a save of N
        ranks makes 2N such calls: publishing every rank each time would be O(N^2) per save)."""
        steps = self.steps
        moved = steps.rank_progress(step, rank) if step is not None and rank is not None else None
        if moved is None or step != max(steps.pending):
            self.metrics.progress(steps.inflight(self._planning()), self._group().world_size)
            return
        handed_off, written, value = moved
        world = self._group().world_size
        phase = inflight_phase(step in self._planning(), handed_off, written, world)
        self.metrics.rank_moved(step, phase.value, handed_off, written, rank, value)

    def record_stall(self, step: int, rank: int, seconds: float) -> None:
        self.stalls.setdefault(step, {})[rank] = seconds
        for old in sorted(self.stalls)[:-STALLS_KEPT]:
            del self.stalls[old]

    def stall(self, step: int) -> dict[str, float]:
        """``{"stall_s": s}``: the slowest rank's stall in the save of ``step``, {} when unknown."""
        by_rank = self.stalls.get(step, {})
        return {"stall_s": max(by_rank.values())} if by_rank else {}

    def record_interval(self, step: int, decision: IntervalDecision) -> None:
        self.interval = IntervalChoice(step, decision)
        self.metrics.interval(decision.steps)

    def record_costs(self, cost_s: float | None, step_time_s: float | None) -> None:
        self.costs = SaveCosts(cost_s, step_time_s)

    def note_job(self, note: JobNote) -> None:
        self.job_info = note
        self.metrics.at_risk(note.train_step)
        bulletin.post(self.job, self.snapshot().to_dict())  # what `status --job` reads, without joining Ray
