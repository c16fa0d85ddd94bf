"""The driver's controller: an explicit state machine over one worker group at a time.

``step()`` is the only code that branches on the state and ``_set_state()`` the only
code that changes it. What to do about a failure is decided by ``FailurePolicy`` (pure,
table-tested); the controller only acts on the decision.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from raytrain_ckpt.common.events import Failure, FailureKind, RollbackRecord, WorkerResult, headline
from raytrain_ckpt.control.watch.goodput import GoodputLedger
from raytrain_ckpt.control.watch.hangs import FLOOR_S, HangClock, Verdict, auto_text
from raytrain_ckpt.control.watch.silence import MAX_REPLACEMENTS, NOTICE_S, STALLED, overdue, silence_budget_s, stuck_line
from raytrain_ckpt.control.watch.stragglers import StragglerWatch
from raytrain_ckpt.spec import JobSpec

if TYPE_CHECKING:
    from raytrain_ckpt.control.watch.preemption import PreemptionGuard

logger = logging.getLogger(__name__)

__all__ = ["Controller", "Decision", "FailureFacts", "FailurePolicy", "GroupPoll", "GroupStartError", "JobResult",
           "JobState", "WorkerGroup", "elastic_world_size"]


class GroupStartError(RuntimeError):
    """The group could not be placed or could not form its process group in time.

    ``mismatch``: a rank found that the resume checkpoint does not fit the job's model (the
    ``CheckpointMismatch`` message); no restart would change that, so the job fails at once.
    """

    def __init__(self, message: str, mismatch: str | None = None) -> None:
        super().__init__(message)
        self.mismatch = mismatch


@dataclass(frozen=True)
class GroupPoll:
    """One look at the group: finished results, failures, and the slowest rank's step."""

    results: list[WorkerResult] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    """Every rank failure seen by this poll ("crash" or "exception"), crashes first."""
    min_step: int = 0
    finished: bool = False
    stall_s: float = 0.0
    """The most checkpoint-stall seconds any rank reported this attempt (the goodput ledger)."""
    eval_s: float = 0.0
    """The most eval seconds any rank reported this attempt."""
    phases: dict[int, str] = field(default_factory=dict)
    """Each answering rank's phase (``Progress.phase``: "saving" while in a save): the hang budget's phase."""
    starts: dict[int, tuple[int, float]] = field(default_factory=dict)
    """Each training rank's latest step and when it began it (time.time()): the straggler watch."""
    rollbacks: tuple[RollbackRecord, ...] = ()
    """The training guard's rollbacks in this attempt so far, in order:
    the most any rank reported, through its progress or its result."""
    evictions: dict[int, float] = field(default_factory=dict)
    """Ranks whose process got SIGTERM (a pod eviction) -> the deadline they stop by (``rank/eviction.py``)."""
    evidence: str | None = None
    """The file the group kept every failed rank's full text in, when ``failures`` is not empty."""
    step_s: float | None = None
    """The longest latest-step duration a training rank measured (``Progress.step_s``; None: none yet)."""


class WorkerGroup(Protocol):
    """What the controller needs from a group of training ranks."""

    def start(self) -> None:
        """Place, create and set up every rank, then start training; raises GroupStartError."""

    def poll(self) -> GroupPoll:
        """Non-blocking (bounded by the poll interval) look at progress and failures."""

    def wait(self, timeout_s: float) -> None:
        """Block until a rank's run ends (it finished, raised, or its process died) or ``timeout_s``
        passed, whichever is first: the controller's pause between polls, cut short by a failure."""

    def shutdown(self, keep_warm: bool = False) -> None:
        """Release the ranks; safe to call twice. ``keep_warm``: keep what can serve the next
        attempt (placement group, processes that reset cleanly), kill the rest."""


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


class Decision(enum.Enum):
    """What to do after a failure."""

    RESTART = "RESTART"
    FAIL = "FAIL"


