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
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import ray
import torch
import torch.distributed as dist
from ray.exceptions import RayError
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.tensor import DTensor

from raytrain_ckpt.checkpoint.format.plannumbers import own_central
from raytrain_ckpt.checkpoint.roles.planning import plan_to_send
from raytrain_ckpt.checkpoint.records import PersistRequest, TrainingPoint
from raytrain_ckpt.checkpoint.roles.client_asks import ClientAsks
from raytrain_ckpt.checkpoint.roles.names import call_restarting
from raytrain_ckpt.checkpoint.errors import StepAborted
from raytrain_ckpt.checkpoint.datapath.buffers import BufferLease
from raytrain_ckpt.checkpoint.errors import StagingFileError
from raytrain_ckpt.checkpoint.policy.interval import CostMeter, IntervalDecision, IntervalFacts, IntervalHistory, choose_interval
from raytrain_ckpt.checkpoint.policy.schedule import SaveSchedule, on_busy_choice
from raytrain_ckpt.checkpoint.datapath.staging import (PinnedCudaStaging, SharedMemoryStaging, Staging, TensorSlot, layout_key,
                                                     map_buffer, plan_slots, populate_of)
from raytrain_ckpt.common.events import cause_text, headline
from raytrain_ckpt.common.faults import maybe_inject
from raytrain_ckpt.spec import CheckpointSpec

logger = logging.getLogger(__name__)

__all__ = ["CheckpointClient", "SaveStats", "next_buffer"]


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
class _Buffer:
    """One of the rank's staging buffers and the step it holds (None: empty, or its save failed)."""

    path: str
    staging: Staging
    lease: BufferLease
    step: int | None = None


def next_buffer(steps: list[int | None]) -> int:
    """Which buffer the next save stages into: an empty one, else the one holding the oldest step.

    Never the one holding the newest step handed off: with two buffers, the newest committed
    step stays intact while the next one is staged (``checkpoint.memory_copies``). A step
    whose save failed on this rank is forgotten (None), so its buffer is the one reused.
    """
    empty = [i for i, s in enumerate(steps) if s is None]
    if empty:
        return empty[0]
    return min(range(len(steps)), key=lambda i: steps[i])  # type: ignore[arg-type,return-value]


@dataclass
class _Layout:
    key: str
    plan_id: str
    slots: list[TensorSlot]
    nbytes: int
    plan: SavePlan
    buffers: list[_Buffer]
    active: int = 0
    """The buffer of the latest save (the one ``before_optimizer_step`` waits for)."""

    @property
    def staging(self) -> Staging:
        return self.buffers[self.active].staging

    @property
    def buffer_path(self) -> str:
        return self.buffers[self.active].path


def _local_tensors(state: dict[str, Any], coordinator: bool = False) -> tuple[dict[str, torch.Tensor], DefaultSavePlanner]:
    """The flat state's tensors (a DTensor's local shard) by name, and the planner that flattened it."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=coordinator)
    tensors = {fqn: v.to_local() if isinstance(v, DTensor) else v
               for fqn, v in planner.state_dict.items() if isinstance(v, torch.Tensor)}
    return tensors, planner


def _flat_state(state: dict[str, Any], coordinator: bool) -> tuple[dict[str, torch.Tensor], DefaultSavePlanner,
                                                                  dict[str, Any]]:
    """The flat state's tensors by name, the planner that flattened it, and its other objects."""
    tensors, planner = _local_tensors(state, coordinator)
    return tensors, planner, {fqn: v for fqn, v in planner.state_dict.items() if not isinstance(v, torch.Tensor)}


