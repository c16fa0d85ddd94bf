"""A failure local to one replica group ends that group only (``parallelism.dp_replicate``).

When every failed rank of a poll belongs to one replica group, that group is not the saving
group (the first), and at least ``fault_tolerance.min_replicas`` groups stay healthy, the verdict
is ``HEAL``: the group is replaced while the others train on, and healed from a live one at its
rejoin step (``control/heal.py``, ``replicas/``). Anything else is left to ``RankFailures``: the
whole job restarts from its last checkpoint, the fallback, and the log says why. Pure: no Ray.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from raytrain_ckpt.common.events import Failure
from raytrain_ckpt.control.watch import Act, Verdict

if TYPE_CHECKING:
    from raytrain_ckpt.control.poll import GroupPoll, WorkerGroup

logger = logging.getLogger(__name__)

__all__ = ["ReplicaHeals"]

LOCAL_KINDS = ("crash", "exception", "rollback")
"""Failures a replica group's replacement recovers from (a guard trip's state is discarded with the group)."""


class ReplicaHeals:
    """Which failures end one replica group only, and the heals so far (for ``status``)."""

    def __init__(self, spec: Any) -> None:
        self.replicas = spec.parallelism.dp_replicate
        self.size = spec.world_size // self.replicas
        self.min_replicas = spec.fault_tolerance.min_replicas
        self.heals = 0
        """Replacements asked for so far."""

    def new_attempt(self) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {"replica_heals": self.heals} if self.replicas > 1 else {}

    def local_group(self, poll: GroupPoll, healing: set[int]) -> tuple[int | None, str]:
        """The one replica group every failure of ``poll`` is in, when a replacement of it keeps
        the job training; else None and why the whole job restarts instead."""
        ranks = {f.rank for f in poll.failures}
        if None in ranks or any(f.kind not in LOCAL_KINDS for f in poll.failures):
            return None, "the failure is not one rank's"
        groups = {r // self.size for r in ranks if r is not None}
        if len(groups) != 1:
            return None, f"ranks of replica groups {sorted(groups)} failed together"
        g = groups.pop()
        if g == 0:
            return None, "replica group 0 saves the checkpoints"
        down = {r // self.size for r in healing} | {g}
        if self.replicas - len(down) < self.min_replicas:
            return None, (f"{self.replicas - len(down)} healthy replica group(s) would be left, below "
                          f"fault_tolerance.min_replicas={self.min_replicas}")
        return g, ""

    def observe(self, poll: GroupPoll, group: WorkerGroup, attempt: int) -> Verdict | None:
        if self.replicas == 1 or not poll.failures:
            return None
        g, why = self.local_group(poll, getattr(group, "healing", set()))
        if g is None:
            logger.warning("attempt %d: replica groups: the whole job restarts (%s)", attempt, why)
            return None
        first = poll.failures[0]
        failure = Failure(attempt, first.kind, first.rank, first.headline, first.detail or str(first),
                          tuple(poll.failures[1:]), poll.evidence)
        self.heals += 1
        line = (f"attempt {attempt}: replica group {g} failed ({first.kind} on rank {first.rank}); replacing it "
                "while the other groups train on")
        return Verdict(Act.HEAL, failure, events=(line,), reason=line, replica=g,
                       diagnostics=(poll.evidence,) if poll.evidence is not None else ())
