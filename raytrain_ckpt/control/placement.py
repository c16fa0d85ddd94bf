"""Where a group's ranks go: a placement group kept off quarantined nodes while the others have
room, shrunk to the world size that fits when the job is elastic (``resources.min_workers``) and
the full group cannot be placed in time, and the health probe a node whose ranks failed before
passes before it gets a rank again (``control/watch/health.py``)."""

from __future__ import annotations

import logging
import time

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from raytrain_ckpt.control.poll import GroupStartError
from raytrain_ckpt.control.policy import elastic_world_size
from raytrain_ckpt.control.pool import bundle_nodes, kill_actor
from raytrain_ckpt.control.watch.drains import room_for
from raytrain_ckpt.control.watch.preemption import draining_nodes
from raytrain_ckpt.control.watch.quarantine import Quarantine
from raytrain_ckpt.spec import JobSpec

logger = logging.getLogger("raytrain_ckpt.control.group")  # the group's lines, as before the split

__all__ = ["Placement", "room_outside"]


class Placement:
    """The placement of one attempt's group; ``spec`` is the job's, or the shrunk one that fit."""

    def __init__(self, spec: JobSpec, attempt: int, quarantine: Quarantine | None) -> None:
        self.spec = spec
        self.attempt = attempt
        self.quarantine = quarantine

    def place(self, bundle: dict[str, float], deadline: float):
        ft, res = self.spec.fault_tolerance, self.spec.resources
        elastic = res.min_workers is not None and res.min_workers < self.spec.world_size
        wait_s = min(ft.placement_timeout_s, ft.start_timeout_s) if elastic else ft.start_timeout_s
        selector = self._around_quarantine(bundle)
        pg = placement_group([dict(bundle)] * self.spec.world_size, strategy=res.placement_strategy,
                             **({"bundle_label_selector": selector} if selector else {}))
        if pg.wait(timeout_seconds=wait_s):
            return pg
        remove_placement_group(pg)
        if elastic:
            fit = room_for(bundle, set(draining_nodes()))  # a draining node takes no bundle
            t = self.spec.training
            n = elastic_world_size(self.spec.world_size, res.min_workers, fit, t.global_batch_size, t.micro_batch_size,
                                   self.spec.parallelism.pp)
            if n is not None and n < self.spec.world_size:
                logger.warning("attempt %d: %d workers could not be placed within fault_tolerance.placement_timeout_s="
                               "%gs; %d fit: continuing with %d workers (dp %d, global batch %d, %d micro-batches "
                               "per rank)", self.attempt, self.spec.world_size, wait_s, fit, n,
                               n // self.spec.parallelism.pp, t.global_batch_size,
                               self.spec.with_workers(n).local_microbatches)
                self.spec = self.spec.with_workers(n)
                pg = placement_group([dict(bundle)] * n, strategy=res.placement_strategy)
                if pg.wait(timeout_seconds=max(0.1, deadline - time.monotonic())):
                    return pg
                remove_placement_group(pg)
        raise GroupStartError(
            f"could not reserve {self.spec.world_size} x {bundle} within {wait_s:g}s; the cluster has "
            f"{ray.available_resources()} available. Lower resources.num_workers / cpus_per_worker, add nodes, "
            "or set resources.min_workers to allow a smaller group."
        )

    def _around_quarantine(self, bundle: dict[str, float]) -> list[dict[str, str]] | None:
        """The label selector keeping the group off quarantined nodes, when the other alive nodes
        have room for every rank (else None: the group may use them, logged)."""
        q = self.quarantine
        selector = q.selector(time.monotonic(), self.spec.world_size) if q is not None else None
        if selector is None or q is None:
            return None
        out = set(q.excluded(time.monotonic()))
        room = room_outside(self.spec, out, bundle)
        if room < self.spec.world_size:
            logger.warning("attempt %d: quarantined node(s) %s used: the other nodes have room for %d of %d ranks",
                           self.attempt, ", ".join(sorted(out)), room, self.spec.world_size)
            return None
        logger.info("attempt %d: placing around quarantined node(s) %s", self.attempt, ", ".join(sorted(out)))
        return selector

    def probe_failed_nodes(self, pg: PlacementGroup, survivors: dict[int, ray.actor.ActorHandle]) -> None:
        """Before a node whose ranks failed before gets a rank: a short health probe (``control/watch/health.py``;
        in a kept rank's process on a CPU node that has one, ``survivors``: no new process on the restart's path).
        A node that fails it is quarantined and this start fails, so the next is placed around it."""
        q = self.quarantine
        if q is None or q.quarantine_s is None:
            return
        where = bundle_nodes(pg)
        nodes = [n for n in where if n in q.failures]
        if not nodes:
            return
        from raytrain_ckpt.checkpoint.storage.backends import job_root
        from raytrain_ckpt.checkpoint.storage.probe import local_root
        from raytrain_ckpt.control.watch.health import plan_probes, probe_nodes

        ck = self.spec.checkpoint
        plans = plan_probes(nodes, where, set(survivors), self.spec.resources.gpus)
        kept = {where[rank]: actor for rank, actor in sorted(survivors.items())}  # a CPU node's checks run there
        problems = probe_nodes(plans, local_root(str(job_root(ck.dir, self.spec.name))) if ck.enabled else None,
                               pg, kept)
        if not problems:
            logger.info("attempt %d: node(s) %s passed the health probe", self.attempt,
                        ", ".join(n[:12] for n in nodes))
            return
        for node in problems:
            q.put_out(node, time.monotonic())
        for actor in survivors.values():
            kill_actor(actor)
        text = "; ".join(f"node {n} failed its health probe ({p})" for n, p in problems.items())
        raise GroupStartError(f"{text}: quarantined for {q.quarantine_s:g}s (fault_tolerance.quarantine_s)")


def room_outside(spec: JobSpec, out: set[str], bundle: dict[str, float] | None = None) -> int:
    """How many ranks the alive nodes other than ``out`` have room for (their total resources)."""
    res = spec.resources
    bundle = bundle or {"CPU": res.cpus_per_worker, **({"GPU": res.gpus} if res.gpus else {})}
    return sum(min(int(n["Resources"].get(k, 0.0) // v) for k, v in bundle.items() if v > 0)
               for n in ray.nodes() if n["Alive"] and n["NodeID"] not in out)
