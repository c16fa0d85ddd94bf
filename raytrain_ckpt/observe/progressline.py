"""The driver's progress line: ``step 120/1000 (12%) | 2410 tok/s | committed 100 | ETA 6m05s | attempt 0 RUNNING``.

On a terminal it is redrawn in place (``\\r``, at most every ``TTY_EVERY_S``); otherwise (a log
file, ``ray job logs -f`` of a submitted job) it is a plain log line every ``PLAIN_EVERY_S``
while the step moves. Tokens/s and the time to finish come from the slowest rank's step over
the last ``WINDOW_S``; the committed step from the job's bulletin (no call to the actor).
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from collections.abc import Callable
from typing import TextIO

logger = logging.getLogger(__name__)

__all__ = ["PLAIN_EVERY_S", "TTY_EVERY_S", "WINDOW_S", "ProgressLine", "progress_text"]

TTY_EVERY_S = 1.0
"""Redraw period on a terminal."""
PLAIN_EVERY_S = 30.0
"""Period of the plain progress line in a log (only while the step moves)."""
WINDOW_S = 60.0
"""The rate (tokens/s, time to finish) is the step's progress over this long."""


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def progress_text(step: int, total: int, tokens_per_s: float | None, committed: int | None,
                  eta_s: float | None, attempt: int, state: str) -> str:
    """The line itself (pure: tested with a table)."""
    rate = f"{tokens_per_s:.0f} tok/s" if tokens_per_s is not None else "- tok/s"
    eta = _duration(eta_s) if eta_s is not None else "-"
    done = f"committed {committed}" if committed is not None else "committed -"
    return (f"step {step}/{total} ({100 * step // max(total, 1)}%) | {rate} | {done} | ETA {eta} | "
            f"attempt {attempt} {state}")


class ProgressLine:
    """Feed it each controller poll (``update``); it decides when and how to show the line."""

    def __init__(self, total: int, tokens_per_step: int, committed: Callable[[], int | None],
                 stream: TextIO | None = None) -> None:
        self.total, self.tokens_per_step, self._committed = total, tokens_per_step, committed
        """``committed()``: the newest committed step, asked only when the line is shown."""
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._samples: deque[tuple[float, int]] = deque()
        self._shown_at = float("-inf")
        self._shown_step: int | None = None
        self._width = 0

    def update(self, step: int, attempt: int, state: str, now: float) -> None:
        if self._samples and step < self._samples[-1][1]:  # a restart went back: the rate starts again
            self._samples.clear()
        self._samples.append((now, step))
        while len(self._samples) > 2 and now - self._samples[0][0] > WINDOW_S:
            self._samples.popleft()
        every = TTY_EVERY_S if self.tty else PLAIN_EVERY_S
        if now - self._shown_at < every or (not self.tty and step == self._shown_step):
            return
        self._shown_at, self._shown_step = now, step
        text = self._text(step, self._committed(), attempt, state)
        if self.tty:
            # redrawn in place on the terminal: a log line per second would bury everything else. The
            # cursor goes back to the line's start (after clearing the rest of it), so a log line
            # printed next overwrites the progress line instead of being glued to its end.
            self.stream.write(f"\r{text}\x1b[K\r")
            self.stream.flush()
            self._width = len(text)
        else:
            logger.info("progress: %s", text)

    def _text(self, step: int, committed: int | None, attempt: int, state: str) -> str:
        (t0, s0), (t1, s1) = self._samples[0], self._samples[-1]
        steps_per_s = (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None
        tokens = steps_per_s * self.tokens_per_step if steps_per_s is not None else None
        eta = (self.total - step) / steps_per_s if steps_per_s else None
        return progress_text(step, self.total, tokens, committed, eta, attempt, state)

    def close(self) -> None:
        """Take the line off the terminal (what follows is printed where it was)."""
        if self.tty and self._width:
            self.stream.write("\x1b[K")  # the last frame cleared: the job's end report follows
            self.stream.flush()
