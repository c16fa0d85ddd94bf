"""Drain notices and stop signals: the save plan, the controller's preemption budget (against a
scripted group, as in test_controller.py), and real signals to this process."""

from __future__ import annotations

import os
import signal

import pytest

from raytrain_ckpt.control.controller import Controller, JobState
from raytrain_ckpt.control.poll import GroupPoll
from raytrain_ckpt.common.events import WorkerResult
from raytrain_ckpt.rank.eviction import on_sigterm
from raytrain_ckpt.control.watch.preemption import PUSH_MB_PER_S, PreemptionGuard, SaveCosts, plan_save, stop_signals
from raytrain_ckpt.spec import JobSpec
from tests.unit.test_controller import GroupDefaults


@pytest.mark.parametrize("left, cost, fits, phrase", [
    (None, 5.0, True, "no deadline"),
    (25.0, None, True, "no save measured"),
    (25.0, 3.0, True, "the last save took 3.0s"),
    (3.5, 3.0, False, "saving what fits"),
    (0.5, 0.1, False, "saving what fits"),
])
def test_save_plan_against_the_deadline(left, cost, fits, phrase):
    plan = plan_save(left, cost)
    assert plan.tier == "durable" and plan.fits is fits and phrase in plan.why


@pytest.mark.parametrize("left, durable, ram, tier, fits, phrase", [
    (25.0, 3.0, 0.5, "durable", True, "the last save took 3.0s"),      # the durable commit fits: always it
    (8.0, 10.0, 0.5, "ram", True, "RAM on a node not draining takes ~0.5s"),
    (8.0, 10.0, None, "durable", False, "saving what fits"),           # no RAM tier (one node, memory_copies 1)
    (1.2, 10.0, 0.5, "ram", False, "saving what fits in RAM"),         # shorter than the fastest tier
    (1.2, 0.4, 0.5, "durable", False, "saving what fits"),             # RAM no faster: the durable one
    (None, 10.0, 0.5, "durable", True, "no deadline"),
    (8.0, None, 0.5, "durable", True, "no save measured"),
])
def test_the_fastest_tier_that_fits_the_time_left(left, durable, ram, tier, fits, phrase):
    plan = plan_save(left, durable, ram)
    assert (plan.tier, plan.fits) == (tier, fits) and phrase in plan.why


def test_ram_tier_costs_are_staging_plus_the_push():
    assert SaveCosts().ram_s() is None
    assert SaveCosts(4.0, 0.2, int(PUSH_MB_PER_S * 1e6)).ram_s() == pytest.approx(1.2)


class DrainedGroup(GroupDefaults):
    """Two ranks on nodes A and B that stop (save and return) at the step in hand once preempted."""

    created: list[DrainedGroup] = []

    def __init__(self, spec: JobSpec, attempt: int) -> None:
        self.spec, self.attempt = spec, attempt
        self.step, self.done = 0, False
        self.preempted: float | None | bool = False
        """False: never asked; else the deadline it was asked to stop by (None: none)."""
        self.nodes = ["A", "B"] if attempt == 0 else ["A", "C"]
        self.evictions: dict[int, float] = {}
        DrainedGroup.created.append(self)

    def start(self) -> None:
        pass

    def rank_nodes(self) -> list[str]:
        return self.nodes

    def preempt(self, deadline_unix: float | None, tier: str = "durable") -> None:
        self.preempted, self.tier = deadline_unix, tier

    def poll(self) -> GroupPoll:
        stopped = self.done or self.preempted is not False
        results = [WorkerResult(r, self.step, 0, {}, "x") for r in range(2)] if stopped else []
        return GroupPoll(results=results, min_step=self.step, finished=stopped, evictions=dict(self.evictions))

    def wait(self, timeout_s: float) -> None:
        pass

    def shutdown(self, keep_warm: bool = False) -> None:
        pass


def _controller(drains: dict, committed: list[int], **ft) -> Controller:
    DrainedGroup.created = []
    spec = JobSpec(name="t", fault_tolerance={"max_restarts": 0, **ft})
    guard = PreemptionGuard(spec.training.steps, lambda: max(committed, default=None), lambda: 1.0,
                            draining=lambda: dict(drains), clock=lambda: 1000.0)
    return Controller(spec, DrainedGroup, sleep=lambda s: None, preemption=guard)


