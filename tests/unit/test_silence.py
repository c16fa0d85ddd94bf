"""Silent checkpointing processes while the group trains: the budget, the status line and the
overdue ones as pure functions (tables); the controller, against a fake group whose writer stops
answering, names it in status, replaces it as a ``writer_hang`` without restarting the group or
spending max_restarts, and falls back to the ranks' hang timeout after MAX_REPLACEMENTS."""

from __future__ import annotations

import pytest

from raytrain_ckpt.control.controller import Controller, JobState
from raytrain_ckpt.control.poll import GroupPoll
from raytrain_ckpt.common.events import WorkerResult
from raytrain_ckpt.control.watch.hangs import FLOOR_S
from raytrain_ckpt.control.watch.silence import MAX_REPLACEMENTS, NOTICE_S, overdue, silence_budget_s, stuck_line
from raytrain_ckpt.spec import JobSpec
from tests.unit.test_controller import GroupDefaults

W = "checkpoint writer on node abc"


@pytest.mark.parametrize(("fixed", "learned", "save", "expected"), [
    (None, None, 600.0, FLOOR_S),         # nothing learned yet: the floor (a ping waits on no step)
    (None, 30.0, 600.0, 30.0),            # the learned step budget
    (None, 300.0, 120.0, 120.0),          # never past a save's own bound
    (20.0, 30.0, 600.0, 20.0),            # a fixed hang timeout wins over the learned one
    (None, 45.0, None, 45.0),             # checkpointing off: the step budget alone
])
def test_silence_budget_table(fixed, learned, save, expected):
    assert silence_budget_s(fixed, learned, FLOOR_S, save) == expected


def test_overdue_and_the_status_line():
    silences = {W: 31.0, "checkpoint actor": 0.5}
    assert overdue(silences, 30.0) == [W] and overdue(silences, 31.0) == []
    assert stuck_line(12, False, {W: NOTICE_S}) is None                   # not yet past the notice
    assert stuck_line(12, True, silences) == f"stuck: step 13 (its save), {W} has not answered for 31s"
    assert stuck_line(12, True, silences, in_flight=10) == f"stuck: step 10 (its save), {W} has not answered for 31s"
    assert stuck_line(12, False, {W: 12.0, "checkpoint actor": 40.0}) == (
        f"stuck: step 12, checkpoint actor has not answered for 40s; {W} has not answered for 12s")


class SilentWriterGroup(GroupDefaults):
    """A group whose checkpoint writer can be stopped (``stop_writer``); replacing it makes it answer."""

    created: list[SilentWriterGroup] = []

    def __init__(self, spec: JobSpec, attempt: int) -> None:
        self.step, self.done, self.saving = 0, False, False
        self.silent_since: float | None = None
        self.now = 0.0
        self.replacements = 0
        SilentWriterGroup.created.append(self)

    def start(self) -> None:
        pass

    def poll(self) -> GroupPoll:
        results = [WorkerResult(r, self.step, 0, {}, "x") for r in range(2)] if self.done else []
        return GroupPoll(results=results, min_step=self.step, finished=self.done,
                         phases={0: "saving" if self.saving else "training", 1: "training"})

    def wait(self, timeout_s: float) -> None:
        self.now += timeout_s

    def shutdown(self, keep_warm: bool = False) -> None:
        pass

    def checkpointing_silences(self) -> dict[str, float]:
        return {W: self.now - self.silent_since} if self.silent_since is not None else {W: 0.0}

    def replace_silent_checkpointing(self, stalled: dict[str, float] | None = None) -> list[str]:
        if self.silent_since is None:
            return []
        self.silent_since, self.saving = None, False
        self.replacements += 1
        return [f"{W} did not answer within 10s: replaced"]

    def stop_writer(self) -> None:
        self.silent_since, self.saving = self.now, True


def _controller() -> tuple[Controller, SilentWriterGroup]:
    SilentWriterGroup.created = []
    spec = JobSpec(name="t", fault_tolerance={"max_restarts": 0, "hang_timeout_s": 20.0, "poll_interval_s": 1.0})
    ctl = Controller(spec, SilentWriterGroup, sleep=lambda s: None)
    ctl.step()
    group = SilentWriterGroup.created[0]
    ctl._clock = lambda: group.now   # the group's wait is the controller's time
    return ctl, group


def test_a_silent_writer_is_named_then_replaced_and_training_goes_on_without_a_restart():
    ctl, group = _controller()
    group.step = 7
    ctl.step()
    group.stop_writer()
    for _ in range(int(NOTICE_S) + 2):
        ctl.step()
    assert ctl.summary()["stuck"].startswith(f"stuck: step 8 (its save), {W} has not answered for ")
    while group.replacements == 0 and ctl.state is JobState.RUNNING:
        ctl.step()
    assert ctl.state is JobState.RUNNING and group.now <= 22        # within the hang timeout of a step
    (failure,) = ctl.result.failures
    assert (failure.kind, failure.rank) == ("writer_hang", None)
    assert failure.headline.startswith(f"stuck: step 8 (its save), {W} has not answered for 2")
    assert "replaced, training continues" in failure.headline and ctl.summary()["stuck"] is None
    assert ctl.restarts == 0 and ctl.attempt == 0
    assert [e for _, e in ctl.result.events if "writer" in e] == [
        "attempt 0 writer_hang detected", f"attempt 0: {W} did not answer within 10s: replaced"]
    for _ in range(15):                                             # the step budget started again
        ctl.step()
    assert ctl.state is JobState.RUNNING
    group.step, group.done = 20, True
    ctl.step()
    assert ctl.state is JobState.SUCCEEDED


def test_past_max_replacements_a_silent_writer_is_left_to_the_hang_timeout():
    ctl, group = _controller()
    group.step = 3
    for _ in range(MAX_REPLACEMENTS):
        group.stop_writer()
        while group.silent_since is not None:
            ctl.step()
    group.stop_writer()
    while ctl.state is JobState.RUNNING:
        ctl.step()
    assert [f.kind for f in ctl.result.failures] == ["writer_hang"] * MAX_REPLACEMENTS + ["hang"]
    assert ctl.state is JobState.FAILED and group.replacements == MAX_REPLACEMENTS


def test_status_names_the_stuck_process():
    from raytrain_ckpt.report.jobstatus import status_line

    line = status_line({"hang_timeout_s": 30.0, "hang_timeout_why": "learned",
                        "stuck": f"stuck: step 13 (its save), {W} has not answered for 31s"})
    assert line == f"hang timeout 30s (learned); stuck: step 13 (its save), {W} has not answered for 31s"


def test_a_stalled_write_is_named_with_its_rank_and_step():
    from raytrain_ckpt.control.watch.silence import STALLED

    key = f"{W}{STALLED}rank 1 step 10"
    assert stuck_line(12, True, {key: 31.0, W: 0.2}, in_flight=10) == (
        f"stuck: step 10 (its save), {W} moved no bytes of its write of rank 1 step 10 for 31s")
    assert overdue({key: 31.0, W: 0.2}, 30.0) == [key]
