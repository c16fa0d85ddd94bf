"""The driver's handle on checkpointing: creates the CheckpointActor and one writer per node,
plans each attempt's checkpoints (the resume point, each rank's source, its writer), and cleans
up at the end of the job."""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import ray
from ray.exceptions import GetTimeoutError

from raytrain_ckpt.checkpoint.policy.interval import IntervalHistory
from raytrain_ckpt.checkpoint.policy.schedule import SaveSchedule
from raytrain_ckpt.checkpoint.policy.retention import KeepBest, RetentionPolicy
from raytrain_ckpt.checkpoint.records import ActorStatus, AttemptPlan, CommittedCopy, GroupLayout, JobNote, RankCheckpointPlan, ResumePoint
from raytrain_ckpt.checkpoint.recovery.memcopy import choose_sources, CopyFacts, RankSource
from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor, actor_concurrency
from raytrain_ckpt.checkpoint.roles.fleet import WriterFleet
from raytrain_ckpt.checkpoint.roles.ramtier import MemoryStep, RamTier, draining
from raytrain_ckpt.checkpoint.roles.names import NAMESPACE, actor_name, call_restarting
from raytrain_ckpt.checkpoint.storage.backends import job_root
from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint
from raytrain_ckpt.checkpoint.format.verify import Verify
from raytrain_ckpt.common.events import headline
from raytrain_ckpt.common.faults import planned
from raytrain_ckpt.spec import CheckpointSpec, JobSpec
from raytrain_ckpt.checkpoint.errors import ResumeRefused

logger = logging.getLogger(__name__)

__all__ = ["NAMESPACE", "CheckpointService", "CopySources", "actor_name"]


COPY_QUERY_TIMEOUT_S = 10.0
"""How long a restart waits for a node's writer to say which in-memory copy it holds; a writer
that does not answer in time (its node is going away) sends the restart to storage."""


def _retention(cfg: CheckpointSpec) -> RetentionPolicy:
    best = cfg.keep_best
    keep_best = KeepBest(best.metric, best.mode, best.k) if best is not None else None
    return RetentionPolicy(cfg.keep_latest_k, cfg.keep_every_n_steps, keep_best)


def _actor_options(spec: JobSpec) -> dict[str, object]:
    return dict(name=actor_name(spec.name), namespace=NAMESPACE, num_cpus=0, max_restarts=-1, max_task_retries=0,
                max_concurrency=actor_concurrency(spec.world_size))  # more waiting calls than Ray's default 1,000


