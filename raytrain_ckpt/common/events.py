"""What the training ranks tell the controller: progress, results and failures, as plain data.

These records cross from the TrainWorker actors (``rank/worker.py``) through the worker group
(``control/group.py``) to the controller and the metrics; keeping them here, free of torch and Ray,
lets the controller and its tests import them without either.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["printable", "Failure", "FailureKind", "NodeProgress", "Progress", "RankPlace", "RollbackRecord", "Trip", "WorkerResult", "cause_text",
           "headline"]

FailureKind = Literal["start", "crash", "exception", "hang", "checkpoint", "mismatch", "preemption", "rollback",
                      "writer_hang", "straggler"]
"""start: the group could not be placed or formed; crash: a rank's process (or its node) died;
exception: a rank raised; hang: no rank finished a step within ``fault_tolerance.hang_timeout_s``
(the same names as ``fault_tolerance.retry_on``). checkpoint: the workers finished but the final
save did not commit; mismatch: the resume checkpoint does not fit the job's model (a user's
mistake, the same on every attempt: never retried). preemption: a node the group used was drained
(a drain notice): the step in hand was saved and the group stopped; counted against
``fault_tolerance.max_preemptions``, never against ``max_restarts``. rollback: the training guard
rolled back to a certified step (the job went on), or a trip it could not roll back ended the job
(never retried). writer_hang: a checkpoint writer or the CheckpointActor stopped answering while
the group trained (``control/watch/silence.py``): it was replaced and training went on. straggler: a rank
reported as a straggler was replaced (``fault_tolerance.replace_stragglers``) after the step in
hand committed. Neither spends ``max_restarts``."""


@dataclass(frozen=True)
class Trip:
    """What tripped the training guard (``rank/guard.py``): the step (0-based: the step that started
    after ``step`` steps), the rank, the metric."""

    step: int
    rank: int
    metric: str

    def __str__(self) -> str:
        return f"{self.metric} on rank {self.rank} at step {self.step + 1}"


@dataclass(frozen=True)
class RollbackRecord:
    """One rollback of the training guard: the trip, the certified step it returned to, the samples it skipped."""

    trip: Trip
    to_step: int
    samples: tuple[int, int]
    """The skipped global sample indices ``[lo, hi)``."""

    def __str__(self) -> str:
        return (f"{self.trip}: rolled back to certified step {self.to_step}, skipped samples "
                f"[{self.samples[0]}, {self.samples[1]})")


@dataclass(frozen=True)
class Progress:
    """A worker's last known state, read by the driver's poll."""

    rank: int
    step: int
    loss: float | None
    last_step_at: float  # time.time() of the last finished step (or of setup)
    phase: str  # "setup" | "training" | "saving" | "done" | "failed"
    stall_s: float = 0.0
    """Seconds this attempt's training waited on saves (the goodput ledger's checkpoint stall)."""
    eval_s: float = 0.0
    """Seconds this attempt spent in evaluation steps."""
    step_started_at: float = 0.0
    """time.time() when this rank began ``step`` (a rank that begins its steps late is a straggler)."""
    rollbacks: tuple[RollbackRecord, ...] = ()
    """The training guard's rollbacks in this attempt so far, in order: the controller records each one as it sees it, not only when the attempt finishes."""
    evicted_until: float | None = None
    """This rank's process got SIGTERM (a pod eviction): the deadline (time.time()) it stops by."""
    step_s: float | None = None
    """How long this rank's latest step took, measured by the rank (None: the attempt's first step,
    a warm-up, or none yet): the hang timeout learns the pace from it, whatever the poll's cadence."""


@dataclass(frozen=True)
class NodeProgress:
    """One node's answer to the poll (``rank/progress.read_node``): the progress its ranks' files
    show, and the ranks the driver asks themselves."""

    progress: dict[int, Progress]
    ask: list[int]


@dataclass(frozen=True)
class RankPlace:
    """Where a rank's process runs: read at the start of an attempt, to read its stacks on a hang."""

    pid: int
    node_id: str


