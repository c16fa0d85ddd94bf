"""What to do about a failure (``FailurePolicy``: pure, table-tested; the controller only acts on
its ``Decision``), and the world size a shrunk group may train at (``elastic_world_size``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from raytrain_ckpt.common.events import FailureKind

__all__ = ["Decision", "FailureFacts", "FailurePolicy", "RestartBudget", "elastic_world_size"]


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


class RestartBudget:
    """The job's restarts against its ``FailurePolicy``: each failure's time is kept, so the
    failures inside ``fault_tolerance.failure_window_s`` can be counted."""

    def __init__(self, ft: Any, policy: FailurePolicy) -> None:
        self._ft, self._policy = ft, policy
        self._times: list[float] = []
        self.restarts = 0

    def decide(self, kind: FailureKind, now: float) -> tuple[Decision, str]:
        """The decision on a ``kind`` failure at ``now`` (a restart is spent here), and why, in words."""
        ft = self._ft
        self._times.append(now)
        recent = None
        if ft.failure_window_s is not None:
            recent = sum(1 for t in self._times if now - t <= ft.failure_window_s)
        facts = FailureFacts(kind, self.restarts, ft.max_restarts, recent)
        if self._policy.decide(facts) is Decision.RESTART:
            self.restarts += 1
            return Decision.RESTART, f"{kind}; restart {self.restarts}/{facts.max_restarts}"
        return Decision.FAIL, (f"{kind}; {self.restarts}/{facts.max_restarts} restarts used"
                               + (f", {recent} failures within {ft.failure_window_s:g}s" if recent is not None else ""))


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
