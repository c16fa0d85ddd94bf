"""The goodput ledger: each stretch of wall time goes to one cause, so the causes add up to the
wall time; redone steps, stalls and each attempt's phases are told apart."""

from __future__ import annotations

import pytest

from raytrain_ckpt.control.watch.goodput import CAUSES, GoodputLedger


def _run_with_a_restart() -> GoodputLedger:
    led = GoodputLedger(0.0)
    led.attempt(0, 0.5)                                          # 0.5 s before the first start
    led.start_marks([("placement", 1.0), ("rendezvous", 1.5), ("load", 2.0)], 2.2)
    led.progress(0, 2.5)                                         # the attempt's starting step
    led.progress(1, 4.0)                                         # its first step
    led.progress(5, 8.0, stall_s=1.0)                            # 4 steps, 1 s of it a save's stall
    led.progress(10, 13.0, stall_s=1.0, eval_s=2.0)
    led.failed("crash", 15.0)
    led.torn_down(16.0)
    led.attempt(1, 17.0)                                         # the back-off
    led.start_marks([("placement", 17.5), ("rendezvous", 18.0), ("load", 19.0)], 19.0)
    led.progress(5, 19.0)                                        # resumed at step 5
    led.progress(6, 20.0)
    led.progress(12, 26.0)                                       # steps 7-10 redone, 11-12 new
    led.finished(27.0)
    led.close(27.5)
    return led


def test_every_second_goes_to_one_cause():
    led = _run_with_a_restart()
    s = led.seconds
    assert set(s) == set(CAUSES)
    assert sum(s.values()) == pytest.approx(led.wall_s) and led.wall_s == pytest.approx(27.5)
    assert s["placement"] == pytest.approx(0.5 + 0.5) and s["rendezvous"] == pytest.approx(1.0)
    assert s["load"] == pytest.approx(0.7 + 1.0)
    assert s["first_step"] == pytest.approx(1.8 + 1.0)         # 2.2 -> 4.0 (to the first step's poll), 19 -> 20
    assert s["checkpoint_stall"] == pytest.approx(1.0 + 1.0)    # the save's stall, the final commit
    assert s["eval"] == pytest.approx(2.0)
    assert s["redone"] == pytest.approx(6.0 * 4 / 6)            # 4 of the 6 steps 6 -> 12 had been trained
    assert s["training"] == pytest.approx(3.0 + 3.0 + 6.0 * 2 / 6)
    assert s["detection"] == pytest.approx(2.0) and s["waiting"] == pytest.approx(0.5 + 1.0)
    assert s["teardown"] == pytest.approx(1.0 + 0.5)
    assert led.goodput == pytest.approx(s["training"] / 27.5)


def test_each_attempt_has_its_phases_and_the_end_line_says_where_the_time_went():
    led = _run_with_a_restart()
    first, second = led.to_dict()["attempts"]
    assert first["ended_by"] == "crash" and second["ended_by"] is None
    assert list(first["phases"])[:4] == ["placement", "rendezvous", "load", "first_step"]
    assert first["phases"]["detection"] == 2.0 and second["phases"]["redone"] == pytest.approx(4.0)
    line = led.end_line()
    assert line.startswith(f"goodput {100 * led.goodput:.1f}% of 27.5 s; 9.0 s lost to 1 failure(s): 4.0 s redone")
    assert "2.0 s checkpoint stall" in line and "\n" not in line
    # a restart's back-off is the failed attempt's last phase
    assert led.timeline_lines()[0] == ("attempt 0: placement 0.50 s, rendezvous 0.50 s, load 0.70 s, "
                                       "first step 1.80 s, checkpoint stall 1.00 s, training 6.00 s, eval 2.00 s, "
                                       "detection 2.00 s, teardown 1.00 s, waiting 1.00 s (ended by a crash)")


def test_a_failed_start_is_placement_up_to_its_last_mark():
    led = GoodputLedger(0.0)
    led.attempt(0, 0.0)
    led.start_marks([], 5.0)
    led.failed("start", 5.0)
    assert led.seconds["placement"] == 5.0 and led.timelines[0].ended_by == "start"


def test_time_trained_while_replica_groups_are_out_is_their_share_degraded():
    """Two replica groups of two ranks: while one is out (ranks 2 and 3 healing), half of each
    stretch's training is the share it did not train; once back, all of it is training again."""
    from types import SimpleNamespace

    clock = SimpleNamespace(now=0.0)
    led = GoodputLedger(0.0, lambda: clock.now, replicas=2, group_size=2)
    led.attempt(0, 0.0)
    led.start_marks([("placement", 1.0)], 1.0)

    def poll(step: int, at: float, healing: tuple[int, ...] = ()) -> None:
        clock.now = at
        led.observe(SimpleNamespace(min_step=step, stall_s=0.0, eval_s=0.0), SimpleNamespace(healing=healing), 0)

    poll(0, 1.0)
    poll(1, 2.0)                         # first step
    poll(5, 6.0)                         # 4 s trained by both groups
    led.replaced()                       # group 1 fails alone
    poll(9, 10.0, healing=(2, 3))        # 4 s trained by group 0 alone: half degraded
    poll(13, 14.0)                       # back: training again
    led.finished(14.0)
    s = led.seconds
    assert sum(s.values()) == pytest.approx(led.wall_s)
    assert s["degraded"] == pytest.approx(2.0) and s["training"] == pytest.approx(4.0 + 2.0 + 4.0)
    assert "2.0 s lost to 1 failure(s): 2.0 s with fewer replica groups" in led.end_line()