class CheckpointService:
    """Job-scoped: lives as long as the driver, across every attempt of the worker group."""

    def __init__(self, spec: JobSpec, fault_env: dict[str, str] | None = None, run_id: str | None = None) -> None:
        self.spec = spec
        self.run_id = run_id or uuid.uuid4().hex  # the actor's restarts report this run's failed saves, no other's
        self.started_unix = time.time()
        cfg = spec.checkpoint
        self.root = job_root(cfg.dir, spec.name)
        env = dict(fault_env or {})  # fault settings: an argument, not a runtime_env (see TrainWorker.__init__)
        self.actor = ray.remote(CheckpointActor).options(**_actor_options(spec)).remote(
            str(self.root), _retention(cfg), cfg.storage_options, cfg.leftover_grace_s, env, self.run_id,
            secrets.token_hex(32))  # the run's seal key: Ray restarts the actor with it (``seals.py``)
        self.fleet = WriterFleet(spec, str(self.root), self.actor, env)
        self.sources = CopySources(spec, self.fleet, self._ask)
        self.ram = RamTier(self.fleet.writers)
        self.memory_step: MemoryStep | None = None
        """A preemption's RAM-tier step, offered once to the next attempt (``keep_in_ram``)."""
        self._note: ray.ObjectRef | None = None
        self.replaced: dict[int, list[str]] = {}
        """By attempt: the checkpoint writers and actor replaced before it, for not answering."""
        self._job: JobNote | None = None
        """The controller's newest summary (``note_job``)."""
        self._start: str | None = None
        """The checkpoint the run began from (None: a fresh start): what a later attempt loads
        before the run's first commit."""
        self._begun: tuple[ResumePoint | None, str] | None = None
        """The run's starting point and ``checkpoint.resume``, until every rank of an attempt loaded
        it (``started``); None once the timeline starts there."""

    def writer_for(self, node_id: str) -> Any:
        """See ``WriterFleet.writer_for``."""
        return self.fleet.writer_for(node_id)

    def preflight(self) -> None:
        """See ``WriterFleet.preflight``."""
        self.fleet.preflight()

    def plan_attempt(self, attempt: int, spec: JobSpec, nodes: list[str]) -> AttemptPlan:
        """Each rank's checkpoint plan for ``attempt`` (``spec``: its layout; ``nodes``: every
        rank's node id): the actor, the writer on its node, the resume point and its source, and
        the interval history (the same on every rank: they agree on the interval)."""
        if attempt > 0:  # a writer or the actor that stopped answering is not handed to the new attempt
            self.replaced[attempt] = self.fleet.replace_silent()
        t0 = time.monotonic()
        point, sources = self.resume_plan(attempt, spec, nodes)
        plan_s = time.monotonic() - t0  # verifying the resume step on storage and choosing each rank's source
        self.fleet.replicate_between(nodes)
        history = self.interval_history()
        return AttemptPlan(tuple(
            RankCheckpointPlan(self.actor, self.writer_for(nodes[rank]), point,
                               sources[rank] if sources else None, history, plan_s)
            for rank in range(spec.world_size)))

    def heal_plans(self, nodes: list[str]) -> tuple[RankCheckpointPlan, ...]:
        """The saving group's replacement's plans (on ``nodes``): the saves in flight settle first."""
        self._ask("settle", self.spec.checkpoint.settle_timeout_s)
        history = self.interval_history()
        return tuple(RankCheckpointPlan(self.actor, self.writer_for(n), None, None, history) for n in nodes)

    def resume_plan(self, attempt: int, spec: JobSpec,
                    nodes: list[str]) -> tuple[ResumePoint | None, list[RankSource] | None]:
        """The step this attempt resumes from, and where each rank loads it from.

        A restart that may load from memory verifies storage only up to sizes first: when every
        copy verifies (their recorded files are the manifest's, and each rank checksums its own
        buffer) storage's bytes are never read. Only when storage serves after all is the step
        verified to ``verify_on_load`` (a damaged step is then skipped as always).
        """
        full = spec.checkpoint.verify_on_load
        quick = attempt > 0 and spec.checkpoint.memory_copies >= 2 and full != "size"
        point = self.acquire(attempt, spec, "size" if quick else full)
        in_ram = self._from_memory_step(attempt, spec, nodes, point)
        if in_ram is not None:
            return in_ram
        sources = self.recovery_sources(attempt, spec, point, nodes)
        if quick and point is not None and sources is not None and sources[0].source != "memory":
            logger.info("attempt %d: verifying step %d on storage (%s), since storage serves", attempt, point.step, full)
            again = self.acquire(attempt, spec, full)
            if again is None or again.step != point.step:
                sources = self.recovery_sources(attempt, spec, again, nodes)
            point = again
        return point, sources

    def ram_tier_nodes(self, draining: set[str]) -> list[str]:
        """Nodes a RAM-tier copy may be pushed to with ``draining`` nodes draining (``RamTier``)."""
        return self.ram.targets(draining)

    def keep_in_ram(self, node: str, step: int, deadline_unix: float | None) -> str | None:
        """After a RAM-tier save of ``step``: hold it off draining ``node`` for the next attempt
        (``RamTier.keep``); None, or why it is not held (the next attempt then resumes from storage)."""
        kept = self.ram.keep(node, step, self.spec.world_size, deadline_unix)
        if isinstance(kept, str):
            logger.warning("preemption: step %d is not held in RAM: %s", step, kept)
            return kept
        self.memory_step = kept
        return None

    def _from_memory_step(self, attempt: int, spec: JobSpec, nodes: list[str], durable: ResumePoint | None
                          ) -> tuple[ResumePoint, list[RankSource]] | None:
        """The RAM-tier step as this attempt's resume point, when every rank's copy is found in
        memory; else None (storage's latest committed step, ``durable``, serves). Offered once."""
        held, self.memory_step = self.memory_step, None
        if held is None or (durable is not None and durable.step >= held.step):
            return None
        # the durable step's path: where a rank that refuses its copy at load time falls back to
        point = ResumePoint(held.step, durable.path if durable is not None else "", held.world_size,
                            held.step * spec.training.global_batch_size, getattr(durable, "metadata_key", None))
        sources = self.sources.recovery_sources(attempt, spec, point, nodes, memory_only=True)
        if sources is not None and sources[0].source == "memory":
            logger.warning("attempt %d: resuming from step %d held in RAM (a preemption's RAM tier; not on storage)",
                           attempt, held.step)
            return point, sources
        fallback = "step 0 (nothing committed)" if durable is None else f"committed step {durable.step}"
        logger.warning("attempt %d: the RAM copy of step %d is lost (%s): resuming from the last durable step, %s",
                       attempt, held.step, sources[0].why if sources else "no copy", fallback)
        return None

    def acquire(self, attempt: int, spec: JobSpec, verify: Verify | None = None) -> ResumePoint | None:
        """Verify (to ``verify``, default ``checkpoint.verify_on_load``) and lease the checkpoint
        this attempt loads (None: start fresh).

        ``spec`` is the attempt's layout (an elastic restart may run fewer workers).
        """
        s = spec
        if attempt > 0:
            self._ask("settle", s.checkpoint.settle_timeout_s)
        self._ask("configure", GroupLayout(s.world_size, s.dp_size, s.spec_hash(), s.model.model_dump(mode="json")))
        holder, verify = f"attempt-{attempt}", verify or s.checkpoint.verify_on_load
        if attempt == 0 or self._begun is not None:
            # Until an attempt's ranks have loaded it, every attempt starts where the run was asked
            # to: the steps the new timeline moves aside are still in place (``started``).
            try:
                point = self._ask("begin", holder, s.checkpoint.resume, verify)
            except InvalidCheckpoint as exc:  # Ray's error is an instance of its cause; keep its message only
                raise ResumeRefused(str(getattr(exc, "cause", None) or exc)) from None
            self._start = point.path if point is not None else None
            self._begun = (point, s.checkpoint.resume)
        else:
            # The newest step of this run's timeline; before its first commit, where the run began.
            point = self._ask("acquire", holder, "latest", verify)
            if point is None and self._start is not None:
                point = self._ask("acquire", holder, self._start, verify)
        if point is None:
            logger.info("attempt %d: no checkpoint to resume from under %s; starting at step 0", attempt, self.root)
        else:
            logger.info("attempt %d: resuming from step %d (%s, saved at world size %d)", attempt, point.step,
                        point.path, point.world_size)
        return point

    def recovery_sources(self, attempt: int, spec: JobSpec, point: ResumePoint | None,
                         nodes: list[str]) -> list[RankSource] | None:
        """See ``CopySources.recovery_sources``."""
        return self.sources.recovery_sources(attempt, spec, point, nodes)

    def _ask(self, method: str, *args: Any) -> Any:
        """Call the CheckpointActor, waiting out a restart (it was on a lost node; Ray restarts it
        elsewhere and it rebuilds its state from storage) for up to fault_tolerance.start_timeout_s.
        Only idempotent methods are asked this way: a call may have run before the actor went away."""
        return call_restarting(lambda: getattr(self.actor, method).remote(*args),
                               self.spec.fault_tolerance.start_timeout_s, f"checkpoint actor {method}")

    def unsaved(self, results: list[Any], status: ActorStatus) -> str | None:
        """Why a finished job's checkpoints are not what it asked for, or None.

        Two cases fail the job: the save of the last step was due (by the interval or
        save_final) and did not commit; or saves were attempted and none of them committed
        (the trained state exists nowhere). ``results`` are the workers' WorkerResults.
        """
        total = self.spec.training.steps
        cfg = self.spec.checkpoint
        trained = bool(results) and results[0].start_step < total
        failed = status.failed
        # With interval_steps=auto only save_final makes the last step's save certain.
        if trained and SaveSchedule.configured(total, cfg.interval_steps, cfg.save_final).by_step(total) \
                and total not in status.committed:
            return f"the final checkpoint (step {total}) did not commit: {failed.get(total, 'it was never saved')}"
        new = [s for s, info in status.steps.items() if info.created_unix >= self.started_unix]
        if failed and not new:
            reasons = "; ".join(f"step {s}: {why}" for s, why in sorted(failed.items()))
            return f"no checkpoint of this run committed, {len(failed)} save(s) failed ({reasons})"
        return None

    def interval_history(self) -> IntervalHistory | None:
        """What ``interval_steps: auto`` starts an attempt from (None: a fixed interval): the
        failures and wall time of the job so far, as the controller reported them, and the
        save cost and step time the earlier attempts measured (their newest decision)."""
        if self.spec.checkpoint.interval_steps != "auto":
            return None
        last = self._ask("interval_history")
        return IntervalHistory(failures=sum(self._job.failures.values()) if self._job is not None else 0,
                               survived_s=time.time() - self.started_unix,
                               cost_s=last.cost_s if last else None, step_time_s=last.step_time_s if last else None)

    def started(self) -> None:
        """Every rank of an attempt loaded its starting point: the first time, the run's timeline
        starts there (``CheckpointActor.start_timeline``: the steps not on it are moved aside)."""
        if self._begun is None:
            return
        point, resume = self._begun
        try:
            self._ask("start_timeline", point.step if point else None, point.path if point else None, resume)
        except InvalidCheckpoint as exc:
            raise ResumeRefused(str(getattr(exc, "cause", None) or exc)) from None
        self._begun = None

    def release(self, attempt: int) -> None:
        self.actor.release.remote(f"attempt-{attempt}")

    def status(self) -> ActorStatus:
        return self._ask("status")

    def note_job(self, info: JobNote) -> None:
        """Tell the CheckpointActor the job's state and training step (it turns them into work at
        risk and ``status --job``), unless the previous note is still on its way: a restarting
        actor must not queue up one call per poll."""
        self._job = info
        if self._note is not None:
            if not ray.wait([self._note], timeout=0)[0]:
                return
            try:
                ray.get(self._note)
            except Exception as exc:  # the actor is restarting or gone; the next note retries
                logger.debug("job note not delivered: %s", exc)
        self._note = self.actor.note_job.remote(info)

    def shutdown(self, settle: bool = True) -> None:
        """Let handed-off saves commit, free staging memory, stop the actors.

        A job that failed may leave a step that every rank handed to a writer: it is still
        committed (bounded by checkpoint.settle_timeout_s), so the next run resumes from it.
        ``settle=False`` (a run stopped by Ctrl-C) does not wait for it: the committed steps stay,
        and the next start removes what was left in flight.
        """
        timeout = self.spec.checkpoint.settle_timeout_s
        try:
            if settle:
                ray.get(self.actor.settle.remote(timeout), timeout=timeout + 30)
            else:
                logger.warning("a checkpoint still in flight is not waited for (interrupted, or its settle gave up)")
        except Exception as exc:  # the actor is gone or stuck: nothing in flight can commit anyway
            logger.warning("could not settle in-flight checkpoints: %s", exc)
        for w in self.fleet.writers.values():
            try:
                ray.get(w.release_all.remote(), timeout=30)
            except Exception as exc:  # a dead writer's files are gone with its node, or leak in /dev/shm
                logger.warning("could not release staging buffers: %s", exc)
            ray.kill(w, no_restart=True)
        ray.kill(self.actor, no_restart=True)


