"""The controller state machine, advanced one step at a time against a fake group."""

from __future__ import annotations

import logging

import pytest

from raytrain_ckpt.control.controller import Controller, JobState
from raytrain_ckpt.control.poll import GroupPoll, GroupStartError
from raytrain_ckpt.control.policy import Decision, FailureFacts, FailurePolicy, elastic_world_size
from raytrain_ckpt.common.events import Failure, RollbackRecord, Trip, WorkerResult
from raytrain_ckpt.control.watch.hangs import Blame
from raytrain_ckpt.spec import JobSpec


class GroupDefaults:
    """The capabilities of the ``WorkerGroup`` protocol a scripted group has no part in, each
    answered with nothing to say: no nodes, no checkpoint processes, no stacks to read."""

    rollbacks_before = 0
    start_marks: list[tuple[str, float]] = []
    nodes: list[str] = []
    replaced: list[str] = []
    healing: set[int] = set()

    def rank_nodes(self) -> list[str]:
        return []

    def preempt(self, deadline_unix: float | None, tier: str = "durable") -> None:
        pass

    def retire(self, rank: int) -> None:
        pass

    def heal(self, replica: int) -> None:
        raise GroupStartError("this group has no replica groups to replace")

    def note_failure(self, failure: Failure) -> str | None:
        return None

    def diagnose(self) -> Blame:
        return Blame((), "no single rank can be blamed: this group cannot read stacks")

    def checkpointing_silences(self) -> dict[str, float]:
        return {}

    def save_in_flight(self) -> int | None:
        return None

    def replace_silent_checkpointing(self, stalled: dict[str, float] | None = None) -> list[str]:
        return []


class FakeWorkerGroup(GroupDefaults):
    """A scripted group. Test-only methods: ``fail(rank)``, ``kill(rank)``, ``advance(steps)``, ``finish()``,
    ``roll_back(record)``."""

    created: list[FakeWorkerGroup] = []
    clock: Clock | None = None
    """The test's clock: the controller's pause between polls is the group's ``wait``."""
    replace_at: dict[int, list[str]] = {}
    """By attempt: what its start replaced for not answering (``WorkerGroup.replaced``)."""

    def __init__(self, spec: JobSpec, attempt: int, start_error: str | None = None) -> None:
        self.spec, self.attempt, self.start_error = spec, attempt, start_error
        self.mismatch = start_error.removeprefix("mismatch:") if start_error and start_error.startswith("mismatch:") \
            else None
        self.step, self.done, self.shut = 0, False, 0
        self.failures: list[Failure] = []
        self.kept_warm: list[bool] = []
        self.rollbacks: list[RollbackRecord] = []
        self.rollbacks_before = 0
        """Set by the controller before ``start``: the job's rollbacks in earlier attempts."""
        self.replaced = FakeWorkerGroup.replace_at.get(attempt, [])
        FakeWorkerGroup.created.append(self)

    def start(self) -> None:
        if self.start_error:
            raise GroupStartError(self.start_error, self.mismatch)

    def poll(self) -> GroupPoll:
        rollbacks = tuple(self.rollbacks)
        results = [WorkerResult(r, self.step, 0, {self.step: 1.0}, "x", rollbacks=rollbacks) for r in range(2)] \
            if self.done else []
        return GroupPoll(results=results, failures=list(self.failures), min_step=self.step, finished=self.done,
                         rollbacks=rollbacks)

    def wait(self, timeout_s: float) -> None:
        if self.clock is not None:
            self.clock.sleep(timeout_s)

    def shutdown(self, keep_warm: bool = False) -> None:
        self.shut += 1
        self.kept_warm.append(keep_warm)

    def fail(self, rank: int) -> None:
        self.failures.append(Failure(self.attempt, "exception", rank, "RuntimeError: boom",
                                     f"rank {rank} failed:\nTraceback (most recent call last):\nRuntimeError: boom"))

    def kill(self, rank: int) -> None:
        self.failures.insert(0, Failure(self.attempt, "crash", rank, "worker process died"))

    def advance(self, steps: int = 1) -> None:
        self.step += steps

    def finish(self) -> None:
        self.done = True

    def roll_back(self, record: RollbackRecord) -> None:
        """The ranks rolled back inside the attempt and report it with their progress."""
        self.rollbacks.append(record)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture()
