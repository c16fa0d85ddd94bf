"""A guard trip's rollback, inside the running attempt (collective: every rank calls it).

The ranks agreed on the trip (``guard.LossGuard.check``) and applied no optimizer step. Then:

1. ``RollbackPolicy`` decides: a budget spent, a trip that recurred right after a skip or no
   certified step ends the job with one report (``GuardFailed``, raised by rank 0; the other ranks
   stop) naming the step, the rank, the metric and the sample indices.
2. The in-flight save settles; rank 0 leases the newest certified step that verifies from the
   CheckpointActor (``acquire``, as a restart does) and tells every rank where it is.
3. Every rank loads it (``load_app_state``: model, optimizer, schedule, step, RNG); the step's
   gradients are dropped.
4. The window of samples read from the certified step to the trip, the tripped step included, is
   skipped from here on (``data/skips.py``) and recorded in every later manifest.
5. Rank 0 makes the certified step the head of the timeline (``start_timeline``): the steps
   committed after it, on the abandoned path, are moved aside and never certified or loaded.

A rollback is no restart: the processes, the process group and the checkpoint client stay, and
``fault_tolerance.max_restarts`` is not spent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from raytrain_ckpt.checkpoint.format.verify import read_manifest
from raytrain_ckpt.checkpoint.storage.backends import open_storage
from raytrain_ckpt.common.locations import is_uri
from raytrain_ckpt.data.skips import SampleSkips
from raytrain_ckpt.common.events import headline
from raytrain_ckpt.rank.guard import GuardFailed, LossGuard, RollbackFacts, RollbackPolicy, RollbackRecord, Trip, failure_report

logger = logging.getLogger(__name__)

__all__ = ["RollbackInterrupted", "adopt_manifest", "roll_back"]


def roll_back(trainer: Any, ckpt: Any | None, guard: LossGuard, trip: Trip, holder: str) -> RollbackRecord | None:
    """Roll every rank back to the newest certified step after ``trip``; returns the record, or
    None on a rank other than 0 when the job ends (rank 0 raises ``GuardFailed`` with the report)."""
    # replica groups: a group's trip ends that group, which is replaced and healed from a live one
    # (the saving group too: a rollback of its own would leave the others on another timeline)
    if trainer.replicas is not None:
        raise GuardFailed(f"{trip.metric} at step {trip.step + 1} on rank {trip.rank}: replica group "
                          f"{trainer.replicas.replica} ends here; it is replaced and healed from a live group", trip.rank)
    t0 = time.monotonic()
    gbs = trainer.spec.training.global_batch_size
    first = trainer.skips.first_sample(trip.step)
    tripped = (first, first + gbs)
    spec = trainer.spec.training.guard
    why = RollbackPolicy.decide(RollbackFacts(trip, guard.certified(), tuple(guard.rollbacks), spec.max_rollbacks,
                                              guard.earlier))
    if not why and ckpt is None:
        why = "checkpointing is off (checkpoint.enabled=false): there is no committed step to return to"
    step, path, key = (None, None, None) if why else _lease_certified(trainer, ckpt, guard, holder, trip)
    if not why and step is None:
        why = "no certified step could be loaded (none verifies any more)"
    if why:
        return _fail(trainer, trip, why, tripped, guard)
    from raytrain_ckpt.checkpoint.format.unpickling import vouch_for
    from raytrain_ckpt.checkpoint.recovery.state import load_app_state

    if key:  # the lease's check of this step's .metadata passed: no rank decodes it again
        vouch_for([key])
    for opt in trainer.optimizers:  # the tripped step's gradients: never applied
        opt.zero_grad(set_to_none=True)
    load_app_state(trainer, path, same_world_size=True)
    assert trainer.state.step == step, (trainer.state.step, step)
    window = trainer.skips.skip(step, trip.step)
    if trainer.rank == 0:
        _ask_actor(trip, f"starting the timeline of step {step}",
                   lambda: ckpt.asks.start_timeline(step, path, f"rollback to step {step}"))
        _ask_actor(trip, f"releasing the lease on step {step}", lambda: ckpt.asks.release(holder))
    dist.barrier()  # no rank saves a step of the new path before the old one is moved aside
    record = RollbackRecord(trip, step, (window.lo, window.hi))
    guard.rolled_back(record)
    if trainer.rank == 0:
        logger.warning("rollback %d/%d: %s in %.2fs; the job continues from step %d",
                       guard.earlier + len(guard.rollbacks),
                       spec.max_rollbacks, record, time.monotonic() - t0, step)
    return record


def _lease_certified(trainer: Any, ckpt: Any, guard: LossGuard, holder: str,
                     trip: Trip) -> tuple[int | None, str | None, str | None]:
    """Rank 0 leases the newest certified step that verifies; every rank gets ``(step, path,
    the decode key of its .metadata that the lease's check passed)``."""
    ckpt.wait_committed()  # the in-flight save settles first: its step may be the certified one
    found: list[Any] = [None, None, None]
    if trainer.rank == 0:
        from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint

        verify = trainer.spec.checkpoint.verify_on_load
        for step in guard.certified_steps():
            try:
                point = _ask_actor(trip, f"leasing certified step {step}",
                                   lambda step=step: ckpt.asks.acquire(holder, str(step), verify))
            except InvalidCheckpoint as exc:  # (Ray's error is one too) gone or damaged: an older certified step
                logger.warning("certified step %d cannot be loaded (%s); trying an older one", step, exc)
                continue
            if point is not None:
                found = [point.step, point.path, point.metadata_key]
                break
    dist.broadcast_object_list(found, src=0)
    return found[0], found[1], found[2]


class RollbackInterrupted(RuntimeError):
    """The CheckpointActor died while a rollback needed it: the failure says so, instead of Ray's
    bare actor error (the restart that follows rebuilds the actor from storage)."""

    def __reduce__(self) -> tuple:
        return (RollbackInterrupted, self.args)


def _ask_actor(trip: Trip, what: str, call: Callable[[], Any]) -> Any:
    """``ray.get(call())`` on the CheckpointActor during the rollback of ``trip``; its death is
    named as what failed (``what``: the rollback's step that needed it)."""
    import ray

    try:
        return ray.get(call())
    except ray.exceptions.RayActorError as exc:
        raise RollbackInterrupted(f"checkpoint actor died during the rollback of {trip} ({what}): "
                                  f"{headline(str(exc))[:300]}") from None


def _fail(trainer: Any, trip: Trip, why: str, tripped: tuple[int, int], guard: LossGuard) -> None:
    report = failure_report(trip, why, tripped, guard.rollbacks, guard.certified())
    if trainer.rank == 0:
        logger.error("%s", report)
        raise GuardFailed(report, trip.rank)  # the failure names the rank that tripped, not this reporter
    return None


def adopt_manifest(trainer: Any, guard: LossGuard | None, path: str) -> None:
    """After a resume from the step at ``path``: keep skipping the windows its manifest records, and
    know the certified step it records (and the step itself, a saved step of this timeline)."""
    # the manifest where the step lives: a local directory or an object-store prefix
    m = read_manifest(open_storage(path, trainer.spec.checkpoint.storage_options),
                      path if is_uri(path) else Path(path))
    rows = {tuple(row) for row in [*trainer.spec.data.skip_samples, *(m.skipped_samples or [])]}
    trainer.skips = SampleSkips.from_lists(trainer.spec.training.global_batch_size, sorted(rows))
    # the replica groups' shares skipped before: every later manifest names them too
    trainer.replica_skips_before = tuple(tuple(row) for row in m.replica_skips or ())
    if guard is not None:
        guard.last_certified = m.certified_step
        guard.saved_step(m.step)
        guard.healthy_through = m.step
        if trainer.rank == 0 and (m.skipped_samples or m.certified_step is not None):
            logger.info("resumed step %d: certified step %s, skipping sample windows %s", m.step,
                        m.certified_step, m.skipped_samples or [])