class _AheadOfFirstSave:
    """The first save's staging buffers, made ready while training goes on.

    The first call asks the writer for this layout's buffers (allocated and backed in full in the
    writer, off the training thread: 0.1-0.3 s per 256 MiB on a loaded machine); a later call,
    once they are ready, maps them and faults their pages in on a thread of its own. The first
    save's setup then finds them allocated and mapped (``writer.allocate`` returns the rank's
    buffer of this attempt, ``map_buffer`` the kept mapping). Nothing is waited for, and a failure
    is left to the save, which meets it again and reports it.
    """

    def __init__(self, writer: Any, rank: int, attempt: int, copies: int) -> None:
        self.writer, self.rank, self.attempt, self.copies = writer, rank, attempt, copies
        self._asked: tuple[int, list[ray.ObjectRef]] | None = None
        self._done = False

    def step(self, state: Callable[[], dict[str, Any]]) -> None:
        if self._done:
            return
        if self._asked is None:
            _, nbytes = plan_slots(_local_tensors(state())[0])
            self._asked = (nbytes, [self.writer.allocate.remote(self.rank, self.attempt, nbytes, c)
                                    for c in range(self.copies)])
            return
        nbytes, refs = self._asked
        if len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
            return
        self._done = True
        try:
            for path in ray.get(refs):
                populate_of(map_buffer(Path(path), nbytes, keep=len(refs))).start()
        except Exception as exc:  # the first save allocates and maps again, and reports what fails
            logger.debug("staging buffers not prepared ahead of the first save: %s", exc)


