"""The preemption guard's side in the cluster: the job's ``PreemptionGuard`` built over its
CheckpointService (the measured save costs, the RAM tier, the writers), and what it asks Ray's GCS
(the CheckpointActor's node and state, the room left on nodes that are not draining).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from raytrain_ckpt.control.watch.preemption import PreemptionGuard, SaveCosts, draining_nodes

logger = logging.getLogger(__name__)

__all__ = ["actor_node", "actor_state", "preemption_guard", "room_for"]

MOVE_WAIT_S = 60.0
"""How long the driver waits for a CheckpointActor it restarted off a draining node to serve again."""


def preemption_guard(spec: Any, service: Any) -> PreemptionGuard | None:
    """The job's guard over drain notices and stop signals (None: nothing is checkpointed, so
    neither can be acted on; fault_tolerance.watch_drains off: signals only)."""
    if service is None:
        return None

    def costs() -> SaveCosts:
        status = service.status()
        latest = status.steps.get(status.latest) if status.latest is not None else None
        if latest is None:
            return SaveCosts()
        return SaveCosts(sum(latest.wall.get(k, 0.0) for k in ("stage_s", "persist_s", "commit_s")),
                         latest.wall.get("stage_s", 0.0), latest.bytes)

    def ram_cost(draining: set[str]) -> float | None:
        if spec.checkpoint.memory_copies < 2 or not service.ram_tier_nodes(draining):
            return None
        return costs().ram_s()

    def move_service() -> None:
        import ray

        was = actor_node(service.actor)
        ray.kill(service.actor, no_restart=False)
        deadline = time.monotonic() + MOVE_WAIT_S
        while time.monotonic() < deadline:  # back, elsewhere: the next call finds it serving
            if actor_state(service.actor) == "ALIVE" and actor_node(service.actor) not in (None, was):
                return
            time.sleep(0.2)
        logger.warning("the CheckpointActor is not back after %.0fs; calls to it wait for its restart", MOVE_WAIT_S)

    draining = draining_nodes if spec.fault_tolerance.watch_drains else dict
    res, ft = spec.resources, spec.fault_tolerance
    bundle = {"CPU": res.cpus_per_worker, **({"GPU": res.gpus} if res.gpus else {})}
    grow = ft.grow_check_s if res.min_workers is not None and res.min_workers < spec.world_size else None
    return PreemptionGuard(spec.training.steps, lambda: service.status().latest, lambda: costs().durable_s, draining,
                           service_node=lambda: actor_node(service.actor), move_service=move_service,
                           full_size=spec.world_size, grow_check_s=grow, room=lambda skip: room_for(bundle, skip),
                           ram_cost=ram_cost, keep_in_ram=service.keep_in_ram, retire_writer=service.fleet.retire,
                           saving_ranks=spec.saving_group().world_size)


def room_for(bundle: dict[str, float], draining: set[str]) -> int:
    """How many more ``bundle``s fit now on the cluster's nodes that are not draining."""
    import ray

    per_node = ray._private.state.available_resources_per_node()
    return sum(min(int(avail.get(k, 0.0) // v) for k, v in bundle.items() if v > 0)
               for node, avail in per_node.items() if node not in draining)


def _actor_info(handle: Any) -> dict:
    import ray

    try:
        return ray._private.state.actors(actor_id=handle._actor_id.hex()) or {}
    except Exception:  # noqa: BLE001 - an actor table Ray cannot read: nothing is moved
        return {}


def actor_node(handle: Any) -> str | None:
    """The node id an actor lives on, from the GCS's actor table (None: not known)."""
    return (_actor_info(handle).get("Address") or {}).get("NodeID") or None


def actor_state(handle: Any) -> str | None:
    """ALIVE, RESTARTING, DEAD, ... from the GCS's actor table (None: not known)."""
    return _actor_info(handle).get("State")
