"""A CheckpointWriter or CheckpointActor that stops answering is not handed to a restarted attempt:
with a real CheckpointActor and CheckpointWriter (``CheckpointService``), both processes are stopped
for real (SIGSTOP), the restart's plan (``plan_attempt``) pings them, kills them and gets fresh ones
from Ray, names them, and a save through the plan's writer then commits to real DCP files."""

from __future__ import annotations

import datetime
import os
import signal
from pathlib import Path

import ray
import torch

from raytrain_ckpt.checkpoint.roles.fleet import PING_TIMEOUT_S
from raytrain_ckpt.checkpoint.roles.service import CheckpointService
from raytrain_ckpt.spec import JobSpec


def _trainer_class() -> type:
    """The trainer actor's class, defined here so that Ray ships it by value (tests are not a package)."""

    class _Trainer:
        """One rank (world size 1) that saves a small state through a CheckpointClient."""

        def save(self, actor, writer, root: str, step: int) -> None:
            import torch.distributed as dist

            from raytrain_ckpt.checkpoint.roles.client import CheckpointClient
            from raytrain_ckpt.spec import CheckpointSpec

            # one rank: an in-process store, no port to race another process for
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=60))
            cfg = CheckpointSpec(enabled=True, dir=root, keep_latest_k=None, interval_steps=50)
            client = CheckpointClient(cfg, 0, 1, 100, actor, writer, torch.device("cpu"))
            client.save(step, {"model": {"w": torch.ones(64, 64)}})
            client.wait_committed()

    return _Trainer


def _pid(handle) -> int:
    return ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def test_a_stopped_writer_and_actor_are_replaced_before_the_restart_and_a_save_then_commits(ray_cluster, tmp_path: Path) -> None:
    spec = JobSpec.model_validate({"name": "silent-writer", "resources": {"num_workers": 1},
                                   "checkpoint": {"enabled": True, "dir": str(tmp_path), "keep_latest_k": None}})
    node = ray.get_runtime_context().get_node_id()
    service = CheckpointService(spec)
    stopped: list[int] = []
    try:
        service.acquire(0, spec)
        writer = service.writer_for(node)
        stopped = [_pid(writer), _pid(service.actor)]
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)                          # the writer's and the actor's processes stop

        plan = service.plan_attempt(1, spec, [node])              # the restart's plan pings it first

        assert service.replaced[1] == [f"checkpoint writer on node {node[:12]} did not answer "
                                       f"within {PING_TIMEOUT_S:g}s: replaced",
                                       f"checkpoint actor did not answer within {PING_TIMEOUT_S:g}s: replaced"]
        assert _pid(plan.ranks[0].writer) not in stopped          # fresh processes answer in their place
        assert _pid(service.actor) not in stopped
        trainer = ray.remote(_trainer_class()).options(num_cpus=0, max_restarts=0).remote()
        ray.get(trainer.save.remote(service.actor, plan.ranks[0].writer, str(tmp_path), 5), timeout=120)
        ray.get(service.actor.wait_committed.remote(5, 60), timeout=90)   # raises unless step 5 commits
        assert 5 in ray.get(service.actor.status.remote(), timeout=60).committed
        ray.kill(trainer)
    finally:
        for pid in stopped:
            for sig in (signal.SIGCONT, signal.SIGKILL):          # the old processes, if Ray left them
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
        service.shutdown()
