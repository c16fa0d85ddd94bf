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

from collections import deque
from collections.abc import Mapping
from statistics import median

__all__ = ["MIN_LATE_S", "StragglerWatch", "WINDOW"]

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
