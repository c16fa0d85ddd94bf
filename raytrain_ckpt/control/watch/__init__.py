"""The controller's detectors, one module each: hangs, silent checkpoint processes, stragglers,
preemptions and drains, rank failures, rollbacks, goodput; and quarantine and node health, which
the group consults when it places.

Every watch the controller runs over its polls owns its own state and implements ``Watch``: it
hears of every attempt's start, looks at every poll (``observe``) and says what the controller
must do in a ``Verdict`` (None: nothing), and says what it adds to ``status``. The controller
asks its watches in their order (``build.watches_for``: the priority order), records what each
verdict carries, and stops at the first verdict that ends the poll (any ``Act`` but ``NOTE``);
when none does, it waits for the next poll. It keeps no detector's state.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from raytrain_ckpt.common.events import Failure, FailureKind
    from raytrain_ckpt.control.poll import GroupPoll, WorkerGroup

__all__ = ["Act", "Verdict", "Watch"]


class Act(enum.Enum):
    """What the controller does with a poll once a watch has spoken."""

    NOTE = "note"
    """Record what the verdict carries; the next watch looks at the poll."""
    PROCEED = "proceed"
    """Record it; the group trains on and is polled again at once (a silent process was replaced)."""
    FAIL = "fail"
    """The attempt failed with ``failure``: the restart policy (``max_restarts``) decides."""
    RESTART = "restart"
    """The group stopped at a saved step on purpose: restart, without spending ``max_restarts``
    (without rank ``retire``'s process, if set)."""
    STOP = "stop"
    """The driver was told to stop and the step in hand is saved: the job ends STOPPED."""
    GIVE_UP = "give_up"
    """The job fails without a restart (``error``: why; a budget of its own is spent)."""
    FINISH = "finish"
    """Every rank is done: the job succeeded."""



@dataclass(frozen=True)
class Verdict:
    """What one watch saw in a poll and what the controller must do about it."""

    act: Act = Act.NOTE
    failure: Failure | None = None
    """FAIL: the failure that ended the attempt; RESTART, STOP, GIVE_UP: what it stopped for."""
    recorded: tuple[Failure, ...] = ()
    """Failures the job recovered from (a rollback, a replaced writer): into ``JobResult.failures``."""
    events: tuple[str, ...] = ()
    """Lines for ``JobResult.events`` (each stamped with the time it is recorded)."""
    stragglers: tuple[str, ...] = ()
    diagnostics: tuple[str, ...] = ()
    """Diagnostics folders (every rank's stacks, a failure's evidence)."""
    preemptions: tuple[dict, ...] = ()
    """Preemption records (``PreemptionRecord.to_dict``) for ``JobResult.preemptions``."""
    retire: int | None = None
    """RESTART: the rank whose process the next attempt does not keep."""
    cause: FailureKind | None = None
    """RESTART: the kind the restart is for (what the release keeps warm); None: nothing failed."""
    reason: str = ""
    """RESTART, STOP, GIVE_UP, FINISH: the state change's reason (logged)."""
    error: str | None = None
    """GIVE_UP: ``JobResult.error``."""
    stopped_by: str | None = None
    """STOP: the signal."""



class Watch(Protocol):
    """What the controller asks of every watch."""

    def new_attempt(self) -> None:
        """An attempt started: its ranks are new, measured afresh (what was reported stays)."""

    def observe(self, poll: GroupPoll, group: WorkerGroup, attempt: int) -> Verdict | None:
        """Look at one poll of the running ``group`` (attempt ``attempt``); what to do, or None."""

    def status(self) -> dict[str, Any]:
        """What this watch adds to the job's summary (``status --job``, the bulletin)."""
