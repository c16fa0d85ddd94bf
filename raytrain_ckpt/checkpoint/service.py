"""The driver's handle on checkpointing: creates the CheckpointActor and one writer per node,
picks the resume point for each attempt, and cleans up at the end of the job."""

from __future__ import annotations

import logging
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raytrain_ckpt.checkpoint.actor import CheckpointActor, ResumePoint
from raytrain_ckpt.checkpoint.writer import CheckpointWriter
from raytrain_ckpt.spec import JobSpec

logger = logging.getLogger(__name__)

__all__ = ["NAMESPACE", "CheckpointService", "actor_name"]

NAMESPACE = "raytrain_ckpt"
"""Ray namespace of a job's named actors, whatever namespace the driver runs in, so that
another process (``raytrain-ckpt status --job``) finds them by name."""


def actor_name(job: str) -> str:
    """The CheckpointActor's Ray name for a job (``raytrain-ckpt status`` finds it by this)."""
    return f"rtc-ckpt-{job}"


class CheckpointService:
    """Job-scoped: lives as long as the driver, across every attempt of the worker group."""

    def __init__(self, spec: JobSpec, fault_env: dict[str, str] | None = None) -> None:
        self.spec = spec
        cfg = spec.checkpoint
        self.root = (cfg.dir.expanduser().resolve() / spec.name)
        env = {"env_vars": fault_env} if fault_env else None
        self.actor = ray.remote(CheckpointActor).options(
            name=actor_name(spec.name), namespace=NAMESPACE, num_cpus=0, max_restarts=-1, max_task_retries=0,
            runtime_env=env,
        ).remote(str(self.root), spec.world_size, spec.spec_hash(), spec.dp_size, cfg.keep_latest_k,
                 cfg.keep_every_n_steps)
        self._writers: dict[str, Any] = {}
        self._env = env

    def writer_for(self, node_id: str) -> Any:
        """The CheckpointWriter pinned to ``node_id`` (created on first use)."""
        if node_id not in self._writers:
            cls = ray.remote(CheckpointWriter)
            self._writers[node_id] = cls.options(
                name=f"rtc-writer-{self.spec.name}-{node_id[:12]}", namespace=NAMESPACE, num_cpus=0,
                max_concurrency=64, max_restarts=-1, max_task_retries=0, runtime_env=self._env,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(self.spec.name, str(self.root), self.actor, self.spec.checkpoint.writer_threads,
                     self.spec.checkpoint.writer_nice)
        return self._writers[node_id]

    def acquire(self, attempt: int, spec: JobSpec) -> ResumePoint | None:
        """Verify and lease the checkpoint this attempt loads (None: start fresh).

        ``spec`` is the attempt's layout (an elastic restart may run fewer workers).
        """
        s = spec
        if attempt > 0:
            ray.get(self.actor.settle.remote(s.checkpoint.settle_timeout_s))
        ray.get(self.actor.configure.remote(s.world_size, s.dp_size, s.spec_hash(), s.model.model_dump(mode="json")))
        point = ray.get(self.actor.acquire.remote(f"attempt-{attempt}", s.checkpoint.resume
                                                  if attempt == 0 else "latest", s.checkpoint.verify_on_load))
        if point is None:
            logger.info("attempt %d: no checkpoint to resume from under %s; starting at step 0", attempt, self.root)
        else:
            logger.info("attempt %d: resuming from step %d (%s, saved at world size %d)", attempt, point.step,
                        point.path, point.world_size)
        return point

    def release(self, attempt: int) -> None:
        self.actor.release.remote(f"attempt-{attempt}")

    def status(self) -> dict[str, Any]:
        return ray.get(self.actor.status.remote())

    def shutdown(self) -> None:
        """Let handed-off saves commit, free staging memory, stop the actors.

        A job that failed may leave a step that every rank handed to a writer: it is still
        committed (bounded by checkpoint.settle_timeout_s), so the next run resumes from it.
        """
        try:
            ray.get(self.actor.settle.remote(self.spec.checkpoint.settle_timeout_s))
        except Exception as exc:  # the actor is gone: nothing in flight can commit anyway
            logger.warning("could not settle in-flight checkpoints: %s", exc)
        for w in self._writers.values():
            try:
                ray.get(w.release_all.remote(), timeout=30)
            except Exception as exc:  # a dead writer's files are gone with its node, or leak in /dev/shm
                logger.warning("could not release staging buffers: %s", exc)
            ray.kill(w, no_restart=True)
        ray.kill(self.actor, no_restart=True)
