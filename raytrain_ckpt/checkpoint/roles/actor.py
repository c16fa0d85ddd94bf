"""CheckpointActor: one per job, the DCP coordinator and the registry of committed steps.

It gathers each rank's local save plan and builds the global plan (cached per layout: a
layout that does not change is planned once per attempt), opens the step's temporary
directory, collects the writers' results, writes ``.metadata`` and commits the step with the
manifest. Retention runs here after each commit, off the training path. All of its state
that matters survives a restart because it is rebuilt from the checkpoint directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from raytrain_ckpt.checkpoint.policy.interval import IntervalDecision
from raytrain_ckpt.checkpoint.format.manifest import InvalidCheckpoint, Manifest
from raytrain_ckpt.checkpoint.format.names import EntryKind, is_uri
from raytrain_ckpt.checkpoint.format.verify import Verify, verify_step
from raytrain_ckpt.checkpoint.storage.layout import LEFTOVER_GRACE_S, CheckpointLayout, LeftoverWatch
from raytrain_ckpt.checkpoint.records import RankReport
from raytrain_ckpt.checkpoint.storage.leases import LeaseFiles, purge_lock
from raytrain_ckpt.checkpoint.storage.dcp import dcp_writer
from raytrain_ckpt.checkpoint.storage.backends import open_storage
from raytrain_ckpt.checkpoint.storage.commit import protocol_for
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy
from raytrain_ckpt.faults import adopt_fault_env, maybe_inject
from raytrain_ckpt.logs import setup_logging
from raytrain_ckpt.metrics import CheckpointMetrics, inflight_phase

logger = logging.getLogger(__name__)

__all__ = ["GROUP_FILE", "CheckpointActor", "ResumePoint", "SaveFailures", "StepAborted"]

SETTLE_CHECK_S = 0.5
"""How often ``settle`` asks the writers of a step in flight whether they still hold its hand-offs."""
WRITER_QUERY_S = 5.0
"""How long ``settle`` waits for a writer's answer; one that does not answer is waited for as before."""
GROUP_FILE = ".group.json"
"""The layout of the group last configured, under the job's root (not a step: nothing scans it)."""


class StepAborted(RuntimeError):
    """A step that will never commit (a writer or the actor died, or it was aborted)."""


@dataclass(frozen=True)
class ResumePoint:
    """A verified checkpoint to load, leased to ``holder`` until released."""

    step: int
    path: str
    world_size: int
    samples_seen: int


@dataclass
class SaveFailures:
    """Failed saves as ``status``, the metrics and the job's end report them: a job whose saves
    keep failing must say so. Counted per step (every rank of a failed step reports it)."""

    total: int = 0
    consecutive: int = 0
    """Failed saves since the last commit."""
    last_step: int | None = None
    last_error: str | None = None

    def failed(self, step: int, reason: str) -> None:
        self.total += 1
        self.consecutive += 1
        self.last_step, self.last_error = step, reason

    def committed(self) -> None:
        self.consecutive = 0


@dataclass
class _Pending:
    tmp: Path
    attempt: int
    started: float
    accepted: set[int] = field(default_factory=set)
    """Ranks whose staged data a writer holds: they will report unless the writer dies."""
    writers: dict[int, tuple[Any, str]] = field(default_factory=dict)
    """rank -> (handle, node id) of the writer holding its hand-off (what ``settle`` asks)."""
    reports: dict[int, tuple[str, list, dict, dict]] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)
    error: str | None = None


@dataclass
class _Gather:
    plans: dict[int, SavePlan] = field(default_factory=dict)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    central: list[SavePlan] | None = None
    plan_id: str = ""
    started: float = field(default_factory=time.monotonic)


