"""The Ray worker group: a placement group and one TrainWorker actor per rank.

It implements the controller's small ``WorkerGroup`` protocol (start / poll / shutdown),
so the state machine is unit-tested with a fake and driven by this class in production.
"""

from __future__ import annotations

import logging
import os
import time

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raytrain_ckpt.checkpoint.service import CheckpointService
from raytrain_ckpt.controller import GroupPoll, GroupStartError, elastic_world_size
from raytrain_ckpt.faults import fault_env
from raytrain_ckpt.spec import JobSpec
from raytrain_ckpt.worker import Progress, TrainWorker, WorkerFailure, WorkerResult

logger = logging.getLogger(__name__)

__all__ = ["RayWorkerGroup"]


class RayWorkerGroup:
    """``num_workers`` TrainWorker actors in one placement group."""

    def __init__(self, spec: JobSpec, attempt: int, checkpoints: CheckpointService | None = None) -> None:
        self.spec = spec
        self.attempt = attempt
        self.checkpoints = checkpoints
        self.workers: list[ray.actor.ActorHandle] = []
        self._runs: dict[ray.ObjectRef, int] = {}
        self._results: dict[int, WorkerResult] = {}
        self._pg = None

    def start(self) -> None:
        """Reserve bundles, create the actors, rendezvous, and start ``run()`` on every rank."""
        ft, res = self.spec.fault_tolerance, self.spec.resources
        deadline = time.monotonic() + ft.start_timeout_s
        # build placement group (smaller, when elastic and the full group does not fit in time)
        bundle = {"CPU": res.cpus_per_worker, **({"GPU": res.gpus} if res.gpus else {})}
        self._pg = self._place(bundle, deadline)
        # build actors
        actor_cls = ray.remote(TrainWorker)
        spec_json = self.spec.model_dump_json()
        # A fault plan set on the driver reaches every worker (see raytrain_ckpt.faults).
        env = fault_env()
        for rank in range(self.spec.world_size):
            strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank)
            self.workers.append(
                actor_cls.options(
                    num_cpus=res.cpus_per_worker, num_gpus=res.gpus, max_concurrency=2,
                    scheduling_strategy=strategy,
                ).remote(spec_json, rank, self.spec.world_size, self.attempt, env)
            )
        # rendezvous at rank 0's node, then set up every rank concurrently
        addr, port = self._get(self.workers[0].address.remote(), deadline, "locate rank 0")
        remaining = max(1.0, deadline - time.monotonic())
        ckpt = self._checkpoint_args()
        try:
            setups = [w.setup.remote(addr, port, remaining, ckpt[rank]) for rank, w in enumerate(self.workers)]
            for rank, ref in enumerate(setups):
                self._get(ref, deadline, f"set up rank {rank}")
        finally:
            if self.checkpoints is not None:
                self.checkpoints.release(self.attempt)
        self._runs = {w.run.remote(): rank for rank, w in enumerate(self.workers)}
        logger.info("attempt %d: %d workers training (rendezvous %s:%d)", self.attempt, len(self.workers), addr, port)

    def _place(self, bundle: dict[str, float], deadline: float):
        ft, res = self.spec.fault_tolerance, self.spec.resources
        elastic = res.min_workers is not None and res.min_workers < self.spec.world_size
        wait_s = min(ft.placement_timeout_s, ft.start_timeout_s) if elastic else ft.start_timeout_s
        pg = placement_group([dict(bundle)] * self.spec.world_size, strategy=res.placement_strategy)
        if pg.wait(timeout_seconds=wait_s):
            return pg
        remove_placement_group(pg)
        if elastic:
            fit = min(int(ray.available_resources().get(k, 0.0) // v) for k, v in bundle.items() if v > 0)
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

    def _checkpoint_args(self) -> list[dict | None]:
        """Per rank: the CheckpointActor, the writer on the rank's node, and what to resume from."""
        if self.checkpoints is None:
            return [None] * self.spec.world_size
        point = self.checkpoints.acquire(self.attempt, self.spec)
        nodes = placement_group_table(self._pg)["bundles_to_node_id"]
        return [{"actor": self.checkpoints.actor, "writer": self.checkpoints.writer_for(nodes[rank]),
                 "resume_path": point.path if point else None,
                 "resume_world_size": point.world_size if point else None}
                for rank in range(self.spec.world_size)]

    def _get(self, ref: ray.ObjectRef, deadline: float, what: str):
        try:
            return ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
        except GetTimeoutError:
            raise GroupStartError(
                f"timed out trying to {what} within fault_tolerance.start_timeout_s="
                f"{self.spec.fault_tolerance.start_timeout_s:g}s"
            ) from None
        except (WorkerFailure, RayActorError) as exc:
            raise GroupStartError(f"failed to {what}: {exc}") from None

    def poll(self) -> GroupPoll:
        """Collect finished runs and failures, then read every rank's progress."""
        failures: list[str] = []
        died = False
        pending = [r for r in self._runs if self._runs[r] not in self._results]
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0) if pending else ([], [])
        for ref in ready:
            rank = self._runs[ref]
            try:
                self._results[rank] = ray.get(ref)
            except WorkerFailure as exc:
                # Ray wraps the worker's exception; its cause carries the clean traceback.
                failures.append(str(getattr(exc, "cause", None) or exc))
            except RayActorError as exc:
                died = True
                failures.insert(0, f"rank {rank} (attempt {self.attempt}): worker process died: {_first_line(exc)}")
        progress = self._progress()
        finished = len(self._results) == len(self.workers)
        return GroupPoll(
            results=[self._results[r] for r in sorted(self._results)],
            failures=failures,
            process_died=died,
            min_step=min((p.step for p in progress.values()), default=0),
            rank0=progress.get(0),
            finished=finished,
        )

    def _progress(self) -> dict[int, Progress]:
        refs = {w.progress.remote(): rank for rank, w in enumerate(self.workers) if rank not in self._results}
        out = {r.rank: Progress(r.rank, r.steps, None, time.time(), "done") for r in self._results.values()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.spec.fault_tolerance.poll_interval_s)
        for ref in ready:
            try:
                p = ray.get(ref)
                out[p.rank] = p
            except RayActorError:
                # The run() ref of a dead actor reports the death; nothing to add here.
                pass
        return out

    def shutdown(self) -> None:
        """Kill the actors (no Ray-level restart: the controller decides) and free the bundles."""
        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception as exc:  # already dead: nothing left to release
                logger.debug("kill failed: %s", exc)
        self.workers = []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
