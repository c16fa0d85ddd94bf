"""``checkpoint.interval_steps: auto``: the Young-Daly policy as a table, its monotonicity, the
cost meter, the anchored schedule and the spec checks."""

from __future__ import annotations

import math

import pytest

from raytrain_ckpt.checkpoint.policy.schedule import SaveSchedule
from raytrain_ckpt.checkpoint.policy.interval import (
    BOOTSTRAP_STEPS,
    PRIOR_WEIGHT,
    CostMeter,
    IntervalFacts,
    blend_mtbf,
    choose_interval,
)
from raytrain_ckpt.spec import SpecError
from raytrain_ckpt.control.preflight import load_spec

DAY = 86400.0

# (total, prior, failures, survived_s, cost_s, step_time_s) -> (steps, reason)
TABLE = [
    # the analytic optimum: sqrt(2 x 2 x 3600) = 120 s of 1 s steps (w=1, nothing observed: mtbf = prior)
    (10_000, 3600.0, 0, 0.0, 2.0, 1.0, 120, "young-daly"),
    # ... of 0.5 s steps: twice the steps
    (10_000, 3600.0, 0, 0.0, 2.0, 0.5, 240, "young-daly"),
    # rounding to the nearest step: sqrt(2 x 1 x 50) = 10 s of 3 s steps = 3.33 -> 3
    (10_000, 50.0, 0, 0.0, 1.0, 3.0, 3, "young-daly"),
    # no data: the bootstrap, whatever the prior
    (10_000, 3600.0, 0, 0.0, None, None, BOOTSTRAP_STEPS, "bootstrap"),
    (10_000, 60.0, 5, 100.0, None, None, BOOTSTRAP_STEPS, "bootstrap"),
    # a cost but no step time yet: still the bootstrap
    (10_000, 3600.0, 0, 0.0, 2.0, None, BOOTSTRAP_STEPS, "bootstrap"),
    # clamps: never beyond the last step, never below one step
    (50, 3600.0, 0, 0.0, 2.0, 1.0, 50, "young-daly"),
    (10_000, 1.0, 0, 0.0, 1e-6, 1.0, 1, "young-daly"),
    (4, 3600.0, 0, 0.0, None, None, 4, "bootstrap"),
    # free saves: every step
    (10_000, 3600.0, 0, 0.0, 0.0, 1.0, 1, "young-daly"),
    # failures observed: mtbf = (3600 + 1800) / (1 + 2) = 1800 -> sqrt(2 x 2 x 1800) = 84.9 s -> 85
    (10_000, 3600.0, 2, 1800.0, 2.0, 1.0, 85, "young-daly"),
    # time survived without a failure raises the estimate: (3600 + 3600) / 1 -> sqrt(2 x 2 x 7200) = 169.7
    (10_000, 3600.0, 0, 3600.0, 2.0, 1.0, 170, "young-daly"),
]


@pytest.mark.parametrize(("total", "prior", "failures", "survived", "cost", "step", "steps", "reason"), TABLE)
def test_choose_interval_table(total, prior, failures, survived, cost, step, steps, reason) -> None:
    d = choose_interval(IntervalFacts(total, prior, failures, survived, cost, step))
    assert (d.steps, d.reason) == (steps, reason)
    assert d.mtbf_s == pytest.approx((PRIOR_WEIGHT * prior + survived) / (PRIOR_WEIGHT + failures))
    if reason == "young-daly":
        assert d.interval_s == pytest.approx(math.sqrt(2 * cost * d.mtbf_s))


def _steps(**kw) -> int:
    base = {"total_steps": 1_000_000, "prior_mtbf_s": 3600.0, "failures": 0, "survived_s": 600.0,
            "cost_s": 1.0, "step_time_s": 0.5}
    return choose_interval(IntervalFacts(**(base | kw))).steps


def test_more_failures_give_a_shorter_interval() -> None:
    seen = [_steps(failures=f) for f in range(0, 8)]
    assert all(a > b for a, b in zip(seen, seen[1:])), seen


def test_higher_cost_gives_a_longer_interval() -> None:
    seen = [_steps(cost_s=c) for c in (0.1, 0.5, 1.0, 4.0, 16.0)]
    assert all(a < b for a, b in zip(seen, seen[1:])), seen


def test_failures_pull_the_estimate_toward_the_observed_rate() -> None:
    # a failure every 10 s against a prior of one hour: the error shrinks with every failure seen
    errors = [abs(blend_mtbf(3600.0, f, 10.0 * f) - 10.0) / 10.0 for f in (1, 10, 100, 1000, 10_000)]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.05


