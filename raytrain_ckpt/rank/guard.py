"""The NaN/Inf and loss-spike guard of one rank, and which steps it certified.

After the backward pass and before the optimizer step, every rank judges its own loss (not
finite; with ``training.guard.spike``, a robust z-score over the rank's last healthy losses above
the threshold) and the ranks agree in one scalar all-reduce (MAX over ``code * 2**20 + rank``): a
trip on any rank is a trip for all, and every rank learns the worst verdict and the rank that gave
it. On a trip no optimizer step is applied: ``check`` raises ``GuardTrip`` and the worker rolls
back (``raytrain_ckpt/rank/rollback.py``).

A committed step is *certified* once ``certify_after_steps`` healthy steps followed it: the guard
remembers the steps saved on the current timeline and how far training got without a trip. A
rollback forgets the steps after its target, so a step saved after the certified one and before
the trip is never certified. ``RollbackPolicy`` decides whether a trip may roll back (pure).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from raytrain_ckpt.common.events import RollbackRecord, Trip
from raytrain_ckpt.spec.sections import GuardSpec

logger = logging.getLogger(__name__)

__all__ = ["GuardFailed", "GuardTrip", "LossGuard", "RollbackFacts", "RollbackPolicy",
           "RollbackRecord", "Trip", "failure_report", "robust_z"]

_HEALTHY, _SPIKE, _NONFINITE = 0, 1, 2
_METRICS = {_SPIKE: "loss spike", _NONFINITE: "non-finite loss"}
_RANK_BITS = 1 << 20
_MAD_SCALE = 1.4826
"""MAD x this estimates the standard deviation of normally distributed values."""


class GuardTrip(RuntimeError):
    """Raised on every rank by ``LossGuard.check`` when any rank tripped."""

    def __init__(self, trip: Trip) -> None:
        super().__init__(str(trip))
        self.trip = trip

    def __reduce__(self) -> tuple:
        return (GuardTrip, (self.trip,))


class GuardFailed(RuntimeError):
    """The job's one report when a trip cannot roll back (budget spent, recurrence, nothing certified).
    Rank 0 raises it; ``rank`` is the rank that tripped, which the job's failure names."""

    def __init__(self, report: str, rank: int | None = None) -> None:
        super().__init__(report)
        self.report, self.rank = report, rank

    def __reduce__(self) -> tuple:
        return (GuardFailed, (self.report, self.rank))


def robust_z(value: float, history: list[float]) -> float:
    """``(value - median) / (1.4826 x MAD)`` of ``history``; a flat history makes any rise infinite."""
    med = statistics.median(history)
    mad = statistics.median(abs(x - med) for x in history) * _MAD_SCALE
    if mad == 0.0:
        return 0.0 if value <= med else math.inf
    return (value - med) / mad


