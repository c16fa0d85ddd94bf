"""What the group's runs ended with: a rank's failure (a crash, an exception, the guard's report)
fails the attempt; every rank done finishes the job. Each a ``Watch``; pure: no Ray, no torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raytrain_ckpt.common.events import Failure
from raytrain_ckpt.control.watch import Act, Verdict

if TYPE_CHECKING:
    from raytrain_ckpt.control.poll import GroupPoll, WorkerGroup

__all__ = ["Finished", "RankFailures"]


class RankFailures:
    """The poll's rank failures: the first one (crashes first) fails the attempt, the others and
    the file that keeps every failed rank's full text ride along with it."""

    def new_attempt(self) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {}  # the failures are the job result's; the summary counts them by kind

    def observe(self, poll: GroupPoll, group: WorkerGroup, attempt: int) -> Verdict | None:
        if not poll.failures:
            return None
        first = poll.failures[0]
        failure = Failure(attempt, first.kind, first.rank, first.headline, first.detail or str(first),
                          tuple(poll.failures[1:]), poll.evidence)
        return Verdict(Act.FAIL, failure, diagnostics=(poll.evidence,) if poll.evidence is not None else ())


class Finished:
    """Every rank's run ended without a failure: the job succeeded."""

    def new_attempt(self) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {}

    def observe(self, poll: GroupPoll, group: WorkerGroup, attempt: int) -> Verdict | None:
        return Verdict(Act.FINISH, reason=f"{poll.min_step} steps done") if poll.finished else None
