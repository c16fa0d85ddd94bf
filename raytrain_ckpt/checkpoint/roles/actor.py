"""CheckpointActor: one per job, the DCP coordinator and the registry of committed steps.

A facade the driver turns into a Ray actor (and tests drive as a plain object): its remote
methods delegate to one member per concern. ``SaveCoordinator`` plans each layout and commits
each step; ``StepRegistry`` knows every step and its ``StepPhase``; ``ResumeTimeline`` picks
where an attempt starts and moves aside what a new timeline leaves behind; ``Retainer`` runs
retention after each commit, off the training path, honouring leases; ``StatusBoard`` reports.
All of its state that matters survives a restart because it is rebuilt from the checkpoint
directory (the group's layout from ``.group.json``, the run's failed saves from
``.failed-saves.json``).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import ray
from torch.distributed.checkpoint.planner import SavePlan

from raytrain_ckpt.checkpoint.policy.interval import IntervalDecision
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy
from raytrain_ckpt.checkpoint.records import (ActorStatus, CentralPlan, FileSum, GroupLayout, JobNote, NodeAnswer, NodeBatch,
                                              ProbesSeen, RankReport, ResumePoint, SaveCosts, WriterRef)
from raytrain_ckpt.checkpoint.roles.board import StatusBoard
from raytrain_ckpt.checkpoint.roles.coordinator import SaveCoordinator
from raytrain_ckpt.checkpoint.roles.groupfile import GROUP_FILE, GroupFile
from raytrain_ckpt.checkpoint.roles.resumecheck import ResumeCheck
from raytrain_ckpt.checkpoint.roles.retainer import Retainer, out_of_space
from raytrain_ckpt.checkpoint.roles.seals import SealedChecks
from raytrain_ckpt.checkpoint.roles.steps import FailedSavesFile, StepRegistry
from raytrain_ckpt.checkpoint.roles.timeline import ResumeTimeline
from raytrain_ckpt.checkpoint.format.manifest import Manifest
from raytrain_ckpt.checkpoint.format.verify import Verify
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout, LEFTOVER_GRACE_S
from raytrain_ckpt.checkpoint.storage.leases import LeaseFiles
from raytrain_ckpt.common.faults import adopt_fault_env
from raytrain_ckpt.common.logs import setup_logging
from raytrain_ckpt.checkpoint.roles.metrics import CheckpointMetrics

logger = logging.getLogger(__name__)

__all__ = ["GROUP_FILE", "CheckpointActor", "actor_concurrency"]


def actor_concurrency(world: int) -> int:
    """How many calls the actor runs at once for a group of ``world`` ranks (its ``max_concurrency``).

    A rank can hold a few calls waiting in it at once: the first save's ``plan`` waits for every
    rank's plan, ``open_step`` and a final save's ``wait_committed`` for the step, a restart's
    ``acquire`` for the check of the newest step. Ray runs at most 1,000 calls of an async actor at
    once by default, so a first save of more than 1,000 ranks had 1,000 ``plan`` calls waiting for
    ranks whose calls were queued behind them, until the plan's timeout aborted the save (measured:
    1,000 of 4,096 ranks arrived in 600 s, ``bench/scale.py --calls-only --ray``). Waiting calls are
    coroutines, not threads: the limit costs nothing until calls arrive."""
    return 1000 + 4 * world

RESTART_RETRIES = 3
"""How many restarts of this actor a call of a save in flight outlives (``open_step``, ``accepted``,
``node_accepted``: each does the same again when it runs twice). The actor is created with
``max_task_retries=0``, so any other call made while it restarts (a drain of its node moves it)
fails, and a save whose calls failed is aborted; these run on the restarted actor instead, which
reads back the plan the ranks save with (``SaveCoordinator._plan_back``), so that save commits."""


class CheckpointActor:
    """Async Ray actor; see the module docstring. Methods are called by writers, trainers and the driver."""

    def __init__(self, root: str, retention: RetentionPolicy, storage_options: dict[str, Any] | None = None,
                 leftover_grace_s: float = LEFTOVER_GRACE_S, fault_env: dict[str, str] | None = None,
                 run_id: str | None = None, seal_key: str | None = None) -> None:
        """``run_id``: the driver's run; an actor Ray restarts gets the same one and carries over the
        run's failed saves (``FailedSavesFile``). None: they are kept in memory only. ``seal_key``
        (hex): the run's secret for its sealed checks (``seals.py``); None: none are kept."""
        setup_logging()
        adopt_fault_env(fault_env)  # an argument, not a runtime_env: see TrainWorker.__init__
        self.layout = CheckpointLayout(root, options=storage_options)
        options = dict(storage_options or {})
        self.layout.storage.makedirs(self.layout.root)
        # The group's layout arrives with configure(); a restarted actor reads the last one back.
        self._group_file = GroupFile(self.layout, bytes.fromhex(seal_key) if seal_key else None)
        self.group = self._group_file.read()
        self.layout.remove_leftover_tmp()
        seals = SealedChecks(self.layout, bytes.fromhex(seal_key)) if seal_key else None
        if seals is not None:  # before the registry reads the steps: checks an earlier actor of the run sealed
            seals.load()
        self.metrics = CheckpointMetrics(self.layout.name)
        group = lambda: self.group  # noqa: E731 - members read the layout configure() set last
        failures = FailedSavesFile(self.layout, run_id, bytes.fromhex(seal_key)) if run_id and seal_key else None
        # (an actor's start writes nothing: what the run sealed is its commits' and resume plans' checks)
        self.steps = StepRegistry(self.layout, self.metrics, group, lambda *moved: self.board.progress(*moved),
                                  failures)
        self.retainer = Retainer(self.layout, retention, self.steps, self.metrics, leftover_grace_s)
        self.timeline = ResumeTimeline(self.layout, options, self.steps, self.retainer)
        self.resume_check = ResumeCheck(self.layout, self.steps.committed, seals.add if seals else None)
        self.timeline.on_pass = seals.add if seals else None
        self.coordinator = SaveCoordinator(self.layout, options, self.steps, retention, self.metrics, group,
                                           lambda step: self.board.stall(step))
        self.board = StatusBoard(self.layout.name, str(self.layout.root), self.steps, self.retainer, self.metrics,
                                 group, self.coordinator.planning, lambda: dict(self.resume_check.refused))
        self.metrics.start(self.committed, self.steps.saves.consecutive)
        logger.info("checkpoint actor for %s: %d committed step(s) %s", root, len(self.committed),
                    sorted(self.committed)[-5:])

    # The registry's and the retainer's state, as tests and the repr read it.
    @property
    def committed(self) -> dict[int, Manifest]:
        return self.steps.committed

    @property
    def leases(self) -> dict[str, int]:
        return self.retainer.leases

    @property
    def lease_files(self) -> LeaseFiles:
        return self.retainer.lease_files

    @property
    def purge_errors(self) -> int:
        return self.retainer.purge_errors

    @property
    def world_size(self) -> int:
        return self.group.world_size

    @property
    def spec_hash(self) -> str:
        return self.group.spec_hash

    # --- the group ------------------------------------------------------------------------

    async def configure(self, group: GroupLayout) -> None:
        """Set the layout of the group about to start (it may differ from the one that saved)
        and the model section recorded in every manifest.

        Kept in ``.group.json`` under the root: Ray restarts a crashed actor with its
        constructor arguments only, and saves in flight need the group's world size.
        """
        self.group = group
        await self._group_file.write(group)

    # --- saving (SaveCoordinator, StepRegistry) -------------------------------------------

    async def plan(self, attempt: int, step: int, rank: int, local_plan: SavePlan, timeout_s: float) -> CentralPlan:
        """See ``SaveCoordinator.plan``."""
        return await self.coordinator.plan(attempt, step, rank, local_plan, timeout_s)

    @ray.method(max_task_retries=RESTART_RETRIES)
    async def open_step(self, step: int, attempt: int) -> str:
        """The temporary directory every rank of ``step`` writes into (created on first call)."""
        return self.steps.open_step(step, attempt)

    @ray.method(max_task_retries=RESTART_RETRIES)
    async def accepted(self, step: int, rank: int, attempt: int, writer: WriterRef | None = None) -> str:
        """A writer (``writer``: its handle and node id) took over rank ``rank``'s staged data of
        ``step``; returns the temporary directory."""
        return self.steps.accepted(step, rank, attempt, writer)

    async def report(self, report: RankReport) -> str:
        """A writer finished a rank of a step; commits when all ranks are in, then applies retention."""
        out = await self.coordinator.report(report)
        if out == "committed":
            self.resume_check.committed(report.step)  # before an acquire can come, so it waits for the check
            # The step is durable from here on: whatever retention does cannot make it an abort.
            await asyncio.to_thread(self.retainer.purge)
        return out

    @ray.method(max_task_retries=RESTART_RETRIES)
    async def node_accepted(self, batch: NodeBatch) -> NodeAnswer:
        """``node_report`` of a batch without reports (hand-offs and stalls, which do the same
        again when they run twice): outlives a restart of this actor as ``accepted`` does."""
        if batch.reports:
            raise ValueError("node_accepted takes no reports: a report is not made twice")
        return await self.node_report(batch)

    async def node_report(self, batch: NodeBatch) -> NodeAnswer:
        """A node's writer speaking for its ranks in one call (``roles/courier.py``): their stalls,
        then their hand-offs (``accepted``), then their reports (``report``), each as its own call
        would be taken. A step commits once every rank of the group reported, however many calls
        brought the reports; an entry's error is its answer, not the call's."""
        for step, rank, seconds in batch.stalls:
            self.board.record_stall(step, rank, seconds)
        accepted: list[object] = []
        for step, rank, attempt in batch.accepted:
            try:
                accepted.append(self.steps.accepted(step, rank, attempt, batch.writer))
            except Exception as exc:  # noqa: BLE001 - that rank's answer (a step aborted meanwhile)
                accepted.append(exc)
        reports: list[object] = []
        for report in batch.reports:
            try:
                reports.append(await self.report(report))
            except Exception as exc:  # noqa: BLE001 - that rank's answer (its step aborted, the commit failed)
                reports.append(exc)
        return NodeAnswer(tuple(accepted), tuple(reports))

    async def settle(self, timeout_s: float) -> None:
        """See ``StepRegistry.settle``."""
        await self.steps.settle(timeout_s)

    async def abort(self, step: int, reason: str, attempt: int | None = None) -> None:
        """See ``StepRegistry.abort``. A step that failed for want of space runs retention again:
        steps it may delete now (a certified step replaced since) make room for the next save."""
        await self.steps.abort(step, reason, attempt)
        if out_of_space(reason):
            await asyncio.to_thread(self.retainer.purge)

    async def wait_committed(self, step: int, timeout_s: float) -> None:
        """Block until ``step`` is committed; raises StepAborted or TimeoutError."""
        await self.steps.wait_committed(step, timeout_s)

    def _purge(self) -> None:
        self.retainer.purge()

    # --- preflight -----------------------------------------------------------------------

    async def probes_seen(self, names: list[str]) -> ProbesSeen:
        """This actor's node id and which of the writers' probe files it sees under the root
        (the shared-storage preflight, checkpoint/storage/probe.py)."""
        import ray

        from raytrain_ckpt.checkpoint.storage.probe import local_root

        local = local_root(str(self.layout.root))
        seen = [n for n in names if local is not None and (Path(local) / n).is_file()]
        return ProbesSeen(ray.get_runtime_context().get_node_id(), seen)

    # --- loading (ResumeTimeline) ----------------------------------------------------------

    async def acquire(self, holder: str, resume: str, verify: Verify) -> ResumePoint | None:
        """See ``ResumeTimeline.acquire``."""
        await self._checked_ahead(verify)
        return await self.timeline.acquire(holder, resume, verify)

    async def begin(self, holder: str, resume: str, verify: Verify) -> ResumePoint | None:
        """See ``ResumeTimeline.begin``."""
        await self._checked_ahead(verify)
        return await self.timeline.begin(holder, resume, verify)

    async def _checked_ahead(self, verify: Verify) -> None:
        """Let a check of the newest commit still running finish first (``ResumeCheck``): the resume
        plan then finds its verdict. Not for a checksum one, which parses every chunk itself."""
        if verify == "size":
            await asyncio.to_thread(self.resume_check.wait)

    async def start_timeline(self, step: int | None, path: str | None, resume: str) -> None:
        """See ``ResumeTimeline.start_timeline``."""
        await self.timeline.start_timeline(step, path, resume)

    async def release(self, holder: str) -> None:
        self.timeline.release(holder)

    async def latest_committed(self) -> int | None:
        """The newest committed step (what a writer's ``committed_copy`` looks for by default)."""
        return max(self.committed) if self.committed else None

    async def manifest_files(self, step: int) -> dict[str, FileSum]:
        """The files committed step ``step``'s manifest lists with their checksum ({} when unknown)."""
        m = self.committed.get(step)
        if m is None:
            return {}
        return {name: FileSum(f.size, f.crc32c) for name, f in m.files.items() if f.crc32c is not None}

    # --- introspection (StatusBoard) -------------------------------------------------------

    async def status(self) -> ActorStatus:
        """Committed, in-flight and failed steps, active leases, and (for ``raytrain-ckpt status``)
        each committed step's manifest summary, the in-flight step's phase, the job's state and
        the work at risk."""
        return self.board.snapshot()

    async def record_interval(self, step: int, decision: IntervalDecision) -> None:
        """The interval the trainers chose at ``step`` (``interval_steps: auto``), and why."""
        self.board.record_interval(step, decision)

    async def record_costs(self, cost_s: float | None, step_time_s: float | None) -> None:
        """Rank 0's measured save cost and step time after a save: the next attempt starts from them."""
        self.board.record_costs(cost_s, step_time_s)

    async def interval_history(self) -> SaveCosts | None:
        """The newest measured save cost and step time (``interval_steps: auto``), or None."""
        return self.board.costs

    async def certify(self, step: int) -> None:
        """The training guard certified ``step`` (healthy steps followed it): retention keeps the
        newest certified step from now on, before a later manifest records it."""
        told = self.retainer.told_certified
        newer = step > max(told, default=-1)
        if step not in told:
            told.append(step)
            del told[:-64]
        if newer:
            # the step kept beside keep_latest_k for the guard moved: the one it replaces is free
            # now, not only after the next commit (a root sized for the retention would fill first)
            await asyncio.to_thread(self.retainer.purge)

    async def note_job(self, note: JobNote) -> None:
        """The driver's view after each controller step: state, attempt, failures, training step."""
        self.board.note_job(note)

    def __repr__(self) -> str:
        # Ray shows this in the dashboard's actor list and puts it before every log line of the
        # actor, and computes it once, when the actor (re)starts: short, and only what stays true
        # (live progress: `raytrain-ckpt status --job <job>`, the metrics).
        layout = getattr(self, "layout", None)  # (also asked of an actor whose __init__ raised)
        return f"CheckpointActor({layout.name if layout is not None else 'not started'})"