def test_decision_describes_its_numbers() -> None:
    d = choose_interval(IntervalFacts(10_000, 3600.0, 2, 1800.0, 2.0, 1.0))
    text = d.describe()
    assert "cost 2.000 s" in text and "mtbf 1800 s" in text and "2 failure(s)" in text
    assert "bootstrap" in choose_interval(IntervalFacts(10, 3600.0)).describe()


def test_cost_meter_adds_the_slowdown_while_persisting_to_the_stall() -> None:
    m = CostMeter()
    assert (m.cost_s(), m.step_time_s()) == (None, None)
    for _ in range(4):
        m.step(1.0, persisting=False)
    m.saved(0.5)
    m.step(1.25, persisting=True)   # 0.25 s slower while the writer works
    m.step(1.5, persisting=True)    # 0.5 s slower
    m.step(0.9, persisting=True)    # faster: no negative slowdown
    m.step(1.0, persisting=False)   # written: a clean step again
    assert m.cost_s() == pytest.approx(1.25)
    assert m.step_time_s() == pytest.approx(1.0)
    m.saved(0.25)                   # the next save: the mean of both
    assert m.cost_s() == pytest.approx((1.25 + 0.25) / 2)


def test_cost_meter_starts_from_the_earlier_attempts() -> None:
    m = CostMeter(cost_s=2.0, step_time_s=0.5)
    assert (m.cost_s(), m.step_time_s()) == (2.0, 0.5)
    m.saved(1.0)
    assert m.cost_s() == pytest.approx(1.5)


@pytest.mark.parametrize(("interval", "anchor", "steps"), [
    (5, 0, [5, 10, 15, 20]),
    (5, 7, [12, 17]),       # re-planned at step 7: counted from there
    (3, 18, []),            # past the end: nothing by the interval (save_final is off here)
    (None, 0, []),
])
def test_anchored_schedule(interval, anchor, steps) -> None:
    s = SaveSchedule(20, interval, False, anchor=anchor)
    assert [step for step in range(1, 21) if s.by_step(step)] == steps


def _load(*overrides: str):
    return load_spec("jobs/llama_debug_fsdp.yaml", list(overrides))


def test_spec_accepts_auto_and_a_prior() -> None:
    spec = _load("checkpoint.interval_steps=auto", "fault_tolerance.expected_mtbf_s=600")
    assert spec.checkpoint.interval_steps == "auto" and spec.fault_tolerance.prior_mtbf_s == 600.0
    assert _load("checkpoint.interval_steps=auto").fault_tolerance.prior_mtbf_s == DAY


@pytest.mark.parametrize(("overrides", "message"), [
    (["checkpoint.interval_steps=sometimes"], "checkpoint.interval_steps=sometimes: 'sometimes' is neither a whole "
                                              "number of steps nor auto"),
    (["checkpoint.interval_steps=2.5"], "neither a whole number of steps nor auto"),
    (["checkpoint.interval_steps=auto", "checkpoint.enabled=false"],
     "checkpoint.interval_steps: auto chooses how often to save, but checkpoint.enabled=false"),
    (["checkpoint.interval_steps=auto", "fault_tolerance.expected_mtbf_s=0"],
     "fault_tolerance.expected_mtbf_s=0: must be > 0; set fault_tolerance.expected_mtbf_s to more than 0"),
    (["fault_tolerance.expected_mtbf_s=600"], "fault_tolerance.expected_mtbf_s: only used with "
                                              "checkpoint.interval_steps=auto"),
])
def test_spec_mistakes_are_one_clear_line(overrides, message) -> None:
    with pytest.raises(SpecError) as info:
        _load(*overrides)
    assert len(info.value.problems) == 1 and message in info.value.problems[0], info.value.problems


def test_status_shows_the_decision_and_validate_explains_auto() -> None:
    from dataclasses import asdict

    from raytrain_ckpt.checkpoint.policy.interval import explain
    from raytrain_ckpt.report.inventory import interval_text

    d = choose_interval(IntervalFacts(10_000, 3600.0, 2, 1800.0, 2.0, 1.0))
    text = interval_text({"step": 30, **asdict(d)})
    assert text.startswith("checkpoint interval (auto): 85 steps, chosen at step 30 (cost 2.000 s")
    note = explain(600.0, 40)
    assert f"every {BOOTSTRAP_STEPS} steps (bootstrap)" in note and "(1 x 600 s + time survived)" in note