class CopySources:
    """Where each rank of a restart loads its step from: the in-memory copy on its node, a peer's
    replica moved to its node, or storage (``memcopy.choose_sources`` decides)."""

    def __init__(self, spec: JobSpec, fleet: WriterFleet, ask: Callable[..., Any]) -> None:
        self.spec, self.fleet, self._ask = spec, fleet, ask

    def recovery_sources(self, attempt: int, spec: JobSpec, point: ResumePoint | None,
                         nodes: list[str], memory_only: bool = False) -> list[RankSource] | None:
        """Where each rank of ``attempt`` loads ``point`` from: its node's in-memory copy or storage,
        decided in one place (``memcopy.choose_sources``) and logged in one line. None: nothing to load.

        ``nodes``: the node id of every rank of the attempt. ``memory_only``: ``point`` is a RAM-tier
        step (no manifest on storage: each copy's own CRC-32C is its only proof).
        """
        if point is None:
            return None
        if attempt == 0:  # a new job: its writers hold nothing yet
            return [RankSource(r, "storage", "the job's first attempt") for r in range(spec.world_size)]
        asked = [self._ask_copy(attempt, rank, node, point.step) for rank, node in enumerate(nodes)]
        deadline = time.monotonic() + COPY_QUERY_TIMEOUT_S  # for all answers together
        answers = [self._answer(ref, deadline) for _, ref in asked]
        # A writer that did not answer in time (its node is going away) is not asked again for
        # each of its ranks, nor sent a copy: the one deadline is all it costs the restart.
        silent = {node for node, answer in zip(nodes, answers) if answer is not None and answer[2]}
        facts = [self._copy_facts(rank, node, step, answer, silent, memory_only)
                 for rank, (node, (step, _), answer) in enumerate(zip(nodes, asked, answers))]
        listed = None if memory_only else {n: asdict(f) for n, f in self._ask("manifest_files", point.step).items()}
        sources = choose_sources(point.step, spec.world_size, point.world_size, spec.checkpoint.memory_copies,
                                 facts, listed)
        if sources[0].source == "memory":
            logger.info("attempt %d: every rank loads step %d from its node's in-memory copy (%d node(s))",
                        attempt, point.step, len(set(nodes)))
        elif not memory_only:  # a RAM-tier step is not on storage: the caller says what serves instead
            logger.info("attempt %d: loading step %d from storage: %s", attempt, point.step, sources[0].why)
        return sources

    def _ask_copy(self, attempt: int, rank: int, node: str,
                  step: int) -> tuple[int, ray.ObjectRef | Exception | None]:
        """Ask ``node``'s writer for rank ``rank``'s copy of ``step``, without waiting for the answer
        (every rank's question is out before any answer is awaited): the step asked for and the
        answer's ref, the error that kept the question from being sent, or None (no copies kept)."""
        if self.spec.checkpoint.memory_copies < 2:
            return step, None
        if planned("stale", "restore", rank, step, attempt):  # the copy of the step before
            step = max((s for s in self._ask("status").committed if s < step), default=-1)
        try:
            return step, self.fleet.writer_for(node).committed_copy.remote(rank, step)
        except Exception as exc:  # no writer there (e.g. the node does not share the root): storage serves
            return step, exc

    def _answer(self, asked: ray.ObjectRef | Exception | None,
                deadline: float) -> tuple[CommittedCopy | None, str | None, bool] | None:
        """A writer's answer to ``_ask_copy`` by ``deadline``: its copy, why it could not be asked,
        and whether it did not answer in time (None: no copies kept, nothing was asked)."""
        if asked is None:
            return None
        if isinstance(asked, Exception):
            return None, f"{type(asked).__name__}: {headline(str(asked))}", False
        try:
            return ray.get(asked, timeout=max(0.0, deadline - time.monotonic())), None, False
        except Exception as exc:  # a dead, unreachable or silent writer: its copy is lost, storage serves
            return None, f"{type(exc).__name__}: {headline(str(exc))}", isinstance(exc, GetTimeoutError)

    def _copy_facts(self, rank: int, node: str, step: int, answer: tuple[CommittedCopy | None, str | None, bool] | None,
                    silent: set[str], memory_only: bool = False) -> CopyFacts:
        if answer is None:
            return CopyFacts(rank, None)
        copy, why, _ = answer
        # a RAM-tier step was pushed off its draining node: looked for on other nodes whatever replication says
        peers = self.spec.checkpoint.replication.mode == "auto" or memory_only
        if copy is None and peers and node not in silent:
            copy = self._copy_from_peer(rank, node, step, silent)  # the rank moved node, or its writer is gone
            why = None if copy is not None else why
        return CopyFacts(rank, copy, why)

    def _copy_from_peer(self, rank: int, node: str, step: int, silent: set[str]) -> CommittedCopy | None:
        """Rank ``rank``'s copy of ``step`` from another node (its old node's own copy, or the
        replica its old node sent to its peer), moved to the writer on ``node`` where the rank now
        runs (re-checked on both ends). None when no alive node holds one, or moving it failed.
        ``silent``: nodes whose writer did not answer in time, not asked (one that times out here
        is added)."""
        # a draining node's writer is not a source: the node is about to go
        alive = (set(RamTier(self.fleet.writers).targets(draining())) - silent)
        for holder in sorted(alive, key=lambda n: (n != node, n)):  # the rank's node first: nothing to move
            try:
                held = ray.get(self.fleet.writers[holder].copies_held.remote(step), timeout=COPY_QUERY_TIMEOUT_S)
                found = next((c for c in held if c.rank == rank), None)
                if found is None:
                    continue
                if holder != node:
                    found = ray.get(self.fleet.writer_for(holder).push_replica.remote(
                        rank, step, self.fleet.writer_for(node), node),
                        timeout=self.spec.fault_tolerance.start_timeout_s)
            except Exception as exc:  # a writer restarting, gone, or a failed move: try the next holder
                if isinstance(exc, GetTimeoutError):  # not asked again for the next rank
                    silent.add(holder)
                logger.info("rank %d: no copy of step %d from node %s: %s", rank, step, holder[:12], headline(str(exc)))
                continue
            logger.info("rank %d loads step %d from the peer replica on node %s (copy of node %s)", rank, step,
                        holder[:12], found.source_node[:12])
            return found.copy
        return None
