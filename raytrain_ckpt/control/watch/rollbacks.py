"""The training guard's rollbacks as the ranks report them (with their progress, or their result):
failures the job recovered from inside an attempt, each recorded once, as soon as a poll sees it
(an attempt that crashes later keeps them). Pure: no Ray, no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raytrain_ckpt.common.events import Failure, RollbackRecord
from raytrain_ckpt.control.watch import Verdict

if TYPE_CHECKING:
    from raytrain_ckpt.control.poll import GroupPoll, WorkerGroup

__all__ = ["RollbackWatch"]


class RollbackWatch:
    """The controller's watch over the running attempt's rollbacks (a ``Watch``)."""

    def __init__(self) -> None:
        self._noted = 0
        """Rollbacks of the running attempt already handed out."""

    def new_attempt(self) -> None:
        self._noted = 0

    def status(self) -> dict[str, Any]:
        return {}  # the rollbacks are failures of the job's result; the summary counts them by kind

    def observe(self, poll: GroupPoll, group: WorkerGroup, attempt: int) -> Verdict | None:
        """The rollbacks this poll shows first (a finished group's with its results), each
        recorded as a failure recovered from."""
        new = self.unseen(poll.rollbacks)
        if poll.finished and poll.results:
            new += self.unseen(poll.results[0].rollbacks)
        if not new:
            return None
        return Verdict(recorded=tuple(Failure(attempt, "rollback", rb.trip.rank, str(rb), str(rb)) for rb in new),
                       events=tuple(f"attempt {attempt} rollback to step {rb.to_step}" for rb in new))

    def unseen(self, rollbacks: tuple[RollbackRecord, ...]) -> tuple[RollbackRecord, ...]:
        """Of the attempt's ``rollbacks`` so far (in order), those not handed out before."""
        out = rollbacks[self._noted:]
        self._noted = max(self._noted, len(rollbacks))
        return out