class LossGuard:
    """One rank's guard: judges each step's loss, agrees with the other ranks, certifies steps."""

    def __init__(self, spec: GuardSpec, rank: int, attempt: int, device: torch.device, earlier: int = 0) -> None:
        self.spec, self.rank, self.attempt, self.device = spec, rank, attempt, device
        self.earlier = earlier
        """Rollbacks the job's earlier attempts made (the driver counts them): the budget is per job."""
        self._losses: deque[tuple[int, float]] = deque(maxlen=spec.spike_window)
        self.saved: list[int] = []
        """Steps saved (or resumed from) on the current timeline, oldest first."""
        self.healthy_through = 0
        """Training got to this step with no trip since the newest rollback."""
        self.rollbacks: list[RollbackRecord] = []
        self.on_certified: Callable[[int], None] = lambda step: None
        """Called with each newly certified step (rank 0 tells the CheckpointActor: retention keeps it)."""
        self._pending = math.nan
        """The loss of the step being judged, kept for the spike window once the step is applied."""
        self.last_certified: int | None = None
        """The newest step certified so far (by this run or, before a resume, as the manifest recorded)."""

    @property
    def enabled(self) -> bool:
        return self.spec.nonfinite or self.spec.spike

    def check(self, step: int, local_loss: torch.Tensor) -> None:
        """Judge this rank's ``local_loss`` of ``step`` and agree with every rank (one all-reduce);
        raises ``GuardTrip`` on every rank when any rank tripped."""
        code = self._local_code(local_loss)
        verdict = torch.tensor([float(code * _RANK_BITS + self.rank)], dtype=torch.float64, device=self.device)
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        worst = int(verdict.item())
        if worst >= _RANK_BITS:
            raise GuardTrip(Trip(step, worst % _RANK_BITS, _METRICS[worst // _RANK_BITS]))

    def _local_code(self, local_loss: torch.Tensor) -> int:
        if not self.spec.spike:
            return _NONFINITE if self.spec.nonfinite and not bool(torch.isfinite(local_loss)) else _HEALTHY
        value = float(local_loss)
        if not math.isfinite(value):
            return _NONFINITE if self.spec.nonfinite else _HEALTHY
        self._pending = value
        if len(self._losses) == self._losses.maxlen:
            z = robust_z(value, [v for _, v in self._losses])
            if z > self.spec.spike_threshold:
                logger.warning("rank %d: loss %.4f is a spike (robust z %.1f > %g over the last %d losses)",
                               self.rank, value, z, self.spec.spike_threshold, len(self._losses))
                return _SPIKE
        return _HEALTHY

    def healthy(self, step: int) -> None:
        """Step ``step`` (0-based) was applied: remember its loss and what it certifies."""
        if self.spec.spike:
            self._losses.append((step, self._pending))
        self.healthy_through = step + 1
        newest = self.certified()
        if newest is not None and newest != self.last_certified:
            self.last_certified = newest
            self.on_certified(newest)
            if self.rank == 0:
                logger.info("step %d is certified: %d healthy steps followed it", newest, self.spec.certify_after_steps)

    def saved_step(self, step: int) -> None:
        """A checkpoint of ``step`` was saved (or loaded) on this timeline."""
        if step not in self.saved:
            self.saved.append(step)

    def lost_step(self, step: int) -> None:
        """The save of ``step`` failed after it began (its write, its hand-off): it is not a step
        to certify, nor to roll back to."""
        if step in self.saved:
            self.saved.remove(step)

    def certified(self) -> int | None:
        """The newest saved step that ``certify_after_steps`` healthy steps followed, or the one a
        resumed manifest recorded."""
        steps = self.certified_steps()
        return steps[0] if steps else None

    def certified_steps(self) -> list[int]:
        """Every certified step of this timeline, newest first (a rollback tries them in order)."""
        done = {s for s in self.saved if self.healthy_through - s >= self.spec.certify_after_steps}
        if self.last_certified is not None:
            done.add(self.last_certified)
        return sorted(done, reverse=True)

    def rolled_back(self, record: RollbackRecord) -> None:
        """Forget what came after the rollback's target: its saves, its losses."""
        to = record.to_step
        self.rollbacks.append(record)
        self.saved = [s for s in self.saved if s <= to]
        self.healthy_through = to
        self.last_certified = to
        kept = [(s, v) for s, v in self._losses if s < to]
        self._losses.clear()
        self._losses.extend(kept)


@dataclass(frozen=True)
class RollbackFacts:
    """What the rollback policy looks at."""

    trip: Trip
    certified: int | None
    rollbacks: tuple[RollbackRecord, ...]
    max_rollbacks: int
    earlier: int = 0
    """Rollbacks of the job's earlier attempts: ``max_rollbacks`` is a budget per job."""


@dataclass(frozen=True)
class RollbackPolicy:
    """Roll back while the budget lasts, unless the trip recurred right after a skip.

    A trip recurs when the previous rollback went to the same certified step and the trip is
    the same metric: no step was certified since, so skipping again would only walk the data.
    """

    @staticmethod
    def decide(facts: RollbackFacts) -> str:
        """``""`` to roll back, else the reason the job fails."""
        if facts.certified is None:
            return "no certified step to roll back to (no committed step was followed by enough healthy steps)"
        if facts.earlier + len(facts.rollbacks) >= facts.max_rollbacks:
            before = f" ({facts.earlier} in earlier attempts)" if facts.earlier else ""
            return f"training.guard.max_rollbacks={facts.max_rollbacks} rollbacks spent{before}"
        last = facts.rollbacks[-1] if facts.rollbacks else None
        if last is not None and last.to_step == facts.certified and last.trip.metric == facts.trip.metric:
            return (f"the same trip recurred right after skipping samples [{last.samples[0]}, {last.samples[1]}) "
                    f"(no step certified since the rollback to step {last.to_step})")
        return ""


def failure_report(trip: Trip, why: str, window: tuple[int, int], history: list[RollbackRecord],
                   certified: int | None = None) -> str:
    """The job's one report for a trip that ends it."""
    lines = [f"training guard: {trip} (samples [{window[0]}, {window[1]})); not rolled back: {why}"]
    if certified is not None:
        lines.append(f"  newest certified step: {certified} (kept by retention: resume from it by hand after a fix)")
    lines += [f"  earlier rollback {i + 1}: {r}" for i, r in enumerate(history)]
    return "\n".join(lines)