@dataclass(frozen=True)
class WorkerResult:
    """What ``TrainWorker.run()`` returns when the rank finishes every step."""

    rank: int
    steps: int
    tokens_seen: int
    losses: dict[int, float]
    fingerprint: str
    start_step: int = 0
    """The step this attempt resumed from (0: a fresh start)."""
    checkpoint: dict[str, float] | None = None
    """Saves, skipped, aborted, stall_s of this rank (None when checkpointing is off)."""
    timings: dict[str, float] | None = None
    """This attempt's setup: pg_init_s, build_s, load_s, and first_step_at (time.time())."""
    served: tuple[int, ...] = ()
    """Every attempt this process was assigned, in order: (0, 1) is a rank kept across a restart."""
    was_spare: bool = False
    """The process started as an idle spare before it took this rank."""
    rollbacks: tuple[Any, ...] = ()
    """The training guard's rollbacks in this attempt (``guard.RollbackRecord``), in order."""
    evicted_until: float | None = None
    """This rank's process got SIGTERM (a pod eviction) and stopped for it: the deadline it had."""
    replicas: dict[str, Any] | None = None
    """With replica groups (``rank/replicas.py``): ``skipped``, the (step, group) of every committed
    step that did not train a group's share (its samples skipped, the membership rule); ``redone``,
    steps redone because their quorum lost a group or was not the rule's; ``waited_s``, seconds
    waited at rejoin steps for a replacement group; ``healed_at``, the step this rank's group was
    healed at from a live group (None: it was not a replacement); ``skipped_samples``, for each
    skipped (step, group) the global sample indices its share held (step, group, first, end)."""


@dataclass(frozen=True)
class Failure:
    """One failure of a worker group, as the controller saw it."""

    attempt: int
    kind: FailureKind
    rank: int | None
    """The rank that failed first (None: the whole group, e.g. a start or a hang)."""
    headline: str
    """The line that says what happened (an exception's type and message)."""
    detail: str = ""
    """The full text of this failure (the failed rank's traceback), for the log and ``JobResult.error``."""
    after: tuple[Failure, ...] = ()
    """The other ranks' failures seen with it (a rank that crashed leaves the others' collectives
    failing: gloo's "Connection reset by peer"): in ``JobResult.error`` and the diagnostics, one
    line each in the log."""
    evidence: str | None = None
    """The file that keeps every failed rank's full text (``<job root>/diagnostics/attempt-<N>/failure.txt``)."""

    def __str__(self) -> str:
        who = f"rank {self.rank}: " if self.rank is not None else ""
        return f"attempt {self.attempt} {self.kind}: {who}{self.headline}"

    def full_text(self) -> str:
        """This failure's text and every other rank's after it: the failure record."""
        return "\n".join([self.detail or self.headline, *(f.detail or str(f) for f in self.after)])

    def log_text(self) -> str:
        """What the log shows: this failure's text, then one line per other rank and where their
        full text is (one headline per failure)."""
        lines = [self.detail or self.headline]
        if self.after:
            where = self.evidence or "JobResult.error"
            lines.append(f"{len(self.after)} other rank(s) failed after it (full text: {where}):")
            lines += [f"  rank {f.rank} {f.kind}: {f.headline}" for f in self.after]
        return "\n".join(lines)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def headline(text: str) -> str:
    """The line of an error message that says what happened.

    A traceback's last line names the exception, so a text with a traceback (Python's, or the
    one Ray prints for a remote task) gives its first line (who failed) and its last; any
    other text gives its first line. Terminal colour codes (Ray colours the task's name) are
    dropped: the line goes into logs, ``--json`` and metrics.
    """
    lines = [ln.strip() for ln in _ANSI.sub("", text).strip().splitlines() if ln.strip()]
    if not lines:
        return "(no message)"
    if not any(ln.startswith(("Traceback (most recent call last)", 'File "')) for ln in lines):
        return lines[0]
    first = "" if lines[0].startswith("Traceback") else lines[0] + " "
    return first + lines[-1]


def cause_text(exc: BaseException) -> str:
    """One line for an error: its headline, and for one raised by another Ray process (Ray's
    ``RayTaskError``, whose first line is its wrapper ``ray::CheckpointWriter.accept() (pid=...,
    repr=...)``) the cause's type and message instead (``PermissionError: [Errno 13] ...``)."""
    wrapped = False
    for _ in range(8):  # a task's error raised again by the task that waited on it nests
        cause = getattr(exc, "cause", None)
        if not (type(exc).__name__.startswith("RayTaskError") and isinstance(cause, BaseException)):
            break
        exc, wrapped = cause, True
    return f"{type(exc).__name__}: {headline(str(exc))}" if wrapped else headline(str(exc))


def printable(line: str) -> str:
    """``line`` with control and separator characters (a NUL, an escape sequence, a newline, U+2028)
    escaped: text that came from a file or a peer stays one visible line on a terminal."""
    if line.isprintable():
        return line
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in line)