class CheckpointClient:
    """One per rank; owned by the TrainWorker."""

    def __init__(self, cfg: CheckpointSpec, rank: int, attempt: int, total_steps: int,
                 actor: Any, writer: Any, device: torch.device, prior_mtbf_s: float | None = None,
                 history: IntervalHistory | None = None, kept_copy: tuple[str, int] | None = None) -> None:
        self.cfg, self.rank, self.attempt, self.total_steps = cfg, rank, attempt, total_steps
        self.actor, self.writer, self.device = actor, writer, device
        self.asks = ClientAsks(actor, writer)  # outside a save: a certified step, a rollback's lease and timeline
        self.stats, self._stall_reported = SaveStats(), 0.0
        self.schedule = SaveSchedule.configured(total_steps, cfg.interval_steps, cfg.save_final)
        self.interval: _AutoInterval | None = None
        if cfg.interval_steps == "auto":
            assert prior_mtbf_s is not None, "interval_steps=auto needs fault_tolerance.expected_mtbf_s"
            self.interval = _AutoInterval(self, prior_mtbf_s, history or IntervalHistory())
        self._layout: _Layout | None = None
        self._kept = kept_copy
        """(buffer path, step) of the in-memory copy this attempt resumed from: not staged over first."""
        self._inflight: tuple[int, ray.ObjectRef] | None = None
        self._inflight_tier = "durable"  # the tier of the save in _inflight
        self._replan = False
        self._last_save_at = time.monotonic()
        self.on_lost: Callable[[int], None] | None = None  # told each step whose save was lost (the guard's)
        self._ahead = _AheadOfFirstSave(writer, rank, attempt, cfg.memory_copies)

    def prepare(self, state: Callable[[], dict[str, Any]]) -> None:
        """Get the first save's staging buffers ready while training goes on (``_AheadOfFirstSave``):
        the worker calls it after every step that does not save."""
        if self._layout is None:
            self._ahead.step(state)

    def due(self, step: int) -> bool:
        """Whether the state after ``step`` optimizer steps should be saved (the same answer on every rank).

        Called once after every step: with ``interval_steps: auto`` it also times the step and,
        when the interval falls on it, chooses the next interval.
        """
        schedule = self.interval.tick(step) if self.interval is not None else self.schedule
        every = self.cfg.interval_seconds
        if not schedule.asks_clock(step, every):
            return schedule.due(step)
        assert every is not None
        return schedule.due(step, self._any_rank(time.monotonic() - self._last_save_at >= every))

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` is set on some rank (a collective: every rank gets the same answer)."""
        return self._any_rank(flag)

    def max_rank(self, value: int) -> int:
        """The largest ``value`` over the ranks (a collective of 4 bytes, as ``any_rank``)."""
        t = torch.tensor([value], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _any_rank(self, flag: bool) -> bool:
        return bool(self.max_rank(int(flag)))

    def before_optimizer_step(self) -> None:
        """Block until the staging copy is done: the optimizer is about to change what it reads.

        The hand-off to the writer after the copy (a round trip to a process that may be busy
        writing another rank) goes on meanwhile; the next save waits for it (``_handed_off``)."""
        if self._layout is not None:
            self.stats.stall_s += self._layout.staging.wait()

    def _handed_off(self) -> float:
        """Wait until the last save's hand-off is done (it sets ``_inflight``); returns the seconds blocked."""
        return self._layout.staging.finish() if self._layout is not None else 0.0

    def save(self, step: int, state: dict[str, Any], point: TrainingPoint | None = None, final: bool = False,
             tier: str = "durable") -> bool:
        """Save ``state`` (a DCP state dict of live tensors, e.g. ``app_state(trainer)``) as ``step``.

        Collective: every rank calls it for the same steps. ``point`` (samples and tokens seen,
        losses) goes into the manifest. ``final``: never skipped (the last step, or a drain's).
        ``tier="ram"``: a drain's RAM tier, held by the writer in memory only (``roles/ramtier.py``).
        False: the save did not go on (skipped, or lost before its copy); a later loss calls ``on_lost``.
        """
        t0 = time.monotonic()
        self._handed_off()  # counted in this save's stall
        if not self._previous_settled(step, final=final or step == self.total_steps):
            return False
        # Opened by the rank (not its node's writer, which may stop answering) while it plans and
        # copies: the writer gets the reply and starts its first write without a round trip.
        opened = self.actor.open_step.remote(step, self.attempt) if tier == "durable" else None
        tensors, self._planner, objects = _flat_state(state, self.rank == 0)
        try:
            layout = self._ensure_layout(step, tensors, objects)
        except (RayError, StepAborted, StagingFileError) as exc:  # writer or actor gone, buffer still leased:
            # lose this save, not the run
            self._aborted(step, exc)
            return False
        payload = pickle.dumps(objects)
        layout.active = next_buffer([b.step for b in layout.buffers])
        buf = layout.buffers[layout.active]
        buf.step = None  # staged over from here on

        token = secrets.randbits(62) + 1
        sent: list[Any] = []

        def begin() -> None:
            """As the copy begins (the buffer's progress is reset for this save): hand the step to
            the writer, which writes each tensor as soon as the copy has reached it."""
            req = PersistRequest(step, self.rank, self.attempt, layout.plan_id, buf.path, layout.nbytes, layout.slots,
                                 payload, layout.plan, point or TrainingPoint(),
                                 stage_s=time.monotonic() - t0, token=token, tier=tier)  # the writer adds the copy's time
            try:
                sent.append(self.writer.accept.remote(req, [opened] if opened is not None else []))  # nested: a failed call is the writer's to handle
            except Exception as exc:  # surfaced by hand_off(): the copy goes on, the step is lost
                sent.append(exc)

        def hand_off() -> None:
            """Once the copy is complete: the writer holds the step (or this save is lost)."""
            try:
                if isinstance(sent[0], Exception):
                    raise sent[0]
                ray.get(sent[0])
            except Exception as exc:  # the writer died or refused the buffer: this step is lost, training goes on
                self._aborted(step, exc)
                return
            buf.step = step
            self._inflight = (step, self.writer.wait.remote(self.rank, step))
            self._inflight_tier = tier
            for b in layout.buffers:  # a buffer not staged into yet: populate it now, not in its first copy
                b.staging.warm()
            maybe_inject("staged", self.rank, step, self.attempt)

        self._inflight = None
        layout.staging.start(tensors, hand_off, lambda: maybe_inject("staging", self.rank, step, self.attempt),
                             token=token, on_begin=begin)
        self.stats.saves += 1
        self._last_save_at = time.monotonic()
        self.stats.stall_s += time.monotonic() - t0
        if self.cfg.mode == "sync":
            self.wait_committed()
        if tier == "durable":  # a RAM-tier step has no manifest to keep it
            self._report_stall(step)
        if self.interval is not None:
            self.interval.saved(self.stats.last_stall_s)
        return True

    def _report_stall(self, step: int) -> None:
        """The actor keeps each step's stall in its manifest (``wall.stall_s``, max over ranks), carried there by the node's writer."""
        self.stats.last_stall_s, self._stall_reported = self.stats.stall_s - self._stall_reported, self.stats.stall_s
        self.writer.record_stall.remote(step, self.rank, self.stats.last_stall_s)

    def _previous_settled(self, step: int, final: bool) -> bool:
        """Apply on_busy to a save still writing; returns False when this save is skipped (on every rank).

        The final save is never skipped: it waits.
        """
        busy = self._inflight is not None and not ray.wait([self._inflight[1]], timeout=0)[0]
        if on_busy_choice(self.cfg.on_busy, final, lambda: self._any_rank(busy)) == "skip":
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
        if self._layout is not None:  # its buffer holds nothing worth keeping
            for b in self._layout.buffers:
                b.step = None if b.step == step else b.step
        self.stats.aborted += 1
        if self.on_lost is not None:
            self.on_lost(step)
        why = cause_text(exc)  # the writer's own error, not Ray's wrapper around it
        logger.warning("checkpoint step %d aborted, training continues: %s", step, why)
        self.actor.abort.remote(step, f"rank {self.rank}: {why}", self.attempt)
        self._replan = True  # a restarted actor or writer lost the plan and the buffer: set up again

    def _ensure_layout(self, step: int, tensors: dict[str, torch.Tensor], objects: dict[str, Any]) -> _Layout:
        """Reuse the cached plan and buffer unless some rank's layout changed (then all plan again)."""
        slots, nbytes = plan_slots(tensors)
        key = layout_key(slots, list(objects))
        if not self._any_rank(self._replan or self._layout is None or self._layout.key != key):
            assert self._layout is not None
            return self._layout
        local, sent = plan_to_send(self._planner.create_local_plan, self.rank, self.device)  # a broadcast
        central = call_restarting(
            lambda: self.actor.plan.remote(self.attempt, step, self.rank, sent, self.cfg.commit_timeout_s),
            RESTART_WAIT_S)
        plan_id = central.plan_id
        plan = self._planner.finish_plan(own_central(central.plan, local))  # from its own items (``plannumbers.py``)
        paths = [call_restarting(lambda c=c: self.writer.allocate.remote(self.rank, self.attempt, nbytes, c),
                                 RESTART_WAIT_S) for c in range(self.cfg.memory_copies)]
        if self._layout is not None:  # before mapping: closing any fd of the file would drop it anyway
            for b in self._layout.buffers:
                b.lease.release()
                close = getattr(b.staging, "close", None)
                if close is not None:  # unregister pinned memory: map_buffer may return the same mapping
                    close()
        buffers = []
        for path in paths:
            buffer = map_buffer(Path(path), nbytes, keep=len(paths))
            lease = BufferLease(Path(path))  # after mapping (map_buffer closes its fd)
            staging: Staging = (PinnedCudaStaging(buffer, slots, self.device) if self.device.type == "cuda"
                                else SharedMemoryStaging(buffer, slots))
            kept = self._kept is not None and self._kept[0] == path and self._layout is None
            buffers.append(_Buffer(path, staging, lease, self._kept[1] if kept and self._kept else None))
        self._layout = _Layout(key, plan_id, slots, nbytes, plan, buffers)
        self._replan = False
        logger.info("checkpoint layout %s: %d tensors, %d x %.1f MB staging buffer(s) %s", key, len(slots),
                    len(paths), nbytes / 1e6, ", ".join(paths))
        return self._layout

    def close(self) -> None:
        """Leave the attempt: let a running staging copy finish and release the buffer mapping.

        A step already handed to the writer is the writer's and the actor's business now.
        """
        if self._layout is None:
            return
        try:
            self._layout.staging.finish()
        except Exception as exc:  # the attempt is over; a failed copy only loses an uncommitted save
            logger.debug("staging copy failed while leaving the attempt: %s", exc)
        for b in self._layout.buffers:
            close = getattr(b.staging, "close", None)
            if close is not None:
                close()
            b.lease.release()  # the writer may give the buffer to the next attempt
        self._layout = None

    def wait_committed(self) -> None:
        """Finish the in-flight save and wait for its commit (the final save, or mode=sync)."""
        self.before_optimizer_step()
        self.stats.stall_s += self._handed_off()
        if self._inflight is None:
            return
        step, ref = self._inflight
        if not self._settle(step, ref) or self._inflight_tier == "ram":  # a RAM-tier step never commits
            return
        try:
            ray.get(self.actor.wait_committed.remote(step, self.cfg.commit_timeout_s))
        except StepAborted as exc:  # another rank's write failed; the earlier steps stay valid
            self.stats.aborted += 1
            logger.warning("checkpoint step %d did not commit: %s", step, headline(str(exc)))


class _AutoInterval:
    """``interval_steps: auto`` for one rank: measures, and re-plans the client's schedule.

    Every rank must save the same steps, so every decision is taken from values all ranks
    share: the attempt's history (the same argument on every rank) and, at each save the
    interval schedules, the maximum over ranks of the measured cost, step time and time
    survived (one all-reduce per such save).
    """

    def __init__(self, client: CheckpointClient, prior_mtbf_s: float, history: IntervalHistory) -> None:
        self.client, self.prior_mtbf_s, self.history = client, prior_mtbf_s, history
        self.meter = CostMeter(history.cost_s, history.step_time_s)
        self.decision: IntervalDecision | None = None
        self._started = time.monotonic()
        self._tick: float | None = None
        self._stall_at_tick = 0.0
        self._after_save = False
        self._written: ray.ObjectRef | None = None
        """The newest save known to be written (not waited on again)."""

    def saved(self, stall_s: float) -> None:
        """A save left the training thread after blocking it ``stall_s``."""
        self.meter.saved(stall_s)
        self._after_save = True
        c = self.client
        if c.rank == 0 and c.actor is not None:  # a hint for the next attempt, not a decision
            c.actor.record_costs.remote(self.meter.cost_s(), self.meter.step_time_s())

    def tick(self, step: int) -> SaveSchedule:
        """After ``step``: time it, and choose the interval at the start and on each interval save.

        Returns the schedule that decides ``step`` (the one in force before a re-plan at it).
        """
        c = self.client
        now = time.monotonic()
        if self._tick is not None:
            stall = c.stats.stall_s - self._stall_at_tick
            self.meter.step(max(0.0, now - self._tick - stall), self._persisting())
        self._tick, self._stall_at_tick = now, c.stats.stall_s
        if self.decision is None:  # the attempt's first step: only the history, no collective
            h = self.history
            self._apply(step - 1, IntervalFacts(c.total_steps, self.prior_mtbf_s, h.failures, h.survived_s,
                                                h.cost_s, h.step_time_s))
        current = c.schedule
        if current.on_interval(step):
            self._apply(step, self._shared_facts())
        return current

    def _persisting(self) -> bool:
        """A save is still being written (its staging copy overlaps the step after it, too)."""
        after_save, self._after_save = self._after_save, False
        inflight = self.client._inflight
        if inflight is None or inflight[1] is self._written:
            return after_save
        if ray.wait([inflight[1]], timeout=0)[0]:
            self._written = inflight[1]
            return after_save
        return True

    def _shared_facts(self) -> IntervalFacts:
        h, c = self.history, self.client
        cost, step_time = self.meter.cost_s(), self.meter.step_time_s()
        local = [-1.0 if cost is None else cost, -1.0 if step_time is None else step_time,
                 time.monotonic() - self._started]
        t = torch.tensor(local, dtype=torch.float64, device=c.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        cost, step_time, elapsed = t.tolist()
        return IntervalFacts(c.total_steps, self.prior_mtbf_s, h.failures, h.survived_s + elapsed,
                             cost if cost >= 0 else None, step_time if step_time > 0 else None)

    def _apply(self, step: int, facts: IntervalFacts) -> None:
        decision = choose_interval(facts)
        c = self.client
        c.schedule = SaveSchedule(c.total_steps, decision.steps, c.cfg.save_final, anchor=step)
        changed = self.decision is None or self.decision.steps != decision.steps
        self.decision = decision
        if c.rank != 0:
            return
        if changed:
            logger.info("[attempt %d rank 0 step %d] checkpoint interval -> %d steps (%s)", c.attempt, step,
                        decision.steps, decision.describe())
        if c.actor is not None:  # status, metrics and the next attempt's history
            c.actor.record_interval.remote(step, decision)


RESTART_WAIT_S = 30.0
"""How long a call waits for a restarting writer before the save is given up."""
