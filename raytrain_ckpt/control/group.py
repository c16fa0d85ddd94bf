"""The Ray worker group: a placement group and one TrainWorker actor per rank.

It implements the controller's small ``WorkerGroup`` protocol (start / poll / shutdown),
so the state machine is unit-tested with a fake and driven by this class in production.
"""

from __future__ import annotations

import logging
import time
import uuid

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import remove_placement_group

from raytrain_ckpt.checkpoint.roles.service import CheckpointService
from raytrain_ckpt.control.poll import GroupPoll, GroupStartError
from raytrain_ckpt.control.placement import Placement, room_outside
from raytrain_ckpt.common.events import Failure, Progress, RankPlace, WorkerResult, headline
from raytrain_ckpt.control.hang_evidence import diagnose, diagnostics_root, locate
from raytrain_ckpt.control.watch.hangs import Blame, keep_failures
from raytrain_ckpt.control.group_checkpoints import GroupCheckpointing
from raytrain_ckpt.control.heal import replace_replica
from raytrain_ckpt.control.pollcalls import poll_progress
from raytrain_ckpt.control.pool import WorkerPool, bundle_nodes, drain, kill_actor, new_worker
from raytrain_ckpt.control.startcalls import StartCalls
from raytrain_ckpt.control.watch.quarantine import Quarantine
from raytrain_ckpt.spec import JobSpec
from raytrain_ckpt.rank.worker import WorkerFailure

logger = logging.getLogger(__name__)

__all__ = ["RayWorkerGroup", "guard_failure"]


def guard_failure(attempt: int, reporter: int, cause: WorkerFailure) -> Failure:
    """The job's failure for the training guard's report: it names the rank that tripped (which
    the report carries), not ``reporter``, the rank that raised it (rank 0)."""
    rank = reporter if cause.rank is None else cause.rank
    return Failure(attempt, "rollback", rank, headline(cause.guard), cause.guard)


