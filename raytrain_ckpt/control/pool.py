"""What a job keeps between attempts: the placement group, surviving worker processes, spares.

Rebuilding a group from nothing costs a placement, a Ray worker process per rank and a torch
import in each (seconds). After a rank crashed on a node that is still alive, most of that is
not needed: the placement group still holds its bundles, the surviving ranks' processes are
healthy once they have left the failed step, and a spare process started ahead of time
(torch already imported) can take the dead rank's place. The pool holds these between the
failed group's ``shutdown(keep_warm=True)`` and the next group's ``start()``; whatever it
cannot vouch for is killed and the next group starts from nothing, as before.

Spares start with the job's first group when every node of its bundles has a core the bundles do
not take; otherwise, and after a restart, once every rank trained a step (a spare importing torch while the group sets up or loads
would take CPU from the very start it is meant to speed up). Spares hold no Ray resources while idle (``num_cpus=0``, pinned to a node): when one takes
over a dead rank it runs on the CPU share that the dead rank's bundle still reserves. They are
CPU-only; on GPU a replacement is started inside the bundle so Ray assigns it the GPU.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from raytrain_ckpt.common.events import headline
from raytrain_ckpt.common.faults import fault_env
from raytrain_ckpt.spec import JobSpec
from raytrain_ckpt.spec.memory import spare_reserve_bytes
from raytrain_ckpt.rank.worker import SPARE_RANK, TrainWorker

logger = logging.getLogger(__name__)

__all__ = ["WorkerPool", "bundle_nodes", "drain", "kill_actor", "new_worker"]


def bundle_nodes(pg: PlacementGroup) -> list[str]:
    """Node id of every bundle, by bundle index."""
    table = placement_group_table(pg)["bundles_to_node_id"]
    return [table.get(i, "") for i in range(len(pg.bundle_specs))]  # "": a bundle whose node is gone, not placed again yet


def _alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


class WorkerPool:
    """Job-scoped keeper of reusable workers; see the module docstring."""

    def __init__(self, spec: JobSpec, fault_env: dict[str, str] | None = None) -> None:
        self.spec = spec
        self._env = fault_env
        self._pg: PlacementGroup | None = None
        self._survivors: dict[int, Any] = {}
        self._spares: dict[str, list[Any]] = {}

    # --- between attempts ----------------------------------------------------------------

    def keep(self, pg: PlacementGroup, survivors: dict[int, Any]) -> None:
        """Hold a failed group's placement group and its reset survivors (by rank) for the next attempt."""
        self._pg, self._survivors = pg, dict(survivors)

    def take(self, world_size: int) -> tuple[PlacementGroup, dict[int, Any]] | None:
        """The kept placement group and survivors, if the next attempt can use them as they are.

        Usable means the same number of bundles and every bundle's node alive; otherwise
        everything kept is released and None is returned (the caller places from scratch).
        """
        pg, survivors = self._pg, self._survivors
        self._pg, self._survivors = None, {}
        if pg is None:
            return None
        try:
            nodes = bundle_nodes(pg)
            usable = len(nodes) == world_size and set(nodes) <= _alive_nodes()
        except Exception as exc:  # the placement group is gone (its node died): start from scratch
            logger.warning("kept placement group unusable: %s", exc)
            usable = False
        if usable:
            return pg, survivors
        logger.info("not reusing workers: the kept placement group lost a node or the layout changed")
        for w in survivors.values():
            kill_actor(w)
        remove_placement_group(pg)
        return None

    # --- spares --------------------------------------------------------------------------

    def spare_for(self, node_id: str) -> Any | None:
        """An idle spare on ``node_id`` (removed from the pool), or None."""
        spares = self._spares.get(node_id) or []
        return spares.pop() if spares else None

    @staticmethod
    def idle_cores(pg: PlacementGroup) -> bool:
        """Whether every node of ``pg``'s bundles has a core its bundles do not take: spares there
        can start with the group (their torch import then takes no CPU the ranks' start needs)."""
        taken: dict[str, float] = {}
        for node, spec in zip(bundle_nodes(pg), pg.bundle_specs):
            taken[node] = taken.get(node, 0.0) + float(spec.get("CPU", 0.0))
        cores = {n["NodeID"]: float(n.get("Resources", {}).get("CPU", 0.0)) for n in ray.nodes() if n.get("Alive")}
        return all(node in cores and cores[node] - used >= 1.0 for node, used in taken.items())

    def replenish_once_trained(self, pg: PlacementGroup, progress: dict[int, Any], ranks: int) -> bool:
        """``replenish`` once each of the group's ``ranks`` finished a step (its ``progress``);
        whether it did."""
        # a rank in a save has finished a step too ("saving" is the step after one, not a set-up phase)
        if len(progress) == ranks and all(p.phase in ("training", "saving", "done") for p in progress.values()):
            self.replenish(pg)
            return True
        return False

    def replenish(self, pg: PlacementGroup, early: bool = False) -> bool:
        """Start spares (without waiting) until the job has ``fault_tolerance.spare_workers`` of them,
        spread over the nodes of ``pg``'s bundles; ``early``: only if every node has idle cores
        (``idle_cores``). Whether it started them (False: the job has none, or not yet)."""
        ft = self.spec.fault_tolerance
        want = ft.spare_workers
        if want == 0 or not ft.reuse_workers or ft.max_restarts == 0 or self.spec.resources.use_gpu:
            return False
        if early and not self.idle_cores(pg):
            return False
        nodes = list(dict.fromkeys(bundle_nodes(pg)))
        have = sum(len(v) for v in self._spares.values())
        reserve = spare_reserve_bytes(self.spec)  # memory each spare touches ahead for a takeover
        for i in range(have, want):
            node = nodes[i % len(nodes)]
            spare = ray.remote(TrainWorker).options(
                num_cpus=0, max_concurrency=2,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            ).remote(self.spec.model_dump_json(), SPARE_RANK, self.spec.world_size, 0, self._env)
            spare.warm.remote()
            if reserve:
                spare.reserve_state.remote(reserve)
            self._spares.setdefault(node, []).append(spare)
        if want > have:
            logger.info("%d spare worker(s) starting%s", want - have,
                        f", each with {reserve / 2**30:.2f} GiB touched ahead for a rank's optimizer state"
                        if reserve else "")
        return True

    def close(self) -> None:
        """Kill everything kept (the job is over)."""
        for w in self._survivors.values():
            kill_actor(w)
        for spares in self._spares.values():
            for w in spares:
                kill_actor(w)
        if self._pg is not None:
            remove_placement_group(self._pg)
        self._pg, self._survivors, self._spares = None, {}, {}