@dataclass(frozen=True)
class FailureFacts:
    """Everything the failure policy may look at."""

    kind: FailureKind
    restarts_done: int
    max_restarts: int
    recent_failures: int | None = None
    """Failures inside fault_tolerance.failure_window_s, this one included (None: no window)."""


class FailurePolicy:
    """Restart while the budget lasts, then fail the job.

    The budget is ``max_restarts`` failures over the whole job, or, with a failure window, at
    most ``max_restarts`` failures inside any window (a job that fails rarely runs forever).
    """

    def __init__(self, retry_on: tuple[str, ...] = ("start", "crash", "exception", "hang"),
                 reuse_workers: bool = True) -> None:
        self.retry_on = retry_on
        self.reuse_workers = reuse_workers

    def keep_warm(self, kind: FailureKind | None) -> bool:
        """Whether a restart after a ``kind`` failure may reuse the surviving processes.

        After a crash or an exception the survivors' collectives fail and they can leave the
        step (after a straggler's replacement every rank stopped at a committed step); after a hang they sit in a collective with the hung rank and are replaced.
        """
        return self.reuse_workers and kind in ("crash", "exception", "straggler")

    def decide(self, facts: FailureFacts) -> Decision:
        # a "mismatch" (or "checkpoint") is never in retry_on: the spec's retry_on cannot name it
        if facts.kind not in self.retry_on:
            return Decision.FAIL
        if facts.recent_failures is not None:
            return Decision.RESTART if facts.recent_failures <= facts.max_restarts else Decision.FAIL
        return Decision.RESTART if facts.restarts_done < facts.max_restarts else Decision.FAIL