class CheckpointActor:
    """Async Ray actor; see the module docstring. Methods are called by writers, trainers and the driver."""

    def __init__(self, root: str, retention: RetentionPolicy, storage_options: dict[str, Any] | None = None,
                 leftover_grace_s: float = LEFTOVER_GRACE_S, fault_env: dict[str, str] | None = None) -> None:
        setup_logging()
        adopt_fault_env(fault_env)  # an argument, not a runtime_env: see TrainWorker.__init__
        self.layout = CheckpointLayout(root, options=storage_options)
        self.storage_options = dict(storage_options or {})
        self.layout.storage.makedirs(self.layout.root)
        self.retention = retention
        # The group's layout arrives with configure(); a restarted actor reads the last one back.
        self.world_size, self.dp_size, self.spec_hash, self.model = 0, 0, "", None
        self._load_group()
        self.layout.remove_leftover_tmp()
        self.committed: dict[int, Manifest] = self.layout.valid_steps("size")
        self.failed: dict[int, str] = {}
        self._skipped: set[int] = set()
        """Steps ``acquire`` dropped for failing verification (still on disk under their step-N name)."""
        self._aborted: set[tuple[int, int]] = set()
        """(step, attempt) of every aborted save: a late hand-off of the same save cannot reopen it."""
        self.saves = SaveFailures()
        self.pending: dict[int, _Pending] = {}
        self.leases: dict[str, int] = {}
        # exporters' leases, judged live by our own clock (see leases.py)
        self.lease_files = LeaseFiles(self.layout.root, storage=self.layout.storage)
        self.purge_errors = 0
        """Retention deletes that failed (logged); the commits they followed stand."""
        self.leftovers = LeftoverWatch(leftover_grace_s)
        """Uncommitted entries (an aborted step a slow writer kept uploading into), judged by our clock."""
        self._gathers: dict[tuple[int, int], _Gather] = {}
        self._metadata: dict[str, Metadata] = {}
        # progress reporting: metrics, `raytrain-ckpt status`, the actor's repr
        self.metrics = CheckpointMetrics(self.layout.name)
        self.stalls: dict[int, dict[int, float]] = {}
        self.job_info: dict[str, Any] = {}
        self.interval: dict[str, Any] | None = None
        """The newest ``interval_steps: auto`` decision (rank 0 reports each one)."""
        self.interval_costs: dict[str, float | None] = {}
        self.metrics.start(self.committed)
        logger.info("checkpoint actor for %s: %d committed step(s) %s", root, len(self.committed),
                    sorted(self.committed)[-5:])

    async def configure(self, world_size: int, dp_size: int, spec_hash: str,
                        model: dict[str, Any] | None = None) -> None:
        """Set the layout of the group about to start (it may differ from the one that saved)
        and the model section recorded in every manifest.

        Kept in ``.group.json`` under the root: Ray restarts a crashed actor with its
        constructor arguments only, and saves in flight need the group's world size.
        """
        self.world_size, self.dp_size, self.spec_hash, self.model = world_size, dp_size, spec_hash, model
        text = json.dumps({"world_size": world_size, "dp_size": dp_size, "spec_hash": spec_hash, "model": model})
        storage = self.layout.storage
        path = storage.join(self.layout.root, GROUP_FILE)
        try:
            await asyncio.to_thread(self.layout.protocol.replace_small_file, path, text.encode())
        except Exception as exc:  # noqa: BLE001 - a full disk, a root moved away: the group still starts
            # The layout is in memory for this actor's life; the file only serves an actor Ray
            # restarts, which must not read the previous group's layout instead.
            logger.warning("could not record the group's layout in %s (%s); training goes on, saves fail "
                           "until the storage takes writes again", path, exc)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(storage.remove_file, path)

    def _load_group(self) -> None:
        storage = self.layout.storage
        path = storage.join(self.layout.root, GROUP_FILE)
        if not storage.is_file(path):
            return
        try:
            g = json.loads(storage.read_bytes(path).decode("utf-8"))
            self.world_size, self.dp_size, self.spec_hash, self.model = (
                int(g["world_size"]), int(g["dp_size"]), str(g["spec_hash"]), g.get("model"))
        except (ValueError, KeyError, TypeError, OSError) as exc:  # unreadable: the next configure() rewrites it
            logger.warning("ignoring %s: %s", path, exc)

    # --- planning ------------------------------------------------------------------------

    async def plan(self, attempt: int, step: int, rank: int, local_plan: SavePlan,
                   timeout_s: float) -> tuple[SavePlan, str]:
        """Gather every rank's local plan for the save of ``step`` in ``attempt`` (the first save
        of a layout; later saves reuse it), then return this rank's central plan and the id of
        the global plan (its cached metadata)."""
        g = self._gathers.setdefault((attempt, step), _Gather())
        g.plans[rank] = local_plan
        if len(g.plans) == self.world_size and g.central is None:
            planner = DefaultSavePlanner()
            ordered = [g.plans[r] for r in range(self.world_size)]
            central, metadata = planner.create_global_plan(ordered)
            g.central = FileSystemWriter(self.layout.root).prepare_global_plan(central)
            g.plan_id = f"{attempt}.{step}"
            self._metadata[g.plan_id] = metadata
            g.ready.set()
            self.metrics.planned(time.monotonic() - g.started)
        try:
            await asyncio.wait_for(g.ready.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise StepAborted(f"save planning: only ranks {sorted(g.plans)} of {self.world_size} arrived "
                              f"within {timeout_s:g}s") from None
        assert g.central is not None
        return g.central[rank], g.plan_id

    # --- saving --------------------------------------------------------------------------

    async def open_step(self, step: int, attempt: int) -> str:
        """The temporary directory every rank of ``step`` writes into (created on first call)."""
        if step in self.committed:
            raise StepAborted(f"step {step} is already committed")
        if (step, attempt) in self._aborted:
            # A rank whose hand-off comes after another rank's write of this save failed: without
            # this, it would open the step again and its final save would wait for a rank that
            # already gave up on it.
            raise StepAborted(f"step {step} was aborted: {self.failed.get(step, 'an earlier failure')}")
        p = self.pending.get(step)
        if p is None or p.error is not None:
            # No await between the lookup and the insert: concurrent callers must share one directory.
            p = _Pending(self.layout.new_tmp_dir(step), attempt, time.monotonic())
            self.pending[step] = p
            self.failed.pop(step, None)
        return str(p.tmp)

    async def accepted(self, step: int, rank: int, attempt: int, writer: tuple[Any, str] | None = None) -> str:
        """A writer (``writer``: its handle and node id) took over rank ``rank``'s staged data of
        ``step``; returns the temporary directory."""
        tmp = await self.open_step(step, attempt)
        self.pending[step].accepted.add(rank)
        if writer is not None:
            self.pending[step].writers[rank] = writer
        self._progress()
        return tmp

    async def settle(self, timeout_s: float) -> None:
        """Before a new attempt loads: finish what can finish, abort what cannot.

        A step some rank never handed to a writer can never commit (that trainer is gone):
        abort it now. A step every rank handed off is waited for, up to ``timeout_s``, unless
        the writer of a rank that has not reported no longer holds its hand-off (it died, with
        its node or alone, or its write failed): then it can never commit and is aborted at once.
        A writer that holds it, or does not answer, is waited for.
        """
        for step, p in list(self.pending.items()):
            if len(p.accepted) < self.world_size:
                await self.abort(step, f"ranks {sorted(set(range(self.world_size)) - p.accepted)} never handed it off")
                continue
            deadline = time.monotonic() + timeout_s
            while not p.done.is_set():
                lost = await self._lost_hand_offs(step, p)
                if lost and not p.done.is_set():
                    await self.abort(step, f"the writer holding ranks {lost} died or failed before they reported")
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    await self.abort(step, f"not committed within {timeout_s:g}s of the restart")
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(p.done.wait(), min(left, SETTLE_CHECK_S))

    async def _lost_hand_offs(self, step: int, p: _Pending) -> list[int]:
        """Ranks of ``step`` not reported whose writer surely no longer holds them: its node is
        dead, Ray says the actor died, or it answers that it does not hold them (a restarted
        writer holds nothing of its previous incarnation). Unknown (no answer in time) is not lost."""
        import ray
        from ray.exceptions import ActorDiedError

        waiting = {r: w for r, w in p.writers.items() if r not in p.reports}
        if not waiting:
            return []
        alive = {n["NodeID"] for n in await asyncio.to_thread(ray.nodes) if n["Alive"]}
        lost = []
        for rank, (writer, node) in sorted(waiting.items()):
            if node in alive:
                try:
                    if await asyncio.wait_for(writer.holds.remote(rank, step), WRITER_QUERY_S):
                        continue
                except ActorDiedError:
                    pass
                except Exception as exc:  # restarting, unreachable or slow to answer: it may still report
                    logger.debug("writer of rank %d step %d did not answer: %s", rank, step, exc)
                    continue
            if rank not in p.reports:  # a report may have come in while we asked
                lost.append(rank)
        return lost

    async def report(self, report: RankReport) -> str:
        """A writer finished rank ``rank`` of ``step``; commits when all ranks are in."""
        step, rank, plan_id, results, files = report.step, report.rank, report.plan_id, report.results, report.files
        t, point = report.timings, report.point
        info = {"stage_s": t.stage_s, "persist_s": t.persist_s, "write_s": t.write_s,
                "samples_seen": point.samples_seen, "tokens_seen": point.tokens_seen,
                "loss": point.loss, "eval_loss": point.eval_loss}
        p = self.pending.get(step)
        if p is None or p.error is not None:
            raise StepAborted(f"step {step} is not in flight (aborted or the checkpoint actor restarted)")
        if plan_id not in self._metadata:
            await self.abort(step, "plan unknown after a checkpoint actor restart")
            raise StepAborted(f"step {step}: plan {plan_id} unknown; the next save plans again")
        p.reports[rank] = (plan_id, results, files, info)
        self._progress()
        if len(p.reports) < self.world_size:
            return "pending"
        try:
            await asyncio.to_thread(self._commit, step, p)
        except Exception as exc:
            await self.abort(step, f"commit failed: {exc}")
            raise
        # The step is durable from here on: whatever retention does cannot make it an abort.
        await asyncio.to_thread(self._purge)
        return "committed"

    def _commit(self, step: int, p: _Pending) -> None:
        t0 = time.monotonic()
        plan_id = next(iter(p.reports.values()))[0]
        writer = dcp_writer(p.tmp, self.storage_options)
        writer.set_up_storage_writer(True, rank=0)
        writer.finish(copy.deepcopy(self._metadata[plan_id]), [r[1] for r in p.reports.values()])
        files: dict[str, dict[str, int]] = {}
        for _, _, f, _ in p.reports.values():
            files.update(f)
        files[".metadata"] = self.layout.describe(self.layout.storage.join(p.tmp, ".metadata"))
        infos = [r[3] for r in p.reports.values()]
        wall = {"stage_s": max(t["stage_s"] for t in infos), "persist_s": max(t["persist_s"] for t in infos),
                "write_s": max(t.get("write_s", 0.0) for t in infos),
                "commit_s": time.monotonic() - t0, "total_s": time.monotonic() - p.started, **self._stall(step)}
        manifest = Manifest(step=step, world_size=self.world_size, dp_size=self.dp_size, spec_hash=self.spec_hash,
                            files=files, samples_seen=int(infos[0].get("samples_seen", 0)),
                            tokens_seen=int(infos[0].get("tokens_seen", 0)), wall=wall,
                            pp_size=self.world_size // self.dp_size,  # the spec makes world = pp x dp
                            model=self.model, eval_loss=infos[0].get("eval_loss"), loss=infos[0].get("loss"),
                            keep_best=best.record() if (best := self.retention.keep_best) else None)
        maybe_inject("commit", 0, step, p.attempt)
        self.layout.commit(p.tmp, manifest)
        self.committed[step] = manifest
        self.saves.committed()
        del self.pending[step]
        p.done.set()
        logger.info("committed step %d: %.1f MB, stage %.3fs persist %.3fs commit %.3fs", step,
                    manifest.total_bytes / 1e6, wall["stage_s"], wall["persist_s"], wall["commit_s"])
        self.metrics.committed(manifest)
        self._progress()

    def _purge(self) -> None:
        """Apply retention after a commit. Never raises: the commit it follows is durable; an
        error is logged and counted, and the purge after the next commit tries again."""
        try:
            self._drop_missing()
            # Under the lease lock: an exporter outside the job either sees its step gone or we see its lease file.
            with self._purge_lock():
                leased = [*self.leases.values(), *self._file_leased_steps()]
                doomed = self.retention.to_delete(self.committed, leased, self.pending,
                                                  {s: m.metrics() for s, m in self.committed.items()})
                removed = [step for step in doomed if self._delete(step)]
        except Exception as exc:  # see the docstring: retention is retried, the commit stands
            self.purge_errors += 1
            logger.error("retention failed (%d failure(s) so far), steps kept for now: %s", self.purge_errors, exc)
            return
        if removed:
            logger.info("retention removed step(s) %s", removed)
            self.metrics.purged(len(removed))
        self._remove_stale_leftovers()

    def _remove_stale_leftovers(self) -> None:
        """After retention: remove entries that never committed and stayed unchanged for
        ``checkpoint.leftover_grace_s`` (never a step in flight). Never raises, like ``_purge``."""
        try:
            self.layout.remove_stale_leftovers(self.leftovers, [p.tmp for p in list(self.pending.values())],
                                               set(self.committed))
        except Exception as exc:  # the next commit's pass tries again; nothing committed is touched
            self.purge_errors += 1
            logger.error("could not remove uncommitted leftovers (%d failure(s) so far): %s", self.purge_errors, exc)

    def _delete(self, step: int) -> bool:
        """Delete one committed step; a failure is logged and counted, and the step stays registered."""
        try:
            if not self.layout.delete(step, self._still_unleased(step)):
                return False  # an exporter leased it meanwhile (object store): kept, deleted by a later pass
        except FileNotFoundError:
            logger.warning("checkpoint step %d vanished from %s (removed by hand?); dropped from the registry",
                           step, self.layout.root)
        except OSError as exc:  # retried after the next commit; the step is still registered and on disk
            self.purge_errors += 1
            logger.error("retention could not delete step %d (%d failure(s) so far): %s", step, self.purge_errors, exc)
            return False
        del self.committed[step]
        return True

    def _drop_missing(self) -> None:
        """Forget committed steps whose directory is gone: retention must count what is on disk."""
        for step in sorted(self.committed):
            if not self.layout.is_committed_name(step):
                logger.warning("checkpoint step %d vanished from %s (removed by hand?); dropped from the registry",
                               step, self.layout.root)
                del self.committed[step]

    async def abort(self, step: int, reason: str, attempt: int | None = None) -> None:
        """Give up on an in-flight step (of ``attempt``, when the caller knows it): remove its
        temporary directory, remember why."""
        p = self.pending.pop(step, None)
        for a in {attempt, p.attempt if p is not None else None} - {None}:
            self._aborted.add((step, a))
        if step not in self.failed:  # the first reason is the cause; later ranks only see the step gone
            self.failed[step] = reason
            self.saves.failed(step, reason)
            self.metrics.save_failed(self.saves.consecutive)
        if p is not None:
            p.error = reason
            p.done.set()
            await asyncio.to_thread(self.layout.storage.remove_tree, p.tmp)
            self.metrics.aborted()
            self._progress()
        logger.warning("checkpoint step %d aborted: %s", step, reason)

    async def wait_committed(self, step: int, timeout_s: float) -> None:
        """Block until ``step`` is committed; raises StepAborted or TimeoutError."""
        if step in self.committed:
            return
        p = self.pending.get(step)
        if p is None:
            raise StepAborted(f"step {step} is not in flight: {self.failed.get(step, 'never started')}")
        await asyncio.wait_for(p.done.wait(), timeout_s)
        if step not in self.committed:
            raise StepAborted(f"step {step} aborted: {p.error}")

    # --- preflight -----------------------------------------------------------------------

    async def probes_seen(self, names: list[str]) -> tuple[str, list[str]]:
        """This actor's node id and which of the writers' probe files it sees under the root
        (the shared-storage preflight, checkpoint/storage/probe.py)."""
        import ray

        from raytrain_ckpt.checkpoint.storage.probe import local_root

        local = local_root(str(self.layout.root))
        seen = [n for n in names if local is not None and (Path(local) / n).is_file()]
        return ray.get_runtime_context().get_node_id(), seen

    # --- loading -------------------------------------------------------------------------

    async def acquire(self, holder: str, resume: str, verify: Verify) -> ResumePoint | None:
        """Pick and verify the checkpoint to resume from, newest valid first, and lease it.

        ``resume`` is ``latest``, ``none``, a step number or a path to a step directory.
        With ``latest`` a candidate that fails verification is skipped with a warning naming it; a
        step asked for by number or path that fails raises InvalidCheckpoint (starting anywhere
        else, say at step 0, would hide that the run did not continue from it).
        """
        if resume == "none":
            return None
        if resume not in ("latest",) and not resume.isdigit():
            try:
                return await asyncio.to_thread(self._point, resume if is_uri(resume) else Path(resume), verify)
            except InvalidCheckpoint as exc:
                raise InvalidCheckpoint(f"checkpoint.resume={resume}: the step does not verify ({exc}); name "
                                        "another step, or use latest for the newest valid one") from None
        candidates = sorted(self.committed, reverse=True)
        if resume.isdigit():
            candidates = [int(resume)] if int(resume) in self.committed else []
            if not candidates:
                raise InvalidCheckpoint(f"checkpoint.resume={resume}: no committed step {resume} in "
                                        f"{self.layout.root} (have {sorted(self.committed)})")
        for step in candidates:
            try:
                point = await asyncio.to_thread(self._point, self.layout.step_dir(step), verify)
            except InvalidCheckpoint as exc:
                self.committed.pop(step, None)
                if resume.isdigit():  # the step asked for, not "the newest that verifies": no fallback
                    raise InvalidCheckpoint(f"checkpoint.resume={resume}: step {step} does not verify ({exc}); "
                                            f"name another step (committed: {sorted(self.committed)}), or use "
                                            "latest for the newest valid one") from None
                logger.warning("not resuming from step %d: %s; trying the previous one", step, exc)
                self._skipped.add(step)
                continue
            self.leases[holder] = step
            return point
        return None

    async def begin(self, holder: str, resume: str, verify: Verify) -> ResumePoint | None:
        """Acquire the run's starting point (see ``acquire``); ``start_timeline`` makes it the head
        of the timeline once every rank has loaded it.

        Refuses (InvalidCheckpoint) a start that would have to move aside a step an export holds.
        """
        point = await self.acquire(holder, resume, verify)
        head = self._head_of(point.step if point else None, point.path if point else None)
        await asyncio.to_thread(self._check_unleased, [s for s in self.committed if s > head], resume)
        return point

    async def start_timeline(self, step: int | None, path: str | None, resume: str) -> None:
        """Every rank loaded the run's starting point (``step`` at ``path``; None: a fresh start):
        make it the head of the timeline.

        Every committed step of this root that is not on the new timeline is moved aside to
        ``step-N.abandoned-<id>``: the steps newer than a step of this root, or all of them when
        the run starts fresh or from another root's step. Otherwise retention would delete the
        new run's steps (it keeps the highest numbers), a new step would meet an old one of the
        same number, and a restart would resume the abandoned run. Not before the ranks loaded
        the start: a start that fails (a checkpoint of another model shape) leaves this root's
        timeline as it was. The driver passes the start back, so an actor restarted meanwhile
        moves the same steps.
        """
        await asyncio.to_thread(self._abandon_after, self._head_of(step, path), resume)

    def _head_of(self, step: int | None, path: str | None) -> int:
        """The step of this root a run starts from, -1 when it starts fresh or from another root."""
        if step is None or path is None or not self._same(path, self.layout.step_dir(step)):
            return -1
        return step

    def _same(self, a: str, b: Path | str) -> bool:
        return self.layout.protocol.same_path(a, b)

    @contextlib.contextmanager
    def _purge_lock(self) -> Iterator[None]:
        """The lease lock of a POSIX root; nothing on an object store (``delete`` re-checks there)."""
        with purge_lock(self.layout.root):
            yield

    def _file_leased_steps(self) -> set[int]:
        return self.lease_files.leased_steps()

    def _still_unleased(self, step: int) -> Callable[[], bool] | None:
        """Object store (no lease lock): the re-check ``layout.delete`` makes after removing the manifest."""
        if self.layout.protocol.file_locks:
            return None
        return lambda: step not in self._file_leased_steps()

    def _abandon_after(self, head: int, resume: str) -> None:
        self._set_damaged_aside(head)
        newer = [s for s in sorted(self.committed) if s > head]
        if not newer:
            return
        with self._purge_lock():  # an exporter holds its step by a lease file
            self._check_unleased(newer, resume, locked=True)
            tag = uuid.uuid4().hex[:8]
            moved = [self.layout.storage.name(self.layout.abandon(s, tag)) for s in newer]
        for s in newer:
            del self.committed[s]
        logger.warning("checkpoint.resume=%s starts a new timeline%s: %d newer committed step(s) moved aside, "
                       "kept and never loaded: %s", resume, f" at step {head}" if head >= 0 else "", len(moved),
                       ", ".join(moved))

    def _check_unleased(self, steps: list[int], resume: str, locked: bool = False) -> None:
        """Raise InvalidCheckpoint when an export holds one of ``steps`` (the steps a new timeline moves aside)."""
        if not steps:
            return
        with contextlib.nullcontext() if locked else self._purge_lock():
            leased = sorted(set(steps) & self._file_leased_steps())
        if leased:
            raise InvalidCheckpoint(f"checkpoint.resume={resume}: step(s) {leased} are being exported and "
                                    "would be moved aside; wait for the export to finish and start again")

    def _set_damaged_aside(self, head: int) -> None:
        """Move the damaged steps newer than ``head`` that ``acquire`` skipped to ``step-N.invalid-<id>``.

        They are off the new timeline too. Left as ``step-N``, a rebuilt registry (sizes only)
        would count a step whose damage only its checksum shows, and this timeline's retention
        would delete it.
        """
        for step in sorted(s for s in self._skipped if s > head):
            if self.layout.is_committed_name(step):
                self.layout.set_aside(self.layout.step_dir(step), EntryKind.INVALID,
                                      "not intact, skipped on resume" + (f"; the run continues from step {head}"
                                                                         if head >= 0 else ""))
        self._skipped.clear()

    def _point(self, path: Path | str, verify: Verify) -> ResumePoint:
        """Verify a step, which may live on another storage than this root (``checkpoint.resume``)."""
        same = protocol_for(path) is type(self.layout.protocol)
        storage = self.layout.storage if same else open_storage(path, self.storage_options if is_uri(path) else None)
        m = verify_step(path, verify, storage)
        return ResumePoint(m.step, str(path), m.world_size, m.samples_seen)

    async def release(self, holder: str) -> None:
        self.leases.pop(holder, None)

    async def latest_committed(self) -> int | None:
        """The newest committed step (what a writer's ``committed_copy`` looks for by default)."""
        return max(self.committed) if self.committed else None

    async def manifest_files(self, step: int) -> dict[str, dict[str, int]]:
        """The files committed step ``step``'s manifest lists: name -> {"size", "crc32c"} ({} when unknown)."""
        m = self.committed.get(step)
        if m is None:
            return {}
        return {name: {"size": f.size, "crc32c": f.crc32c} for name, f in m.files.items() if f.crc32c is not None}

    # --- introspection -------------------------------------------------------------------

    async def status(self) -> dict[str, Any]:
        """Committed, in-flight and failed steps, active leases, and (for ``raytrain-ckpt status``)
        each committed step's manifest summary, the in-flight step's phase, the job's state and
        the work at risk."""
        return self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        step, phase, ranks = self._inflight()
        return {"root": str(self.layout.root), "committed": sorted(self.committed),
                "in_flight": sorted(self.pending), "failed": dict(self.failed),
                "purge_errors": self.purge_errors, "failed_saves": asdict(self.saves),
                "leases": dict(Counter(self.leases.values())),
                "latest": max(self.committed) if self.committed else None,
                "job": self.layout.name, "world_size": self.world_size,
                "steps": {s: {"bytes": m.total_bytes, "wall": {**m.wall, **self._stall(s)},
                              "created_unix": m.created_unix} for s, m in self.committed.items()},
                "inflight": {"step": step, "phase": phase, "ranks": ranks},
                "job_info": dict(self.job_info), "at_risk": self.metrics.at_risk(),
                "interval": dict(self.interval) if self.interval is not None else None}

    # --- progress reporting --------------------------------------------------------------

    async def record_stall(self, step: int, rank: int, seconds: float) -> None:
        """A rank's training thread was blocked ``seconds`` by the save of ``step``."""
        self.stalls.setdefault(step, {})[rank] = seconds
        for old in sorted(self.stalls)[:-64]:  # bounded: only recent steps are shown
            del self.stalls[old]

    def _stall(self, step: int) -> dict[str, float]:
        by_rank = self.stalls.get(step, {})
        return {"stall_s": max(by_rank.values())} if by_rank else {}

    async def record_interval(self, step: int, decision: IntervalDecision) -> None:
        """The interval the trainers chose at ``step`` (``interval_steps: auto``), and why."""
        self.interval = {"step": step, **asdict(decision)}
        self.metrics.interval(decision.steps)

    async def record_costs(self, cost_s: float | None, step_time_s: float | None) -> None:
        """Rank 0's measured save cost and step time after a save: the next attempt starts from them."""
        self.interval_costs = {"cost_s": cost_s, "step_time_s": step_time_s}

    async def interval_history(self) -> dict[str, Any]:
        """The newest measured save cost and step time (``interval_steps: auto``), or {}."""
        return dict(self.interval_costs)

    async def note_job(self, info: dict[str, Any]) -> None:
        """The driver's view after each controller step: state, attempt, failures, training step."""
        self.job_info = info
        self.metrics.at_risk(info.get("train_step"))

    def _progress(self) -> None:
        step, phase, ranks = self._inflight()
        self.metrics.progress(step, phase, ranks, self.world_size)

    def _inflight(self) -> tuple[int | None, str, dict[int, int]]:
        """The newest step in flight, its phase, and each rank's progress (1 handed off, 2 written)."""
        planning = [s for (_, s), g in list(self._gathers.items()) if not g.ready.is_set()]
        if not self.pending:
            return (max(planning), "planning", {}) if planning else (None, "idle", {})
        step = max(self.pending)
        p = self.pending[step]
        ranks = {r: 1 for r in p.accepted} | {r: 2 for r in p.reports}
        return step, inflight_phase(step in planning, len(p.accepted), len(p.reports), self.world_size), ranks

    def __repr__(self) -> str:
        # Ray shows this in the dashboard's actor list but computes it once, when the actor
        # (re)starts, so it names only what stays true and says where live progress is.
        import ray

        node = ray.get_runtime_context().get_node_id()[:12] if ray.is_initialized() else "-"
        job = self.layout.name
        return f"CheckpointActor(job={job} root={self.layout.root} node={node}; live: raytrain-ckpt status --job {job})"
