"""Replacing one replica group while the others train on (``parallelism.dp_replicate``).

The failed group's processes are killed (their heartbeat to the Lighthouse stops, so the healthy
groups' next quorum forms without them), and new ones take their ranks: an idle spare on the
rank's node first, else a new process in the rank's bundle. They rendezvous as a group of their
own at their first rank's store, are set up without loading any checkpoint, and start ``run()``:
their first step waits for the healthy groups at the rejoin step and receives a live group's
state there (``replicas/sync.py``, ``rank/replicas.py``). Storage is never read.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from raytrain_ckpt.control.pool import kill_actor, new_worker

logger = logging.getLogger(__name__)

__all__ = ["replace_replica"]


def replace_replica(group: Any, replica: int, pg: Any, calls: Any, lighthouse: Any,
                    address: str | None) -> dict[ray.ObjectRef, int]:
    """Kill replica group ``replica`` of ``group`` (a ``RayWorkerGroup``: its placement group
    ``pg``, its ``StartCalls``, its Lighthouse actor and that actor's ``address``) and start the
    replacement; returns the new ranks' ``run()`` refs (ref -> rank). Raises ``GroupStartError``
    when the replacement cannot join or set up within ``fault_tolerance.start_timeout_s``."""
    spec = group.spec
    size = spec.world_size // spec.parallelism.dp_replicate
    ranks = list(range(replica * size, (replica + 1) * size))
    deadline = time.monotonic() + spec.fault_tolerance.start_timeout_s
    ray.get(lighthouse.replacing.remote(replica))  # an earlier replacement's ranks are not ready any more
    for rank in ranks:
        kill_actor(group.workers[rank])
    nodes = group.rank_nodes()
    spec_json = spec.model_dump_json()
    fresh: list[Any] = []
    for rank in ranks:
        spare = group.pool.spare_for(nodes[rank]) if group.pool is not None and nodes else None
        if spare is not None:
            try:
                ray.get(spare.assign.remote(spec_json, rank, spec.world_size, group.attempt, group.run_id),
                        timeout=max(0.1, deadline - time.monotonic()))
                fresh.append(spare)
                continue
            except Exception as exc:  # noqa: BLE001 - a spare that cannot serve: a new process instead
                logger.warning("replica %d: spare for rank %d unusable (%s); starting a new process", replica, rank, exc)
                kill_actor(spare)
        fresh.append(new_worker(spec, pg, rank, group.attempt, group.run_id))
    meet = calls.get(fresh[0].address.remote(), deadline, f"locate rank {ranks[0]}")
    joins = [w.join.remote(meet.host, meet.port) for w in fresh]
    setups = [w.setup.remote(None, group.rollbacks_before, address, True) for w in fresh]
    calls.get_all(joins, deadline, f"join replica {replica}'s rank {{rank}} to its process group")
    calls.get_all(setups, deadline, f"set up replica {replica}'s rank {{rank}}")
    for rank, w in zip(ranks, fresh, strict=True):
        group.workers[rank] = w
    logger.warning("attempt %d: replica group %d (ranks %d-%d) replaced; it rejoins from a live group",
                   group.attempt, replica, ranks[0], ranks[-1])
    return {w.run.remote(): rank for rank, w in zip(ranks, fresh, strict=True)}
