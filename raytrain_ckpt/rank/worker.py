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

import datetime
import gc
import importlib
import logging
import os
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from raytrain_ckpt.checkpoint.records import RankCheckpointPlan
from raytrain_ckpt.common.events import NodeProgress, Progress, RankPlace, WorkerResult
from raytrain_ckpt.rank.eviction import on_sigterm
from raytrain_ckpt.common.faults import adopt_fault_env, maybe_inject
from raytrain_ckpt.common.logs import rename_log_prefix, setup_logging
from raytrain_ckpt.rank.progress import ProgressFile, PublishedProgress, read_node
from raytrain_ckpt.observe.metrics import TrainerMetrics
from raytrain_ckpt.rank.nccl_trace import enable_recorder, rank_trace
from raytrain_ckpt.observe.loggers import open_job_loggers
from raytrain_ckpt.observe.scalars import ScalarLogger, log_step
from raytrain_ckpt.spec import JobSpec

logger = logging.getLogger(__name__)

__all__ = ["Rendezvous", "TrainWorker", "WorkerFailure"]

SPARE_RANK = -1
"""The rank of an idle spare worker that no attempt has assigned yet."""
_WARM_MODULES = ("raytrain_ckpt.rank.trainer", "raytrain_ckpt.checkpoint.roles.client", "raytrain_ckpt.checkpoint.recovery.state",
                 "torch.distributed.checkpoint", "torch.distributed.fsdp")
_IMPORT_LOCK = threading.Lock()
_TIERS = ("durable", "ram")
"""A drain's save tiers (``preemption.SavePlan.tier``), in the order the ranks' MAX agrees on."""


def _deterministic_cuda() -> None:
    """Only deterministic CUDA kernels from here on (``training.deterministic``). cuBLAS reads
    its workspace setting when this process creates its first handle, i.e. at the first
    matmul, which comes after this call (made in join(); setup() waits for it): the actor has
    not run one before."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


@dataclass(frozen=True)
class Rendezvous:
    """Where an attempt's ranks meet: the store rank 0 hosts (``TrainWorker.address``)."""

    host: str
    port: int


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


def _is_mismatch(exc: BaseException) -> bool:
    from raytrain_ckpt.checkpoint.errors import CheckpointMismatch

    return isinstance(exc, CheckpointMismatch)


