"""The goodput ledger: every second of a job's wall time, accounted to one cause.

The controller moves one clock hand through the job: each stretch of time from the last mark to
now goes to exactly one cause, so the causes add up to the wall time by construction.

- placement, rendezvous, load: a group's start (reserving bundles and asking for the processes;
  the processes starting and joining the process group; building the model and loading the resume
  point), from the group's own marks; a start that fails is placement up to its last mark.
- first step: from the group running until the slowest rank's first step of the attempt.
- training: the slowest rank's steps, less the parts below.
- redone: steps that an earlier attempt had already finished (lost to a restart).
- degraded: with replica groups, the share of training time the groups out under the heal rule
  did not train (a stretch trained while k of R groups were out: k/R of it; the rest is training).
- checkpoint stall: the time a rank spent waiting on a save (the largest of the ranks'), and
  after the last step the wait for the final commit.
- eval: evaluation steps (the largest of the ranks').
- detection: from the last step before a failure until the failure was seen (for a hang, the
  hang timeout), including reading every rank's stacks.
- teardown: releasing a failed group. waiting: the restart back-off.

The controller sees progress once per poll (``fault_tolerance.poll_interval_s``), so a stretch is
split at that resolution. Goodput is training / wall time. Pure: no Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raytrain_ckpt.control.poll import GroupPoll, WorkerGroup
    from raytrain_ckpt.control.watch import Verdict

__all__ = ["CAUSES", "GoodputLedger"]

CAUSES = ("training", "checkpoint_stall", "eval", "redone", "degraded", "first_step", "placement", "rendezvous", "load",
          "detection", "teardown", "waiting")


_NAMES = {"degraded": "with fewer replica groups"}


@dataclass
class AttemptTimeline:
    """One attempt's phases, in seconds, in the order they began."""

    attempt: int
    phases: dict[str, float] = field(default_factory=dict)
    ended_by: str | None = None
    """The failure kind that ended it (None: it finished, or runs)."""


