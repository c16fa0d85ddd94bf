"""The trainer's side of checkpointing: decide when, plan, stage, hand off.

A save costs the training loop: building the flat state dict, pickling the few non-tensor
entries, and starting the staging copy. The copy runs while the next forward/backward runs;
``before_optimizer_step()`` waits for it right before the optimizer changes the parameters.
Planning with the CheckpointActor is a round trip only when the layout changes (the first
save of an attempt).
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.exceptions import ActorUnavailableError, RayError
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.tensor import DTensor

from raytrain_ckpt.checkpoint.actor import StepAborted
from raytrain_ckpt.checkpoint.buffers import BufferLease, StagingFileError
from raytrain_ckpt.checkpoint.staging import (
    PinnedCudaStaging,
    SharedMemoryStaging,
    Staging,
    TensorSlot,
    layout_key,
    map_buffer,
    plan_slots,
)
from raytrain_ckpt.checkpoint.writer import PersistRequest
from raytrain_ckpt.events import headline
from raytrain_ckpt.faults import maybe_inject
from raytrain_ckpt.spec import CheckpointSpec

logger = logging.getLogger(__name__)

__all__ = ["CheckpointClient", "SaveSchedule", "SaveStats"]


@dataclass(frozen=True)
class SaveSchedule:
    """When a step is saved: a pure decision, table-tested.

    ``interval_steps`` decides for every step, the last one included; ``save_final`` only adds
    a save of the last step; the time trigger (``clock_due``: ``interval_seconds`` passed on
    some rank) adds a save of any step.
    """

    total_steps: int
    interval_steps: int | None
    save_final: bool

    def by_step(self, step: int) -> bool:
        """Due whatever the clock says (the same answer on every rank, no collective)."""
        if self.interval_steps is not None and step % self.interval_steps == 0:
            return True
        return self.save_final and step == self.total_steps

    def due(self, step: int, clock_due: bool = False) -> bool:
        return self.by_step(step) or clock_due


@dataclass
class SaveStats:
    """What checkpointing cost this rank's training loop."""

    saves: int = 0
    skipped: int = 0
    aborted: int = 0
    stall_s: float = 0.0
    """Seconds the training thread was blocked by checkpointing (planning, staging waits, busy waits)."""
    last_stall_s: float = 0.0
    """The part of ``stall_s`` since the save before the latest one (metrics, the step's manifest)."""


@dataclass
class _Layout:
    key: str
    plan_id: str
    slots: list[TensorSlot]
    nbytes: int
    plan: SavePlan
    buffer_path: str
    staging: Staging
    lease: BufferLease


