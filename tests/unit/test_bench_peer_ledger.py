"""The Ray Train column of ``bench/goodput.py`` accounts its time as the goodput ledger does.

Its ledger is built from rank 0's step log, not from the controller's clock, so it is checked
here with tables: redone steps, the first step of each attempt and saves are not training, and
the trace without its hang moves the later attempts up.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import goodput  # noqa: E402


def test_redone_steps_and_restart_gaps_are_lost() -> None:
    # attempt 0: steps 1-6 at 1 s each, a 0.5 s save at step 5; rank 1 dies after step 6;
    # attempt 1 resumes from step 5 at t=20: step 6 (its first) then 7 and 8.
    rows = [(0, 1, 1.0, 1.0), (0, 2, 2.0, 2.0), (0, 3, 3.0, 3.0), (0, 4, 4.0, 4.0), (0, 5, 5.0, 5.5),
            (0, 6, 6.5, 6.5), (1, 6, 20.0, 20.0), (1, 7, 21.0, 21.0), (1, 8, 22.0, 22.0)]
    led = goodput.ray_train_ledger(rows, started=-2.0, ended=28.0)
    assert led["seconds"] == pytest.approx({"training": 7.0, "redone": 0.0, "checkpoint": 0.5, "restarts": 13.5,
                                            "start, first step": 3.0, "end": 6.0})
    assert sum(led["seconds"].values()) == pytest.approx(led["wall_s"])
    assert led["restarts"] == 1
    assert led["lost_s"] == pytest.approx(21.0 - 7.0 - 0.5)
    assert led["goodput"] == pytest.approx(7.0 / 30.0)


def test_a_step_an_earlier_attempt_finished_is_redone() -> None:
    rows = [(0, 1, 1.0, 1.0), (0, 2, 2.0, 2.0), (0, 3, 3.0, 3.0), (1, 1, 10.0, 10.0), (1, 2, 11.0, 11.0),
            (1, 3, 12.0, 12.0), (1, 4, 13.0, 13.0)]
    led = goodput.ray_train_ledger(rows, started=0.0, ended=13.0)
    assert led["seconds"]["redone"] == 2.0
    assert led["seconds"]["training"] == 3.0


@pytest.mark.parametrize(("trace", "expected"), [
    (["crash rank=1 step=12 attempt=0", "hang rank=1 step=17 attempt=1", "crash rank=1 step=16 attempt=2",
      "slow rank=1 step=-1 attempt=3 seconds=0.5"],
     ["crash rank=1 step=12 attempt=0", "crash rank=1 step=16 attempt=1", "slow rank=1 step=-1 attempt=2 seconds=0.5"]),
    (["crash rank=0 step=7 attempt=0"], ["crash rank=0 step=7 attempt=0"]),
])
def test_without_hangs_moves_later_attempts_up(trace: list[str], expected: list[str]) -> None:
    assert goodput.without_hangs(trace) == expected
