"""The straggler watch: a rank that begins its steps late by more than the margin of the step time,
over the last WINDOW steps every rank reported, is reported once; jitter and a single late step are not."""

from __future__ import annotations

from raytrain_ckpt.stragglers import WINDOW, StragglerWatch


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
