"""A failure local to one replica group ends that group only (``parallelism.dp_replicate``).

When every rank a failure names (a crash, an exception, a guard report, a hang's culprit, and the
failures after it) belongs to one replica group, at least ``fault_tolerance.min_replicas`` groups
stay healthy, and (for the first group, which saves the checkpoints) its replacement rejoins
before the last step, the controller replaces that
group while the others train on; it is healed from a live one at its rejoin step
(``control/heal.py``, ``replicas/``). Anything else restarts the whole job from its last
checkpoint, the fallback, and the log says why. Pure: no Ray.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from raytrain_ckpt.common.events import Failure
from raytrain_ckpt.control.poll import GroupStartError
from raytrain_ckpt.control.watch import Verdict

if TYPE_CHECKING:
    from raytrain_ckpt.control.poll import GroupPoll, WorkerGroup

logger = logging.getLogger(__name__)

__all__ = ["ReplicaHeals"]

LOCAL_KINDS = ("crash", "exception", "rollback", "hang")
"""Failures a replica group's replacement recovers from (a guard trip's or a hang's state is
discarded with the group)."""


class ReplicaHeals:
    """Which failures end one replica group only, and how many heals were asked for (``status``).
    The controller asks ``local_replica`` about every failure that ends an attempt (a rank's crash,
    exception or guard report, a hang with its culprit): a group to replace, or None."""

    def __init__(self, spec: Any) -> None:
        self.replicas = spec.parallelism.dp_replicate
        self.size = spec.world_size // self.replicas
        self.min_replicas = spec.fault_tolerance.min_replicas
        self._saves_until = spec.training.steps - spec.fault_tolerance.heal_steps - 3 if spec.checkpoint.enabled else None
        """With checkpointing: the last step at which the saving group may fail and still rejoin
        before the last step (to save it); None: no group saves."""
        self._high = 0
        """The highest slowest-rank step a poll saw (a poll no live rank answered reads 0)."""
        self._healing: set[int] = set()
        """The replica groups being replaced or healed, as of the latest poll."""
        self.records: list[dict[str, Any]] = []
        """Every replacement asked for (``JobResult.heals``): replica, rank, kind, attempt, headline,
        at (time.time()), and healed_s once its ranks trained a step (failure -> back in the quorum)."""

    @property
    def heals(self) -> int:
        return len(self.records)

    def new_attempt(self) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {"replica_heals": self.heals, "replicas_healing": sorted(self._healing)}

    def observe(self, poll: GroupPoll, group: WorkerGroup, attempt: int) -> Verdict | None:
        """Times each heal: done once none of its group's ranks is still healing (failures reach
        this watch through the controller, ``local_replica``, whichever watch saw them)."""
        healing = self._healing = {r // self.size for r in getattr(group, "healing", ())}
        self._high = max(self._high, poll.min_step)
        for record in self.records:
            if "healed_s" not in record and record["attempt"] == attempt and record["replica"] not in healing:
                record["healed_s"] = round(time.time() - record["at"], 3)
                logger.info("attempt %d: replica group %d healed %.1f s after its %s", attempt, record["replica"],
                            record["healed_s"], record["kind"])
        return None

    def move_off(self, group: WorkerGroup, node: str, ranks: tuple[int, ...], attempt: int, step: int = 0,
                 kind: str = "drain") -> bool:
        """``node`` drains (``kind``; "eviction": the processes of ``ranks`` got SIGTERM), holding
        ``ranks`` (the slowest rank at ``step``): when enough groups
        stay healthy (and the saving group, if it is one of them, can rejoin in time to save the
        last step), each of those groups is replaced off the node now (``heal``), its state from a
        live group, and True; else False (the whole job saves the step in hand and restarts off
        the node). A replacement that cannot be placed in time: False too."""
        groups = sorted({r // self.size for r in ranks})
        down = {r // self.size for r in getattr(group, "healing", ())} | set(groups)
        if self.replicas - len(down) < self.min_replicas:
            return False
        if 0 in groups and self._saves_until is not None and max(step, self._high) > self._saves_until:
            return False
        what = f"node {node} drains" if kind == "drain" else f"rank(s) {', '.join(map(str, ranks))} got SIGTERM"
        for g in groups:
            logger.warning("attempt %d: %s, of replica group %d; replacing that group elsewhere while the others "
                           "train on", attempt, what, g)
            self.records.append({"replica": g, "rank": min(r for r in ranks if r // self.size == g), "kind": kind,
                                 "attempt": attempt, "headline": what, "at": time.time()})
            try:
                group.heal(g, off_node=True)
            except GroupStartError as exc:
                logger.warning("attempt %d: replica group %d could not be placed off node %s (%s); the whole job saves "
                               "and restarts off it", attempt, g, node, exc)
                return False
        return True

    def local_replica(self, failure: Failure, healing: set[int], step: int = 0) -> int | None:
        """The replica group to replace for ``failure`` (with the failures after it, all in that
        group; ``step``: the slowest rank's), when the job can train on without it; else None,
        and the log says why the whole job restarts."""
        g, why = self._local(failure, healing, step)
        if g is None:
            logger.warning("attempt %d: replica groups: the whole job restarts (%s)", failure.attempt, why)
            return None
        self.records.append({"replica": g, "rank": failure.rank, "kind": failure.kind, "attempt": failure.attempt,
                             "headline": failure.headline, "at": time.time()})
        return g

    def _local(self, failure: Failure, healing: set[int], step: int) -> tuple[int | None, str]:
        failures = [failure, *failure.after]
        ranks = {f.rank for f in failures}
        if None in ranks or any(f.kind not in LOCAL_KINDS for f in failures):
            return None, f"a {failure.kind} failure that is not one rank's"
        groups = {r // self.size for r in ranks if r is not None}
        if len(groups) != 1:
            return None, f"ranks of replica groups {sorted(groups)} failed together"
        g = groups.pop()
        if g == 0 and self._saves_until is not None and max(step, self._high) > self._saves_until:
            return None, ("replica group 0 saves the checkpoints and would rejoin too close to the last step to "
                          "save it")
        down = {r // self.size for r in healing} | {g}
        if self.replicas - len(down) < self.min_replicas:
            return None, (f"{self.replicas - len(down)} healthy replica group(s) would be left, below "
                          f"fault_tolerance.min_replicas={self.min_replicas}")
        return g, ""
