"""The controller's watches: the factory's priority order and each watch's verdict for a poll."""

from __future__ import annotations

import pytest

from raytrain_ckpt.common.events import Failure, WorkerResult
from raytrain_ckpt.control.controller import Controller, JobState
from raytrain_ckpt.control.poll import GroupPoll
from raytrain_ckpt.control.watch import Act, Verdict
from raytrain_ckpt.control.watch.build import watches_for
from raytrain_ckpt.control.watch.goodput import GoodputLedger
from raytrain_ckpt.control.watch.hangs import HangWatch
from raytrain_ckpt.control.watch.outcomes import Finished, RankFailures
from raytrain_ckpt.control.watch.preemption import PreemptionGuard
from raytrain_ckpt.control.watch.rollbacks import RollbackWatch
from raytrain_ckpt.control.watch.silence import SilenceWatch
from raytrain_ckpt.control.watch.stragglers import StragglerStop, StragglerSwap
from raytrain_ckpt.spec import JobSpec
from tests.unit.test_controller import FakeWorkerGroup, GroupDefaults


def test_the_factory_builds_every_watch_in_priority_order_with_the_guard_and_its_budget():
    spec = JobSpec(name="t", fault_tolerance={"max_preemptions": 3})
    ledger = GoodputLedger(0.0, lambda: 0.0)
    guard = PreemptionGuard(spec.training.steps, lambda: None, draining=dict)
    kinds = [type(w) for w in watches_for(spec, lambda: 0.0, ledger, guard)]
    assert kinds == [GoodputLedger, RollbackWatch, StragglerSwap, PreemptionGuard, RankFailures, StragglerStop,
                     Finished, SilenceWatch, HangWatch]
    assert guard.limit == 3
    assert PreemptionGuard not in [type(w) for w in watches_for(spec, lambda: 0.0, ledger)]


def _crash(rank: int) -> Failure:
    return Failure(0, "crash", rank, "worker process died")


FINISHED = [WorkerResult(r, 7, 0, {7: 1.0}, "x") for r in range(2)]


@pytest.mark.parametrize(("watch", "poll", "expected"), [
    (RankFailures(), GroupPoll(min_step=3), None),
    (RankFailures(), GroupPoll(failures=[_crash(1), _crash(0)], evidence="/d/failure.txt"),
     Verdict(Act.FAIL, Failure(4, "crash", 1, "worker process died", str(_crash(1)), (_crash(0),),
                               "/d/failure.txt"), diagnostics=("/d/failure.txt",))),
    (Finished(), GroupPoll(min_step=7), None),
    (Finished(), GroupPoll(results=FINISHED, min_step=7, finished=True), Verdict(Act.FINISH, reason="7 steps done")),
])
def test_what_the_group_ended_with_is_the_verdict(watch, poll, expected):
    assert watch.observe(poll, GroupDefaults(), 4) == expected


def test_a_crash_and_a_finish_in_one_poll_fail_the_attempt_the_failure_comes_first():
    FakeWorkerGroup.created = []
    ctl = Controller(JobSpec(name="t", fault_tolerance={"max_restarts": 0}), FakeWorkerGroup, sleep=lambda s: None)
    ctl.step()
    FakeWorkerGroup.created[0].finish()
    FakeWorkerGroup.created[0].kill(1)
    ctl.step()
    assert ctl.state is JobState.FAILED and [f.kind for f in ctl.result.failures] == ["crash"]
    assert ctl.result.results == []