def test_a_drain_whose_save_did_not_commit_records_no_saved_step():
    """The ranks stopped at step 57, but its save never committed: the record says no step was
    saved (``saved_step`` None) and 7 steps lost, as the headline does."""
    drains: dict = {}
    ctl = _controller(drains, [50])
    ctl.step()
    group = DrainedGroup.created[0]
    group.step = 57
    drains["B"] = 1025.0
    ctl.step()
    ctl.step()                                             # stopped; 57 not committed
    [failure] = ctl.result.failures
    assert "the save did not complete: resuming at committed step 50, 7 steps lost" in failure.headline
    [record] = ctl.result.preemptions
    assert record["saved_step"] is None and record["steps_lost"] == 7, record


def test_a_drained_rank_node_restarts_without_spending_a_restart():
    drains: dict = {}
    committed: list[int] = [50]
    ctl = _controller(drains, committed)
    ctl.step()
    group = DrainedGroup.created[0]
    group.step = 57
    drains["B"] = 1025.0                                   # 25 s notice on rank 1's node
    ctl.step()
    assert group.preempted == 1025.0 and ctl.state is JobState.RUNNING
    committed.append(57)                                   # the ranks saved the step in hand
    ctl.step()
    assert ctl.state is JobState.RECOVERING and ctl.restarts == 0 and ctl.preemptions == 1
    [failure] = ctl.result.failures
    assert failure.kind == "preemption" and "step 57 saved, 0 steps lost" in failure.headline
    assert ctl.result.preemptions == [{"attempt": 0, "node": "B", "deadline_unix": 1025.0, "time_left_s": 25.0,
                                       "tier": "durable", "saved_step": 57, "steps_lost": 0,
                                       "cause": "drain"}]
    assert "step 57 saved" in ctl.summary()["preemption"]
    ctl.step()
    ctl.step()                                             # attempt 1 on A and C: B still drains, not its node
    second = DrainedGroup.created[1]
    assert ctl.state is JobState.RUNNING and second.preempted is False
    second.done = True
    ctl.step()
    assert ctl.state is JobState.SUCCEEDED


def _ram_controller(drains: dict, kept: list, keep_result: str | None = None) -> Controller:
    DrainedGroup.created = []
    spec = JobSpec(name="t", fault_tolerance={"max_restarts": 0})

    def keep_in_ram(node: str, step: int, deadline: float | None) -> str | None:
        kept.append((node, step, deadline))
        return keep_result

    guard = PreemptionGuard(spec.training.steps, lambda: 50, lambda: 12.0, draining=lambda: dict(drains),
                            clock=lambda: 1000.0, ram_cost=lambda draining: 0.5, keep_in_ram=keep_in_ram)
    return Controller(spec, DrainedGroup, sleep=lambda s: None, preemption=guard)


def test_a_deadline_shorter_than_the_durable_save_keeps_the_step_in_ram_off_the_node():
    drains: dict = {}
    kept: list = []
    ctl = _ram_controller(drains, kept)
    ctl.step()
    group = DrainedGroup.created[0]
    group.step = 57
    drains["B"] = 1008.0                                   # 8 s notice; the last durable save took 12 s
    ctl.step()
    assert (group.preempted, group.tier) == (1008.0, "ram")
    ctl.step()                                             # stopped at 57: its copies pushed off B
    assert kept == [("B", 57, 1008.0)] and ctl.state is JobState.RECOVERING and ctl.restarts == 0
    [failure] = ctl.result.failures
    assert failure.kind == "preemption" and "tier ram" in failure.headline
    assert "step 57 held in RAM on nodes not draining" in failure.headline
    assert "committed step 50 is untouched), 0 steps lost" in failure.headline
    assert ctl.result.preemptions[0]["tier"] == "ram" and ctl.result.preemptions[0]["saved_step"] == 57
    assert "tier ram" in ctl.summary()["preemption"]


def test_a_ram_copy_that_cannot_be_kept_falls_back_to_the_committed_step():
    drains: dict = {}
    kept: list = []
    ctl = _ram_controller(drains, kept, keep_result="pushing rank 1's copy failed")
    ctl.step()
    DrainedGroup.created[0].step = 57
    drains["B"] = 1008.0
    ctl.step()
    ctl.step()
    [failure] = ctl.result.failures
    assert "the RAM copy was not kept (pushing rank 1's copy failed): resuming at committed step 50, 7 steps lost" \
        in failure.headline
    assert ctl.result.preemptions[0]["steps_lost"] == 7


def test_a_save_that_did_not_commit_counts_the_steps_lost():
    drains: dict = {}
    ctl = _controller(drains, [50])
    ctl.step()
    DrainedGroup.created[0].step = 57
    drains["A"] = 1010.0
    ctl.step()
    ctl.step()                                             # stopped, but 57 never committed
    assert ctl.result.preemptions[0]["steps_lost"] == 7
    assert "resuming at committed step 50, 7 steps lost" in ctl.result.failures[0].headline


