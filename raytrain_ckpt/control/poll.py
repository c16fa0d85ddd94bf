"""What the controller knows of a group of training ranks: the ``WorkerGroup`` protocol (every
capability the controller uses), one poll's record (``GroupPoll``) and ``GroupStartError``.

Plain: no Ray, no torch. The controller, its watches and the Ray group (``group.py``) import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from raytrain_ckpt.common.events import Failure, RollbackRecord, WorkerResult

if TYPE_CHECKING:
    from raytrain_ckpt.control.watch.hangs import Blame

__all__ = ["GroupPoll", "GroupStartError", "WorkerGroup"]


class GroupStartError(RuntimeError):
    """The group could not be placed or could not form its process group in time.

    ``mismatch``: a rank found that the resume checkpoint does not fit the job's model (the
    ``CheckpointMismatch`` message); no restart would change that, so the job fails at once.
    """

    def __init__(self, message: str, mismatch: str | None = None) -> None:
        super().__init__(message)
        self.mismatch = mismatch


@dataclass(frozen=True)
class GroupPoll:
    """One look at the group: finished results, failures, and the slowest rank's step."""

    results: list[WorkerResult] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    """Every rank failure seen by this poll ("crash" or "exception"), crashes first."""
    min_step: int = 0
    finished: bool = False
    stall_s: float = 0.0
    """The most checkpoint-stall seconds any rank reported this attempt (the goodput ledger)."""
    eval_s: float = 0.0
    """The most eval seconds any rank reported this attempt."""
    phases: dict[int, str] = field(default_factory=dict)
    """Each answering rank's phase (``Progress.phase``: "saving" while in a save): the hang budget's phase."""
    starts: dict[int, tuple[int, float]] = field(default_factory=dict)
    """Each training rank's latest step and when it began it (time.time()): the straggler watch."""
    rollbacks: tuple[RollbackRecord, ...] = ()
    """The training guard's rollbacks in this attempt so far, in order:
    the most any rank reported, through its progress or its result."""
    evictions: dict[int, float] = field(default_factory=dict)
    """Ranks whose process got SIGTERM (a pod eviction) -> the deadline they stop by (``rank/eviction.py``)."""
    evidence: str | None = None
    """The file the group kept every failed rank's full text in, when ``failures`` is not empty."""
    step_s: float | None = None
    """The longest latest-step duration a training rank measured (``Progress.step_s``; None: none yet)."""


class WorkerGroup(Protocol):
    """What the controller needs from a group of training ranks: every capability it uses, declared
    here (a test double implements each; what a group cannot do, it answers with nothing to say)."""

    rollbacks_before: int
    """The guard's rollbacks in the job's earlier attempts (set before ``start``: the budget is per job)."""
    start_marks: list[tuple[str, float]]
    """(phase, clock time it ended) of the start: placement, rendezvous, load (the goodput ledger)."""
    nodes: list[str]
    """The nodes the group was placed on (empty: unknown)."""
    healing: set[int]
    """Ranks of replacement replica groups that have not trained a step yet (``heal``)."""

    @property
    def replaced(self) -> list[str]:
        """The checkpoint writers and actor this attempt's start replaced for not answering, one line each."""

    def start(self) -> None:
        """Place, create and set up every rank, then start training; raises GroupStartError."""

    def poll(self) -> GroupPoll:
        """Non-blocking (bounded by the poll interval) look at progress and failures."""

    def wait(self, timeout_s: float) -> None:
        """Block until a rank's run ends (it finished, raised, or its process died) or ``timeout_s``
        passed, whichever is first: the controller's pause between polls, cut short by a failure."""

    def shutdown(self, keep_warm: bool = False) -> None:
        """Release the ranks; safe to call twice. ``keep_warm``: keep what can serve the next
        attempt (placement group, processes that reset cleanly), kill the rest."""

    def heal(self, replica: int, off_node: bool = False) -> None:
        """Replace replica group ``replica`` while the others train on (``off_node``: elsewhere
        than its draining node); raises GroupStartError."""

    def rank_nodes(self) -> list[str]:
        """Node id of every rank, by rank."""

    def preempt(self, deadline_unix: float | None, tier: str = "durable") -> None:
        """Ask every rank to save the step in hand (in ``tier``) at the next step boundary and stop."""

    def retire(self, rank: int) -> None:
        """Never keep ``rank``'s process for the next attempt (a straggler's replacement)."""

    def note_failure(self, failure: Failure) -> str | None:
        """Count a failure against the nodes of its ranks; the quarantine line of a node it puts out, if any."""

    def diagnose(self) -> Blame:
        """Every rank's stacks and step read before a hung group is torn down, and the culprit."""

    def checkpointing_silences(self) -> dict[str, float]:
        """Checkpoint writers and the actor (and stalled writes) by name: seconds without an answer."""

    def save_in_flight(self) -> int | None:
        """The step of the save in flight, if any."""

    def replace_silent_checkpointing(self, stalled: dict[str, float] | None = None) -> list[str]:
        """Replace the silent checkpoint writers or actor (and the writers of ``stalled`` writes);
        one line per replaced process (empty: each answered the confirming ping)."""
