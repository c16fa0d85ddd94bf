"""The driver's controller: an explicit state machine over one worker group at a time.

``step()`` is the only code that branches on the state and ``_set_state()`` the only
code that changes it. What to do about a poll is said by the job's watches (``control/watch/``,
built by ``watches_for``), each in a ``Verdict``; what to do about a failure is decided by
``FailurePolicy`` (pure, table-tested). The controller acts on both in one place (``_act``) and
keeps no detector's state.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from raytrain_ckpt.common.events import Failure, FailureKind, WorkerResult, headline
from raytrain_ckpt.control.poll import GroupPoll, GroupStartError, WorkerGroup
from raytrain_ckpt.control.policy import Decision, FailurePolicy, RestartBudget
from raytrain_ckpt.control.watch import Act, Verdict, Watch
from raytrain_ckpt.control.watch.build import watches_for
from raytrain_ckpt.control.watch.goodput import GoodputLedger
from raytrain_ckpt.control.watch.hangs import HangWatch, auto_text
from raytrain_ckpt.control.watch.replicas import ReplicaHeals
from raytrain_ckpt.spec import JobSpec

if TYPE_CHECKING:
    from raytrain_ckpt.control.watch.preemption import PreemptionGuard

logger = logging.getLogger(__name__)

W = TypeVar("W")

__all__ = ["Controller", "JobResult", "JobState"]


class JobState(enum.Enum):
    """Lifecycle of a job. SUCCEEDED, FAILED and STOPPED are terminal. STOPPED: a signal to the
    driver (`ray job stop`, Ctrl-C) ended it on purpose, after saving the step in hand."""

    STARTING = "STARTING"
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.STOPPED)


@dataclass
class JobResult:
    """The outcome the driver reports and exits with."""

    state: JobState
    attempts: int
    results: list[WorkerResult] = field(default_factory=list)
    error: str | None = None
    elapsed_s: float = 0.0
    checkpoints: dict | None = None
    """The CheckpointActor's final status (committed steps, failures), when checkpointing is on."""
    failures: list[Failure] = field(default_factory=list)
    """Every failure that ended an attempt, in order."""
    events: list[tuple[float, str]] = field(default_factory=list)
    """(time.time(), what) of every failure detected and every group start and start-up."""
    preemptions: list[dict] = field(default_factory=list)
    """Every preemption acted on: node, deadline, tier, saved step, steps lost (``PreemptionRecord``)."""
    stopped: str | None = None
    """Set when a signal to the driver stopped the job (state STOPPED): what was saved (the step that is safe)."""
    stopped_by: str | None = None
    """The signal that stopped the job ("SIGTERM", "SIGINT"; None: it was not stopped)."""
    goodput: dict | None = None
    """Where the wall time went (``GoodputLedger.to_dict``): goodput, seconds by cause, each attempt's phases."""
    diagnostics: list[str] = field(default_factory=list)
    """The diagnostics folder of every hang (every rank's stacks and the verdict), in order."""
    quarantined: list[str] = field(default_factory=list)
    """Every node put in quarantine (``fault_tolerance.quarantine_s``), one line each."""
    stragglers: list[str] = field(default_factory=list)
    """Every rank reported as a straggler (``fault_tolerance.straggler_margin``), one line each."""
    heals: list[dict] = field(default_factory=list)
    """Every replica group replaced while the others trained on (``parallelism.dp_replicate``):
    replica, rank, kind, attempt, headline, at (time.time()), healed_s (the failure's detection ->
    its replacement trained a step with the others). Its failure is in ``failures`` too."""
    restarts: dict[str, int] = field(default_factory=dict)
    """Whole-group restarts spent on ``fault_tolerance.max_restarts``, by the failure's kind: a heal
    is not one (unless its replacement did not start), a preemption's or a straggler's spends none."""

    @property
    def losses(self) -> dict[int, float]:
        """Rank 0's logged global losses by step."""
        return self.results[0].losses if self.results else {}


GroupFactory = Callable[[JobSpec, int], WorkerGroup]


