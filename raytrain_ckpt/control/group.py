"""The Ray worker group: a placement group and one TrainWorker actor per rank.

It implements the controller's small ``WorkerGroup`` protocol (start / poll / shutdown),
so the state machine is unit-tested with a fake and driven by this class in production.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raytrain_ckpt.checkpoint.roles.service import CheckpointService
from raytrain_ckpt.control.poll import GroupPoll, GroupStartError
from raytrain_ckpt.control.policy import elastic_world_size
from raytrain_ckpt.common.events import Failure, Progress, RankPlace, WorkerResult, headline
from raytrain_ckpt.common.faults import fault_env
from raytrain_ckpt.control.hang_evidence import diagnose, diagnostics_root, locate
from raytrain_ckpt.control.watch.hangs import Verdict, keep_failures
from raytrain_ckpt.rank.progress import poll_progress
from raytrain_ckpt.control.pool import WorkerPool, bundle_nodes, kill_actor
from raytrain_ckpt.control.watch.preemption import draining_nodes, room_for
from raytrain_ckpt.control.watch.quarantine import Quarantine
from raytrain_ckpt.spec import JobSpec
from raytrain_ckpt.rank.worker import TrainWorker, WorkerFailure

logger = logging.getLogger(__name__)

__all__ = ["RayWorkerGroup", "guard_failure"]


def guard_failure(attempt: int, reporter: int, cause: WorkerFailure) -> Failure:
    """The job's failure for the training guard's report: it names the rank that tripped (which
    the report carries), not ``reporter``, the rank that raised it (rank 0)."""
    rank = reporter if cause.rank is None else cause.rank
    return Failure(attempt, "rollback", rank, headline(cause.guard), cause.guard)


class RayWorkerGroup:
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
        self.start_marks: list[tuple[str, float]] = []
        self.quarantine = quarantine
        self.nodes: list[str] = []
        """The node of each rank's bundle, once placed."""
        self.rollbacks_before = 0
        """The guard's rollbacks in the job's earlier attempts (the controller sets it before ``start``)."""
        self._retired: set[int] = set()
        """Ranks whose process is never kept for the next attempt (``retire``)."""
        """(phase, time.monotonic() it ended) of the start: placement, rendezvous, load (the goodput ledger)."""
        """Each rank's (pid, node id): where its stacks are read from if the group hangs."""

    @property
    def replaced(self) -> list[str]:
        """The checkpoint writers and actor this attempt's start replaced because they did not
        answer (``CheckpointService.plan_attempt``), one line each."""
        return self.checkpoints.replaced.get(self.attempt, []) if self.checkpoints is not None else []

    def start(self) -> None:
        """Reserve bundles, create the actors, rendezvous, and start ``run()`` on every rank."""
        ft, res = self.spec.fault_tolerance, self.spec.resources
        deadline = time.monotonic() + ft.start_timeout_s
        self.start_marks.clear()
        # build placement group: the kept one, or a new one (smaller, when elastic and the
        # full group does not fit in time)
        kept = self.pool.take(self.spec.world_size) if self.pool is not None else None
        bundle = {"CPU": res.cpus_per_worker, **({"GPU": res.gpus} if res.gpus else {})}
        self._pg, survivors = kept if kept is not None else (self._place(bundle, deadline), {})
        self._probe_failed_nodes(survivors)
        # build actors: survivors keep their rank, spares and new processes fill the gaps
        self.workers = self._assign_workers(survivors, deadline)
        self.nodes = bundle_nodes(self._pg)
        self.start_marks.append(("placement", time.monotonic()))
        # rendezvous at rank 0's node; plan the resume point while the ranks join, then set up
        # every rank concurrently
        meet = self._get(self.workers[0].address.remote(), deadline, "locate rank 0")
        addr, port = meet.host, meet.port
        joins = [w.join.remote(addr, port) for w in self.workers]
        try:
            ckpt = (self.checkpoints.plan_attempt(self.attempt, self.spec, bundle_nodes(self._pg))
                    if self.checkpoints is not None else None)
            setups = [w.setup.remote(ckpt.ranks[rank] if ckpt is not None else None, self.rollbacks_before)
                      for rank, w in enumerate(self.workers)]
            self._get_all(joins, deadline, "join rank {rank} to the process group")
            self.start_marks.append(("rendezvous", time.monotonic()))
            self._get_all(setups, deadline, "set up rank {rank}")
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
                workers[rank] = self._new_worker(rank)
                continue
            workers[rank] = actor
            assigns[actor.assign.remote(spec_json, rank, self.spec.world_size, self.attempt, self.run_id)] = rank
        for ref, rank in assigns.items():
            try:
                self._get(ref, deadline, f"assign rank {rank} to a kept worker")
                self.reused += 1
            except GroupStartError as exc:
                logger.warning("attempt %d: kept worker for rank %d unusable (%s); starting a new one",
                               self.attempt, rank, exc)
                kill_actor(workers[rank])
                workers[rank] = self._new_worker(rank)
        return [workers[r] for r in range(self.spec.world_size)]

    def _new_worker(self, rank: int) -> ray.actor.ActorHandle:
        """A new TrainWorker process in bundle ``rank`` of the placement group."""
        res = self.spec.resources
        strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank)
        # A fault plan set on the driver reaches every worker (see raytrain_ckpt.common.faults).
        return ray.remote(TrainWorker).options(
            num_cpus=res.cpus_per_worker, num_gpus=res.gpus, max_concurrency=2, scheduling_strategy=strategy,
        ).remote(self.spec.model_dump_json(), rank, self.spec.world_size, self.attempt, fault_env(), self.run_id)

    def _place(self, bundle: dict[str, float], deadline: float):
        ft, res = self.spec.fault_tolerance, self.spec.resources
        elastic = res.min_workers is not None and res.min_workers < self.spec.world_size
        wait_s = min(ft.placement_timeout_s, ft.start_timeout_s) if elastic else ft.start_timeout_s
        selector = self._around_quarantine(bundle)
        pg = placement_group([dict(bundle)] * self.spec.world_size, strategy=res.placement_strategy,
                             **({"bundle_label_selector": selector} if selector else {}))
        if pg.wait(timeout_seconds=wait_s):
            return pg
        remove_placement_group(pg)
        if elastic:
            fit = room_for(bundle, set(draining_nodes()))  # a draining node takes no bundle
            t = self.spec.training
            n = elastic_world_size(self.spec.world_size, res.min_workers, fit, t.global_batch_size, t.micro_batch_size,
                                   self.spec.parallelism.pp)
            if n is not None and n < self.spec.world_size:
                logger.warning("attempt %d: %d workers could not be placed within fault_tolerance.placement_timeout_s="
                               "%gs; %d fit: continuing with %d workers (dp %d, global batch %d, %d micro-batches "
                               "per rank)", self.attempt, self.spec.world_size, wait_s, fit, n,
                               n // self.spec.parallelism.pp, t.global_batch_size,
                               self.spec.with_workers(n).local_microbatches)
                self.spec = self.spec.with_workers(n)
                pg = placement_group([dict(bundle)] * n, strategy=res.placement_strategy)
                if pg.wait(timeout_seconds=max(0.1, deadline - time.monotonic())):
                    return pg
                remove_placement_group(pg)
        raise GroupStartError(
            f"could not reserve {self.spec.world_size} x {bundle} within {wait_s:g}s; the cluster has "
            f"{ray.available_resources()} available. Lower resources.num_workers / cpus_per_worker, add nodes, "
            "or set resources.min_workers to allow a smaller group."
        )

    def _around_quarantine(self, bundle: dict[str, float]) -> list[dict[str, str]] | None:
        """The label selector keeping the group off quarantined nodes, when the other alive nodes
        have room for every rank (else None: the group may use them, logged)."""
        q = self.quarantine
        selector = q.selector(time.monotonic(), self.spec.world_size) if q is not None else None
        if selector is None or q is None:
            return None
        out = set(q.excluded(time.monotonic()))
        room = self._room_outside(out, bundle)
        if room < self.spec.world_size:
            logger.warning("attempt %d: quarantined node(s) %s used: the other nodes have room for %d of %d ranks",
                           self.attempt, ", ".join(sorted(out)), room, self.spec.world_size)
            return None
        logger.info("attempt %d: placing around quarantined node(s) %s", self.attempt, ", ".join(sorted(out)))
        return selector

    def _probe_failed_nodes(self, survivors: dict[int, ray.actor.ActorHandle]) -> None:
        """Before a node whose ranks failed before gets a rank: a short health probe (``control/watch/health.py``).
        A node that fails it is quarantined and this start fails, so the next is placed around it."""
        q = self.quarantine
        nodes = [n for n in bundle_nodes(self._pg) if n in q.failures] if q is not None else []
        if q is None or not nodes or q.quarantine_s is None:
            return
        from raytrain_ckpt.checkpoint.storage.backends import job_root
        from raytrain_ckpt.checkpoint.storage.probe import local_root
        from raytrain_ckpt.control.watch.health import plan_probes, probe_nodes

        ck = self.spec.checkpoint
        plans = plan_probes(nodes, bundle_nodes(self._pg), set(survivors), self.spec.resources.gpus)
        problems = probe_nodes(plans, local_root(str(job_root(ck.dir, self.spec.name))) if ck.enabled else None,
                               self._pg)
        if not problems:
            logger.info("attempt %d: node(s) %s passed the health probe", self.attempt,
                        ", ".join(n[:12] for n in nodes))
            return
        for node in problems:
            q.put_out(node, time.monotonic())
        for actor in survivors.values():
            kill_actor(actor)
        text = "; ".join(f"node {n} failed its health probe ({p})" for n, p in problems.items())
        raise GroupStartError(f"{text}: quarantined for {q.quarantine_s:g}s (fault_tolerance.quarantine_s)")

    def _room_outside(self, out: set[str], bundle: dict[str, float] | None = None) -> int:
        """How many ranks the alive nodes other than ``out`` have room for (their total resources)."""
        res = self.spec.resources
        bundle = bundle or {"CPU": res.cpus_per_worker, **({"GPU": res.gpus} if res.gpus else {})}
        return sum(min(int(n["Resources"].get(k, 0.0) // v) for k, v in bundle.items() if v > 0)
                   for n in ray.nodes() if n["Alive"] and n["NodeID"] not in out)

    def note_failure(self, failure: Failure) -> str | None:
        """A rank's crash or hang: count it against its node; the line to report when that puts
        the node in quarantine (``fault_tolerance.quarantine_s``), else None."""
        q, rank = self.quarantine, failure.rank
        if q is None or failure.kind not in ("crash", "hang") or rank is None or rank >= len(self._where):
            return None
        where = self._where[rank]
        if where is None or not q.note(where.node_id, time.monotonic()):
            return None
        line = (f"node {where.node_id} quarantined for {q.quarantine_s:g}s (fault_tolerance.quarantine_s): its "
                f"ranks failed {len(q.failures[where.node_id])} times, the latest rank {rank} ({failure.kind})")
        logger.warning("attempt %d: %s", self.attempt, line)
        return line

    def _get_all(self, refs: list[ray.ObjectRef], deadline: float, what: str) -> None:
        """Every rank's ``refs[rank]``, in the order they finish: the first failure raises at once
        (a rank that cannot join leaves the others waiting in the rendezvous until the deadline).
        A failure names the ranks not done yet too: it may be a peer's echo of theirs (rank 0's
        rendezvous timing out on a rank that never arrived)."""
        pending = {ref: rank for rank, ref in enumerate(refs)}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise self._timed_out(what.format(rank=_ranks(pending.values())))
            done = {ref: pending.pop(ref) for ref in ready}
            late = f" (rank {_ranks(pending.values())} not done yet)" if pending else ""
            for ref, rank in done.items():
                try:
                    self._get(ref, deadline, what.format(rank=rank) + late)
                except GroupStartError as exc:
                    if exc.mismatch is not None:
                        _collect([*done, *pending], deadline)
                    raise

    def _timed_out(self, what: str) -> GroupStartError:
        return GroupStartError(f"timed out trying to {what} within fault_tolerance.start_timeout_s="
                               f"{self.spec.fault_tolerance.start_timeout_s:g}s")

    def _get(self, ref: ray.ObjectRef, deadline: float, what: str):
        try:
            return ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
        except GetTimeoutError:
            raise self._timed_out(what) from None
        except (WorkerFailure, RayActorError) as exc:
            # Ray wraps the worker's exception; its cause is the WorkerFailure itself
            cause = getattr(exc, "cause", None) or exc
            raise GroupStartError(f"failed to {what}: {exc}", getattr(cause, "mismatch", None)) from None
        except RayTaskError as exc:  # anything else a rank raised while starting: a failed start, counted
            cause = getattr(exc, "cause", None) or exc
            raise GroupStartError(f"failed to {what}: {type(cause).__name__}: {headline(str(cause))}") from None

    def poll(self) -> GroupPoll:
        """Collect finished runs and failures, then read every rank's progress."""
        failures: list[Failure] = []
        pending = self._pending_runs()
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0) if pending else ([], [])
        for ref in ready:
            rank = self._runs[ref]
            try:
                self._results[rank] = ray.get(ref)
            except WorkerFailure as exc:
                # Ray wraps the worker's exception; its cause carries the clean traceback.
                cause = getattr(exc, "cause", None) or exc
                if getattr(cause, "guard", None):  # the training guard's one report: no traceback, no restart
                    failures.append(guard_failure(self.attempt, rank, cause))
                    continue
                failures.append(Failure(self.attempt, "exception", rank, headline(cause.text), str(cause)))
            except RayActorError as exc:
                what = f"worker process died: {headline(str(exc))}"
                failures.insert(0, Failure(self.attempt, "crash", rank, what, f"rank {rank}: {what}\n{exc}"))
        evidence = keep_failures(diagnostics_root(self.spec), self.attempt, failures) if failures else None
        progress = self._progress()
        finished = len(self._results) == len(self.workers)
        self._maybe_start_spares(progress)
        return GroupPoll(
            results=[self._results[r] for r in sorted(self._results)],
            failures=failures,
            evidence=evidence,
            min_step=min((p.step for p in progress.values()), default=0),
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

    def rank_nodes(self) -> list[str]:
        """Node id of every rank, by rank (the placement group's bundles)."""
        return bundle_nodes(self._pg) if self._pg is not None else []

    def preempt(self, deadline_unix: float | None, tier: str = "durable") -> None:
        """A drain notice: every rank saves the step in hand (in ``tier``) at the next step boundary and stops."""
        for w in self.workers:
            w.preempt.remote(deadline_unix, tier)

    def retire(self, rank: int) -> None:
        """The next attempt gets a spare or a new process for ``rank`` (a straggler), even when the
        others are kept."""
        self._retired.add(rank)

    def checkpointing_silences(self) -> dict[str, float]:
        """How long each checkpoint writer and the actor has left its ping unanswered (``control/watch/silence.py``)."""
        return self.checkpoints.fleet.silences(time.monotonic()) if self.checkpoints is not None else {}

    def save_in_flight(self) -> int | None:
        """The oldest step the CheckpointActor has in flight (the save a silent writer holds up), as
        its bulletin last said (None: none or unknown)."""
        from raytrain_ckpt.checkpoint.roles import bulletin

        posted = bulletin.posted(self.spec.name) if self.checkpoints is not None else None
        steps = (posted or {}).get("in_flight") or []
        return min(steps) if steps else None

    def replace_silent_checkpointing(self, stalled: dict[str, float] | None = None) -> list[str]:
        """Kill and restart the checkpoint writers and actor that do not answer a ping now, and the
        writers of ``stalled`` writes still unmoved past their budget; one line each."""
        return self.checkpoints.fleet.replace_silent(stalled=stalled) if self.checkpoints is not None else []

    def diagnose(self) -> Verdict:
        """Before the hung group is torn down: every rank's stacks and step, kept under the job
        root's diagnostics/attempt-N/, and the culprit (``hang_evidence``)."""
        return diagnose(self.workers, self._where, diagnostics_root(self.spec) / f"attempt-{self.attempt}")

    def _pending_runs(self) -> list[ray.ObjectRef]:
        """The ``run()`` refs of ranks whose result is not collected yet."""
        return [r for r in self._runs if self._runs[r] not in self._results]

    def wait(self, timeout_s: float) -> None:
        """Until the ranks' runs have ended or ``timeout_s`` passes, returning early once a run has
        ended and the others ended too: a crash is seen as soon as Ray reports it, not at the
        next poll.

        When a process dies, its peers' collectives fail at once, so their runs often end (with a
        connection reset) before Ray reports the death. Returning at the first end would report
        that echo as the failure; waiting for the other runs, within the same interval, lets the
        poll see the crash itself, as a poll after the whole interval would have.
        """
        pending = self._pending_runs()
        if not pending:
            time.sleep(timeout_s)
            return
        deadline = time.monotonic() + timeout_s
        ended, rest = ray.wait(pending, num_returns=1, timeout=timeout_s)
        if ended and rest:
            ray.wait(rest, num_returns=len(rest), timeout=max(0.0, deadline - time.monotonic()))

    def _maybe_start_spares(self, progress: dict[int, Progress]) -> None:
        """Start spares once every rank finished a step: a spare importing torch while the group
        sets up or loads would take CPU from the very restart it is meant to speed up."""
        if self._spares_started or self.pool is None or self._pg is None:
            return
        # a rank in a save has finished a step too ("saving" is the step after one, not a set-up phase)
        if len(progress) == len(self.workers) and all(p.phase in ("training", "saving", "done")
                                                       for p in progress.values()):
            self._spares_started = True
            self.pool.replenish(self._pg)

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
        if keep_warm and out & set(self.nodes) and self._room_outside(out) >= self.spec.world_size:
            keep_warm = False  # a kept bundle would keep a quarantined node in the group: placed anew around it
        survivors = self._drain() if keep_warm and self.pool is not None and self._pg is not None else {}
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

    def _drain(self) -> dict[int, ray.actor.ActorHandle]:
        """Reset every rank whose run() ends before the drain timeout; returns those that reset cleanly.

        A rank whose own code failed leaves its peers blocked in a collective with it;
        resetting it first (closing its connections) is what unblocks them, so reset as soon
        as each run ends rather than after all of them.
        """
        deadline = time.monotonic() + self.spec.fault_tolerance.drain_timeout_s
        running = dict(self._runs)
        resets: dict[ray.ObjectRef, int] = {}
        while running and time.monotonic() < deadline:
            ended, _ = ray.wait(list(running), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for ref in ended:
                rank = running.pop(ref)
                if _ended_alive(ref):
                    resets[self.workers[rank].reset.remote()] = rank
        survivors = {}
        done, _ = ray.wait(list(resets), num_returns=len(resets), timeout=max(0.1, deadline - time.monotonic()))
        for ref in done:
            try:
                ray.get(ref)
                survivors[resets[ref]] = self.workers[resets[ref]]
            except Exception as exc:  # a rank that cannot reset is replaced, not reused
                logger.warning("rank %d could not reset and is replaced: %s", resets[ref], headline(str(exc)))
        return survivors


def _ranks(ranks: Iterable[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def _ended_alive(ref: ray.ObjectRef) -> bool:
    """Whether a finished run() ref came from a process that is still alive."""
    try:
        ray.get(ref)
    except RayActorError:
        return False
    except Exception:  # the rank raised (often because a peer died): the process itself is fine
        return True
    return True


def _collect(refs: list[ray.ObjectRef], deadline: float, wait_s: float = 5.0) -> None:
    """Fetch and drop what the other ranks' calls return: after a checkpoint mismatch every rank
    fails the same way, and Ray prints each failure nobody fetched as an unhandled error, with
    its traceback, beside the one-line message the user gets."""
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, min(wait_s, deadline - time.monotonic())))
    for ref in ready:
        try:
            ray.get(ref)
        except Exception:  # the same mismatch, reported once already
            pass
