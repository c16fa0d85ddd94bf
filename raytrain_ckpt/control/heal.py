"""Replacing one replica group while the others train on (``parallelism.dp_replicate``).

The failed group's processes are killed (their heartbeat to the Lighthouse stops, so the healthy
groups' next quorum forms without them), and new ones take their ranks: an idle spare on the
rank's node first, else a new process in the rank's bundle; a group leaving a draining node gets
a placement group of its own, elsewhere (Ray places nothing on a draining node). They rendezvous as a group of their
own at their first rank's store, are set up without loading any checkpoint, and start ``run()``:
their first step waits for the healthy groups at the rejoin step and receives a live group's
state there (``replicas/sync.py``, ``rank/replicas.py``). Storage is never read. The first group
saves the checkpoints: before its replacement is set up, its saves in flight commit or are
aborted (``CheckpointService.heal_plans``), and the replacement saves from its rejoin step on; no
step is saved while it is out.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from raytrain_ckpt.control.hang_evidence import locate
from raytrain_ckpt.control.poll import GroupStartError
from raytrain_ckpt.control.pool import bundle_nodes, kill_actor, new_worker

logger = logging.getLogger(__name__)

__all__ = ["Replacement", "replace_replica"]


@dataclass
class Replacement:
    """A replica group's replacement: its ranks' ``run()`` refs (ref -> rank), and, when it was
    placed off a draining node, its own placement group and the node of each of its ranks."""

    runs: dict[ray.ObjectRef, int]
    pg: Any = None
    nodes: dict[int, str] = field(default_factory=dict)
    places: dict[int, Any] = field(default_factory=dict)
    """Rank -> ``RankPlace`` (pid, node) of each new process that said where it runs."""


def _off_node(spec: Any, size: int, deadline: float) -> Any:
    """A placement group of ``size`` rank bundles for a group leaving a draining node (Ray places
    no bundle on a draining node). Raises ``GroupStartError`` when it cannot be placed in time."""
    res = spec.resources
    bundle = {"CPU": res.cpus_per_worker, **({"GPU": res.gpus} if res.gpus else {})}
    pg = placement_group([bundle] * size, strategy=res.placement_strategy)
    if not pg.wait(timeout_seconds=max(0.1, deadline - time.monotonic())):
        remove_placement_group(pg)
        raise GroupStartError(f"no room for {size} x {bundle} off the draining node within "
                              "fault_tolerance.start_timeout_s")
    return pg


def _saving_plans(group: Any, old: list[Any], places: list[Any], nodes: list[str]) -> tuple[list[Any], float]:
    """The saving group's replacement's checkpoint plans, each naming the writer of the node its
    process landed on (``places``; ``nodes``: the bundles' nodes, where a process could not say),
    once the failed group's processes are gone and its saves in flight settled
    (``CheckpointService.heal_plans``); and the deadline for the rest of the start (the settle
    may take ``checkpoint.settle_timeout_s``)."""
    spec = group.spec
    ray.wait([w.where.remote() for w in old], num_returns=len(old), timeout=5.0)  # a killed actor's calls fail once it is gone
    try:
        plans = list(group.checkpoints.heal_plans([p.node_id if p is not None else n for p, n in zip(places, nodes,
                                                                                                     strict=True)]))
    except Exception as exc:  # noqa: BLE001 - the actor, a writer or the storage probe: the whole job restarts
        raise GroupStartError(f"the saving replica group's checkpoint plans: {exc}") from None
    return plans, time.monotonic() + spec.fault_tolerance.start_timeout_s


def replace_replica(group: Any, replica: int, pg: Any, calls: Any, lighthouse: Any, address: str | None,
                    off_node: bool = False) -> Replacement:
    """Kill replica group ``replica`` of ``group`` (a ``RayWorkerGroup``: its placement group
    ``pg``, its ``StartCalls``, its Lighthouse actor and that actor's ``address``) and start the
    replacement, in the group's bundles or, ``off_node`` (its node drains), in a placement group
    of its own. Raises ``GroupStartError`` when the replacement cannot be placed, join or set up
    within ``fault_tolerance.start_timeout_s``."""
    spec = group.spec
    size = spec.world_size // spec.parallelism.dp_replicate
    ranks = list(range(replica * size, (replica + 1) * size))
    deadline = time.monotonic() + spec.fault_tolerance.start_timeout_s
    ray.get(lighthouse.replacing.remote(replica))  # an earlier replacement's ranks are not ready any more
    own = _off_node(spec, size, deadline) if off_node else None  # before the kill: a drain's fallback still saves
    old = [group.workers[rank] for rank in ranks]
    for w in old:
        kill_actor(w)
    nodes = group.rank_nodes()
    spec_json = spec.model_dump_json()
    fresh: list[Any] = []
    for i, rank in enumerate(ranks):
        if own is not None:
            fresh.append(new_worker(spec, own, rank, group.attempt, group.run_id, bundle=i))
            continue
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
    places = locate(fresh, max(0.1, deadline - time.monotonic()))  # where the new processes run (hang stacks, writers)
    plans: list[Any] = [None] * size
    if replica == 0 and group.checkpoints is not None:
        plans, deadline = _saving_plans(group, old, places, [nodes[r] if nodes else "" for r in ranks])
    meet = calls.get(fresh[0].address.remote(), deadline, f"locate rank {ranks[0]}")
    joins = [w.join.remote(meet.host, meet.port) for w in fresh]
    setups = [w.setup.remote(plan, group.rollbacks_before, address, True) for w, plan in zip(fresh, plans, strict=True)]
    calls.get_all(joins, deadline, f"join replica {replica}'s rank {{rank}} to its process group")
    calls.get_all(setups, deadline, f"set up replica {replica}'s rank {{rank}}")
    for rank, w in zip(ranks, fresh, strict=True):
        group.workers[rank] = w
    logger.warning("attempt %d: replica group %d (ranks %d-%d) replaced%s; it rejoins from a live group%s",
                   group.attempt, replica, ranks[0], ranks[-1], " off its draining node" if own is not None else "",
                   " and saves the checkpoints again from there (none is saved until then)"
                   if plans[0] is not None else "")
    placed = dict(zip(ranks, bundle_nodes(own), strict=True)) if own is not None else {}
    return Replacement({w.run.remote(): rank for rank, w in zip(ranks, fresh, strict=True)}, own, placed,
                       {r: p for r, p in zip(ranks, places, strict=True) if p is not None})