def make():
    FakeWorkerGroup.created, FakeWorkerGroup.replace_at = [], {}

    def _make(max_restarts: int = 0, hang_timeout_s: float = 10.0, start_errors: tuple[str, ...] = (),
              **ft: float):
        spec = JobSpec(name="t", fault_tolerance={"max_restarts": max_restarts, "hang_timeout_s": hang_timeout_s,
                                                  "poll_interval_s": 1.0, **ft})
        errors = list(start_errors)
        clock = FakeWorkerGroup.clock = Clock()

        def factory(s: JobSpec, attempt: int) -> FakeWorkerGroup:
            return FakeWorkerGroup(s, attempt, errors.pop(0) if errors else None)

        return Controller(spec, factory, clock=clock, sleep=clock.sleep), clock

    return _make


def test_start_run_succeed(make):
    ctl, _ = make()
    assert ctl.state is JobState.STARTING
    ctl.step()
    assert ctl.state is JobState.RUNNING
    group = FakeWorkerGroup.created[0]
    group.advance(3)
    ctl.step()
    assert ctl.state is JobState.RUNNING
    group.finish()
    ctl.step()
    assert ctl.state is JobState.SUCCEEDED and ctl.state.is_terminal
    assert [r.steps for r in ctl.result.results] == [3, 3]


def test_a_finished_job_whose_final_checkpoint_did_not_commit_is_rejected(make):
    ctl, _ = make()
    ctl.step()
    FakeWorkerGroup.created[0].finish()
    ctl.step()
    assert ctl.state is JobState.SUCCEEDED
    ctl.reject("checkpoint", "the final checkpoint (step 3) did not commit: disk full")
    assert ctl.state is JobState.FAILED and ctl.result.state is JobState.FAILED
    assert ctl.result.error == "the final checkpoint (step 3) did not commit: disk full"
    assert [str(f) for f in ctl.result.failures] == ["attempt 0 checkpoint: the final checkpoint (step 3) did not commit: disk full"]


def test_a_running_job_stopped_from_outside_fails_and_releases_its_group_whatever_the_budget(make):
    ctl, _ = make(max_restarts=3)
    ctl.step()
    FakeWorkerGroup.created[0].advance(2)
    ctl.stop("checkpoint", "checkpoint.dir: another run took this job's root over")
    ctl.run()                                      # ends at once: no restart, the group released
    assert ctl.state is JobState.FAILED and ctl.result.state is JobState.FAILED and ctl.attempt == 0
    assert FakeWorkerGroup.created[0].shut == 1 and len(FakeWorkerGroup.created) == 1
    assert [str(f) for f in ctl.result.failures] == ["attempt 0 checkpoint: checkpoint.dir: another run took this "
                                                     "job's root over"]
    ctl.stop("checkpoint", "again")                # a job that ended stays as it ended
    assert len(ctl.result.failures) == 1


def test_worker_failure_without_budget_fails_with_rank_in_error(make):
    ctl, _ = make(max_restarts=0)
    ctl.step()
    FakeWorkerGroup.created[0].fail(1)
    ctl.step()
    assert ctl.state is JobState.FAILED
    assert "rank 1" in ctl.result.error


def test_failure_with_budget_restarts_a_new_group(make):
    ctl, _ = make(max_restarts=1)
    ctl.step()
    FakeWorkerGroup.created[0].fail(0)
    ctl.step()
    assert ctl.state is JobState.RECOVERING
    ctl.step()
    assert ctl.state is JobState.STARTING and FakeWorkerGroup.created[0].shut == 1
    ctl.step()
    assert ctl.state is JobState.RUNNING and FakeWorkerGroup.created[1].attempt == 1
    FakeWorkerGroup.created[1].fail(0)
    ctl.step()
    assert ctl.state is JobState.FAILED and ctl.restarts == 1


def test_a_checkpoint_writer_replaced_at_a_restart_is_in_the_result_events(make):
    ctl, _ = make(max_restarts=1)
    FakeWorkerGroup.replace_at[1] = ["checkpoint writer on node abc did not answer within 10s: replaced"]
    ctl.step()
    FakeWorkerGroup.created[0].fail(0)
    ctl.step()
    ctl.step()
    ctl.step()
    assert ctl.state is JobState.RUNNING
    notes = [e for _, e in ctl.result.events if "did not answer" in e]
    assert notes == ["attempt 1: checkpoint writer on node abc did not answer within 10s: replaced"]