class GoodputLedger:
    """Accounts wall time to causes as the controller reports what happened. A ``Watch`` too (the
    first one): each poll's progress (``observe``), never a verdict; ``clock``: the controller's."""

    def __init__(self, now: float, clock: Callable[[], float] | None = None, replicas: int = 1,
                 group_size: int = 1) -> None:
        self._clock = clock
        self._replicas, self._group_size = replicas, group_size
        self._out = 0
        """Replica groups out (replaced or healing) as of the latest poll."""
        self.started_at = now
        self._mark = now
        self.seconds: dict[str, float] = dict.fromkeys(CAUSES, 0.0)
        self.timelines: list[AttemptTimeline] = []
        self._high = -1
        """The highest step any attempt finished: steps up to it are redone work."""
        self._base: int | None = None
        """The slowest rank's step at the last mark of this attempt (None: no poll yet)."""
        self._first_done = False
        self._busy = (0.0, 0.0)
        """The (checkpoint stall, eval) seconds the ranks reported at the last mark."""
        self.failures = 0

    def _add(self, cause: str, now: float) -> None:
        dt = max(0.0, now - self._mark)
        self._mark = max(self._mark, now)
        self._book(cause, dt)

    def _book(self, cause: str, dt: float) -> None:
        self.seconds[cause] += dt
        if self.timelines and dt > 0:
            phases = self.timelines[-1].phases
            phases[cause] = phases.get(cause, 0.0) + dt

    def new_attempt(self) -> None:
        pass  # the controller marks the attempt with its number and time (``attempt``)

    def observe(self, poll: GroupPoll, group: WorkerGroup, attempt: int) -> Verdict | None:
        """The poll's progress (``progress``) at the clock's time; nothing for the controller to do."""
        assert self._clock is not None, "a ledger that observes polls needs the controller's clock"
        self._out = len({r // self._group_size for r in getattr(group, "healing", ())})
        self.progress(poll.min_step, self._clock(), poll.stall_s, poll.eval_s)
        return None

    def status(self) -> dict[str, Any]:
        """The ``Watch``'s part of the summary: goodput so far."""
        return {"goodput": round(self.goodput, 4)}

    def attempt(self, attempt: int, now: float) -> None:
        """An attempt begins its start (time before it: waiting)."""
        self._add("waiting", now)
        self.timelines.append(AttemptTimeline(attempt))
        self._base, self._first_done, self._busy = None, False, (0.0, 0.0)

    def start_marks(self, marks: list[tuple[str, float]], now: float) -> None:
        """The start ended at ``now`` (running or failed); ``marks``: (phase, when it ended) in order."""
        for cause, until in marks:
            self._add(cause, min(until, now))
        if now > self._mark:
            self._add(marks[-1][0] if marks else "placement", now)

    def progress(self, step: int, now: float, stall_s: float = 0.0, eval_s: float = 0.0) -> None:
        """A poll saw the slowest rank at ``step``; ``stall_s``, ``eval_s``: the ranks' totals this attempt."""
        if self._base is None:
            self._base, self._busy = step, (stall_s, eval_s)
            return
        if step <= self._base:
            return
        dt = max(0.0, now - self._mark)
        self._mark = max(self._mark, now)
        if not self._first_done:
            self._first_done = True
            self._book("first_step", dt)
        else:
            stall = min(dt, max(0.0, stall_s - self._busy[0]))
            ev = min(dt - stall, max(0.0, eval_s - self._busy[1]))
            rest = dt - stall - ev
            n = step - self._base
            redone = rest * max(0, min(step, self._high) - self._base) / n
            self._book("checkpoint_stall", stall)
            self._book("eval", ev)
            degraded = (rest - redone) * min(self._out, self._replicas) / self._replicas
            self._book("redone", redone)
            self._book("degraded", degraded)
            self._book("training", rest - redone - degraded)
        self._busy = (stall_s, eval_s)
        self._base = step
        self._high = max(self._high, step)

    def failed(self, kind: str, now: float) -> None:
        """A failure was seen (and its evidence read) at ``now``."""
        self.failures += 1
        self._add("detection", now)
        if self.timelines:
            self.timelines[-1].ended_by = kind

    def replaced(self) -> None:
        """A failure ended one replica group only: the others train on (its cost: ``degraded``)."""
        self.failures += 1

    def torn_down(self, now: float) -> None:
        self._add("teardown", now)

    def finished(self, now: float) -> None:
        """Every rank is done: the time since the last step was the final commit."""
        self._add("checkpoint_stall", now)

    def close(self, now: float) -> None:
        """The job ends: time not yet accounted (a release after the end) is teardown."""
        self._add("teardown", now)

    @property
    def wall_s(self) -> float:
        return self._mark - self.started_at

    @property
    def goodput(self) -> float:
        return self.seconds["training"] / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"goodput": round(self.goodput, 4), "wall_s": round(self.wall_s, 3),
                "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
                "attempts": [{"attempt": t.attempt, "ended_by": t.ended_by,
                              "phases": {k: round(v, 3) for k, v in t.phases.items()}} for t in self.timelines]}

    def end_line(self) -> str:
        """'goodput 93.1% of 60.2 s; 4.1 s lost to 1 failure(s): 1.0 s redone, ...; 3.0 s checkpoint stall'."""
        return self.line_of(self.to_dict(), self.failures)

    @staticmethod
    def line_of(ledger: dict[str, Any], failures: int) -> str:
        """The end line of a ledger in its ``to_dict`` form (``JobResult.goodput``)."""
        s = ledger["seconds"]
        lost = [(k, s[k]) for k in ("redone", "degraded", "detection", "teardown", "waiting", "placement",
                                     "rendezvous", "load", "first_step") if s.get(k, 0.0) >= 0.05]
        other = [(k, s[k]) for k in ("checkpoint_stall", "eval") if s[k] >= 0.05]
        line = f"goodput {100 * ledger['goodput']:.1f}% of {ledger['wall_s']:.1f} s"
        if failures:
            restart = sum(v for k, v in lost if k in ("redone", "degraded", "detection", "teardown", "waiting"))
            line += f"; {restart:.1f} s lost to {failures} failure(s)"
        if lost or other:
            line += ": " + ", ".join(f"{v:.1f} s {_NAMES.get(k, k.replace('_', ' '))}" for k, v in lost + other)
        return line

    def timeline_lines(self) -> list[str]:
        """One line per attempt: its phases and durations."""
        return [f"attempt {t.attempt}: " + ", ".join(f"{k.replace('_', ' ')} {v:.2f} s" for k, v in t.phases.items())
                + (f" (ended by a {t.ended_by})" if t.ended_by else "") for t in self.timelines]
