"""Stragglers: a rank that begins its steps persistently later than its peers.

In synchronous data-parallel training every rank waits in the step's first collective for the
last one to arrive, so a slow rank (a slow core, data loading, a noisy neighbour) shows as the
rank that begins each step late, while every rank's step ends at about the same time. Each rank
reports when it began its latest step (``Progress.step_started_at``); at each poll where every
rank reports the same step, a rank's lateness is its start minus the earliest start. A rank whose
median lateness over the last ``WINDOW`` such steps exceeds ``fault_tolerance.straggler_margin`` x
the median step time (and ``MIN_LATE_S``) is reported, once. The skew (the largest lateness of the
latest step) is a metric. Pure: no Ray, no torch.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from statistics import median
from typing import TYPE_CHECKING, Any

from raytrain_ckpt.common.events import Failure, headline
from raytrain_ckpt.control.watch import Act, Verdict

if TYPE_CHECKING:
    from raytrain_ckpt.control.poll import GroupPoll, WorkerGroup

logger = logging.getLogger(__name__)

__all__ = ["MIN_LATE_S", "StragglerStop", "StragglerSwap", "StragglerWatch", "WINDOW"]

WINDOW = 8
MIN_LATE_S = 0.05
"""Lateness below this is noise (a log line, a scheduler tick), whatever the step time."""


class StragglerWatch:
    """Per-rank lateness at the start of a step, and the ranks it makes stragglers."""

    def __init__(self, margin: float | None) -> None:
        self.margin = margin
        self.late: dict[int, deque[float]] = {}
        self._steps: deque[float] = deque(maxlen=WINDOW * 4)
        self._last: tuple[int, float] | None = None
        self.skew_s = 0.0
        """The largest lateness of the latest step seen by every rank."""
        self.reported: dict[int, str] = {}
        """Rank -> the line that reported it."""

    def restart(self) -> None:
        """A new attempt: its ranks are new processes, measured afresh (reports stay)."""
        self.late.clear()
        self._last = None

    def observe(self, starts: Mapping[int, tuple[int, float]]) -> list[str]:
        """Each rank's (step, when it began it) at one poll; returns the lines of newly found stragglers."""
        steps = {s for s, _ in starts.values()}
        if self.margin is None or len(starts) < 2 or len(steps) != 1:
            return []
        step = steps.pop()
        earliest = min(t for _, t in starts.values())
        if earliest <= 0 or (self._last is not None and step <= self._last[0]):
            return []
        if self._last is not None:
            self._steps.append((earliest - self._last[1]) / (step - self._last[0]))
        self._last = (step, earliest)
        self.skew_s = max(t for _, t in starts.values()) - earliest
        for rank, (_, t) in starts.items():
            self.late.setdefault(rank, deque(maxlen=WINDOW)).append(t - earliest)
        if not self._steps:
            return []
        step_s = median(self._steps)
        found = []
        for rank, late in sorted(self.late.items()):
            if len(late) < WINDOW or rank in self.reported:
                continue
            lag = median(late)
            if lag > max(MIN_LATE_S, self.margin * step_s):
                line = (f"rank {rank} is a straggler: it begins its steps {lag:.2f} s after the first rank (median of "
                        f"the last {WINDOW} steps; a step takes {step_s:.2f} s; fault_tolerance.straggler_margin="
                        f"{self.margin:g})")
                self.reported[rank] = line
                found.append(line)
        return found


class StragglerSwap:
    """The controller's straggler watch (a ``Watch``), with ``fault_tolerance.replace_stragglers``:
    once a rank is reported, every rank saves and commits the step in hand and stops (as for a
    drain); the restart then gives that rank a spare or a new process. Each rank once per job
    (the watch reports a rank once)."""

    def __init__(self, spec: Any, watch: StragglerWatch, latest: Callable[[], int | None] | None = None) -> None:
        self._latest = latest
        """The newest committed step (the driver's checkpoint service), to say whether the stop's save committed."""
        self.on = spec.fault_tolerance.replace_stragglers and spec.checkpoint.enabled
        self.steps = spec.training.steps
        self.watch = watch
        self.rank: int | None = None
        """The straggler rank whose replacement the running attempt stops for."""
        self._swapped: set[int] = set()

    def new_attempt(self) -> None:
        self.watch.restart()
        self.rank = None

    def status(self) -> dict[str, Any]:
        return {"stragglers": sorted(self.watch.reported)}

    def observe(self, poll: GroupPoll, group: WorkerGroup, attempt: int) -> Verdict | None:
        """The stragglers this poll reports (one line each, logged), then ``maybe_swap``."""
        lines = [f"attempt {attempt}: {line}" for line in self.watch.observe(poll.starts)]
        for line in lines:
            logger.warning("%s", line)
        self.maybe_swap(group, attempt)
        return Verdict(stragglers=tuple(lines)) if lines else None

    def maybe_swap(self, group: WorkerGroup, attempt: int) -> None:
        """Stop the group at a committed step for the first straggler not yet replaced."""
        if not self.on or self.rank is not None:
            return
        ranks = sorted(set(self.watch.reported) - self._swapped)
        if not ranks:
            return
        self.rank = ranks[0]
        self._swapped.add(ranks[0])
        logger.warning("attempt %d: replacing straggler rank %d (fault_tolerance.replace_stragglers): saving the step "
                       "in hand, then restarting with a new process for it", attempt, ranks[0])
        group.preempt(None)

    def stopped(self, poll: GroupPoll) -> bool:
        """Whether the group finished short of the last step because it stopped for a replacement."""
        return poll.finished and self.rank is not None and min(r.steps for r in poll.results) < self.steps

    def failure(self, poll: GroupPoll, attempt: int) -> Failure:
        """The straggler's replacement, as the failure the restart is for."""
        assert self.rank is not None
        step = min(r.steps for r in poll.results)
        latest = self._latest() if self._latest is not None else None
        if latest == step:
            where = f"at committed step {step}"
        elif self._latest is None:
            where = f"after step {step}"
        else:  # its save did not commit: the restart resumes from the step before
            where = (f"after step {step}, whose save did not commit (resuming at "
                     f"{f'committed step {latest}' if latest is not None else 'the start'})")
        text = f"rank {self.rank} replaced {where} (fault_tolerance.replace_stragglers): {self.watch.reported[self.rank]}"
        return Failure(attempt, "straggler", self.rank, headline(text), text)


class StragglerStop:
    """The swap's second look (a ``Watch``), after the group's failures and drains: a group that
    stopped at a committed step for a straggler's replacement restarts without it, on no budget
    (a ``RESTART`` verdict)."""

    def __init__(self, swap: StragglerSwap) -> None:
        self.swap = swap

    def new_attempt(self) -> None:
        pass  # the swap hears of it

    def status(self) -> dict[str, Any]:
        return {}  # the swap's part

    def observe(self, poll: GroupPoll, group: WorkerGroup, attempt: int) -> Verdict | None:
        if not self.swap.stopped(poll):
            return None
        failure = self.swap.failure(poll, attempt)
        rank, step = failure.rank, min(r.steps for r in poll.results)
        return Verdict(Act.RESTART, failure, recorded=(failure,), retire=rank, cause="straggler",
                       events=(f"attempt {attempt} straggler rank {rank} replaced",),
                       reason=f"straggler rank {rank} at step {step}; restarts not spent")