def test_hang_detected_after_timeout_without_progress(make):
    ctl, clock = make(hang_timeout_s=5.0)
    ctl.step()
    group = FakeWorkerGroup.created[0]
    for _ in range(5):
        group.advance()
        ctl.step()
    assert ctl.state is JobState.RUNNING  # progressing, never hung
    for _ in range(7):
        ctl.step()
    assert ctl.state is JobState.FAILED
    assert "hang_timeout_s" in ctl.result.error and clock.now >= 5.0


def test_start_error_uses_the_restart_budget(make):
    ctl, _ = make(max_restarts=1, start_errors=("could not reserve",))
    ctl.step()
    assert ctl.state is JobState.RECOVERING
    result = None
    ctl.step()
    ctl.step()
    FakeWorkerGroup.created[1].finish()
    result = ctl.run()
    assert result.state is JobState.SUCCEEDED and result.attempts == 2


def test_a_checkpoint_mismatch_at_start_fails_at_once_whatever_the_budget(make):
    ctl, _ = make(max_restarts=3, start_errors=("mismatch:checkpoint /x/step-00000002: w has shape (2,) there",))
    result = ctl.run()
    assert result.state is JobState.FAILED and result.attempts == 1 and ctl.restarts == 0
    (failure,) = result.failures
    assert failure.kind == "mismatch" and failure.headline == "checkpoint /x/step-00000002: w has shape (2,) there"


def test_run_always_releases_the_group(make):
    ctl, _ = make()
    ctl.step()
    FakeWorkerGroup.created[0].fail(0)
    ctl.run()
    assert FakeWorkerGroup.created[0].shut == 1 and ctl.group is None


@pytest.mark.parametrize(
    ("kind", "done", "budget", "expected"),
    [
        ("crash", 0, 0, Decision.FAIL),
        ("crash", 0, 1, Decision.RESTART),
        ("crash", 1, 1, Decision.FAIL),
        ("hang", 2, 3, Decision.RESTART),
        ("start", 3, 3, Decision.FAIL),
        ("mismatch", 0, 3, Decision.FAIL),   # a checkpoint that does not fit the model: never retried
    ],
)
def test_failure_policy_table(kind, done, budget, expected):
    assert FailurePolicy().decide(FailureFacts(kind, done, budget)) is expected


@pytest.mark.parametrize(
    ("done", "budget", "recent", "expected"),
    [
        (5, 1, 1, Decision.RESTART),   # many failures, but only this one inside the window
        (5, 1, 2, Decision.FAIL),
        (0, 0, 1, Decision.FAIL),
        (0, 2, 2, Decision.RESTART),
    ],
)
def test_failure_policy_window_table(done, budget, recent, expected):
    assert FailurePolicy().decide(FailureFacts("crash", done, budget, recent)) is expected


def _crash_now(ctl: Controller) -> None:
    ctl.group.fail(1)
    ctl.step()


def test_failure_window_forgives_old_failures_and_backoff_waits(make):
    ctl, clock = make(max_restarts=1, failure_window_s=100.0, restart_backoff_s=7.0)
    ctl.step()                                   # STARTING -> RUNNING
    _crash_now(ctl)
    assert ctl.state is JobState.RECOVERING
    before = clock.now
    ctl.step()                                   # RECOVERING -> STARTING, after the backoff
    assert ctl.state is JobState.STARTING and clock.now - before == 7.0
    ctl.step()
    clock.now += 500.0                           # the first failure leaves the window
    _crash_now(ctl)
    assert ctl.state is JobState.RECOVERING      # a second failure, but only one in the window
    ctl.step()
    ctl.step()
    _crash_now(ctl)                              # two inside the window: the budget of 1 is spent
    assert ctl.state is JobState.FAILED
    assert len(ctl.result.failures) == 3
    assert [(f.attempt, f.kind, f.rank, f.headline) for f in ctl.result.failures] == \
        [(i, "exception", 1, "RuntimeError: boom") for i in range(3)]
    assert str(ctl.result.failures[0]) == "attempt 0 exception: rank 1: RuntimeError: boom"