def test_max_preemptions_bounds_them():
    drains = {"B": 1025.0}
    ctl = _controller(drains, [10], max_preemptions=0)
    ctl.step()
    ctl.step()
    ctl.step()
    assert ctl.state is JobState.FAILED and ctl.preemptions == 1
    assert [f.kind for f in ctl.result.failures] == ["preemption"]


def test_a_drain_of_a_node_the_job_does_not_use_is_ignored():
    ctl = _controller({"Z": 1025.0}, [10])
    ctl.step()
    DrainedGroup.created[0].done = True
    ctl.step()
    assert DrainedGroup.created[0].preempted is False and ctl.state is JobState.SUCCEEDED and not ctl.result.failures


def test_a_stop_request_saves_the_step_in_hand_and_ends_the_job():
    committed = [20]
    ctl = _controller({}, committed)
    ctl.step()
    DrainedGroup.created[0].step = 33
    ctl.watch(PreemptionGuard).request_stop("SIGTERM", 30.0)
    ctl.step()
    assert DrainedGroup.created[0].preempted == 1030.0
    committed.append(33)
    ctl.step()
    assert ctl.state is JobState.STOPPED and ctl.result.stopped == "SIGTERM: step 33 is committed and safe"
    assert ctl.result.stopped_by == "SIGTERM" and ctl.result.error is None
    assert not ctl.result.failures and ctl.preemptions == 0      # a stop is no failure: nothing spent


class ReplicatedGroup(DrainedGroup):
    """Two replica groups of two ranks (0-1 saves, 2-3 replicates); the second group trains one
    step past the first before it sees the stop."""

    def poll(self) -> GroupPoll:
        stopped = self.preempted is not False
        results = [WorkerResult(r, self.step + (r >= 2), 0, {}, "x") for r in range(4)] if stopped else []
        return GroupPoll(results=results, min_step=self.step, finished=stopped, evictions={})


@pytest.mark.parametrize("saving_ranks, stopped", [
    (2, "SIGTERM: step 33 is committed and safe (1 steps after it lost)"),
    (None, "SIGTERM: the save did not complete: resuming at committed step 33, 1 steps lost"),
])
def test_a_stop_of_replica_groups_is_judged_by_the_saving_group(saving_ranks, stopped):
    """The step saved is the saving group's: a replica group one step ahead of it when the stop
    came loses that step, and the save stands (None: every rank counts, as without replicas)."""
    DrainedGroup.created = []
    committed = [20]
    spec = JobSpec(name="t", fault_tolerance={"max_restarts": 0})
    guard = PreemptionGuard(spec.training.steps, lambda: max(committed), lambda: 1.0, draining=dict,
                            clock=lambda: 1000.0, saving_ranks=saving_ranks)
    ctl = Controller(spec, ReplicatedGroup, sleep=lambda s: None, preemption=guard)
    ctl.step()
    DrainedGroup.created[0].step = 33
    guard.request_stop("SIGTERM", 30.0)
    ctl.step()
    committed.append(33)
    ctl.step()
    assert ctl.state is JobState.STOPPED and ctl.result.stopped == stopped


def test_the_first_signal_asks_for_a_stop_the_second_stops_now_and_says_so(caplog):
    guard = PreemptionGuard(10, lambda: None, draining=dict)
    seen: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with stop_signals(guard, 7.0):
            os.kill(os.getpid(), signal.SIGTERM)
            assert guard.stop_request is not None and guard.stop_request[0] == "SIGTERM" and not seen
            with pytest.raises(KeyboardInterrupt):         # a second one: stop now (the driver's Ctrl-C path)
                os.kill(os.getpid(), signal.SIGTERM)
            assert "SIGTERM again: stopping now" in caplog.text and not seen
            os.kill(os.getpid(), signal.SIGTERM)           # after that: the handler that was there before
            assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_shrunk_group_grows_back_when_room_appears_off_draining_nodes():
    DrainedGroup.created = []
    spec = JobSpec(name="t", resources={"num_workers": 2, "min_workers": 1},
                   fault_tolerance={"max_restarts": 0, "grow_check_s": 5.0})
    now = [1000.0]
    room = {"free": 0}
    asked: list[set] = []

    def room_for(draining: set) -> int:
        asked.append(draining)
        return room["free"]

    guard = PreemptionGuard(spec.training.steps, lambda: 40, draining=lambda: {"B": 2000.0}, clock=lambda: now[0],
                            full_size=2, grow_check_s=5.0, room=room_for)
    ctl = Controller(spec, DrainedGroup, sleep=lambda s: None, preemption=guard)
    ctl.step()
    group = DrainedGroup.created[0]
    group.nodes, group.step = ["A"], 40                    # placed at 1 of 2 workers
    now[0] += 6
    ctl.step()                                             # no room yet: keeps training
    assert group.preempted is False and asked == [{"B"}]    # the draining node's room is not counted
    room["free"] = 1
    ctl.step()                                             # checked again only after grow_check_s
    assert group.preempted is False and len(asked) == 1
    now[0] += 6
    ctl.step()
    assert group.preempted is None and guard.outcome == "grow" and ctl.state is JobState.RUNNING
    ctl.step()                                             # the step in hand saved: restart at full size
    assert ctl.state is JobState.RECOVERING and ctl.preemptions == 0 and not ctl.result.failures
    ctl.step()
    ctl.step()
    assert ctl.state is JobState.RUNNING and guard.outcome == "preemption"


