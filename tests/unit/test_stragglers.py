"""The straggler watch: a rank that begins its steps late by more than the margin of the step time,
over the last WINDOW steps every rank reported, is reported once; jitter and a single late step are not.
With fault_tolerance.replace_stragglers the controller stops the group at a committed step and
restarts it with that rank retired (its process not kept), without spending max_restarts."""

from __future__ import annotations

import pytest

from raytrain_ckpt.control.controller import Controller, JobState
from raytrain_ckpt.control.poll import GroupPoll
from raytrain_ckpt.common.events import WorkerResult
from raytrain_ckpt.spec import JobSpec
from tests.unit.test_controller import GroupDefaults
from raytrain_ckpt.control.watch.stragglers import WINDOW, StragglerWatch


def _feed(watch: StragglerWatch, lateness: dict[int, float], steps: int, step_s: float = 1.0,
          first: int = 1) -> list[str]:
    found = []
    for i in range(steps):
        t0 = 1000.0 + i * step_s
        found += watch.observe({r: (first + i, t0 + late) for r, late in lateness.items()})
    return found


def test_a_rank_late_at_every_step_is_reported_once():
    watch = StragglerWatch(margin=0.25)
    assert _feed(watch, {0: 0.0, 1: 0.5, 2: 0.01}, WINDOW - 1) == []          # not enough steps yet
    (line,) = _feed(watch, {0: 0.0, 1: 0.5, 2: 0.01}, 1, first=WINDOW)
    assert line == ("rank 1 is a straggler: it begins its steps 0.50 s after the first rank (median of the last 8 "
                    "steps; a step takes 1.00 s; fault_tolerance.straggler_margin=0.25)")
    assert watch.skew_s == 0.5 and list(watch.reported) == [1]
    assert _feed(watch, {0: 0.0, 1: 0.5, 2: 0.01}, 5, first=WINDOW + 1) == []  # said once


def test_jitter_one_late_step_and_mixed_steps_are_not_stragglers():
    watch = StragglerWatch(margin=0.25)
    assert _feed(watch, {0: 0.0, 1: 0.02, 2: 0.04}, 3 * WINDOW) == []         # under MIN_LATE_S
    assert watch.observe({0: (100, 2000.0), 1: (100, 2005.0)}) == []          # one late step: the median holds
    assert watch.observe({0: (101, 2001.0), 1: (100, 2005.0)}) == []          # ranks between steps: not compared
    assert _feed(StragglerWatch(margin=None), {0: 0.0, 1: 5.0}, 3 * WINDOW) == []   # watch off
    slow = StragglerWatch(margin=0.25)
    assert _feed(slow, {0: 0.0, 1: 0.2}, 2 * WINDOW, step_s=1.0) == []        # 0.2 s of a 1 s step: in the margin


class SlowRankGroup(GroupDefaults):
    """Two ranks; rank 1 begins every step 0.5 s late. ``preempt`` makes both stop after the next step
    (the step saved), as the ranks do; ``retire`` records the rank the next attempt must not reuse."""

    created: list[SlowRankGroup] = []

    def __init__(self, spec: JobSpec, attempt: int) -> None:
        self.attempt, self.step, self.stop_at = attempt, 0, None
        self.kept_warm: list[bool] = []
        self.retired: list[int] = []
        SlowRankGroup.created.append(self)

    def start(self) -> None:
        pass

    def poll(self) -> GroupPoll:
        self.step += 1
        done = self.step >= 40 or self.stop_at is not None and self.step >= self.stop_at
        results = [WorkerResult(r, self.step, 0, {}, "x") for r in range(2)] if done else []
        late = 0.5 if self.attempt == 0 else 0.0
        return GroupPoll(results=results, min_step=self.step, finished=done,
                         starts={0: (self.step, 1000.0 + self.step), 1: (self.step, 1000.0 + self.step + late)})

    def wait(self, timeout_s: float) -> None:
        pass

    def shutdown(self, keep_warm: bool = False) -> None:
        self.kept_warm.append(keep_warm)

    def preempt(self, deadline_unix: float | None) -> None:
        self.stop_at = self.step + 1

    def retire(self, rank: int) -> None:
        self.retired.append(rank)


def _run_slow_rank(tmp_path, replace: bool) -> Controller:
    SlowRankGroup.created = []
    spec = JobSpec(name="t", training={"steps": 40},
                   checkpoint={"enabled": True, "dir": str(tmp_path)},
                   fault_tolerance={"max_restarts": 0, "hang_timeout_s": 60.0, "replace_stragglers": replace})
    return Controller(spec, SlowRankGroup, sleep=lambda s: None)


def test_with_replace_stragglers_a_straggler_is_replaced_at_a_committed_step_without_spending_restarts(tmp_path):
    ctl = _run_slow_rank(tmp_path, replace=True)
    result = ctl.run()
    assert result.state is JobState.SUCCEEDED and result.attempts == 2 and ctl.restarts == 0
    first, second = SlowRankGroup.created
    assert first.stop_at == WINDOW + 1 and first.retired == [1] and first.kept_warm == [True]
    (failure,) = result.failures
    assert (failure.kind, failure.rank) == ("straggler", 1)
    assert failure.headline.startswith(f"rank 1 replaced after step {WINDOW + 1} "  # (no checkpoint service here)
                                       "(fault_tolerance.replace_stragglers): rank 1 is a straggler")
    assert "attempt 0 straggler rank 1 replaced" in [e for _, e in result.events]
    assert second.retired == [] and ctl.summary()["failures"] == {"straggler": 1}


def test_without_replace_stragglers_a_straggler_is_only_reported(tmp_path):
    ctl = _run_slow_rank(tmp_path, replace=False)
    result = ctl.run()
    assert result.state is JobState.SUCCEEDED and result.attempts == 1 and result.failures == []
    assert len(result.stragglers) == 1 and SlowRankGroup.created[0].stop_at is None


def test_replace_stragglers_needs_the_watch():
    with pytest.raises(ValueError, match="replace_stragglers.*straggler_margin is null"):
        JobSpec(name="t", fault_tolerance={"replace_stragglers": True, "straggler_margin": None})
