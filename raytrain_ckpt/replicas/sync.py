"""One rank's side of the replicate dimension, over torchft's Manager.

A step under replicas runs ``begin()`` (the step's quorum, asynchronously, while the forward and
backward passes run), ``average(grads)`` (the gradients averaged across the replicas taking part:
each rank with the rank of the same shard in every other replica), then ``commit()``: the vote
of every replica group; the optimizer steps only when it passes. A replica that joins late or
restarts is healed inside ``begin``'s quorum: torchft sends it the ``state()`` of a live replica
that is at the quorum's step, and ``load(state)`` puts it in place; storage is never read.

torchft's ``DistributedDataParallel`` is not used: a peer that dies inside the backward pass
makes its communication hook assert instead of failing the vote (``docs/ARCHITECTURE.md``,
"Replicas heal from a live peer").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

__all__ = ["ReplicaSync"]


class ReplicaSync:
    """The replicate dimension of one rank: ``replica`` is its replica group, ``rank``/``ranks``
    its place inside that group, whose ranks share the TCP store at ``store``."""

    def __init__(self, *, replica: int, rank: int, ranks: int, lighthouse: str, store: tuple[str, int],
                 state: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None],
                 timeout_s: float = 30.0, init_sync: bool = True) -> None:
        """``init_sync``: at step 0 replicas other than the first receive its state (torchft's
        default); False when every replica starts from the same parameters anyway (the job's
        seeded initialisation), so that nothing is sent."""
        from torchft import Manager, ProcessGroupGloo

        timeout = timedelta(seconds=timeout_s)
        self.replica = replica
        self.manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1, load_state_dict=load,
                               state_dict=state, replica_id=f"replica{replica}", store_addr=store[0],
                               store_port=store[1], rank=rank, world_size=ranks, lighthouse_addr=lighthouse,
                               timeout=timeout, quorum_timeout=timedelta(seconds=2 * timeout_s),
                               init_sync=init_sync)

    def begin(self) -> None:
        """Start this step's quorum (and a heal, when this replica is behind)."""
        self.manager.start_quorum()

    def average(self, grads: Sequence[torch.Tensor]) -> None:
        """Average ``grads`` in place across the replicas of this step's quorum, in one flat buffer.
        A failed peer does not raise here: it fails the vote (``commit``)."""
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.manager.allreduce(flat).wait()
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def commit(self) -> bool:
        """Every replica group's vote on this step: apply the optimizer step only when True."""
        return self.manager.should_commit()

    @property
    def step(self) -> int:
        """The replicas' step count (committed steps; a healed replica takes its peer's)."""
        return self.manager.current_step()

    def participants(self) -> int:
        """How many replica groups take part in this step's quorum."""
        return self.manager.num_participants()

    def close(self) -> None:
        self.manager.shutdown(wait=False)
