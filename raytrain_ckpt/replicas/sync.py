"""One rank's side of the replicate dimension, over torchft's Manager.

A step under replicas runs ``begin(step)`` (the step's quorum, asynchronously, while the forward
and backward passes run), ``average(grads)`` (the gradients averaged across the replica groups
taking part: each rank with the rank of the same shard in every other group), then
``commit(step)``: the step is applied only when its quorum is the one the membership rule
(``membership.py``) expects and every rank of this group voted for it; otherwise the same step
is redone. A replacement group is healed inside its first quorum: torchft sends it the
``state()`` of a live group at the quorum's step and ``load(state)`` puts it in place; storage is
never read. The healthy groups and a replacement meet at its rejoin step in the Lighthouse actor
(``roster.py``), so that the replacement's first quorum is always that step's.

torchft's ``DistributedDataParallel`` is not used: a peer that dies inside the backward pass
makes its communication hook assert instead of failing the vote (``docs/ARCHITECTURE.md``,
"Replicas heal from a live peer").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import ray
import torch

from raytrain_ckpt.replicas.lighthouse import TICK_MS
from raytrain_ckpt.replicas.membership import Membership

__all__ = ["ReplicaSync", "average_flat"]

logger = logging.getLogger(__name__)


def average_flat(manager: Any, grads: Sequence[torch.Tensor]) -> None:
    """Average ``grads`` in place through torchft ``manager``'s allreduce, in one flat buffer."""
    flat = torch.cat([g.reshape(-1) for g in grads])
    manager.allreduce(flat).wait()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _recording_pg(timeout: timedelta, group_size: int) -> Any:
    """torchft's gloo process group, remembering which replica groups each quorum holds (its
    ``configure`` receives every member's global rank: replica x group size + rank)."""
    from torchft import ProcessGroupGloo

    class RecordingGloo(ProcessGroupGloo):
        present: set[int] = set()

        def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int,  # type: ignore[override]
                      quorum_id: int | None = None, group_rank: int | None = None,
                      group_world_size: int | None = None, global_ranks: list[int] | None = None) -> None:
            self.present = {r // group_size for r in global_ranks or ()}
            super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size,
                              global_ranks)

    return RecordingGloo(timeout=timeout)


