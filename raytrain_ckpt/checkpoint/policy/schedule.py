"""Whether a step is saved, and what a save does when the previous one is still being written:
pure decisions, table-tested (``tests/unit/test_save_schedule.py``).

Every answer to "is a save due" comes from here: the trainer's client before each save
(``SaveSchedule.due``), the driver's warning that a restart would have nothing to resume from
(``saves_before_last``) and the service's check that a finished job's final save committed
(``SaveSchedule.by_step`` of the last step). Every rank must save the same steps, so a decision
that depends on something a rank sees alone (its clock, its writer being busy) is taken from
a value the ranks agree on first; the functions here say when that agreement (a collective) is
needed at all, so the trainer asks for it only then.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["BusyChoice", "OnBusy", "SaveSchedule", "on_busy_choice", "saves_before_last"]

OnBusy = Literal["wait", "skip"]
"""``checkpoint.on_busy``: what a save does while the previous one is still being written."""
BusyChoice = Literal["save", "skip"]


@dataclass(frozen=True)
class SaveSchedule:
    """When a step is saved.

    ``interval_steps`` decides for every step, the last one included, counted from ``anchor``
    (0 for a fixed interval; with ``interval_steps: auto`` the step where the policy last chose
    one); ``save_final`` only adds a save of the last step; the time trigger (``clock_due``:
    ``interval_seconds`` passed on some rank) adds a save of any step.
    """

    total_steps: int
    interval_steps: int | None
    save_final: bool
    anchor: int = 0

    @classmethod
    def configured(cls, total_steps: int, interval_steps: int | Literal["auto"] | None,
                   save_final: bool) -> SaveSchedule:
        """The schedule a config sets before anything is measured: ``auto`` has no fixed interval
        (only ``save_final`` is certain) until the interval policy chooses one."""
        return cls(total_steps, None if interval_steps == "auto" else interval_steps, save_final)

    def on_interval(self, step: int) -> bool:
        """The interval falls on ``step``."""
        n = self.interval_steps
        return n is not None and step > self.anchor and (step - self.anchor) % n == 0

    def by_step(self, step: int) -> bool:
        """Due whatever the clock says (the same answer on every rank, no collective)."""
        return self.on_interval(step) or (self.save_final and step == self.total_steps)

    def asks_clock(self, step: int, interval_seconds: float | None) -> bool:
        """Whether the time trigger can change the answer at ``step``: only then do the ranks
        agree on their clocks (clocks differ per rank, and one rank must not save a step the
        others skip)."""
        return interval_seconds is not None and not self.by_step(step)

    def due(self, step: int, clock_due: bool = False) -> bool:
        return self.by_step(step) or clock_due


def saves_before_last(total_steps: int, interval_steps: int | Literal["auto"] | None,
                      interval_seconds: float | None) -> bool:
    """Whether a save can fall before the last step (so a restart has something newer than where
    the run began): by the clock, by an interval shorter than the run, or by ``auto`` (which
    may choose any interval)."""
    if interval_seconds is not None or interval_steps == "auto":
        return True
    return interval_steps is not None and interval_steps < total_steps


def on_busy_choice(on_busy: OnBusy, final: bool, busy_somewhere: Callable[[], bool]) -> BusyChoice:
    """What a save does while the previous save may still be writing.

    ``skip`` skips it when the previous save is still writing on some rank; ``wait`` (and the
    final save, which is never skipped) saves after waiting for it. ``busy_somewhere`` (a
    collective: every rank must skip the same steps) is asked only when its answer decides.
    """
    if on_busy == "skip" and not final and busy_somewhere():
        return "skip"
    return "save"
