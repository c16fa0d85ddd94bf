"""Where the replica groups meet around a heal: the membership rule's shared state (pure).

A group that fails is out of the steps ``s .. s+H-1`` (``s``: the first step committed without it,
``H``: ``fault_tolerance.heal_steps``) and back at step ``s+H``. The healthy groups know ``s`` from
their quorums; the replacement group does not know any step (torchft heals it to its peers'). So
the two sides meet here, in the Lighthouse actor (``lighthouse.py``):

- each healthy group's ranks, at step ``s+H``, say so (``wait_at``) and wait until every rank of
  the replacement group is ``ready``;
- each rank of the replacement group, once set up, waits until a healthy group waits for it
  (``rejoin_step``), says it is ``ready`` and asks for the quorum, where torchft heals it;
- a replacement's first committed step clears the replica's entry (``rejoined``); the driver
  starting another replacement for it (a second failure while it healed) clears its ``ready``
  ranks (``replacing``), so the healthy groups wait on.
"""

from __future__ import annotations

__all__ = ["Roster"]


class Roster:
    """The meeting state of every replica group being healed, keyed by replica index."""

    def __init__(self) -> None:
        self._waiting: dict[int, int] = {}
        self._ready: dict[int, set[int]] = {}

    def wait_at(self, replica: int, step: int) -> None:
        """The healthy groups wait for ``replica`` at ``step`` (its rejoin step)."""
        self._waiting[replica] = step

    def rejoin_step(self, replica: int) -> int | None:
        """The step the healthy groups wait for ``replica`` at (None: they are not there yet)."""
        return self._waiting.get(replica)

    def ready(self, replica: int, rank: int) -> None:
        """Rank ``rank`` (within its group) of ``replica``'s replacement asks for its first quorum now."""
        self._ready.setdefault(replica, set()).add(rank)

    def is_ready(self, replica: int, ranks: int) -> bool:
        """Whether all ``ranks`` ranks of ``replica``'s replacement are ready."""
        return len(self._ready.get(replica, ())) >= ranks

    def replacing(self, replica: int) -> None:
        """A new replacement of ``replica`` starts: the ranks of an earlier one are not ready."""
        self._ready.pop(replica, None)

    def rejoined(self, replica: int) -> None:
        """``replica`` committed a step with the others: its heal is over."""
        self._waiting.pop(replica, None)
        self._ready.pop(replica, None)

    def healing(self) -> dict[int, int]:
        """Replica -> the rejoin step the healthy groups wait at, for every heal still open there."""
        return dict(self._waiting)