def test_without_window_two_crashes_spend_a_budget_of_one(make):
    ctl, clock = make(max_restarts=1, failure_window_s=None)
    ctl.step()
    ctl.group.kill(1)
    ctl.step()
    ctl.step()
    ctl.step()
    clock.now += 10_000.0
    ctl.group.kill(0)
    ctl.step()
    assert ctl.state is JobState.FAILED
    assert [(f.attempt, f.kind, f.rank) for f in ctl.result.failures] == [(0, "crash", 1), (1, "crash", 0)]


@pytest.mark.parametrize(
    ("requested", "min_workers", "fit", "gbs", "mbs", "expected"),
    [
        (4, 2, 4, 16, 2, 4),      # everything fits: no shrink
        (4, 2, 3, 16, 2, 2),      # 3 fit, but 16 is not a multiple of 2 x 3: 2
        (4, 2, 3, 12, 2, 3),      # 12 = 2 x 3 x 2: 3 workers, 2 micro-batches each
        (4, 3, 2, 16, 2, None),   # fewer than min_workers fit
        (4, 1, 0, 16, 2, None),   # nothing fits
        (8, 1, 5, 8, 1, 4),
        (2, 1, 1, 16, 4, 1),
    ],
)
def test_elastic_world_size_table(requested, min_workers, fit, gbs, mbs, expected):
    assert elastic_world_size(requested, min_workers, fit, gbs, mbs) == expected


@pytest.mark.parametrize(
    ("requested", "min_workers", "fit", "gbs", "mbs", "pp", "expected"),
    [
        (4, 2, 3, 16, 2, 2, 2),    # pp=2: 3 fit, but the world must be a multiple of pp: 2 (dp 1)
        (8, 2, 7, 16, 2, 2, 4),    # 6 = pp 2 x dp 3 fits, but 16 is not a multiple of 2 x 3: 4 (dp 2)
        (6, 3, 5, 12, 1, 3, 3),    # pp=3: dp 1
        (4, 2, 1, 16, 2, 2, None), # not even one full pipeline fits
    ],
)
def test_elastic_world_size_keeps_the_pipeline(requested, min_workers, fit, gbs, mbs, pp, expected):
    assert elastic_world_size(requested, min_workers, fit, gbs, mbs, pp) == expected


@pytest.mark.parametrize(
    ("kind", "retry_on", "expected"),
    [
        ("exception", ("crash", "hang"), Decision.FAIL),      # a bug in user code: do not burn restarts
        ("crash", ("crash", "hang"), Decision.RESTART),
        ("hang", ("crash",), Decision.FAIL),
        ("start", ("start", "crash", "exception", "hang"), Decision.RESTART),
    ],
)
def test_failure_policy_retries_only_listed_kinds(kind, retry_on, expected):
    assert FailurePolicy(retry_on).decide(FailureFacts(kind, 0, 3)) is expected


def test_exception_not_in_retry_on_fails_at_once(make):
    ctl, _ = make(max_restarts=3, retry_on=["crash"])
    ctl.step()
    _crash_now(ctl)                              # the fake group reports an exception, not a dead process
    assert ctl.state is JobState.FAILED and ctl.result.failures[0].kind == "exception"


@pytest.mark.parametrize(("kind", "reuse", "expected"), [
    ("crash", True, True),
    ("exception", True, True),
    ("hang", True, False),   # the survivors sit in a collective with the hung rank
    ("start", True, False),
    ("crash", False, False),
])
def test_keep_warm_table(kind, reuse, expected):
    assert FailurePolicy(reuse_workers=reuse).keep_warm(kind) is expected


@pytest.mark.parametrize(("inject", "kept"), [("kill", True), ("fail", True), ("hang", False)])
def test_restart_keeps_survivors_warm_only_after_crash_or_exception(make, inject, kept):
    ctl, clock = make(max_restarts=1, hang_timeout_s=5.0)
    ctl.step()
    first = FakeWorkerGroup.created[0]
    if inject == "hang":
        for _ in range(7):
            ctl.step()
    else:
        getattr(first, inject)(1)
        ctl.step()
    assert ctl.state is JobState.RECOVERING
    ctl.step()
    assert first.kept_warm == [kept]
    ctl.step()
    second = FakeWorkerGroup.created[1]
    second.finish()
    ctl.run()
    assert ctl.state is JobState.SUCCEEDED
    assert second.kept_warm == [False]  # the end of the job releases everything


