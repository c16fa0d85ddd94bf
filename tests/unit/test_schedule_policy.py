"""The save schedule's other decisions (``policy/schedule.py``): the config's schedule, when the
clock is asked, whether a save falls before the last step, and the ``on_busy`` choice."""

from __future__ import annotations

import pytest

from raytrain_ckpt.checkpoint.policy.schedule import SaveSchedule, on_busy_choice, saves_before_last


@pytest.mark.parametrize(("interval", "expected"), [(5, 5), ("auto", None), (None, None)])
def test_configured_has_no_interval_for_auto(interval, expected) -> None:
    assert SaveSchedule.configured(10, interval, True) == SaveSchedule(10, expected, True)


# (interval_steps, save_final, step, interval_seconds) -> asks the clock
@pytest.mark.parametrize(("interval", "final", "step", "seconds", "asks"), [
    (5, False, 3, 60.0, True),
    (5, False, 5, 60.0, False),    # due by the interval: the clock cannot change the answer
    (5, True, 10, 60.0, False),
    (None, True, 10, 60.0, False),  # the final save
    (None, False, 7, 60.0, True),
    (5, False, 3, None, False),     # no time trigger
])
def test_asks_clock_only_when_it_decides(interval, final, step, seconds, asks) -> None:
    assert SaveSchedule(10, interval, final).asks_clock(step, seconds) is asks


# (total_steps, interval_steps, interval_seconds) -> a save can fall before the last step
@pytest.mark.parametrize(("total", "interval", "seconds", "before"), [
    (10, 5, None, True),
    (10, 9, None, True),
    (10, 10, None, False),
    (10, 20, None, False),
    (10, None, None, False),
    (10, None, 60.0, True),
    (10, 20, 60.0, True),
    (10, "auto", None, True),
])
def test_saves_before_last(total, interval, seconds, before) -> None:
    assert saves_before_last(total, interval, seconds) is before


# (on_busy, final, busy somewhere) -> choice, and whether the ranks were asked
@pytest.mark.parametrize(("on_busy", "final", "busy", "choice", "asked"), [
    ("skip", False, True, "skip", True),
    ("skip", False, False, "save", True),
    ("skip", True, True, "save", False),   # the final save is never skipped: it waits
    ("wait", False, True, "save", False),
    ("wait", True, False, "save", False),
])
def test_on_busy_choice(on_busy, final, busy, choice, asked) -> None:
    calls: list[bool] = []

    def busy_somewhere() -> bool:
        calls.append(busy)
        return busy
    assert on_busy_choice(on_busy, final, busy_somewhere) == choice
    assert bool(calls) is asked