class ReplicaSync:
    """The replicate dimension of one rank: ``replica`` is its replica group, ``rank``/``ranks``
    its place inside that group, whose ranks share the TCP store at ``store``. ``roster``: the
    Lighthouse actor's name (the meeting point of heals); ``replacement``: this group replaces a failed
    one and is healed in its first quorum."""

    def __init__(self, *, replica: int, rank: int, ranks: int, lighthouse: str,
                 store: tuple[str, int], state: Callable[[], dict[str, Any]],
                 load: Callable[[dict[str, Any]], None], membership: Membership, roster: str | None = None,
                 replacement: bool = False, timeout_s: float = 30.0, meet_timeout_s: float = 600.0) -> None:
        from torchft import Manager

        timeout = timedelta(seconds=timeout_s)
        self.replica, self.rank, self.ranks = replica, rank, ranks
        self.membership = membership
        self._roster = ray.get_actor(roster) if roster is not None else None
        self._heal_step = 0
        self._healing = replacement
        self._meet_timeout_s = meet_timeout_s
        self.waited_s = 0.0
        """Seconds this rank waited at rejoin steps for a replacement to be ready (the goodput ledger)."""
        self.redone = 0
        """Steps redone because their quorum was not the rule's."""
        self.last_skipped = 0
        """How many groups' shares the last committed step skipped."""
        self._pg = _recording_pg(timeout, ranks)

        def manager() -> Any:
            return Manager(pg=self._pg, min_replica_size=1, load_state_dict=load, state_dict=state,
                           replica_id=f"replica{replica}", store_addr=store[0], store_port=store[1], rank=rank,
                           world_size=ranks, lighthouse_addr=lighthouse, timeout=timeout,
                           quorum_timeout=timedelta(seconds=meet_timeout_s), init_sync=False)

        # A replacement's Manager (and its heartbeat to the Lighthouse) starts only at its rejoin step:
        # a heartbeating group that has not joined holds back every quorum that is not the previous
        # one's members (torchft's majority rule), such as the healthy groups' first one after the failure.
        self._manager = manager
        self.manager: Any = None if replacement else manager()

    def begin(self, step: int) -> None:
        """Start step ``step``'s quorum (1-based), after meeting a replacement that rejoins at it."""
        if self.manager is None:
            self._rejoin()
            return
        for g in self.membership.rejoining(step):
            self._meet(g, step)
        self.manager.start_quorum()

    def _rejoin(self) -> None:
        """A replacement: wait until the healthy groups wait for this group, start its Manager, ask
        for the quorum (torchft heals it there), and say it is ready."""
        deadline = time.monotonic() + self._meet_timeout_s
        while ray.get(self._roster.rejoin_step.remote(self.replica)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica group {self.replica}: no healthy group reached its rejoin step "
                                   f"within {self._meet_timeout_s:.0f} s")
            time.sleep(TICK_MS / 1000)
        self.manager = self._manager()
        self.manager.start_quorum()
        ray.get(self._roster.ready.remote(self.replica, self.rank))

    def _meet(self, group: int, step: int) -> None:
        """A healthy rank at ``group``'s rejoin step: wait until every rank of its replacement is ready."""
        t0 = time.monotonic()
        ray.get(self._roster.wait_at.remote(group, step))
        while not ray.get(self._roster.is_ready.remote(group, self.ranks)):
            if time.monotonic() - t0 > self._meet_timeout_s:
                raise TimeoutError(f"replica group {group} was not back by step {step} within "
                                   f"{self._meet_timeout_s:.0f} s")
            time.sleep(TICK_MS / 1000)
        time.sleep(4 * TICK_MS / 1000)  # its quorum request reaches the Lighthouse first (else: the step is redone)
        self.waited_s += time.monotonic() - t0

    def average(self, grads: Sequence[torch.Tensor]) -> None:
        """Average ``grads`` in place across the replicas of this step's quorum, in one flat buffer.
        A failed peer does not raise here: it fails the vote (``commit``)."""
        if grads:
            average_flat(self.manager, grads)

    def commit(self, step: int) -> bool:
        """Whether step ``step`` is applied: its quorum is the rule's and this group's ranks voted for
        it. False: nothing was applied and the same step is redone."""
        self.manager.wait_quorum()
        present = set(self._pg.present)
        if self._healing:  # the state arrives in the vote; the membership comes with it
            ok = self.manager.should_commit()
            if ok:
                self._healing = False
                self.last_skipped = len(self.membership.committed(self._heal_step, present))
                ray.get(self._roster.rejoined.remote(self.replica))
            return ok
        why = self.membership.judge(step, present)
        if why is not None:
            self.manager.report_error(RuntimeError(f"step {step}: {why}"))
        ok = self.manager.should_commit()
        if ok:
            skipped = self.membership.committed(step, present)
            self.last_skipped = len(skipped)
            if skipped and self.rank == 0 and (step - 1, skipped[0]) not in self.membership.skipped:
                logger.warning("replica %d: step %d trained without replica group(s) %s", self.replica, step, skipped)
        else:
            self.redone += 1
        return ok

    def healed(self, membership: dict[str, Any], step: int) -> None:
        """The heal's state arrived (torchft calls the rank's ``load`` inside the vote): the live
        group's membership record, and ``step``, the step this group heals at."""
        self.membership.load(membership, step)
        self._heal_step = step

    @property
    def step(self) -> int:
        """The replicas' step count (committed steps; a healed replica takes its peer's)."""
        return self.manager.current_step() if self.manager is not None else 0

    def record(self) -> dict[str, Any]:
        """This rank's replicate-dimension record for its result (``WorkerResult.replicas``)."""
        return {"skipped": list(self.membership.skipped), "redone": self.redone, "waited_s": round(self.waited_s, 3),
                "healed_at": self._heal_step or None}

    def participants(self) -> int:
        """How many replica groups take part in this step's quorum."""
        return self.manager.num_participants()

    def close(self) -> None:
        """Stop this rank's Manager (and, on the group's first rank, its heartbeat to the Lighthouse)."""
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None