def test_the_default_hang_timeout_is_learned_and_the_ledger_adds_up(make):
    """hang_timeout_s auto: the first step gets its own budget, then 10 x p99 of the step times, at
    least 30 s; a group that cannot read stacks gets a hang that blames no rank, and says so."""
    ctl, clock = make(max_restarts=1, hang_timeout_s="auto")
    ctl.step()
    group = FakeWorkerGroup.created[0]
    ctl.step()                                    # the starting step
    clock.sleep(100.0)                            # a slow first step (compile): within its 300 s budget
    group.advance()
    ctl.step()
    assert ctl.state is JobState.RUNNING
    for _ in range(10):                           # 1 s steps (one per poll): 10 x p99 is under the floor
        group.advance()
        ctl.step()
    assert ctl.summary()["hang_timeout_s"] == 30.0
    hung_at = clock.now
    while ctl.state is JobState.RUNNING:
        ctl.step()
    assert ctl.state is JobState.RECOVERING and 29.0 <= clock.now - hung_at <= 32.0   # the last step: 1 s before
    hang = ctl.result.failures[0]
    assert hang.kind == "hang" and hang.rank is None and "no single rank can be blamed" in hang.headline
    assert "hang_timeout_s=auto: 10 x p99 step time 1 s, at least 30 s" in hang.headline
    ctl.step()                                    # teardown, then the restart
    ctl.step()
    FakeWorkerGroup.created[1].finish()
    ctl.step()
    ctl.ledger.close(clock.now)
    led = ctl.ledger.to_dict()
    assert sum(led["seconds"].values()) == pytest.approx(clock.now) and led["seconds"]["first_step"] >= 100.0
    assert led["seconds"]["detection"] > 30.0 and [a["ended_by"] for a in led["attempts"]] == ["hang", None]


def test_a_rollback_is_recorded_as_soon_as_the_progress_reports_it_once_and_survives_a_later_crash(make):
    ctl, _ = make(max_restarts=1)
    ctl.step()
    group = FakeWorkerGroup.created[0]
    group.advance(10)
    first = RollbackRecord(Trip(9, 1, "non-finite loss"), 6, (96, 160))
    group.roll_back(first)
    ctl.step()
    assert ctl.state is JobState.RUNNING           # a rollback is no failure of the group: no restart
    assert [(f.attempt, f.kind, f.rank) for f in ctl.result.failures] == [(0, "rollback", 1)]
    assert ctl.result.failures[0].headline == str(first)
    assert ctl.summary()["failures"] == {"rollback": 1}  # what `status --job` shows mid-attempt
    ctl.step()
    ctl.step()                                     # the same report on later polls: recorded once
    assert len(ctl.result.failures) == 1
    group.roll_back(RollbackRecord(Trip(13, 0, "loss spike"), 10, (160, 224)))
    ctl.step()
    assert ctl.summary()["failures"] == {"rollback": 2} and ctl.result.failures[1].rank == 0
    group.kill(1)                                  # the attempt crashes later: its rollbacks stay
    ctl.step()
    assert ctl.state is JobState.RECOVERING
    assert [f.kind for f in ctl.result.failures] == ["rollback", "rollback", "crash"]
    ctl.step()
    ctl.step()
    second = FakeWorkerGroup.created[1]
    assert (FakeWorkerGroup.created[0].rollbacks_before, second.rollbacks_before) == (0, 2)  # the budget is per job
    second.roll_back(RollbackRecord(Trip(9, 1, "non-finite loss"), 6, (96, 160)))  # a new attempt counts anew
    second.finish()                                # seen first in the finished poll: its results carry it too
    ctl.step()
    assert ctl.state is JobState.SUCCEEDED
    assert [(f.attempt, f.kind) for f in ctl.result.failures] == [
        (0, "rollback"), (0, "rollback"), (0, "crash"), (1, "rollback")]
    assert ctl.summary()["failures"] == {"rollback": 3, "crash": 1}