def kill_actor(actor: Any) -> None:
    """``ray.kill`` without Ray-level restart; an already dead actor is fine."""
    try:
        ray.kill(actor, no_restart=True)
    except Exception as exc:  # already dead: nothing left to release
        logger.debug("kill failed: %s", exc)


def drain(runs: dict[ray.ObjectRef, int], workers: list[ray.actor.ActorHandle],
          drain_timeout_s: float) -> dict[int, ray.actor.ActorHandle]:
    """Reset every rank whose run() ends before the drain timeout; returns those that reset cleanly.

    A rank whose own code failed leaves its peers blocked in a collective with it;
    resetting it first (closing its connections) is what unblocks them, so reset as soon
    as each run ends rather than after all of them.
    """
    deadline = time.monotonic() + drain_timeout_s
    running = dict(runs)
    resets: dict[ray.ObjectRef, int] = {}
    while running and time.monotonic() < deadline:
        ended, _ = ray.wait(list(running), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        for ref in ended:
            rank = running.pop(ref)
            if _ended_alive(ref):
                resets[workers[rank].reset.remote()] = rank
    survivors = {}
    done, _ = ray.wait(list(resets), num_returns=len(resets), timeout=max(0.1, deadline - time.monotonic()))
    for ref in done:
        try:
            ray.get(ref)
            survivors[resets[ref]] = workers[resets[ref]]
        except Exception as exc:  # a rank that cannot reset is replaced, not reused
            logger.warning("rank %d could not reset and is replaced: %s", resets[ref], headline(str(exc)))
    return survivors


def _ended_alive(ref: ray.ObjectRef) -> bool:
    """Whether a finished run() ref came from a process that is still alive."""
    try:
        ray.get(ref)
    except RayActorError:
        return False
    except Exception:  # the rank raised (often because a peer died): the process itself is fine
        return True
    return True


def new_worker(spec: JobSpec, pg: PlacementGroup, rank: int, attempt: int, run_id: str,
               bundle: int | None = None) -> ray.actor.ActorHandle:
    """A new TrainWorker process for ``rank`` of ``attempt`` in bundle ``bundle`` (default: ``rank``) of ``pg``."""
    res = spec.resources
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank if bundle is None else bundle)
    # A fault plan set on the driver reaches every worker (see raytrain_ckpt.common.faults).
    return ray.remote(TrainWorker).options(
        num_cpus=res.cpus_per_worker, num_gpus=res.gpus, max_concurrency=2, scheduling_strategy=strategy,
    ).remote(spec.model_dump_json(), rank, spec.world_size, attempt, fault_env(), run_id)