class TrainWorker(PublishedProgress):
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

        Under a lock: a spare's own warm() may still be importing when assign() calls it from
        the actor's other thread, and two threads importing at once can deadlock on module locks.
        """
        pipelined = ("torch.distributed.pipelining",) if self.spec.parallelism.pp > 1 else ()
        with _IMPORT_LOCK:
            for name in _WARM_MODULES + pipelined:
                importlib.import_module(name)
        return os.getpid()

    def reserve_state(self, nbytes: int) -> int:
        """Touch ``nbytes`` of memory now, while idle, for the optimizer state of the rank this
        spare may take over (``checkpoint.state.StateReserve``); returns the bytes reserved."""
        from raytrain_ckpt.checkpoint.recovery.state import StateReserve

        reserve = StateReserve(nbytes)
        if self.rank != SPARE_RANK:  # assigned a rank meanwhile (the other actor thread): too late to help
            return 0
        self._reserve = reserve
        return nbytes

    def reset(self) -> None:
        """Leave the finished or failed attempt: stop staging, drop the trainer, destroy the process group.

        Destroying the process group closes this rank's connections, so a peer still blocked
        in a collective with it fails at once instead of waiting for the collective timeout.
        """
        self._stop.set()
        if self.checkpoints is not None:
            self.checkpoints.close()  # waits for a running staging copy: nothing reads the state after it
        if self.trainer is not None:
            from raytrain_ckpt.checkpoint.recovery.state import StateReserve, optimizer_tensors
            from raytrain_ckpt.parallel import release_mesh

            release_mesh(self.trainer.mesh)
            if self.trainer.device.type == "cpu" and self.spec.checkpoint.enabled:
                # the next attempt loads its optimizer state into these pages, not fresh ones
                self._reserve = StateReserve(recycled=optimizer_tensors(self.trainer))
        self.trainer = None
        self.checkpoints = None
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None
        gc.collect()  # only what this attempt made: join() froze everything older (gc.freeze)
        self._progress = Progress(self.rank, 0, None, time.time(), "setup")
        self._rollbacks = ()

    def _prefix(self) -> str:
        step = self.trainer.state.step if self.trainer else 0
        return f"[attempt {self.attempt} rank {self.rank} step {step}] "

    def address(self) -> Rendezvous:
        """Host the attempt's rendezvous (rank 0): a store already listening on a free port of
        this node, and its address for the other ranks' ``join()``.

        The store listens before any rank is asked to join, so no rank's connection is refused:
        a refused one is retried after a back-off of about half a second (ARCHITECTURE, "Rank 0
        hosts the rendezvous before the ranks join").
        """
        import ray

        self._store = None  # a previous start's store, if any: closed
        self._store = dist.TCPStore(ray.util.get_node_ip_address(), 0, self.world_size, is_master=True,
                                    timeout=self._collective_timeout(), wait_for_workers=False)
        return Rendezvous(ray.util.get_node_ip_address(), self._store.port)

    def _collective_timeout(self) -> datetime.timedelta:
        # The same timeout bounds the rendezvous and every collective: a rank whose peer hangs
        # fails on its own after about hang_timeout_s instead of torch's default 30 minutes,
        # never below join_timeout_s, the rendezvous's (room for a loaded machine).
        from raytrain_ckpt.control.watch.hangs import collective_timeout_s

        return datetime.timedelta(seconds=collective_timeout_s(self.spec.fault_tolerance))

    def join(self, master_addr: str, master_port: int) -> None:
        """Join the attempt's process group (rendezvous at rank 0's ``master_addr:master_port``).

        The driver plans the resume point while the ranks join, and hands it to ``setup()``,
        which waits for this to finish: with two actor threads the two calls may start in
        either order.
        """
        try:
            maybe_inject("join", self.rank, 0, self.attempt)
            self._join(master_addr, master_port)
            return
        except Exception:
            self._join_error = traceback.format_exc()
        finally:
            self._joined.set()
        raise WorkerFailure(self.rank, self.attempt, self._join_error)  # outside the except block: see setup()

    def _join(self, master_addr: str, master_port: int) -> None:
        # What exists now (modules, this actor, caches) outlives the attempt: freezing it keeps
        # reset()'s collection to what the attempt made (0.17 s -> 0.01 s of a restart's teardown).
        gc.freeze()
        if self.spec.resources.use_gpu:
            # Ray sets CUDA_VISIBLE_DEVICES per actor, so the assigned GPU is device 0 here.
            torch.cuda.set_device(0)
            if self.spec.training.deterministic:
                _deterministic_cuda()
            enable_recorder()  # read when the NCCL group is made: the dump a hang keeps (rank/nccl_trace.py)
        t0 = time.monotonic()
        timeout = self._collective_timeout()
        store = self._store if self._store is not None else dist.TCPStore(
            master_addr, master_port, self.world_size, is_master=False, timeout=timeout)
        dist.init_process_group(
            backend="nccl" if self.spec.resources.use_gpu else "gloo",
            store=store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
        )
        self.timings["pg_init_s"] = time.monotonic() - t0

    def setup(self, ckpt: RankCheckpointPlan | None = None, rollbacks_before: int = 0) -> None:
        """Once ``join()`` is done: build model, optimizer and data, and load the resume checkpoint
        (``ckpt``: this rank's checkpoint plan; None: checkpointing is off). ``rollbacks_before``:
        the guard's rollbacks in the job's earlier attempts (``training.guard.max_rollbacks`` is per job)."""
        self._rollbacks_before = rollbacks_before
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
        self.trainer = Trainer(self.spec, device, self._prefix, restoring)
        self.trainer.attempt = self.attempt
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

    def _setup_checkpoints(self, ckpt: RankCheckpointPlan) -> None:
        from raytrain_ckpt.checkpoint.roles.client import CheckpointClient
        from raytrain_ckpt.checkpoint.recovery.memcopy import restore

        trainer = self.trainer
        assert trainer is not None
        kept = None
        point = ckpt.resume
        if point is not None:
            source = ckpt.source
            copy = source.copy if source is not None else None
            done = restore(trainer, point.path, point.step, point.world_size == self.world_size, copy,
                           source.why if source is not None else "", self.attempt,
                           self.spec.checkpoint.verify_on_load,
                           lambda: ckpt.writer.forget_copy.remote(self.rank, point.step))
            self.timings["load_s"] = done.seconds
            self.timings["resume_plan_s"] = ckpt.plan_s
            self.timings["load_verify_s"] = done.verify_s
            self.timings["load_checksum_s"] = done.checksum_s
            self.timings["load_read_s"] = done.read_s
            self.timings["loaded_from_memory"] = float(done.source == "memory")
            self.start_step = trainer.state.step
            trainer.state_reserve = None  # unused (a load without optimizer state): not kept alive
            kept = copy.path if done.source == "memory" and copy is not None else None
            from raytrain_ckpt.rank.rollback import adopt_manifest

            if point.path:  # a RAM-tier step with nothing committed before it has no manifest
                adopt_manifest(trainer, trainer.guard, point.path)
            if self.rank == 0:
                logger.info("%sresumed step %d from %s in %.2fs (%s)", self._prefix(), self.start_step,
                            "memory" if kept else point.path, done.seconds, done.why)
        self.checkpoints = CheckpointClient(self.spec.checkpoint, self.rank, self.attempt, self.spec.training.steps,
                                            ckpt.actor, ckpt.writer, trainer.device,
                                            self.spec.fault_tolerance.prior_mtbf_s, ckpt.interval,
                                            kept_copy=(kept, self.start_step) if kept else None)
        trainer.before_optimizer_step = self.checkpoints.before_optimizer_step
        if trainer.guard is not None and self.rank == 0:  # retention keeps the newest certified step
            trainer.guard.on_certified = lambda step: ckpt.actor.certify.remote(step)
        self._progress = Progress(self.rank, self.start_step, None, time.time(), "setup")
        self._rollbacks = ()

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
        from raytrain_ckpt.checkpoint.records import TrainingPoint
        from raytrain_ckpt.rank.guard import GuardTrip

        trainer = self.trainer
        assert trainer is not None, "setup() must succeed before run()"
        ckpt = self.checkpoints
        loss, eval_s = None, 0.0
        ft = self.spec.fault_tolerance
        watch = ckpt is not None and (ft.watch_drains or ft.replace_stragglers)  # both stop via preempt()
        phase = "done"
        scalars = self._open_scalars()
        measured = False  # the attempt's first step is a warm-up: its time does not teach the hang timeout
        while trainer.state.step < self.spec.training.steps and not self._stop.is_set():
            maybe_inject("step", self.rank, trainer.state.step, self.attempt)
            t0, began = time.monotonic(), time.time()
            try:
                report = trainer.train_step()
            except GuardTrip as exc:  # no optimizer step was applied, on any rank
                if self._roll_back(exc.trip) is None:
                    break  # rank 0 raised the job's report; this rank stops
                continue
            if report.eval_loss is not None:  # the step's report times the training part only
                eval_s += max(0.0, time.monotonic() - t0 - report.step_time_s)
            due = ckpt is not None and ckpt.due(report.step)
            # a drain notice reached some rank: every rank saves this step, in the same tier (one
            # collective agrees on both: 0 no notice, else 1 + the tier's index in _TIERS)
            level = ckpt.max_rank(1 + _TIERS.index(self._notice_tier) if self._notice.is_set() else 0) if watch else 0
            preempted, tier = level > 0, _TIERS[max(0, level - 1)]
            if due or preempted:
                guard = trainer.guard
                point = TrainingPoint(report.step * self.spec.training.global_batch_size, trainer.state.tokens_seen,
                                      report.loss, report.eval_loss, guard.certified() if guard else None,
                                      tuple(tuple(w) for w in trainer.skips.as_lists()))
                self._progress = Progress(self.rank, self._progress.step, loss, self._progress.last_step_at, "saving")
                ckpt.save(report.step, app_state(trainer), point, final=preempted, tier=tier)
                if guard is not None:
                    guard.saved_step(report.step)
            elif ckpt is not None:
                ckpt.prepare(lambda: app_state(trainer))  # the first save's buffers, while training goes on
            trainer.log(report)
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
                if self.rank == 0:
                    logger.warning("%sdrain notice: stopping at step %d, saved", self._prefix(), report.step)
                if self._evicted_until is not None:
                    logger.warning("%sSIGTERM (an eviction): stopping at step %d, saved; %.1fs of "
                                   "fault_tolerance.stop_grace_s left", self._prefix(), report.step,
                                   self._evicted_until - time.time())
                break
        if scalars is not None:
            scalars.close()
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
                            self._evicted_until)

    def _roll_back(self, trip: Any) -> Any:
        """A guard trip: roll back inside this attempt (``raytrain_ckpt/rank/rollback.py``)."""
        from raytrain_ckpt.rank.rollback import roll_back

        assert self.trainer is not None
        record = roll_back(self.trainer, self.checkpoints, self.trainer.guard, trip, f"rollback-{self.attempt}")
        self.metrics.rolled_back(record)
        if record is not None:
            self._rollbacks = tuple(self.trainer.guard.rollbacks)
        return record

    def _evicted(self) -> bool:
        """The first SIGTERM (a signal handler on the main thread: no log line here, the training
        thread logs the stop): stop like a drain notice within fault_tolerance.stop_grace_s. A spare
        has nothing to save and exits as Ray's handler does."""
        if self.rank == SPARE_RANK:
            return False
        self._evicted_until = time.time() + self.spec.fault_tolerance.stop_grace_s
        self._notice.set()
        return True

    def preempt(self, deadline_unix: float | None, tier: str = "durable") -> None:
        """A node of the group drains (before ``deadline_unix``): save the step in hand (in ``tier``,
        ``preemption.plan_save``) at the next step boundary and stop; called from the second actor
        thread while ``run()`` trains."""
        if not self._notice.is_set():
            logger.warning("%sdrain notice (deadline %s): saving the step in hand (%s tier)", self._prefix(),
                           "none" if deadline_unix is None else f"in {deadline_unix - time.time():.1f}s", tier)
        self._notice_tier = tier
        self._notice.set()

    def _open_scalars(self) -> ScalarLogger | None:
        """Rank 0's TensorBoard run (``training.tensorboard_dir``); the points after the step this
        attempt resumed from are replaced (observe/scalars.py). An attempt that fails leaves its file
        flushed up to ``FLUSH_S`` before."""
        if self.rank != 0:
            return None
        assert self.trainer is not None
        return open_job_loggers(self.spec, "train", self.trainer.state.step)

    def where(self) -> RankPlace:
        """This process's pid and Ray node id: where its stacks are read from when the group hangs."""
        import ray

        return RankPlace(os.getpid(), ray.get_runtime_context().get_node_id())

    def nccl_trace(self) -> bytes | str:
        """This rank's NCCL flight recorder or why none (``rank/nccl_trace.py``), while ``run()`` is stuck."""
        return rank_trace()

    def node_progress(self, ranks: list[int]) -> NodeProgress:
        """The progress of ``ranks``, this node's ranks of this attempt, read from their files."""
        return read_node(self.run_id, self.attempt, ranks)

    def progress(self) -> Progress:
        """The last finished step, this attempt's rollbacks so far and an eviction's deadline;
        answered from the second actor thread while ``run()`` trains."""
        return replace(self._shown(), rollbacks=self._rollbacks)

    def _shown(self) -> Progress:
        """The progress with an eviction's deadline, as ``progress()`` answers and the node's file
        shows it (written at the rank's next change of progress, by the training thread)."""
        return replace(self._progress, evicted_until=self._evicted_until)

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