class CheckpointClient:
    """One per rank; owned by the TrainWorker."""

    def __init__(self, cfg: CheckpointSpec, rank: int, attempt: int, total_steps: int,
                 actor: Any, writer: Any, device: torch.device) -> None:
        self.cfg, self.rank, self.attempt, self.total_steps = cfg, rank, attempt, total_steps
        self.actor, self.writer, self.device = actor, writer, device
        self.stats = SaveStats()
        self._stall_reported = 0.0
        self.schedule = SaveSchedule(total_steps, cfg.interval_steps, cfg.save_final)
        self._layout: _Layout | None = None
        self._inflight: tuple[int, ray.ObjectRef] | None = None
        self._replan = False
        self._last_save_at = time.monotonic()

    def due(self, step: int) -> bool:
        """Whether the state after ``step`` optimizer steps should be saved (the same answer on every rank)."""
        if self.schedule.by_step(step) or self.cfg.interval_seconds is None:
            return self.schedule.due(step)
        # Clocks differ per rank: agree, or one rank would save a step the others skip.
        elapsed = time.monotonic() - self._last_save_at
        return self.schedule.due(step, self._any_rank(elapsed >= self.cfg.interval_seconds))

    def _any_rank(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def before_optimizer_step(self) -> None:
        """Block until the staging copy is done: the optimizer is about to change what it reads."""
        if self._layout is not None:
            self.stats.stall_s += self._layout.staging.wait()

    def save(self, step: int, state: dict[str, Any], info: dict[str, float] | None = None) -> None:
        """Save ``state`` (a DCP state dict of live tensors, e.g. ``app_state(trainer)``) as ``step``.

        Collective: every rank calls it for the same steps. ``info`` (samples_seen,
        tokens_seen) goes into the manifest.
        """
        t0 = time.monotonic()
        if not self._previous_settled(step, final=step == self.total_steps):
            return
        tensors, objects = self._flatten(state)
        try:
            layout = self._ensure_layout(step, tensors, objects)
        except (RayError, StepAborted, StagingFileError) as exc:  # writer or actor gone, buffer still leased:
            # lose this save, not the run
            self._aborted(step, exc)
            return
        info = dict(info or {})
        payload = pickle.dumps(objects)

        def hand_off() -> None:
            info["stage_s"] = time.monotonic() - t0
            req = PersistRequest(step, self.rank, self.attempt, layout.plan_id, layout.buffer_path, layout.nbytes,
                                 layout.slots, payload, layout.plan, info)
            try:
                _get_restarting(lambda: self.writer.accept.remote(req))
            except Exception as exc:  # the writer died: this step is lost, training goes on
                self._aborted(step, exc)
                return
            self._inflight = (step, self.writer.wait.remote(self.rank, step))
            maybe_inject("staged", self.rank, step, self.attempt)

        self._inflight = None
        layout.staging.start(tensors, hand_off, lambda: maybe_inject("staging", self.rank, step, self.attempt))
        self.stats.saves += 1
        self._last_save_at = time.monotonic()
        self.stats.stall_s += time.monotonic() - t0
        if self.cfg.mode == "sync":
            self.wait_committed()
        self._report_stall(step)

    def _report_stall(self, step: int) -> None:
        """The actor keeps each step's stall in its manifest (``wall.stall_s``, max over ranks)."""
        self.stats.last_stall_s, self._stall_reported = self.stats.stall_s - self._stall_reported, self.stats.stall_s
        self.actor.record_stall.remote(step, self.rank, self.stats.last_stall_s)

    def _previous_settled(self, step: int, final: bool) -> bool:
        """Apply on_busy to a save still writing; returns False when this save is skipped (on every rank).

        The final save is never skipped: it waits.
        """
        busy = self._inflight is not None and not ray.wait([self._inflight[1]], timeout=0)[0]
        if self.cfg.on_busy == "skip" and not final and self._any_rank(busy):
            self.stats.skipped += 1
            logger.warning("checkpoint step %d skipped: the previous save is still being written "
                           "(checkpoint.on_busy=skip)", step)
            return False
        if self._inflight is not None:
            self._settle(*self._inflight)  # counted in save()'s stall
        return True

    def _settle(self, step: int, ref: ray.ObjectRef) -> bool:
        """Wait for a hand-off to finish writing; a failed write aborts that step only."""
        self._inflight = None
        try:
            ray.get(ref)
        except Exception as exc:  # the step is lost, training goes on; the next save retries
            self._aborted(step, exc)
            return False
        return True

    def _aborted(self, step: int, exc: BaseException) -> None:
        self.stats.aborted += 1
        logger.warning("checkpoint step %d aborted, training continues: %s", step, headline(str(exc)))
        self.actor.abort.remote(step, f"rank {self.rank}: {headline(str(exc))}")
        self._replan = True  # a restarted actor or writer lost the plan and the buffer: set up again

    def _flatten(self, state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, is_coordinator=self.rank == 0)
        self._planner = planner
        tensors, objects = {}, {}
        for fqn, value in planner.state_dict.items():
            if isinstance(value, torch.Tensor):
                tensors[fqn] = value.to_local() if isinstance(value, DTensor) else value
            else:
                objects[fqn] = value
        return tensors, objects

    def _ensure_layout(self, step: int, tensors: dict[str, torch.Tensor], objects: dict[str, Any]) -> _Layout:
        """Reuse the cached plan and buffer unless some rank's layout changed (then all plan again)."""
        slots, nbytes = plan_slots(tensors)
        key = layout_key(slots, list(objects))
        if not self._any_rank(self._replan or self._layout is None or self._layout.key != key):
            assert self._layout is not None
            return self._layout
        local = self._planner.create_local_plan()
        central, plan_id = _get_restarting(
            lambda: self.actor.plan.remote(self.attempt, step, self.rank, local, self.cfg.commit_timeout_s))
        plan = self._planner.finish_plan(central)
        path = _get_restarting(lambda: self.writer.allocate.remote(self.rank, self.attempt, nbytes))
        if self._layout is not None:  # before mapping: closing any fd of the file would drop it anyway
            self._layout.lease.release()
        buffer = map_buffer(Path(path), nbytes)
        lease = BufferLease(Path(path))  # after mapping (map_buffer closes its fd)
        staging: Staging = (PinnedCudaStaging(buffer, slots, self.device) if self.device.type == "cuda"
                            else SharedMemoryStaging(buffer, slots))
        self._layout = _Layout(key, plan_id, slots, nbytes, plan, path, staging, lease)
        self._replan = False
        logger.info("checkpoint layout %s: %d tensors, %.1f MB staging buffer %s", key, len(slots), nbytes / 1e6, path)
        return self._layout

    def close(self) -> None:
        """Leave the attempt: let a running staging copy finish and release the buffer mapping.

        A step already handed to the writer is the writer's and the actor's business now.
        """
        if self._layout is None:
            return
        try:
            self._layout.staging.wait()
        except Exception as exc:  # the attempt is over; a failed copy only loses an uncommitted save
            logger.debug("staging copy failed while leaving the attempt: %s", exc)
        close = getattr(self._layout.staging, "close", None)
        if close is not None:
            close()
        self._layout.lease.release()  # the writer may give the buffer to the next attempt
        self._layout = None

    def wait_committed(self) -> None:
        """Finish the in-flight save and wait for its commit (the final save, or mode=sync)."""
        self.before_optimizer_step()
        if self._inflight is None:
            return
        step, ref = self._inflight
        if not self._settle(step, ref):
            return
        try:
            ray.get(self.actor.wait_committed.remote(step, self.cfg.commit_timeout_s))
        except StepAborted as exc:  # another rank's write failed; the earlier steps stay valid
            self.stats.aborted += 1
            logger.warning("checkpoint step %d did not commit: %s", step, headline(str(exc)))


RESTART_WAIT_S = 30.0
"""How long a call waits for a restarting writer before the save is given up."""


def _get_restarting(call: Callable[[], ray.ObjectRef]) -> Any:
    """``ray.get(call())``, retried while the actor is restarting (after a crash Ray brings it back)."""
    deadline = time.monotonic() + RESTART_WAIT_S
    while True:
        try:
            return ray.get(call())
        except ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)