def test_a_notice_at_the_last_step_lets_the_job_succeed():
    drains: dict = {}
    ctl = _controller(drains, [1000])
    ctl.step()
    group = DrainedGroup.created[0]
    group.step = ctl.spec.training.steps
    drains["B"] = 1025.0
    ctl.step()
    ctl.step()
    assert ctl.state is JobState.SUCCEEDED and ctl.preemptions == 0


def test_the_metrics_count_preemptions_and_their_lost_steps(monkeypatch):
    from raytrain_ckpt.control.metrics import ControllerMetrics
    from raytrain_ckpt.observe import metrics

    recorded: list[tuple[str, float, dict]] = []
    monkeypatch.setattr(metrics, "record", lambda name, value, tags: recorded.append((name, value, dict(tags))))
    drains: dict = {}
    ctl = _controller(drains, [50])
    ctl._observer = ControllerMetrics("t", checkpointing=True)
    ctl.step()
    DrainedGroup.created[0].step = 54
    drains["B"] = 1020.0
    ctl.step()
    ctl.step()                                             # 54 never committed: 4 steps lost

    def values(name: str, **tags: str) -> list[float]:
        return [v for n, v, t in recorded if n == name and tags.items() <= t.items()]

    assert values("job_failures_total", cause="preemption") == [1]
    assert values("job_preemption_steps_lost_total") == [4] and values("job_preemption_notice_seconds") == [20.0]
    assert values("job_restarts_total") == []


def test_sigterm_to_a_rank_process_is_a_preemption_of_that_rank_with_its_deadline():
    committed: list[int] = [50]
    ctl = _controller({}, committed)
    ctl.step()
    group = DrainedGroup.created[0]
    group.step = 57
    group.evictions = {1: 1030.0}                          # rank 1's process got SIGTERM: 30 s of stop_grace_s
    ctl.step()
    assert group.preempted == 1030.0 and ctl.state is JobState.RUNNING
    committed.append(57)
    ctl.step()
    assert ctl.state is JobState.RECOVERING and ctl.restarts == 0 and ctl.preemptions == 1
    [failure] = ctl.result.failures
    assert failure.kind == "preemption" and failure.rank == 1
    assert failure.headline == "the process of rank 1 got SIGTERM on node B (30.0s notice, tier durable): step 57 saved, 0 steps lost"
    assert ctl.result.preemptions[0]["cause"] == "sigterm" and ctl.result.preemptions[0]["node"] == "B"


def test_on_sigterm_acts_on_the_first_signal_and_hands_the_second_to_the_handler_before():
    seen: list[str] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append("before"))
    try:
        assert on_sigterm(lambda: seen.append("act") is None)
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == ["act"]
        os.kill(os.getpid(), signal.SIGTERM)               # a second signal: the handler before, at once
        assert seen == ["act", "before"]
        assert on_sigterm(lambda: False)                   # nothing to save: the handler before, at once
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == ["act", "before", "before"]
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_drained_node_without_ranks_loses_its_writer_and_the_actor_and_training_goes_on():
    spec = JobSpec(name="t", fault_tolerance={"max_restarts": 0})
    moved: list[str] = []
    retired: list[str] = []
    guard = PreemptionGuard(spec.training.steps, lambda: 10, draining=lambda: {"W": 1025.0, "S": 1025.0},
                            clock=lambda: 1000.0, service_node=lambda: "S", move_service=lambda: moved.append("S"),
                            retire_writer=lambda node: retired.append(node) is None)
    DrainedGroup.created = []
    ctl = Controller(spec, DrainedGroup, sleep=lambda s: None, preemption=guard)
    ctl.step()
    ctl.step()
    ctl.step()                                             # each node is acted on once
    group = DrainedGroup.created[0]
    assert sorted(retired) == ["S", "W"] and moved == ["S"]
    assert group.preempted is False and ctl.state is JobState.RUNNING and not ctl.result.failures
