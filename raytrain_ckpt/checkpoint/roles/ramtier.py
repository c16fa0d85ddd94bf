"""The RAM tier of a preemption's save: a step held only in RAM, off the draining node.

When a drain's deadline is too short for a durable commit (``preemption.plan_save``), every rank
stages the step in hand into its staging buffer and hands it to its node's writer with tier
``ram``: the writer records the buffer as the step's copy (its CRC-32C, no file written) and
nothing is reported to the CheckpointActor, so storage and its committed steps stay as they
were. Once the group stopped, ``RamTier.keep`` pushes the copies held on the draining node to
a writer on a node that is not draining (``Replication.push``: chunked, CRC-32C checked on
arrival) and checks that every rank's copy is held off the draining nodes. The result is a
``MemoryStep``: the next attempt resumes from it, from memory only (``CheckpointService``), each
rank checking its copy's CRC-32C before loading. A memory step is offered once; when a copy is
missing or refused, the attempt resumes from the latest committed step on storage instead.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import ray

from raytrain_ckpt.common.events import headline

logger = logging.getLogger(__name__)

__all__ = ["MemoryStep", "RamTier", "draining"]

ASK_TIMEOUT_S = 10.0
"""How long ``keep`` waits for a writer to list the copies it holds."""


@dataclass(frozen=True)
class MemoryStep:
    """A step held only in RAM, on nodes that are not draining."""

    step: int
    world_size: int
    holders: dict[int, str]
    """Rank -> the node whose writer holds its copy."""


def draining() -> set[str]:
    """The nodes Ray is draining (the GCS's record)."""
    return set(ray._private.state.state.get_draining_nodes() or {})


class RamTier:
    """The driver's side of the RAM tier: where copies can go, and moving them there."""

    def __init__(self, writers: dict[str, Any]) -> None:
        self.writers = writers
        """The job's writers by node id (``WriterFleet.writers``, shared)."""

    def targets(self, draining: set[str]) -> list[str]:
        """Nodes with a writer of this job, alive and not draining: where a RAM-tier copy may go."""
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        return sorted((set(self.writers) & alive) - draining)

    def keep(self, node: str, step: int, world_size: int, deadline_unix: float | None) -> MemoryStep | str:
        """Push the copies of ``step`` held on draining ``node`` to a node that is not draining,
        by ``deadline_unix``; the step held, or why not."""
        draining_now = draining() | {node}
        targets = self.targets(draining_now)
        if not targets:
            return "no node outside the drain holds a writer of this job"
        held = self._held(step, targets)
        source = self.writers.get(node)
        if source is None:
            return f"no writer on node {node[:12]}"
        try:
            own = ray.get(source.copies_held.remote(step), timeout=ASK_TIMEOUT_S)
        except Exception as exc:  # the draining node's writer is gone: its ranks' copies with it
            return f"the writer on node {node[:12]} cannot be asked: {headline(str(exc))}"
        target = targets[0]
        for copy in own:
            if copy.rank in held:
                continue
            left = None if deadline_unix is None else max(0.1, deadline_unix - time.time())
            t0 = time.monotonic()
            try:
                ray.get(source.push_replica.remote(copy.rank, step, self.writers[target], target), timeout=left)
            except Exception as exc:  # the step is not held; storage's committed step is the fallback
                return f"pushing rank {copy.rank}'s copy to node {target[:12]} failed: {headline(str(exc))}"
            held[copy.rank] = target
            logger.warning("preemption: rank %d's copy of step %d pushed from draining node %s to node %s in %.2fs "
                           "(%.1f MB)", copy.rank, step, node[:12], target[:12], time.monotonic() - t0,
                           copy.nbytes / 1e6)
        missing = sorted(set(range(world_size)) - set(held))
        if missing:
            return f"no copy of step {step} for rank(s) {missing} on a node outside the drain"
        return MemoryStep(step, world_size, held)

    def _held(self, step: int, nodes: list[str]) -> dict[int, str]:
        """Rank -> node, for the copies of ``step`` the writers on ``nodes`` hold (own or replica)."""
        asked = {n: self.writers[n].copies_held.remote(step) for n in nodes}
        held: dict[int, str] = {}
        for node, ref in asked.items():
            try:
                copies = ray.get(ref, timeout=ASK_TIMEOUT_S)
            except Exception as exc:  # that node's copies do not count; another may hold them
                logger.info("node %s: copies of step %d unknown: %s", node[:12], step, headline(str(exc)))
                continue
            for c in copies:
                held.setdefault(c.rank, node)
        return held