def test_a_crash_logs_one_headline_per_other_rank_and_keeps_their_tracebacks_in_the_record(make, caplog):
    ctl, _ = make(max_restarts=1)
    ctl.step()
    group = FakeWorkerGroup.created[0]
    group.fail(0)             # gloo's "Connection reset by peer" on the rank that did not fail
    group.kill(1)             # the cause: polled first
    with caplog.at_level(logging.ERROR, logger="raytrain_ckpt.control.controller"):
        ctl.step()
    assert ctl.state is JobState.RECOVERING
    [logged] = [r.getMessage() for r in caplog.records if "failure:" in r.getMessage()]
    assert logged.splitlines() == ["attempt 0 crash failure:", "attempt 0 crash: rank 1: worker process died",
                                   "1 other rank(s) failed after it (full text: JobResult.error):",
                                   "  rank 0 exception: RuntimeError: boom"]
    assert "Traceback" not in logged
    [failure] = ctl.result.failures
    assert (failure.kind, failure.rank, [f.rank for f in failure.after]) == ("crash", 1, [0])
    assert "worker process died" in ctl.result.error and "Traceback (most recent call last)" in ctl.result.error


def test_a_single_failure_logs_its_full_text(make, caplog):
    ctl, _ = make()
    ctl.step()
    FakeWorkerGroup.created[0].fail(1)
    with caplog.at_level(logging.ERROR, logger="raytrain_ckpt.control.controller"):
        ctl.step()
    assert ctl.state is JobState.FAILED
    [logged] = [r.getMessage() for r in caplog.records if "failure:" in r.getMessage()]
    assert "Traceback (most recent call last)" in logged and "other rank" not in logged


class HealingGroup(FakeWorkerGroup):
    """A scripted group of replica groups: ``heal`` records the group it was asked to replace."""

    def __init__(self, spec: JobSpec, attempt: int, start_error: str | None = None) -> None:
        super().__init__(spec, attempt, start_error)
        self.healing: set[int] = set()
        self.healed: list[int] = []

    def heal(self, replica: int) -> None:
        self.healed.append(replica)
        self.failures.clear()  # the failed group's runs are dropped with it


def test_one_replica_groups_crash_replaces_that_group_and_the_job_trains_on_in_the_same_attempt():
    FakeWorkerGroup.created = []
    spec = JobSpec(name="t", resources={"num_workers": 2}, parallelism={"dp_replicate": 2, "dp_shard": 1},
                   fault_tolerance={"max_restarts": 1, "poll_interval_s": 1.0})
    clock = Clock()
    ctl = Controller(spec, lambda s, a: HealingGroup(s, a), clock=clock, sleep=clock.sleep)
    ctl.step()
    group = FakeWorkerGroup.created[0]
    group.kill(1)  # rank 1: replica group 1
    ctl.step()
    assert ctl.state is JobState.RUNNING and group.healed == [1] and ctl.attempt == 0
    assert [(h["replica"], h["rank"], h["kind"]) for h in ctl.result.heals] == [(1, 1, "crash")]
    assert [f.kind for f in ctl.result.failures] == ["crash"] and ctl.restarts == 1
    assert ctl.summary()["replica_heals"] == 1
    group.kill(1)  # the budget is spent: the next failure fails the job
    ctl.step()
    assert ctl.state is JobState.FAILED and group.healed == [1]
    group.failures.clear()
    # replica group 0 saves: healed alone too, far enough from the last step (its replacement saves on)
    ctl2 = Controller(spec, lambda s, a: HealingGroup(s, a), clock=clock, sleep=clock.sleep)
    ctl2.step()
    FakeWorkerGroup.created[-1].kill(0)
    ctl2.step()
    assert ctl2.state is JobState.RUNNING and FakeWorkerGroup.created[-1].healed == [0]
    # ... but not when its replacement would rejoin too close to the end to save the last step: 30
    # steps, heal_steps 5, the slowest rank at step 22 heals (its group rejoins by 29), at 23 not
    near = spec.model_copy(update={"training": spec.training.model_copy(update={"steps": 30}),
                                   "fault_tolerance": spec.fault_tolerance.model_copy(update={"heal_steps": 5,
                                                                                               "max_restarts": 2})})
    for at, healed, state in ((22, [0], JobState.RUNNING), (23, [], JobState.RECOVERING)):
        ctl3 = Controller(near, lambda s, a: HealingGroup(s, a), clock=clock, sleep=clock.sleep)
        ctl3.step()
        FakeWorkerGroup.created[-1].advance(at)
        ctl3.step()
        FakeWorkerGroup.created[-1].kill(0)
        ctl3.step()
        assert ctl3.state is state and FakeWorkerGroup.created[-1].healed == healed, at
