"""``checkpoint.interval_steps: auto``: how often to save, from what saving and failing cost.

Young-Daly: with a save costing ``C`` seconds of training time and failures arriving every
``M`` seconds on average, the interval that minimises checkpoint overhead plus the expected
work lost to a failure is ``T = sqrt(2 x C x M)`` seconds of training, i.e. ``T / step_time``
steps. The policy is a pure function of plain facts (``choose_interval``), tested with a table;
the trainer's CheckpointClient measures the facts and asks it at each scheduled save.

* ``C`` (``cost_s``): what a save took from training: the stall of the training thread
  (flattening, planning, staging waits) plus the slowdown of the steps that ran while the
  writer persisted it (their step time above the steps that ran with no save in flight).
* ``M`` (``mtbf_s``): the spec's prior ``fault_tolerance.expected_mtbf_s`` blended with the
  failures seen so far, as if the prior were ``PRIOR_WEIGHT`` failures observed over
  ``PRIOR_WEIGHT x prior`` seconds: ``(w x prior + survived_s) / (w + failures)``. No failure
  yet: the estimate only grows with the time survived; each failure pulls it toward the rate
  observed.
* Bootstrap: before any save was measured there is no ``C``: the first saves come every
  ``BOOTSTRAP_STEPS`` steps, which measures one soon.

The result is clamped to ``[1, total_steps]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["BOOTSTRAP_STEPS", "PRIOR_WEIGHT", "CostMeter", "IntervalDecision", "IntervalFacts", "IntervalHistory",
           "blend_mtbf", "choose_interval", "explain", "young_daly_s"]

BOOTSTRAP_STEPS = 10
"""Steps between saves until the cost of one save has been measured."""
PRIOR_WEIGHT = 1.0
"""How many observed failures the spec's prior MTBF counts as."""


@dataclass(frozen=True)
class IntervalFacts:
    """Everything the interval policy may look at; the same values on every rank."""

    total_steps: int
    prior_mtbf_s: float
    failures: int = 0
    """Failures of the job so far (every attempt before this one ended in one)."""
    survived_s: float = 0.0
    """Wall seconds the job has run so far, every attempt and restart included."""
    cost_s: float | None = None
    """Measured training time one save costs (None: no save measured yet)."""
    step_time_s: float | None = None
    """Measured seconds of one training step, saves excluded (None: not measured yet)."""


@dataclass(frozen=True)
class IntervalDecision:
    """The chosen interval and the numbers behind it (logged, shown by ``status``, exported)."""

    steps: int
    reason: str
    """``young-daly`` or ``bootstrap`` (no save measured yet)."""
    mtbf_s: float
    failures: int
    survived_s: float
    cost_s: float | None = None
    step_time_s: float | None = None
    interval_s: float | None = None
    """The Young-Daly optimum in seconds, before rounding to steps and clamping."""

    def describe(self) -> str:
        """``cost 0.80 s, step 0.12 s, mtbf 3600 s (2 failure(s) in 1800 s), young-daly 75.9 s``."""
        head = f"mtbf {self.mtbf_s:.0f} s ({self.failures} failure(s) in {self.survived_s:.0f} s)"
        if self.reason == "bootstrap":
            return f"bootstrap: no save measured yet, {head}"
        return (f"cost {self.cost_s:.3f} s, step {self.step_time_s:.3f} s, {head}, "
                f"sqrt(2 x cost x mtbf) = {self.interval_s:.1f} s")


def blend_mtbf(prior_s: float, failures: int, survived_s: float, weight: float = PRIOR_WEIGHT) -> float:
    """The MTBF estimate: the prior counted as ``weight`` failures, plus what was observed."""
    return (weight * prior_s + survived_s) / (weight + failures)


def young_daly_s(cost_s: float, mtbf_s: float) -> float:
    """The interval in seconds of training that minimises overhead plus expected lost work."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def choose_interval(facts: IntervalFacts) -> IntervalDecision:
    """Steps between saves for ``facts``: Young-Daly once a save was measured, else the bootstrap."""
    mtbf = blend_mtbf(facts.prior_mtbf_s, facts.failures, facts.survived_s)
    common = {"mtbf_s": mtbf, "failures": facts.failures, "survived_s": facts.survived_s}
    if facts.cost_s is None or not facts.step_time_s:
        return IntervalDecision(_clamp(BOOTSTRAP_STEPS, facts.total_steps), "bootstrap", **common)
    seconds = young_daly_s(max(facts.cost_s, 0.0), mtbf)
    steps = _clamp(round(seconds / facts.step_time_s), facts.total_steps)
    return IntervalDecision(steps, "young-daly", cost_s=facts.cost_s, step_time_s=facts.step_time_s,
                            interval_s=seconds, **common)


def explain(prior_mtbf_s: float, total_steps: int) -> str:
    """What ``interval_steps: auto`` will do, for ``validate``: the bootstrap and the formula."""
    return (f"checkpoint.interval_steps=auto: saves every {_clamp(BOOTSTRAP_STEPS, total_steps)} steps (bootstrap) "
            f"until one save is measured, then every sqrt(2 x cost x mtbf) / step_time steps, clamped to "
            f"[1, {total_steps}], re-chosen at each such save and after each restart; cost = stall + slowdown "
            f"of one save, mtbf = ({PRIOR_WEIGHT:g} x {prior_mtbf_s:g} s + time survived) / ({PRIOR_WEIGHT:g} + "
            f"failures)")


def _clamp(steps: int, total_steps: int) -> int:
    return max(1, min(int(steps), total_steps))


@dataclass(frozen=True)
class IntervalHistory:
    """What an attempt starts from: the job's failures and time so far (the driver's), and the
    cost and step time measured by the attempts before (the CheckpointActor's last decision)."""

    failures: int = 0
    survived_s: float = 0.0
    cost_s: float | None = None
    step_time_s: float | None = None


class CostMeter:
    """One rank's measurements: step time, and what each save cost (stall + slowdown).

    ``step()`` gets every step's time with the checkpoint stall taken out, and whether a save
    was being persisted meanwhile; ``saved()`` the stall of a save. A step run while a save
    persists and slower than the mean of the steps run without one adds the difference to
    that save's cost.
    """

    def __init__(self, cost_s: float | None = None, step_time_s: float | None = None) -> None:
        # Carried over from earlier attempts: each counts as one sample.
        self._costs: list[float] = [cost_s] if cost_s is not None else []
        self._clean: list[float] = [step_time_s] if step_time_s is not None else []
        self._current: float | None = None
        """The cost of the newest save, still accumulating while it persists."""

    def step(self, seconds: float, persisting: bool) -> None:
        if persisting and self._current is not None and self._clean:
            self._current += max(0.0, seconds - self.step_time_s())
            return
        if not persisting:
            self._clean = (self._clean + [seconds])[-256:]

    def saved(self, stall_s: float) -> None:
        """A save finished on the training thread; the previous one is fully measured now."""
        self._close()
        self._current = stall_s

    def _close(self) -> None:
        if self._current is not None:
            self._costs = (self._costs + [self._current])[-64:]
            self._current = None

    def cost_s(self) -> float | None:
        """Mean cost of the saves measured so far, the newest with the slowdown measured until now."""
        done = self._costs + ([self._current] if self._current is not None else [])
        return sum(done) / len(done) if done else None

    def step_time_s(self) -> float | None:
        return sum(self._clean) / len(self._clean) if self._clean else None
