"""A rank's checkpoints, as a part of ``TrainWorker``: the resume at setup (from memory, a peer's
replica or storage), the trainer's ``CheckpointClient``, a guard trip's rollback inside the
attempt, a spare's memory reserved ahead for the optimizer state it may load, and ``reset()``,
which leaves an attempt and keeps its optimizer's pages for the next one."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from raytrain_ckpt.checkpoint.records import RankCheckpointPlan
from raytrain_ckpt.common.events import Progress
from raytrain_ckpt.rank.answers import SPARE_RANK

logger = logging.getLogger("raytrain_ckpt.rank.worker")  # the worker's lines, as before the split

__all__ = ["RankCheckpoints"]


class RankCheckpoints:
    """Uses the worker's ``spec``, ``rank``, ``attempt``, ``trainer``, ``timings`` and its progress."""

    spec: Any
    rank: int
    world_size: int
    attempt: int
    trainer: Any
    checkpoints: Any
    metrics: Any
    timings: dict[str, float]
    start_step: int
    _reserve: Any
    _progress: Progress
    _rollbacks: tuple[Any, ...]
    _stop: Any
    _store: Any

    _prefix: Callable[[], str]

    def _setup_checkpoints(self, ckpt: RankCheckpointPlan) -> None:
        from raytrain_ckpt.checkpoint.roles.client import CheckpointClient
        from raytrain_ckpt.checkpoint.roles.client_asks import ClientAsks
        from raytrain_ckpt.checkpoint.recovery.memcopy import restore

        trainer = self.trainer
        assert trainer is not None
        kept = None
        point = ckpt.resume
        group = self.world_size // self.spec.parallelism.dp_replicate
        saves = self.rank < group  # with replica groups the first one saves; the others only load, from storage
        if point is not None:
            if point.metadata_key:  # the plan checked this step's .metadata: not decoded again here
                from raytrain_ckpt.checkpoint.format.unpickling import vouch_for

                vouch_for([point.metadata_key])
            source = ckpt.source if saves else None
            copy = source.copy if source is not None else None
            done = restore(trainer, point.path, point.step, saves and point.world_size == group, copy,
                           source.why if source is not None else "", self.attempt,
                           self.spec.checkpoint.verify_on_load,
                           lambda: ClientAsks(ckpt.actor, ckpt.writer).forget_copy(self.rank, point.step))
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
        self._progress = Progress(self.rank, self.start_step, None, time.time(), "setup")
        self._rollbacks = ()
        if not saves:
            return
        self.checkpoints = CheckpointClient(self.spec.checkpoint, self.rank, self.attempt, self.spec.training.steps,
                                            ckpt.actor, ckpt.writer, trainer.device,
                                            self.spec.fault_tolerance.prior_mtbf_s, ckpt.interval,
                                            kept_copy=(kept, self.start_step) if kept else None)
        trainer.before_optimizer_step = self.checkpoints.before_optimizer_step
        if trainer.guard is not None:  # a save lost after it began certifies nothing
            self.checkpoints.on_lost = trainer.guard.lost_step
        if trainer.guard is not None and self.rank == 0:  # retention keeps the newest certified step
            trainer.guard.on_certified = self.checkpoints.asks.certify

    def _roll_back(self, trip: Any) -> Any:
        """A guard trip: roll back inside this attempt (``raytrain_ckpt/rank/rollback.py``)."""
        from raytrain_ckpt.rank.rollback import roll_back

        assert self.trainer is not None
        record = roll_back(self.trainer, self.checkpoints, self.trainer.guard, trip, f"rollback-{self.attempt}")
        self.metrics.rolled_back(record)
        if record is not None:
            self._rollbacks = tuple(self.trainer.guard.rollbacks)
        return record

    def reserve_state(self, nbytes: int) -> int:
        """Touch ``nbytes`` of memory now, while idle, for the optimizer state of the rank this
        spare may take over (``checkpoint.state.StateReserve``); returns the bytes reserved."""
        from raytrain_ckpt.checkpoint.recovery.state import StateReserve

        reserve = StateReserve(nbytes)
        if self.rank != SPARE_RANK:  # assigned a rank meanwhile (the other actor thread): too late to help
            return 0
        self._reserve = reserve
        return nbytes

    def _close_scalars(self) -> None:
        """Close rank 0's loggers of this attempt (``_open_scalars``), once: their background
        threads send what they still hold (``observe/loggers.py``). A failed attempt's run() never
        got to close them; a kept process that opened the next attempt's loggers first would read
        the runs' floors without those points and log the replayed steps twice."""
        scalars, self._scalars = getattr(self, "_scalars", None), None
        if scalars is not None:
            scalars.close()

    def reset(self) -> None:
        """Leave the finished or failed attempt: stop staging, drop the trainer, destroy the process group.

        Destroying the process group closes this rank's connections, so a peer still blocked
        in a collective with it fails at once instead of waiting for the collective timeout.
        """
        self._stop.set()
        self._close_scalars()  # a failed attempt's logged points reach the run before the next attempt reads its floor
        if self.checkpoints is not None:
            self.checkpoints.close()  # waits for a running staging copy: nothing reads the state after it
        if self.trainer is not None and self.trainer.replicas is not None:
            self.trainer.replicas.close()
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
