"""The DCP coordinator of a job's saves: plans each layout once, commits each step.

It gathers each rank's local save plan and builds the global plan (cached per layout: a
layout that does not change is planned once per attempt), then, once every rank's writer
reported, finishes ``.metadata`` from their write results and commits the step with its
manifest. A later save of a layout whose ranks' results did not change reuses the last
``.metadata`` instead (``repeats.py``); one where only byte items moved splices it
(``metadatafile.py``). Which steps are in flight, and their phases, is the step
registry's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy
from raytrain_ckpt.checkpoint.records import CentralPlan, GroupLayout, RankReport
from raytrain_ckpt.checkpoint.errors import StepAborted
from raytrain_ckpt.checkpoint.roles.metadatafile import MetadataFiles
from raytrain_ckpt.checkpoint.roles.repeats import RESEND, ResultsCache, committed_plan, copy_metadata
from raytrain_ckpt.checkpoint.roles.steps import InFlightStep, StepRegistry
from raytrain_ckpt.checkpoint.format.fingerprints import merge_shard_sums
from raytrain_ckpt.checkpoint.format.manifest import Manifest
from raytrain_ckpt.checkpoint.roles.planning import GatheredPlans
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.common.faults import maybe_inject
from raytrain_ckpt.checkpoint.roles.metrics import CheckpointMetrics

logger = logging.getLogger(__name__)

__all__ = ["SaveCoordinator"]


@dataclass
class _Gather:
    plans: GatheredPlans = field(default_factory=GatheredPlans)
    arrived: set[int] = field(default_factory=set)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    central: list[Any] | None = None
    """Per rank: its ``CentralNumbers`` (or its central ``SavePlan``, when DCP's planner planned)."""
    taken: set[int] = field(default_factory=set)
    """Ranks that took their central plan: once all have, the gather is dropped."""
    plan_id: str = ""
    started: float = field(default_factory=time.monotonic)


class SaveCoordinator:
    """Plans and commits; see the module docstring."""

    def __init__(self, layout: CheckpointLayout, storage_options: dict, steps: StepRegistry,
                 retention: RetentionPolicy, metrics: CheckpointMetrics, group: Callable[[], GroupLayout],
                 stall: Callable[[int], dict[str, float]]) -> None:
        self.layout, self.storage_options, self.steps = layout, storage_options, steps
        self.retention, self.metrics, self._group, self._stall = retention, metrics, group, stall
        self._gathers: dict[tuple[int, int], _Gather] = {}
        self._taken: tuple[tuple[int, int], _Gather] | None = None
        """The last gather every rank took its plan from: a call sent again (``call_restarting``
        after the reply was lost) gets its plan from it. One, replaced by the next."""
        self._metadata: dict[str, Metadata] = {}
        self.repeats = ResultsCache()
        self.files = MetadataFiles()
        self._reading_plan = asyncio.Lock()
        self._not_on_storage: set[str] = set()

    def planning(self) -> list[int]:
        """Steps whose ranks' plans are still being gathered."""
        return [s for (_, s), g in list(self._gathers.items()) if not g.ready.is_set()]

    async def plan(self, attempt: int, step: int, rank: int, local_plan: SavePlan, timeout_s: float) -> CentralPlan:
        """Gather every rank's local plan for the save of ``step`` in ``attempt`` (the first save
        of a layout; later saves reuse it), then return this rank's central plan and the id of
        the global plan (its cached metadata). A gather is dropped once every rank took its plan,
        or once the last rank waiting for it gave up: neither its plans nor its central plans
        (each O(ranks x tensors)) outlive it, but for the central plans of the last gather every
        rank took (``_taken``), so that a call sent again gets its plan instead of a new gather."""
        world = self._group().world_size
        key = (attempt, step)
        if key not in self._gathers and self._taken is not None and self._taken[0] == key:
            done = self._taken[1]  # every rank took its plan: this rank's call, sent again
            assert done.central is not None
            return CentralPlan(done.central[rank], done.plan_id)
        g = self._gathers.setdefault(key, _Gather())
        g.plans.add(rank, local_plan)  # kept as numbers (``planning.py``)
        g.arrived.add(rank)
        del local_plan  # this call's frame waits below: it must not keep the rank's plan alive
        if len(g.plans) == world and g.central is None:
            # DCP's global plan on the ranks' numbers (or DCP's planner, its chunk check O(n log n)
            # instead of pairwise). The ranks write from their plan's items and prefix; its planner
            # data (the flattened keys' paths) is in the metadata, not sent back. On an object store
            # the file names spread over its key ranges (``spread_names``).
            chunks: dict = {}  # the tensors' chunks as arrays, what .metadata is written from
            g.central, metadata = g.plans.build(world, spread=not self.layout.protocol.renames, chunk_arrays=chunks)
            g.plan_id = f"{attempt}.{step}"
            self._metadata[g.plan_id] = metadata
            self.files.planned(g.plan_id, chunks)
            self.repeats.keep_only(g.plan_id)
            g.plans.clear()  # every rank's local plan (O(ranks x tensors)): not needed once the global plan is
            g.ready.set()
            self.metrics.planned(time.monotonic() - g.started)
        try:
            await asyncio.wait_for(g.ready.wait(), timeout_s)
        except asyncio.TimeoutError:
            g.plans.pop(rank)
            if not g.plans and self._gathers.get(key) is g:  # the last one waiting: nobody will finish it
                del self._gathers[key]
            raise StepAborted(f"save planning: only ranks {sorted(g.arrived)} of {world} arrived "
                              f"within {timeout_s:g}s") from None
        assert g.central is not None
        mine = CentralPlan(g.central[rank], g.plan_id)
        g.taken.add(rank)
        if len(g.taken) == len(g.central) and self._gathers.get(key) is g:
            del self._gathers[key]
            g.plans.clear()  # (a call sent again before the drop put its local plan back)
            self._taken = (key, g)
        return mine

    async def report(self, report: RankReport) -> str:
        """A writer finished rank ``report.rank`` of its step; commits when all ranks are in:
        ``committed``, else ``pending``."""
        step = report.step
        self.steps.in_flight(step, report.attempt)
        if not await self._known_plan(report.plan_id):
            await self.steps.abort(step, "plan unknown after a checkpoint actor restart")
            raise StepAborted(f"step {step}: plan {report.plan_id} unknown; the next save plans again")
        resolved = self.repeats.resolve(report)
        if resolved is None:  # sent by digest, and this actor restarted since: the writer sends it again
            return RESEND
        p = self.steps.reported(resolved)
        if len(p.reports) < self._group().world_size:
            return "pending"
        if p.committing:  # a report sent again (a retried call) while the commit it completed runs
            await self.steps.wait_committed(step, None)
            return "committed"
        p.committing = True
        try:
            manifest = await asyncio.to_thread(self._commit, step, p)
        except Exception as exc:
            p.committing = False
            await self.steps.abort(step, f"commit failed: {exc}")
            raise
        self.steps.commit_done(step, manifest)  # on the event loop's thread: it wakes the step's waiters
        return "committed"

    async def _known_plan(self, plan_id: str) -> bool:
        """Whether ``plan_id`` is known, read back from storage if need be (one read at a time:
        every rank's report of the first save after a restart asks at once, and the read is O(items))."""
        if plan_id in self._metadata:
            return True
        async with self._reading_plan:
            if plan_id in self._metadata:
                return True
            if plan_id in self._not_on_storage or not await asyncio.to_thread(self._plan_back, plan_id):
                self._not_on_storage.add(plan_id)  # the other ranks' reports do not read again
                return False
            return True

    def _plan_back(self, plan_id: str) -> bool:
        """After a restart of this actor: the plan ``plan_id`` the ranks still save with, read back
        from its newest committed step (``repeats.committed_plan``). False when there is none."""
        metadata = committed_plan(self.layout.storage, self.layout.step_dir, dict(self.steps.committed), plan_id)
        if metadata is None:
            return False
        if plan_id not in self._metadata:
            self._metadata[plan_id] = metadata
            logger.info("plan %s read back from its newest committed step: its saves in flight commit", plan_id)
        return True

    def _commit(self, step: int, p: InFlightStep) -> Manifest:
        """Write ``.metadata`` and the manifest and make the step durable (on a thread); its manifest."""
        t0 = time.monotonic()
        reports = [p.reports[r] for r in sorted(p.reports)]
        files: dict[str, dict[str, int]] = {}
        for r in reports:
            files.update(r.files)
        files[".metadata"] = self._metadata_file(p, reports)
        timings = [r.timings for r in reports]
        wall = {"stage_s": max(t.stage_s for t in timings), "persist_s": max(t.persist_s for t in timings),
                "write_s": max(t.write_s for t in timings),
                "commit_s": time.monotonic() - t0, "total_s": time.monotonic() - p.started, **self._stall(step)}
        manifest = self._manifest(step, files, wall, reports[0])
        manifest = manifest.model_copy(update={"tensors": merge_shard_sums([r.tensors for r in reports]) or None})
        maybe_inject("commit", 0, step, p.attempt)
        final = self.layout.commit(p.tmp, manifest)
        try:  # the step is durable now: nothing after this may call it failed
            self.repeats.record(reports[0].plan_id, reports, self.layout.storage.join(final, ".metadata"),
                                files[".metadata"])
        except Exception as exc:  # noqa: BLE001 - only the next save's reuse of this .metadata is lost
            logger.warning("step %d committed, but its .metadata will not be reused by the next save: %s", step, exc)
        logger.info("committed step %d: %.1f MB, stage %.3fs persist %.3fs commit %.3fs", step,
                    manifest.total_bytes / 1e6, wall["stage_s"], wall["persist_s"], wall["commit_s"])
        return manifest

    def _metadata_file(self, p: InFlightStep, reports: list[RankReport]) -> dict[str, int]:
        """Write the step's ``.metadata`` (copied from the last committed one of the plan when every
        rank's results are the same, spliced when only byte items moved) and return its manifest entry."""
        plan_id = reports[0].plan_id
        path = self.layout.storage.join(p.tmp, ".metadata")
        last = self.repeats.reusable(plan_id, reports)
        if last is not None and copy_metadata(self.layout.storage, last.path, path):
            self.repeats.reused += 1
            return dict(last.entry)
        self.repeats.rebuilt += 1
        # Written from the plan's and the ranks' arrays (``format/metaemit.py``); the cached plan's
        # metadata is read, not changed.
        self.layout.storage.write_bytes(path, self.files.make(plan_id, self._metadata[plan_id], reports).data)
        return self.layout.describe(path)

    def _manifest(self, step: int, files: dict[str, dict[str, int]], wall: dict[str, float],
                  first: RankReport) -> Manifest:
        g, point = self._group(), first.point
        return Manifest(step=step, world_size=g.world_size, dp_size=g.dp_size, spec_hash=g.spec_hash,
                        files=files, samples_seen=int(point.samples_seen), tokens_seen=int(point.tokens_seen),
                        wall=wall, pp_size=g.world_size // g.dp_size,  # the spec makes world = pp x dp
                        model=g.model, eval_loss=point.eval_loss, loss=point.loss,
                        keep_best=best.record() if (best := self.retention.keep_best) else None,
                        certified_step=point.certified_step,
                        skipped_samples=[list(w) for w in point.skipped_samples] or None,
                        replica_skips=[list(w) for w in point.replica_skips] or None)
