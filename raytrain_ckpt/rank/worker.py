"""TrainWorker: one Ray actor per rank, wrapping a ``Trainer``.

The actor is threaded (``max_concurrency=2``): ``run()`` trains in one thread while
``progress()`` answers the driver's polls from the other, so reporting progress never
blocks a training step and a step never waits on the driver.

A worker process outlives an attempt when it can: after a peer crashed, ``reset()`` drops
the trainer and the process group, and ``assign()`` gives the same process its place in the
next attempt (torch imported, Ray worker started, CPU caches warm). An idle spare is a
TrainWorker that was never assigned (``rank == -1``) and only ran ``warm()``.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
import traceback
import uuid
from typing import Any

import torch
import torch.distributed as dist

from raytrain_ckpt.checkpoint.records import RankCheckpointPlan, TrainingPoint
from raytrain_ckpt.common.events import Progress, WorkerResult
from raytrain_ckpt.rank.eviction import on_sigterm
from raytrain_ckpt.common.faults import adopt_fault_env, maybe_inject
from raytrain_ckpt.common.logs import rename_log_prefix, setup_logging
from raytrain_ckpt.rank.answers import SPARE_RANK, TIERS, RankAnswers
from raytrain_ckpt.rank.progress import ProgressFile, PublishedProgress
from raytrain_ckpt.rank.replicas import replica_record, replica_skips
from raytrain_ckpt.rank.rendezvous import RankRendezvous
from raytrain_ckpt.rank.resume import RankCheckpoints
from raytrain_ckpt.rank.metrics import TrainerMetrics
from raytrain_ckpt.observe.loggers import open_job_loggers
from raytrain_ckpt.observe.scalars import ScalarLogger, log_step
from raytrain_ckpt.spec import JobSpec

logger = logging.getLogger(__name__)

__all__ = ["SPARE_RANK", "TrainWorker", "WorkerFailure"]

_WARM_MODULES = ("raytrain_ckpt.rank.trainer", "raytrain_ckpt.checkpoint.roles.client", "raytrain_ckpt.checkpoint.recovery.state",
                 "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch._dynamo")
"""What a rank's setup() imports, imported ahead (``warm``). ``torch._dynamo`` is not imported by any
of the others: torch imports it at the first call of a function it keeps out of compilation (the
meta-device init of the model's first layer calls one), 0.3-0.5 s that a spare would otherwise
spend in its build, between the crash and the first step after it."""
_IMPORT_LOCK = threading.Lock()


class WorkerFailure(RuntimeError):
    """A rank's exception, with its rank and formatted traceback (picklable across actors)."""

    def __init__(self, rank: int, attempt: int, text: str, mismatch: str | None = None,
                 guard: str | None = None) -> None:
        super().__init__(f"rank {rank} (attempt {attempt}) failed:\n{text}")
        self.rank = rank
        self.attempt = attempt
        self.text = text
        self.mismatch = mismatch
        """The message of a ``CheckpointMismatch``: the resume checkpoint does not fit this model,
        which no restart changes (the driver fails the job at once, exit 2)."""
        self.guard = guard
        """The training guard's report of a trip it could not roll back (``guard.GuardFailed``):
        no restart either (the failure's kind is ``rollback``)."""

    def __reduce__(self) -> tuple:
        return (WorkerFailure, (self.rank, self.attempt, self.text, self.mismatch, self.guard))


def _replica_sync(worker: TrainWorker, lighthouse: str | None, heal: bool) -> Any:
    """None without replica groups (no ``lighthouse``); else ``worker``'s side of the replicate
    dimension (``rank/replicas.py``). Every group starts from the same seeded parameters or the same
    checkpoint, so a start sends nothing; a replacement group (``heal``) is healed from a live one."""
    if lighthouse is None:
        return None
    from raytrain_ckpt.rank.rendezvous import collective_timeout_s
    from raytrain_ckpt.rank.replicas import replica_sync
    from raytrain_ckpt.replicas.lighthouse import lighthouse_name

    assert worker.trainer is not None
    ft = worker.spec.fault_tolerance
    return replica_sync(worker.trainer, replica=worker.replica, rank=worker.rank % worker.group_size,
                        ranks=worker.group_size, lighthouse=lighthouse, store=worker._meet,
                        roster=lighthouse_name(worker.run_id, worker.attempt), replacement=heal,
                        timeout_s=collective_timeout_s(ft), meet_timeout_s=2 * ft.start_timeout_s)


def _point(trainer: Any, report: Any) -> TrainingPoint:
    """What the trainers know at ``report``'s step, for its manifest."""
    guard = trainer.guard
    return TrainingPoint(report.step * trainer.spec.training.global_batch_size, trainer.state.tokens_seen,
                         report.loss, report.eval_loss, guard.certified() if guard else None,
                         tuple(tuple(w) for w in trainer.skips.as_lists()),
                         replica_skips(trainer, report.step))


def _is_mismatch(exc: BaseException) -> bool:
    from raytrain_ckpt.checkpoint.errors import CheckpointMismatch

    return isinstance(exc, CheckpointMismatch)


class TrainWorker(PublishedProgress, RankRendezvous, RankCheckpoints, RankAnswers):
    """One training rank. Created by the worker group as a Ray actor."""

    def __init__(self, spec_json: str, rank: int, world_size: int, attempt: int,
                 fault_env: dict[str, str] | None = None, run_id: str | None = None) -> None:
        setup_logging(force=True)
        # Passed as an argument, not a runtime_env: an actor with its own runtime_env cannot use
        # Ray's prestarted worker processes, which makes every restart slower.
        adopt_fault_env(fault_env)
        self.trainer = None
        self.checkpoints = None
        self.served: list[int] = []
        self.was_spare = rank == SPARE_RANK
        self._reserve: Any = None
        """Memory touched ahead for the next trainer's loaded optimizer state: a spare's
        (``reserve_state()``) or the failed attempt's state of a kept process (``reset()``)."""
        self._evicted_until: float | None = None
        """Set by the first SIGTERM to this process (a pod eviction, ``rank/eviction.py``): the deadline."""
        self.assign(spec_json, rank, world_size, attempt, run_id)
        if self.spec.checkpoint.enabled and self.spec.fault_tolerance.watch_drains:
            on_sigterm(self._evicted)  # __init__ runs on the process's main thread: the one place a handler installs

    def assign(self, spec_json: str, rank: int, world_size: int, attempt: int, run_id: str | None = None) -> None:
        """Take rank ``rank`` of attempt ``attempt`` of the run ``run_id`` (a fresh, reset or spare
        process; None: a run of its own, as for a spare that is assigned again before it serves)."""
        assert self.trainer is None, "reset() before assigning a new attempt"
        self.spec = JobSpec.model_validate_json(spec_json)
        self.rank, self.world_size, self.attempt = rank, world_size, attempt
        if getattr(self, "_named", None) not in (None, repr(self)):  # a spare took over a rank
            rename_log_prefix(repr(self))
        self._named = repr(self)
        self.run_id = run_id or uuid.uuid4().hex
        if rank != SPARE_RANK:
            self.served.append(attempt)
        # Every change of the progress is also written for the node (rank/progress.py: one poll call per node).
        self._progress_file = ProgressFile(self.run_id, attempt, rank) if rank != SPARE_RANK else None
        self._progress = Progress(rank, 0, None, time.time(), "setup")
        self._rollbacks: tuple[Any, ...] = ()
        """This attempt's rollbacks so far, reported with the progress (``progress()``)."""
        self._stop = threading.Event()
        self._notice = threading.Event()
        """Set by ``preempt()``: a node of the group drains; the ranks agree on a step, save it and stop."""
        self._notice_tier = "durable"
        self.start_step = 0
        self.timings: dict[str, float] = {}
        self._joined = threading.Event()
        self._join_error: str | None = None
        self._store: dist.TCPStore | None = None
        """Rank 0's rendezvous store, listening from ``address()`` until ``reset()``."""
        self.metrics = TrainerMetrics(self.spec.name, rank)
        torch.set_num_threads(max(1, int(self.spec.resources.cpus_per_worker)))
        if rank != SPARE_RANK:
            # What setup() imports, imported now (at once for a spare or a kept process): join()
            # freezes what exists before the attempt, and join() and setup() may run at the same
            # time on the actor's two threads, where two imports can deadlock on module locks.
            self.warm()

    def warm(self) -> int:
        """Import what setup() needs, so a spare that takes over a rank starts training sooner.
        Under a lock: a spare's own warm() may still be importing when assign() calls it from the
        actor's other thread, and two threads importing at once can deadlock on module locks."""
        pipelined = ("torch.distributed.pipelining",) if self.spec.parallelism.pp > 1 else ()
        with _IMPORT_LOCK:
            for name in _WARM_MODULES + pipelined:
                importlib.import_module(name)
        return os.getpid()

    def _prefix(self) -> str:
        step = self.trainer.state.step if self.trainer else 0
        return f"[attempt {self.attempt} rank {self.rank} step {step}] "

    def join(self, master_addr: str, master_port: int) -> None:
        """Join the attempt's process group (rendezvous at rank 0's ``master_addr:master_port``).
        The driver plans the resume point while the ranks join and hands it to ``setup()``, which
        waits for this to finish: with two actor threads the two calls may start in either order."""
        try:
            maybe_inject("join", self.rank, 0, self.attempt)
            self._join(master_addr, master_port)
            return
        except Exception:
            self._join_error = traceback.format_exc()
        finally:
            self._joined.set()
        raise WorkerFailure(self.rank, self.attempt, self._join_error)  # outside the except block: see setup()

    def setup(self, ckpt: RankCheckpointPlan | None = None, rollbacks_before: int = 0,
              lighthouse: str | None = None, heal: bool = False) -> None:
        """Once ``join()`` is done: build model, optimizer and data, and load the resume checkpoint
        (``ckpt``: this rank's plan; None: checkpointing is off, or ``heal``: this rank's replica group
        replaces a failed one and receives a live group's state). ``rollbacks_before``: the guard's
        rollbacks in earlier attempts; ``lighthouse``: with replica groups, the quorum's address."""
        self._rollbacks_before, self._lighthouse, self._heal = rollbacks_before, lighthouse, heal
        try:
            if not self._joined.wait(self.spec.fault_tolerance.start_timeout_s):
                raise TimeoutError("join() did not finish within fault_tolerance.start_timeout_s")
            if self._join_error is not None:
                raise RuntimeError(f"joining the process group failed:\n{self._join_error}")
            maybe_inject("setup", self.rank, 0, self.attempt)
            self._setup(restoring=ckpt is not None and ckpt.resume is not None)
            if ckpt is not None:
                self._setup_checkpoints(ckpt)
            return
        except Exception as exc:
            text = traceback.format_exc()
            mismatch = str(exc) if _is_mismatch(exc) else None
        self._progress = Progress(self.rank, 0, None, time.time(), "failed")
        # Raised here, outside the except block, on purpose: raised inside it, it would chain the
        # original exception, whose traceback keeps every frame alive (the trainer, its FSDP state
        # and the process group, whose connections then stay open after reset()).
        raise WorkerFailure(self.rank, self.attempt, text, mismatch)

    def _setup(self, restoring: bool) -> None:
        from raytrain_ckpt.rank.trainer import Trainer

        device = torch.device("cuda", 0) if self.spec.resources.use_gpu else torch.device("cpu")
        t0 = time.monotonic()
        self.trainer = Trainer(self.spec, device, self._prefix, restoring, self.replica)
        self.trainer.attempt = self.attempt
        self.trainer.replicas = _replica_sync(self, self._lighthouse, self._heal)
        self.timings["build_s"] = time.monotonic() - t0
        if restoring:  # the load creates the optimizer's state: from the spare's reserve, if any
            self.trainer.state_reserve = self._reserve
        self._reserve = None
        if self.spec.training.guard.nonfinite or self.spec.training.guard.spike:
            from raytrain_ckpt.rank.guard import LossGuard

            self.trainer.guard = LossGuard(self.spec.training.guard, self.rank, self.attempt, device,
                                           self._rollbacks_before)
        if self.rank == 0:
            logger.info("%sprocess group ready: %d ranks, backend %s, pid %d", self._prefix(), self.world_size,
                        dist.get_backend(), os.getpid())

    def run(self) -> WorkerResult:
        """Train to ``training.steps``; raises WorkerFailure with the traceback on error."""
        from raytrain_ckpt.rank.guard import GuardFailed

        report, rank = None, self.rank
        try:
            return self._run()
        except GuardFailed as exc:
            text = report = exc.report
            rank = self.rank if exc.rank is None else exc.rank  # the rank that tripped, not rank 0 that reports
        except Exception:
            text = traceback.format_exc()
        self._progress = Progress(self.rank, self._progress.step, self._progress.loss, time.time(), "failed")
        raise WorkerFailure(rank, self.attempt, text, guard=report)  # outside the except block: see setup()

    def _run(self) -> WorkerResult:
        from raytrain_ckpt.checkpoint.recovery.state import app_state
        from raytrain_ckpt.rank.guard import GuardTrip

        trainer = self.trainer
        assert trainer is not None, "setup() must succeed before run()"
        ckpt = self.checkpoints
        loss, eval_s = None, 0.0
        ft = self.spec.fault_tolerance
        watch = ckpt is not None and (ft.watch_drains or ft.replace_stragglers)  # both stop via preempt()
        phase = "done"
        scalars = None if self._heal else self._open_scalars()  # a replacement's: once it is healed (below)
        measured = False  # the attempt's first step is a warm-up: its time does not teach the hang timeout
        alone = ckpt is None and trainer.replicas is not None  # a group that does not save stops at a notice at once
        while trainer.state.step < self.spec.training.steps and not self._stop.is_set() and not (alone and self._notice.is_set()):
            maybe_inject("step", self.rank, trainer.state.step, self.attempt)
            t0, began = time.monotonic(), time.time()
            try:
                report = trainer.train_step()
            except GuardTrip as exc:  # no optimizer step was applied, on any rank
                if self._roll_back(exc.trip) is None:
                    break  # rank 0 raised the job's report; this rank stops
                continue
            if report is None:
                continue  # replica groups: the step was not applied; the same step again
            if report.eval_loss is not None:  # the step's report times the training part only
                eval_s += max(0.0, time.monotonic() - t0 - report.step_time_s)
            due = ckpt is not None and ckpt.due(report.step)
            # a drain notice reached some rank: every rank saves this step, in the same tier (one
            # collective agrees on both: 0 no notice, else 1 + the tier's index in TIERS)
            level = ckpt.max_rank(1 + TIERS.index(self._notice_tier) if self._notice.is_set() else 0) if watch else 0
            preempted, tier = level > 0, TIERS[max(0, level - 1)]
            if went_on := due or preempted:  # (then whether the save went on)
                guard, point = trainer.guard, _point(trainer, report)
                self._progress = Progress(self.rank, self._progress.step, loss, self._progress.last_step_at, "saving")
                went_on = ckpt.save(report.step, app_state(trainer), point, final=preempted, tier=tier)
                if guard is not None and went_on:  # a skipped or lost save certifies nothing
                    guard.saved_step(report.step)
            elif ckpt is not None:
                ckpt.prepare(lambda: app_state(trainer))  # the first save's buffers, while training goes on
            trainer.log(report)
            if scalars is None and self._heal:  # from the healed step on: the run's points before it are kept
                scalars = self._open_scalars(report.step - 1)
            if scalars is not None:
                log_step(scalars, report)
            self.metrics.after_step(report, ckpt)
            loss = report.loss if report.loss is not None else loss
            now = time.time()
            self._progress = Progress(self.rank, report.step, loss, now, "training",
                                      ckpt.stats.stall_s if ckpt is not None else 0.0, eval_s, began,
                                      step_s=now - began if measured else None)
            measured = True
            self.timings.setdefault("first_step_at", self._progress.last_step_at)
            if preempted:
                phase = "preempted"  # the step is saved: commit it and stop (the driver restarts off the node)
                how = "its save on its way" if went_on else "its save did not go on (the warning above)"
                if self.rank == 0:
                    logger.warning("%sdrain notice: stopping at step %d, %s", self._prefix(), report.step, how)
                if self._evicted_until is not None:
                    logger.warning("%sSIGTERM (an eviction): stopping at step %d, %s; %.1fs of "
                                   "fault_tolerance.stop_grace_s left", self._prefix(), report.step, how,
                                   self._evicted_until - time.time())
                break
        self._close_scalars()
        if trainer.replicas is not None:  # its heartbeat stops: the groups still stepping form quorums without it
            trainer.replicas.close()
        stats = None
        if ckpt is not None:
            self._progress = Progress(self.rank, self._progress.step, loss, self._progress.last_step_at, "saving")
            ckpt.wait_committed()
            stats = dict(vars(ckpt.stats))
        state = trainer.state
        self._progress = Progress(self.rank, state.step, loss, time.time(), phase)
        return WorkerResult(self.rank, state.step, state.tokens_seen, dict(state.losses), trainer.fingerprint(),
                            self.start_step, stats, dict(self.timings), tuple(self.served), self.was_spare,
                            tuple(trainer.guard.rollbacks) if trainer.guard is not None else (),
                            self._evicted_until, replica_record(trainer) if trainer.replicas is not None else None)

    def _open_scalars(self, start: int | None = None) -> ScalarLogger | None:
        """Rank 0's TensorBoard run (``training.tensorboard_dir``); the points after the step this
        attempt resumed from (``start``: after that step) are replaced (observe/scalars.py). An
        attempt that fails leaves its file flushed up to ``FLUSH_S`` before."""
        if self.rank != 0:
            return None
        assert self.trainer is not None
        from raytrain_ckpt.checkpoint.storage.backends import job_root

        root = str(job_root(self.spec.checkpoint.dir, self.spec.name))
        self._scalars = open_job_loggers(self.spec, "train", self.trainer.state.step if start is None else start,
                                         root)  # closed by _close_scalars
        return self._scalars

    def __repr__(self) -> str:
        # Shown in the Ray dashboard's actor list and as the log prefix. Ray evaluates it once,
        # when the actor starts, so it names no attempt: a kept process keeps its rank across
        # attempts. A spare that takes a rank is renamed in the log prefix (logs.rename_log_prefix);
        # the Actors page keeps the name it started with (the GCS records the repr once).
        # (It is also evaluated when __init__ raised: a spec a rank cannot load is reported as
        # itself, not as an AttributeError of this method.)
        if not hasattr(self, "spec"):
            return "TrainWorker(not started)"
        who = "spare" if self.rank == SPARE_RANK else f"rank {self.rank}/{self.world_size}"
        return f"TrainWorker({self.spec.name} {who})"