class RayWorkerGroup(GroupCheckpointing):
    """``num_workers`` TrainWorker actors in one placement group."""

    def __init__(self, spec: JobSpec, attempt: int, checkpoints: CheckpointService | None = None,
                 pool: WorkerPool | None = None, quarantine: Quarantine | None = None,
                 run_id: str | None = None) -> None:
        self.spec = spec
        self.run_id = run_id or uuid.uuid4().hex
        """The run's identity (the driver mints one per run): the key of its ranks' files on a node."""
        self.attempt = attempt
        self.checkpoints = checkpoints
        self.pool = pool
        self.workers: list[ray.actor.ActorHandle] = []
        self._runs: dict[ray.ObjectRef, int] = {}
        self._results: dict[int, WorkerResult] = {}
        self._pg = None
        self.reused = 0
        """Ranks of this attempt served by a kept or spare process instead of a new one."""
        self._spares_started = False
        self._where: list[RankPlace | None] = []
        """Each rank's (pid, node id): where its stacks are read from if the group hangs."""
        self.start_marks: list[tuple[str, float]] = []
        """(phase, time.monotonic() it ended) of the start: placement, rendezvous, load (the goodput ledger)."""
        self.quarantine = quarantine
        self.nodes: list[str] = []
        """The node of each rank's bundle, once placed."""
        self.rollbacks_before = 0
        """The guard's rollbacks in the job's earlier attempts (the controller sets it before ``start``)."""
        self._retired: set[int] = set()
        """Ranks whose process is never kept for the next attempt (``retire``)."""
        self._calls = StartCalls(spec.fault_tolerance.start_timeout_s)
        self._lighthouse, self._lighthouse_address = None, None  # with replica groups: the quorum, killed with the group
        self.healing: set[int] = set()  # ranks of replacement replica groups that have not trained a step yet (``heal``)
        self._moved, self._own_pgs = {}, []  # replica groups moved off a draining node: their ranks' nodes, their bundles

    def start(self) -> None:
        """Reserve bundles, create the actors, rendezvous, and start ``run()`` on every rank."""
        ft, res = self.spec.fault_tolerance, self.spec.resources
        deadline = time.monotonic() + ft.start_timeout_s
        self.start_marks.clear()
        # build placement group: the kept one, or a new one (smaller, when elastic and the
        # full group does not fit in time)
        kept = self.pool.take(self.spec.world_size) if self.pool is not None else None
        bundle = {"CPU": res.cpus_per_worker, **({"GPU": res.gpus} if res.gpus else {})}
        placement = Placement(self.spec, self.attempt, self.quarantine)
        try:
            self._pg, survivors = kept if kept is not None else (placement.place(bundle, deadline), {})
        finally:
            self.spec = placement.spec  # an elastic group that did not fit whole trains at the size that fit
        placement.probe_failed_nodes(self._pg, survivors)
        # build actors: survivors keep their rank, spares and new processes fill the gaps
        self.workers = self._assign_workers(survivors, deadline)
        self.nodes = bundle_nodes(self._pg)
        self.start_marks.append(("placement", time.monotonic()))
        # a first start on idle cores: spares ready before the first step (a restart's replenish
        # waits for its first step: a spare's start would slow the very restart it serves)
        if self.pool is not None and self.attempt == 0:
            self._spares_started = self.pool.replenish(self._pg, early=True)
        # rendezvous at rank 0's node (with replicas: each group at its first rank's); plan the
        # resume point while the ranks join (the first group saves), then set up every rank concurrently
        addr, port, joins = _join_groups(self.spec, self.workers, self._calls, deadline)
        self._lighthouse, lighthouse = self._lighthouse, self._lighthouse_address = _start_lighthouse(
            self.spec, self.run_id, self.attempt)
        try:
            saving = self.spec.saving_group()
            ckpt = (self.checkpoints.plan_attempt(self.attempt, saving, bundle_nodes(self._pg)[:saving.world_size])
                    if self.checkpoints is not None else None)
            setups = [w.setup.remote(ckpt.ranks[rank % saving.world_size] if ckpt is not None else None,
                                     self.rollbacks_before, lighthouse)
                      for rank, w in enumerate(self.workers)]
            self._calls.get_all(joins, deadline, "join rank {rank} to the process group")
            self.start_marks.append(("rendezvous", time.monotonic()))
            self._calls.get_all(setups, deadline, "set up rank {rank}")
            self.start_marks.append(("load", time.monotonic()))
            if self.checkpoints is not None:
                self.checkpoints.started()  # every rank loaded the start: the timeline begins there
        finally:
            if self.checkpoints is not None:
                self.checkpoints.release(self.attempt)
        self._where = locate(self.workers, max(1.0, deadline - time.monotonic()))  # for a hang's stacks
        self._runs = {w.run.remote(): rank for rank, w in enumerate(self.workers)}
        logger.info("attempt %d: %d workers training (%d reused; rendezvous %s:%d)", self.attempt,
                    len(self.workers), self.reused, addr, port)

    def _assign_workers(self, survivors: dict[int, ray.actor.ActorHandle],
                        deadline: float) -> list[ray.actor.ActorHandle]:
        """One actor per rank: a kept survivor, else a spare on the rank's node, else a new process.

        A kept or spare process that turns out dead when assigned is replaced by a new one:
        reuse only ever saves time, it never fails a start.
        """
        spec_json = self.spec.model_dump_json()
        nodes = bundle_nodes(self._pg)
        workers: dict[int, ray.actor.ActorHandle] = {}
        assigns: dict[ray.ObjectRef, int] = {}
        for rank in range(self.spec.world_size):
            actor = survivors.get(rank)
            if actor is None and self.pool is not None and not self.spec.resources.use_gpu:
                actor = self.pool.spare_for(nodes[rank])
            if actor is None:
                workers[rank] = new_worker(self.spec, self._pg, rank, self.attempt, self.run_id)
                continue
            workers[rank] = actor
            assigns[actor.assign.remote(spec_json, rank, self.spec.world_size, self.attempt, self.run_id)] = rank
        for ref, rank in assigns.items():
            try:
                self._calls.get(ref, deadline, f"assign rank {rank} to a kept worker")
                self.reused += 1
            except GroupStartError as exc:
                logger.warning("attempt %d: kept worker for rank %d unusable (%s); starting a new one",
                               self.attempt, rank, exc)
                kill_actor(workers[rank])
                workers[rank] = new_worker(self.spec, self._pg, rank, self.attempt, self.run_id)
        return [workers[r] for r in range(self.spec.world_size)]

    def note_failure(self, failure: Failure) -> str | None:
        """A rank's crash or hang: count it against its node; the line to report when that puts
        the node in quarantine (``fault_tolerance.quarantine_s``), else None."""
        return count_failure(self.quarantine, self._where, failure, self.attempt)

    def poll(self) -> GroupPoll:
        """Collect finished runs and failures, then read every rank's progress."""
        pending = self._pending_runs()
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0) if pending else ([], [])
        failures = collect_runs({ref: self._runs[ref] for ref in ready}, self._results, self.attempt)
        evidence = keep_failures(diagnostics_root(self.spec), self.attempt, failures) if failures else None
        progress = self._progress()
        self.healing -= {r for r, p in progress.items() if p.phase in ("training", "saving", "done")}
        # every other rank finished before a replacement's rejoin step (past the last step): it is not
        # needed; the saving group's always is (it rejoins in time to save the last step, ``ReplicaHeals``)
        saving = self.spec.world_size // self.spec.parallelism.dp_replicate if self.checkpoints is not None else 0
        finished = (bool(self._results) and not any(r < saving for r in self.healing)
                    and set(self._results) | self.healing == set(range(len(self.workers))))
        for rank in self.healing if finished else ():
            kill_actor(self.workers[rank])
        # without idle cores, spares start once every rank finished a step: a spare importing torch
        # while the group sets up or loads would take CPU from the very restart it is meant to speed up
        if not self._spares_started and self.pool is not None and self._pg is not None:
            self._spares_started = self.pool.replenish_once_trained(self._pg, progress, len(self.workers))
        return GroupPoll(
            results=[self._results[r] for r in sorted(self._results)],
            failures=failures,
            evidence=evidence,
            min_step=min((p.step for r, p in progress.items() if r not in self.healing), default=0),
            finished=finished,
            stall_s=max((p.stall_s for p in progress.values()), default=0.0),
            eval_s=max((p.eval_s for p in progress.values()), default=0.0),
            phases={r: p.phase for r, p in progress.items()},
            starts={r: (p.step, p.step_started_at) for r, p in progress.items() if p.phase == "training"},
            step_s=max((p.step_s for p in progress.values() if p.step_s is not None), default=None),
            rollbacks=max([p.rollbacks for p in progress.values()] + [r.rollbacks for r in self._results.values()],
                          key=len, default=()),
            evictions={r: p.evicted_until for r, p in progress.items() if p.evicted_until is not None}
            | {r.rank: r.evicted_until for r in self._results.values() if r.evicted_until is not None},
        )

    def heal(self, replica: int, off_node: bool = False) -> None:
        """Replace replica group ``replica`` while the others train on (``control/heal.py``);
        ``off_node``: its node drains, the replacement is placed elsewhere (so is a group moved before:
        its bundles are on the node it left)."""
        ranks = {r for r in range(self.spec.world_size) if r // (self.spec.world_size // self.spec.parallelism.dp_replicate) == replica}
        off_node = off_node or bool(ranks & set(self._moved))
        self._runs = {ref: r for ref, r in self._runs.items() if r not in ranks}
        self._results = {r: res for r, res in self._results.items() if r not in ranks}
        self.healing |= ranks
        new = replace_replica(self, replica, self._pg, self._calls, self._lighthouse, self._lighthouse_address, off_node)
        self._runs |= new.runs
        self._moved |= new.nodes
        self._where = [new.places.get(r, w) for r, w in enumerate(self._where)]  # a hang reads the new processes' stacks
        self._own_pgs += [new.pg] if new.pg is not None else []

    def rank_nodes(self) -> list[str]:
        """Node id of every rank, by rank (the placement group's bundles; a replica group moved off a draining node: its own)."""
        return [self._moved.get(r, n) for r, n in enumerate(bundle_nodes(self._pg))] if self._pg is not None else []

    def preempt(self, deadline_unix: float | None, tier: str = "durable") -> None:
        """A drain notice: every rank saves the step in hand (in ``tier``) at the next step boundary and stops."""
        for w in self.workers:
            w.preempt.remote(deadline_unix, tier)

    def retire(self, rank: int) -> None:
        """The next attempt gets a spare or a new process for ``rank`` (a straggler), even when the
        others are kept."""
        self._retired.add(rank)

    def diagnose(self) -> Blame:
        """Before the hung group is torn down: every rank's stacks and step, kept under the job
        root's diagnostics/attempt-N/, and the culprit (``hang_evidence``)."""
        return diagnose(self.workers, self._where, diagnostics_root(self.spec) / f"attempt-{self.attempt}")

    def _pending_runs(self) -> list[ray.ObjectRef]:
        """The ``run()`` refs of ranks whose result is not collected yet."""
        return [r for r in self._runs if self._runs[r] not in self._results]

    def wait(self, timeout_s: float) -> None:
        """Until the ranks' runs have ended or ``timeout_s`` passes, returning early once a run has
        ended and the others ended too: a crash is seen as soon as Ray reports it, not at the next
        poll. (A dead process's peers often end first, with a connection reset: waiting for the
        other runs within the interval lets the poll see the crash itself, not that echo.)"""
        pending = self._pending_runs()
        if not pending:
            time.sleep(timeout_s)
            return
        deadline = time.monotonic() + timeout_s
        ended, rest = ray.wait(pending, num_returns=1, timeout=timeout_s)
        if ended and rest:
            ray.wait(rest, num_returns=len(rest), timeout=max(0.0, deadline - time.monotonic()))

    def _progress(self) -> dict[int, Progress]:
        out = {r.rank: Progress(r.rank, r.steps, None, time.time(), "done") for r in self._results.values()}
        running = [rank for rank in range(len(self.workers)) if rank not in self._results]
        # One call per node (rank/progress.py); a dead rank's run() ref reports its death.
        out |= poll_progress(self.workers, self.nodes, running, self.spec.fault_tolerance.poll_interval_s)
        return out

    def shutdown(self, keep_warm: bool = False) -> None:
        """Kill the actors (no Ray-level restart: the controller decides) and free the bundles.

        With ``keep_warm`` (a restart after a crash or exception) and a pool, the placement
        group and every rank that leaves the failed step and resets within
        ``fault_tolerance.drain_timeout_s`` are kept for the next attempt; only the rest is killed.
        """
        out = set(self.quarantine.excluded(time.monotonic())) if self.quarantine is not None else set()
        if keep_warm and out & set(self.nodes) and room_outside(self.spec, out) >= self.spec.world_size:
            keep_warm = False  # a kept bundle would keep a quarantined node in the group: placed anew around it
        survivors = drain(self._runs, self.workers, self.spec.fault_tolerance.drain_timeout_s) if keep_warm and self.pool is not None and self._pg is not None else {}
        survivors = {rank: w for rank, w in survivors.items() if rank not in self._retired}
        for rank, w in enumerate(self.workers):
            if rank not in survivors:
                kill_actor(w)
        if survivors:
            assert self.pool is not None
            self.pool.keep(self._pg, survivors)
            logger.info("attempt %d: keeping rank(s) %s for the next attempt", self.attempt, sorted(survivors))
        elif self._pg is not None:
            remove_placement_group(self._pg)
        self.workers = []
        self._pg = None
        for pg in self._own_pgs:
            remove_placement_group(pg)
        if self._lighthouse is not None:
            kill_actor(self._lighthouse)
            self._lighthouse = None


def count_failure(quarantine: Quarantine | None, where: list[RankPlace | None], failure: Failure,
                  attempt: int) -> str | None:
    """``RayWorkerGroup.note_failure``: ``failure`` counted against its rank's node (``where``)."""
    rank = failure.rank
    place = where[rank] if rank is not None and rank < len(where) else None
    if quarantine is None or rank is None or place is None:
        return None
    line = quarantine.rank_failed(failure.kind, rank, place.node_id, time.monotonic())
    if line is not None:
        logger.warning("attempt %d: %s", attempt, line)
    return line


def _join_groups(spec: JobSpec, workers: list[ray.actor.ActorHandle], calls: StartCalls,
                 deadline: float) -> tuple[str, int, list[ray.ObjectRef]]:
    """Ask every rank to join its process group: the job's, at rank 0's store, or with replica
    groups each group's own, at its first rank's. Returns rank 0's address and the join calls."""
    size = spec.world_size // spec.parallelism.dp_replicate
    meets = [calls.get(workers[g].address.remote(), deadline, f"locate rank {g}")
             for g in range(0, spec.world_size, size)]
    joins = [w.join.remote(meets[rank // size].host, meets[rank // size].port) for rank, w in enumerate(workers)]
    return meets[0].host, meets[0].port, joins


def _start_lighthouse(spec: JobSpec, run_id: str, attempt: int) -> tuple[ray.actor.ActorHandle | None, str | None]:
    """With replica groups: the attempt's quorum server on the head node (``replicas/lighthouse.py``)
    and its address; None, None without."""
    from raytrain_ckpt.replicas.lighthouse import lighthouse_name, start_lighthouse

    r = spec.parallelism.dp_replicate
    if r == 1:
        return None, None
    actor, address = start_lighthouse(lighthouse_name(run_id, attempt), min_replicas=spec.fault_tolerance.min_replicas)
    logger.info("attempt %d: %d replica groups of %d ranks; quorum at %s", attempt, r, spec.world_size // r, address)
    return actor, address


def collect_runs(ended: dict[ray.ObjectRef, int], results: dict[int, WorkerResult], attempt: int) -> list[Failure]:
    """The ended ``run()`` refs (ref -> rank): each result into ``results``; the failures, crashes first."""
    failures: list[Failure] = []
    for ref, rank in ended.items():
        try:
            results[rank] = ray.get(ref)
        except WorkerFailure as exc:
            # Ray wraps the worker's exception; its cause carries the clean traceback.
            cause = getattr(exc, "cause", None) or exc
            if getattr(cause, "guard", None):  # the training guard's one report: no traceback, no restart
                failures.append(guard_failure(attempt, rank, cause))
                continue
            failures.append(Failure(attempt, "exception", rank, headline(cause.text), str(cause)))
        except RayActorError as exc:
            what = f"worker process died: {headline(str(exc))}"
            failures.insert(0, Failure(attempt, "crash", rank, what, f"rank {rank}: {what}\n{exc}"))
    return failures
