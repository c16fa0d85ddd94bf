"""Windows of global sample indices a job skips, and where each step's samples start then.

Without skips step ``s`` reads samples ``[s * gbs, (s + 1) * gbs)``. A rollback from a trip at
step ``t`` to step ``c`` skips the window ``[first(c), first(t) + gbs)``: every sample the
rolled-back steps and the tripped step read. From step ``c`` on, the job reads on past the window,
so the steps after ``c`` read ``first(t) + gbs + (s - c) * gbs``. Several windows add up: a
window recorded at step ``c`` shifts every step ``>= c`` by its length.

The windows are recorded in every manifest after them (``Manifest.skipped_samples``), so a
resume from any later step keeps skipping them; a run given the same windows from its start
reads exactly the same samples (what the guard's tests compare against).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["SampleSkips", "SkipWindow"]


@dataclass(frozen=True)
class SkipWindow:
    """From step ``step`` on, the samples ``[lo, hi)`` are never read."""

    step: int
    lo: int
    hi: int

    def as_list(self) -> list[int]:
        """``[step, lo, hi]``, as a manifest records it."""
        return [self.step, self.lo, self.hi]


class SampleSkips:
    """The windows of one job; maps a step to the global index of its first sample."""

    def __init__(self, global_batch_size: int, windows: Iterable[SkipWindow] = ()) -> None:
        self.global_batch_size = global_batch_size
        self.windows: list[SkipWindow] = sorted(windows, key=lambda w: (w.step, w.lo))

    @classmethod
    def from_lists(cls, global_batch_size: int, rows: Iterable[Iterable[int]]) -> SampleSkips:
        """From a manifest's ``skipped_samples`` (``[[step, lo, hi], ...]``)."""
        return cls(global_batch_size, (SkipWindow(*map(int, row)) for row in rows))

    def offset(self, step: int) -> int:
        """Samples skipped before ``step`` starts: its first sample is ``step * gbs + offset(step)``."""
        return sum(w.hi - w.lo for w in self.windows if w.step <= step)

    def first_sample(self, step: int) -> int:
        """The global index of the first sample step ``step`` reads."""
        return step * self.global_batch_size + self.offset(step)

    def skip(self, to_step: int, tripped_step: int) -> SkipWindow:
        """Record the rollback from a trip at ``tripped_step`` to ``to_step``: the window of every
        sample the steps ``to_step .. tripped_step`` read. Returns it."""
        if not 0 <= to_step <= tripped_step:
            raise ValueError(f"a rollback goes back: to step {to_step} from step {tripped_step}")
        window = SkipWindow(to_step, self.first_sample(to_step), self.first_sample(tripped_step) + self.global_batch_size)
        self.windows = sorted([*self.windows, window], key=lambda w: (w.step, w.lo))
        return window

    def as_lists(self) -> list[list[int]]:
        return [w.as_list() for w in self.windows]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SampleSkips) and (self.global_batch_size, self.windows) == (
            other.global_batch_size, other.windows)

    def __repr__(self) -> str:
        return f"SampleSkips({self.as_lists()})"