def elastic_world_size(requested: int, min_workers: int, fit: int, global_batch: int, micro_batch: int,
                       pp: int = 1) -> int | None:
    """The largest world size <= ``fit`` and >= ``min_workers`` that keeps the global batch.

    The global batch must stay a multiple of micro_batch x dp, so a shrink adds gradient
    accumulation instead of changing the optimization. Only dp shrinks: the world stays a
    multiple of the pipeline degree ``pp`` (dp = world / pp). None: no such size.
    """
    for n in range(min(requested, fit), min_workers - 1, -1):
        if n >= pp and n % pp == 0 and global_batch % (micro_batch * (n // pp)) == 0:
            return n
    return None


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
        self._clock = clock
        self._sleep = sleep
        self.state = JobState.STARTING
        self.attempt = 0
        self.restarts = 0
        self.group: WorkerGroup | None = None
        self.result = JobResult(JobState.STARTING, 0)
        self._last_step = -1
        self._last_advance = clock()
        self._started = clock()
        self._failure_times: list[float] = []
        self._last_failure: FailureKind | None = None
        self._observer = observer
        self.last_poll: GroupPoll | None = None
        """The latest poll of the running group (read by the observer)."""
        self.preemption = preemption
        self.preemptions = 0
        self.hangs = HangClock(spec)
        self.ledger = GoodputLedger(self._started)
        self.stragglers = StragglerWatch(spec.fault_tolerance.straggler_margin)
        self._last_hang: str | None = None
        self._rollbacks_noted = 0
        """Rollbacks of the running attempt already in ``result.failures``."""
        self._stuck: str | None = None
        """A checkpoint writer or the actor silent now, with the step (``silence.stuck_line``)."""
        self._silent_replaced = 0
        self._swap: int | None = None
        """The straggler rank whose replacement the running attempt stops for (replace_stragglers)."""
        self._swapped: set[int] = set()

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
        for line in self.ledger.timeline_lines() if self.result.failures else ():
            logger.info("%s", line)
        logger.info("%s", self.ledger.end_line())
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
            self._observer(self)

    def summary(self) -> dict[str, Any]:
        """The job at a glance, for ``raytrain-ckpt status --job``: state, attempt, restarts,
        failures by kind, and the slowest rank's step (what every rank has trained)."""
        poll = self.last_poll
        return {"state": self.state.value, "attempt": self.attempt, "restarts": self.restarts,
                "failures": dict(Counter(f.kind for f in self.result.failures)),
                "preemption": next((f.headline for f in reversed(self.result.failures) if f.kind == "preemption"), None),
                "train_step": poll.min_step if poll is not None else None,
                "hang_timeout_s": self.hangs.current_s, "hang_timeout_why": self.hangs.why,
                "last_hang": self._last_hang, "goodput": round(self.ledger.goodput, 4),
                "stragglers": sorted(self.stragglers.reported), "stuck": self._stuck}

    def reject(self, kind: str, message: str) -> None:
        """Fail a job whose workers finished but whose outcome is not what was asked for
        (its final checkpoint did not commit): the result says why, the exit code is 1."""
        assert self.state is JobState.SUCCEEDED, self.state
        self.result.failures.append(Failure(self.attempt, kind, None, headline(message), message))
        self.result.events.append((time.time(), f"attempt {self.attempt} {kind} rejected"))
        logger.error("attempt %d finished, but %s", self.attempt, message)
        self.result.error = message
        self._set_state(JobState.FAILED, kind)

    def stop(self, kind: FailureKind, message: str) -> None:
        """Fail a job that has not ended, from outside its group (another run took its checkpoint
        root over): the run loop ends and releases the group; the result says why (exit code 1)."""
        if self.state.is_terminal:
            return
        self.result.failures.append(Failure(self.attempt, kind, None, headline(message), message))
        self.result.events.append((time.time(), f"attempt {self.attempt} stopped"))
        logger.error("attempt %d stopped: %s", self.attempt, message)
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
        if hasattr(self.group, "rollbacks_before"):  # the guard's budget is per job, not per attempt
            self.group.rollbacks_before = sum(f.kind == "rollback" for f in self.result.failures)
        try:
            self.group.start()
        except GroupStartError as exc:
            self._note_replaced()
            self.ledger.start_marks(getattr(self.group, "start_marks", []), self._clock())
            if exc.mismatch is not None:
                self._on_failure(Failure(self.attempt, "mismatch", None, headline(exc.mismatch), str(exc)))
            else:
                self._on_failure(Failure(self.attempt, "start", None, headline(str(exc)), str(exc)))
            return
        self._note_replaced()
        self._last_step, self._last_advance = -1, self._clock()
        self._rollbacks_noted = 0
        if self.preemption is not None:
            self.preemption.new_attempt()
        self.ledger.start_marks(getattr(self.group, "start_marks", []), self._last_advance)
        if getattr(self.group, "nodes", None):
            self.result.events.append((time.time(), f"attempt {self.attempt} placed on {','.join(self.group.nodes)}"))
        self.hangs.attempt_started()
        self.stragglers.restart()
        self._swap = None
        self.result.events.append((time.time(), f"attempt {self.attempt} running"))
        self._set_state(JobState.RUNNING, f"{self.spec.world_size} workers started")

    def _note_replaced(self) -> None:
        """Into the result's events: the checkpoint writers or actor the start replaced for not
        answering (a stopped process; the previous failure may have been theirs, not the ranks')."""
        for note in getattr(self.group, "replaced", []):
            self.result.events.append((time.time(), f"attempt {self.attempt}: {note}"))

    def _watch_group(self) -> None:
        assert self.group is not None
        poll = self.last_poll = self.group.poll()
        self.ledger.progress(poll.min_step, self._clock(), poll.stall_s, poll.eval_s)
        self._note_rollbacks(poll.rollbacks)
        for line in self.stragglers.observe(poll.starts):
            logger.warning("attempt %d: %s", self.attempt, line)
            self.result.stragglers.append(f"attempt {self.attempt}: {line}")
        self._maybe_swap_straggler()
        preempted = self.preemption.watch(self.group, poll, self.attempt) if self.preemption is not None else None
        if preempted is not None:
            self._on_preemption(preempted)
        elif poll.failures:
            first = poll.failures[0]
            if poll.evidence is not None:
                self.result.diagnostics.append(poll.evidence)
            self._on_failure(Failure(self.attempt, first.kind, first.rank, first.headline, first.detail or str(first),
                                     tuple(poll.failures[1:]), poll.evidence))
        elif poll.finished and self._swap is not None and min(r.steps for r in poll.results) < self.spec.training.steps:
            self._on_straggler_stopped(poll)
        elif poll.finished:
            self.ledger.finished(self._clock())
            self.result.results = poll.results
            self._note_rollbacks(poll.results[0].rollbacks if poll.results else ())
            self._set_state(JobState.SUCCEEDED, f"{poll.min_step} steps done")
        elif self._replaced_silent(poll, hung := self._hung(poll)):
            self._last_advance = self._clock()  # its ranks waited on it: the step budget starts again
        elif hung:
            self._on_failure(self._hang_failure(poll))
        else:
            self.group.wait(self.spec.fault_tolerance.poll_interval_s)

    def _note_rollbacks(self, rollbacks: tuple[RollbackRecord, ...]) -> None:
        """The training guard's rollbacks are failures the job recovered from: each is recorded
        once, as soon as a poll sees it (an attempt that crashes later keeps them)."""
        for rb in rollbacks[self._rollbacks_noted:]:
            self.result.failures.append(Failure(self.attempt, "rollback", rb.trip.rank, str(rb), str(rb)))
            self.result.events.append((time.time(), f"attempt {self.attempt} rollback to step {rb.to_step}"))
        self._rollbacks_noted = max(self._rollbacks_noted, len(rollbacks))

    def _replaced_silent(self, poll: GroupPoll, hung: bool) -> bool:
        """A checkpoint writer or the actor silent past its budget (``control/watch/silence.py``) is replaced while
        the group trains on; returns whether one was. The silence is in ``status`` meanwhile.
        ``hung``: the ranks are past their hang timeout; one silent past ``NOTICE_S`` is then what
        they wait on (a save), replaced instead of blaming them."""
        look = getattr(self.group, "checkpointing_silences", None)
        silences = look() if look is not None else {}
        saving = "saving" in poll.phases.values()
        in_flight = None
        if any(v > NOTICE_S for v in silences.values()) and hasattr(self.group, "save_in_flight"):
            in_flight = self.group.save_in_flight()  # type: ignore[union-attr]
        self._stuck = stuck_line(poll.min_step, saving, silences, in_flight=in_flight)
        ck = self.spec.checkpoint
        budget = silence_budget_s(self.hangs.fixed, self.hangs.learned_s(), FLOOR_S,
                                  ck.commit_timeout_s if ck.enabled else None)
        budget = min(budget, NOTICE_S) if hung else budget
        late = overdue(silences, budget)
        if not late or self._silent_replaced >= MAX_REPLACEMENTS:
            return False
        why = "its ranks are past their hang timeout" if hung else "the hang timeout of a step"
        text = (f"{stuck_line(poll.min_step, saving, {w: silences[w] for w in late}, budget, in_flight)}: "
                f"silent for longer than "
                f"{budget:.0f}s ({why}); replaced, training continues")
        stalled = {w: budget for w in late if STALLED in w}
        replaced = self.group.replace_silent_checkpointing(stalled)  # type: ignore[union-attr]
        if not replaced:  # it answered the confirming ping: a pause, not a hang
            logger.warning("attempt %d: %s answered again; not replaced", self.attempt, ", ".join(late))
            return False
        self._silent_replaced += 1
        self.result.failures.append(Failure(self.attempt, "writer_hang", None, headline(text),
                                            "\n".join([text, *replaced])))
        self.result.events.append((time.time(), f"attempt {self.attempt} writer_hang detected"))
        self.result.events += [(time.time(), f"attempt {self.attempt}: {note}") for note in replaced]
        logger.error("attempt %d writer_hang (%d/%d, max_restarts not spent): %s", self.attempt,
                     self._silent_replaced, MAX_REPLACEMENTS, text)
        self._last_hang, self._stuck = text, None
        return True

    def _maybe_swap_straggler(self) -> None:
        """``fault_tolerance.replace_stragglers``: once a rank is reported, every rank saves and
        commits the step in hand and stops (as for a drain); the restart then gives that rank a
        spare or a new process. Each rank once per job (the watch reports a rank once)."""
        ft, group = self.spec.fault_tolerance, self.group
        if not ft.replace_stragglers or not self.spec.checkpoint.enabled or self._swap is not None:
            return
        ranks = sorted(set(self.stragglers.reported) - self._swapped)
        if not ranks or not hasattr(group, "preempt"):
            return
        self._swap = ranks[0]
        self._swapped.add(ranks[0])
        logger.warning("attempt %d: replacing straggler rank %d (fault_tolerance.replace_stragglers): saving the step "
                       "in hand, then restarting with a new process for it", self.attempt, ranks[0])
        group.preempt(None)  # type: ignore[union-attr]

    def _on_straggler_stopped(self, poll: GroupPoll) -> None:
        """The group stopped at a committed step for a straggler's replacement: restart without it."""
        rank = self._swap
        assert rank is not None
        step = min(r.steps for r in poll.results)
        text = (f"rank {rank} replaced at committed step {step} (fault_tolerance.replace_stragglers): "
                f"{self.stragglers.reported[rank]}")
        self.result.failures.append(Failure(self.attempt, "straggler", rank, headline(text), text))
        self.result.events.append((time.time(), f"attempt {self.attempt} straggler rank {rank} replaced"))
        retire = getattr(self.group, "retire", None)
        if retire is not None:
            retire(rank)
        self._last_failure = "straggler"
        self._set_state(JobState.RECOVERING, f"straggler rank {rank} at step {step}; restarts not spent")

    def _hung(self, poll: GroupPoll) -> bool:
        now = self._clock()
        if poll.min_step != self._last_step:
            self._last_step, self._last_advance = poll.min_step, now
            self.hangs.observe(poll.min_step, now, poll.step_s)
            learned = self.hangs.learned_s()
            if learned is not None and not self.hangs.announced:
                self.hangs.announced = True
                self.hangs.budget(poll.min_step + 1)
                logger.info("hang timeout auto: %.0f s (%s)", learned, self.hangs.why)
            return False
        budget, _ = self.hangs.budget(poll.min_step + 1, poll.phases)
        return now - self._last_advance > budget

    def _hang_failure(self, poll: GroupPoll) -> Failure:
        """The hang, with every rank's stacks read and the culprit named before anything is killed."""
        budget, why = self.hangs.current_s, self.hangs.why
        diagnose = getattr(self.group, "diagnose", None)
        try:
            verdict = diagnose() if diagnose is not None else Verdict((), "no single rank can be blamed: "
                                                                          "this group cannot read stacks")
        except Exception as exc:  # noqa: BLE001 - the evidence is best effort: the hang is still handled
            verdict = Verdict((), f"no single rank can be blamed: the evidence could not be read ({exc})")
        setting = "auto" if self.hangs.fixed is None else f"{budget:g}"
        timeout = (f"no step finished for {budget:.0f}s (fault_tolerance.hang_timeout_s={setting}: {why}); "
                   f"slowest rank at step {poll.min_step}")
        where = f"stuck in {verdict.where()}: " if verdict.where() else ""
        text = f"{where}{verdict.reason}; {timeout}"
        if verdict.folder is not None:
            self.result.diagnostics.append(verdict.folder)
            text += f"; every rank's stacks in {verdict.folder}"
        frames = "".join(f"\n  rank {r}: " + "\n    ".join(f[:12]) for r, f in verdict.frames.items() if f)
        self._last_hang = f"rank {verdict.rank}: {text}" if verdict.rank is not None else text
        return Failure(self.attempt, "hang", verdict.rank, text, text + (f"\nstacks:{frames}" if frames else ""))

    def _on_failure(self, failure: Failure) -> None:
        ft, kind = self.spec.fault_tolerance, failure.kind
        now = self._clock()
        self.ledger.failed(kind, now)
        note = getattr(self.group, "note_failure", None)
        quarantined = note(failure) if note is not None else None
        if quarantined is not None:
            self.result.quarantined.append(quarantined)
            self.result.events.append((time.time(), quarantined))
        self._failure_times.append(now)
        recent = None
        if ft.failure_window_s is not None:
            recent = sum(1 for t in self._failure_times if now - t <= ft.failure_window_s)
        facts = FailureFacts(kind, self.restarts, ft.max_restarts, recent)
        self._last_failure = kind
        self.result.failures.append(failure)
        decision = self._policy.decide(facts)
        self.result.events.append((time.time(), f"attempt {self.attempt} {kind} detected"))
        if kind == "mismatch":  # a user's mistake: its message, without the ranks' tracebacks
            logger.error("attempt %d: the resume checkpoint does not fit this job: %s", self.attempt, failure.headline)
        else:
            logger.error("attempt %d %s failure:\n%s", self.attempt, kind, failure.log_text())
        self.result.error = failure.full_text()
        if decision is Decision.RESTART:
            self.restarts += 1
            self._set_state(JobState.RECOVERING, f"{kind}; restart {self.restarts}/{facts.max_restarts}")
        else:
            self._set_state(JobState.FAILED, f"{kind}; {self.restarts}/{facts.max_restarts} restarts used"
                            + (f", {recent} failures within {ft.failure_window_s:g}s" if recent is not None else ""))

    def _on_preemption(self, failure: Failure) -> None:
        """A drained node stopped the group: restart off it, on the preemption budget, not max_restarts'."""
        assert self.preemption is not None
        if self.preemption.outcome == "grow":  # capacity came back: the step is saved, restart at full size
            self.result.events.append((time.time(), f"attempt {self.attempt} grow"))
            self._last_failure = None
            self._set_state(JobState.RECOVERING, failure.headline)
            return
        if self.preemption.outcome == "stop":  # the driver was told to stop: the step is saved, stop
            self._on_stop(failure)
            return
        limit = self.spec.fault_tolerance.max_preemptions
        self.preemptions += 1
        self._last_failure = "preemption"
        self.result.failures.append(failure)
        self.result.preemptions.append(self.preemption.records[-1].to_dict())
        self.result.events.append((time.time(), f"attempt {self.attempt} preemption detected"))
        if limit is not None and self.preemptions > limit:
            self.result.error = failure.detail
            self._set_state(JobState.FAILED, f"preemption; {self.preemptions - 1}/{limit} preemptions survived "
                                             "(fault_tolerance.max_preemptions)")
            return
        self._set_state(JobState.RECOVERING, f"preemption {self.preemptions}"
                                             + (f"/{limit}" if limit is not None else "") + "; restarts not spent")

    def _on_stop(self, stop: Failure) -> None:
        """A signal to the driver ended the job on purpose once the step in hand was saved: STOPPED,
        not a failure (no budget spent, no error); ``result.stopped`` names the step that is safe."""
        assert self.preemption is not None and self.preemption.stop_request is not None
        self.result.stopped, self.result.stopped_by = stop.headline, self.preemption.stop_request[0]
        self.result.events.append((time.time(), f"attempt {self.attempt} stopped by {self.result.stopped_by}"))
        self._set_state(JobState.STOPPED, stop.headline)

    def _release_group(self, keep_warm: bool = False) -> None:
        if self.group is not None:
            self.group.shutdown(keep_warm=keep_warm)
            self.group = None