class Controller:
    """Runs a job to a terminal state: start a group, watch it, restart or finish."""

    def __init__(
        self,
        spec: JobSpec,
        group_factory: GroupFactory,
        policy: FailurePolicy | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        observer: Callable[[Controller], None] | None = None,
        preemption: PreemptionGuard | None = None,
    ) -> None:
        self.spec = spec
        self._factory = group_factory
        ft = spec.fault_tolerance
        self._policy = policy or FailurePolicy(tuple(ft.retry_on), ft.reuse_workers)
        self._budget = RestartBudget(ft, self._policy)
        self._clock = clock
        self._sleep = sleep
        self.state = JobState.STARTING
        self.attempt = 0
        self.group: WorkerGroup | None = None
        self.result = JobResult(JobState.STARTING, 0)
        self._started = clock()
        self._last_failure: FailureKind | None = None
        self._observer = observer
        self.last_poll: GroupPoll | None = None
        """The latest poll of the running group (read by the observer)."""
        r = spec.parallelism.dp_replicate
        self.ledger = GoodputLedger(self._started, clock, r, spec.world_size // r)
        """Where the wall time went: the controller marks each attempt's start and end on it."""
        self.watches: list[Watch] = watches_for(spec, clock, self.ledger, preemption)
        """Every watch over the polls, each owning its state, in priority order (``watches_for``)."""
        heals = self.watch(ReplicaHeals)
        self.result.heals = heals.records if heals is not None else []

    def watch(self, kind: type[W]) -> W | None:
        """The job's watch of type ``kind`` (None: the job has none), for what it measured."""
        return next((w for w in self.watches if isinstance(w, kind)), None)

    @property
    def preemptions(self) -> int:
        """Preemptions survived so far (``fault_tolerance.max_preemptions``)."""
        return sum(f.kind == "preemption" for f in self.result.failures)

    @property
    def restarts(self) -> int:
        """Restarts spent on failures (``fault_tolerance.max_restarts``)."""
        return self._budget.restarts

    def run(self) -> JobResult:
        """Step until terminal; always releases the group."""
        logger.info("%s", auto_text(self.spec))
        try:
            while not self.state.is_terminal:
                self.step()
        finally:
            self._release_group()
            self.ledger.close(self._clock())
        self.result.elapsed_s = self._clock() - self._started
        self.result.goodput = self.ledger.to_dict()
        for line in [*(self.ledger.timeline_lines() if self.result.failures else ()), self.ledger.end_line()]:
            logger.info("%s", line)
        return self.result

    def step(self) -> None:
        """Advance the state machine by one transition or one poll."""
        if self.state is JobState.STARTING:
            self._start_group()
        elif self.state is JobState.RUNNING:
            self._watch_group()
        elif self.state is JobState.RECOVERING:
            self._release_group(keep_warm=self._policy.keep_warm(self._last_failure))
            self.ledger.torn_down(self._clock())
            self._sleep(self.spec.fault_tolerance.restart_backoff_s)
            self.attempt += 1
            self._set_state(JobState.STARTING, f"attempt {self.attempt}")
        if self._observer is not None:  # metrics: called after every transition or poll
            state = self.state
            self._observer(self)
            if self.state is not state:  # the observer ended the job (``stop``): it sees that end too
                self._observer(self)

    def summary(self) -> dict[str, Any]:
        """The job at a glance, for ``raytrain-ckpt status --job``: state, attempt, restarts,
        failures by kind, and the slowest rank's step (what every rank has trained)."""
        poll = self.last_poll
        out = {"state": self.state.value, "attempt": self.attempt, "restarts": self.restarts,
               "failures": dict(Counter(f.kind for f in self.result.failures)),
               "preemption": next((f.headline for f in reversed(self.result.failures) if f.kind == "preemption"), None),
               "train_step": poll.min_step if poll is not None else None}
        for watch in self.watches:
            out.update(watch.status())
        return out

    def reject(self, kind: str, message: str) -> None:
        """Fail a job whose workers finished but whose outcome is not what was asked for
        (its final checkpoint did not commit): the result says why, the exit code is 1."""
        assert self.state is JobState.SUCCEEDED, self.state
        self._fail_job(kind, message, f"{kind} rejected", f"finished, but {message}")
        if self._observer is not None:  # after run(): the metrics and the job's note say FAILED too
            self._observer(self)

    def stop(self, kind: FailureKind, message: str) -> None:
        """Fail a job that has not ended, from outside its group (another run took its checkpoint
        root over): the run loop ends and releases the group; the result says why (exit code 1)."""
        if not self.state.is_terminal:
            self._fail_job(kind, message, "stopped", f"stopped: {message}")

    def _fail_job(self, kind: str, message: str, what: str, log_line: str) -> None:
        """FAILED from outside the group's failures (no restart): ``what`` the event, ``log_line`` the error logged."""
        self.result.failures.append(Failure(self.attempt, kind, None, headline(message), message))
        self.result.events.append((time.time(), f"attempt {self.attempt} {what}"))
        logger.error("attempt %d %s", self.attempt, log_line)
        self.result.error = message
        self._set_state(JobState.FAILED, kind)

    def _set_state(self, new: JobState, reason: str) -> None:
        logger.info("%s -> %s (%s)", self.state.value, new.value, reason)
        self.state = new
        self.result.state = new

    def _start_group(self) -> None:
        self.result.events.append((time.time(), f"attempt {self.attempt} starting"))
        self.ledger.attempt(self.attempt, self._clock())
        self.group = self._factory(self.spec, self.attempt)
        self.result.attempts = self.attempt + 1
        # the guard's budget is per job, not per attempt
        self.group.rollbacks_before = sum(f.kind == "rollback" for f in self.result.failures)
        try:
            self.group.start()
        except GroupStartError as exc:
            self.result.events += _replaced(self.attempt, self.group)
            self.ledger.start_marks(self.group.start_marks, self._clock())
            kind, text = ("mismatch", exc.mismatch) if exc.mismatch is not None else ("start", str(exc))
            self._on_failure(Failure(self.attempt, kind, None, headline(text), str(exc)))
            return
        self.result.events += _replaced(self.attempt, self.group)
        running = self._clock()
        for watch in self.watches:
            watch.new_attempt()
        self.ledger.start_marks(self.group.start_marks, running)
        if self.group.nodes:
            self.result.events.append((time.time(), f"attempt {self.attempt} placed on {','.join(self.group.nodes)}"))
        self.result.events.append((time.time(), f"attempt {self.attempt} running"))
        self._set_state(JobState.RUNNING, f"{self.spec.world_size} workers started")

    def _watch_group(self) -> None:
        """One poll, asked of every watch in priority order until a verdict ends it; none did:
        wait for the next poll."""
        assert self.group is not None
        poll = self.last_poll = self.group.poll()
        for watch in self.watches:
            verdict = watch.observe(poll, self.group, self.attempt)
            if verdict is not None and self._act(verdict, poll):
                return
        self.group.wait(self.spec.fault_tolerance.poll_interval_s)

    def _act(self, verdict: Verdict, poll: GroupPoll) -> bool:
        """Record what ``verdict`` carries and do what it says; whether it ended the poll."""
        assert self.group is not None
        result = self.result
        result.failures += verdict.recorded
        result.preemptions += verdict.preemptions
        result.events += [(time.time(), line) for line in verdict.events]
        result.stragglers += verdict.stragglers
        result.diagnostics += verdict.diagnostics
        act = verdict.act
        if act is Act.FAIL:
            assert verdict.failure is not None
            self._on_failure(verdict.failure)
        elif act is Act.RESTART:
            if verdict.retire is not None:
                self.group.retire(verdict.retire)
            self._last_failure = verdict.cause
            self._set_state(JobState.RECOVERING, verdict.reason)
        elif act is Act.STOP:
            result.stopped, result.stopped_by = verdict.reason, verdict.stopped_by
            self._set_state(JobState.STOPPED, verdict.reason)
        elif act is Act.GIVE_UP:
            result.error = verdict.error
            self._set_state(JobState.FAILED, verdict.reason)
        elif act is Act.FINISH:
            self.ledger.finished(self._clock())
            result.results = poll.results
            self._set_state(JobState.SUCCEEDED, verdict.reason)
        return act is not Act.NOTE

    def _on_failure(self, failure: Failure) -> None:
        heals = self.watch(ReplicaHeals)
        step = self.last_poll.min_step if self.last_poll is not None else 0
        replica = heals.local_replica(failure, self.group.healing, step) if heals and self.group is not None else None
        if replica is not None:
            self._heal(failure, replica)
            return
        kind, now = failure.kind, self._clock()
        self.ledger.failed(kind, now)
        quarantined = self.group.note_failure(failure) if self.group is not None else None
        if quarantined is not None:
            self.result.quarantined.append(quarantined)
            self.result.events.append((time.time(), quarantined))
        self._last_failure = kind
        self.result.failures.append(failure)
        # with replica groups a guard trip ends its group (no rollback of its own): restarted as a crash
        decision, why = self._budget.decide("crash" if kind == "rollback" and heals is not None else kind, now)
        if decision is Decision.RESTART:
            _count(self.result.restarts, kind)
        self.result.events.append((time.time(), f"attempt {self.attempt} {kind} detected"))
        if kind == "mismatch":  # a user's mistake: its message, without the ranks' tracebacks
            logger.error("attempt %d: the resume checkpoint does not fit this job: %s", self.attempt, failure.headline)
        else:
            logger.error("attempt %d %s failure:\n%s", self.attempt, kind, failure.log_text())
        self.result.error = failure.full_text()
        self._set_state(JobState.RECOVERING if decision is Decision.RESTART else JobState.FAILED, why)

    def _heal(self, failure: Failure, replica: int) -> None:
        """One replica group failed alone: spend a restart on replacing it (``control/heal.py``)
        while the others train on; a replacement that cannot start restarts the whole job."""
        assert self.group is not None
        self.result.failures.append(failure)
        self.ledger.replaced()
        # a guard trip's state is discarded with its group: a live group's replaces it
        decision, why = self._budget.decide("crash" if failure.kind == "rollback" else failure.kind, self._clock())
        self.result.error = failure.full_text()
        if decision is not Decision.RESTART:
            logger.error("attempt %d %s failure in replica group %d:\n%s", self.attempt, failure.kind, replica,
                         failure.log_text())
            self._set_state(JobState.FAILED, why)
            return
        logger.error("attempt %d %s failure in replica group %d; replacing it (%s), the others train on:\n%s",
                     self.attempt, failure.kind, replica, why, failure.log_text())
        try:
            self.group.heal(replica)
        except GroupStartError as exc:  # the restart it spent restarts the whole job
            self._last_failure = failure.kind
            _count(self.result.restarts, failure.kind)
            self._set_state(JobState.RECOVERING, f"replica group {replica}'s replacement did not start: {exc}")
            return
        self.result.events.append((time.time(), f"attempt {self.attempt}: replica group {replica} replaced"))
        hang = self.watch(HangWatch)
        if hang is not None:  # the healthy groups may have waited for the failed one: the step budget starts again
            hang.waited(f"replica group {replica} replaced after a {failure.kind} on rank {failure.rank}")

    def _release_group(self, keep_warm: bool = False) -> None:
        if self.group is not None:
            self.group.shutdown(keep_warm=keep_warm)
            self.group = None


def _count(counts: dict[str, int], key: str) -> None:
    counts[key] = counts.get(key, 0) + 1


def _replaced(attempt: int, group: WorkerGroup) -> list[tuple[float, str]]:
    """For the result's events: the checkpoint writers or actor the start replaced for not answering
    (a stopped process; the previous failure may have been theirs, not the ranks')."""
    return [(time.time(), f"attempt {attempt}: {note}") for note in group.replaced]
