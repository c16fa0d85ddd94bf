"""The Ray Train peer of the benches: the same ``Trainer`` under Ray Train's ``TorchTrainer``.

Each bench writes its own training loop (what it injects or watches differs) from these parts:
``start`` builds the ``Trainer`` in a Ray Train worker and resumes it from
``ray.train.get_checkpoint()``; ``save`` is Ray Train's documented checkpointing (``dcp.save`` by
every rank into one directory, then ``ray.train.report(checkpoint=...)`` from rank 0, which Ray
Train copies into the run's storage); ``torch_trainer`` wires a loop into a ``TorchTrainer`` on
2 CPU workers. Needs ``ray[train]`` (``pip install -e ".[bench]"``); ``available()`` says whether
it is installed, so a bench can skip the column without it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray


def available() -> bool:
    """Whether ``ray[train]`` and its dependencies import."""
    try:
        from ray.train.torch import TorchTrainer  # noqa: F401
    except ImportError:
        return False
    return True


def start(config: dict) -> tuple[Any, int, int | None]:
    """In a Ray Train worker: the ``Trainer`` of ``config["spec"]``, this worker's rank, and the step
    it resumed from (None on a fresh start). With ``parallelism.dp_replicate`` > 1 each worker is
    a replica group of its own (Ray Train's ``TorchftConfig``), the group of its rank."""
    import torch
    from ray import train

    from raytrain_ckpt.checkpoint.recovery.state import load_app_state
    from raytrain_ckpt.spec import JobSpec
    from raytrain_ckpt.rank.trainer import Trainer

    torch.set_num_threads(1)
    spec = JobSpec.model_validate_json(config["spec"])
    rank = train.get_context().get_world_rank()
    trainer = Trainer(spec, torch.device("cpu"), replica=rank if spec.parallelism.dp_replicate > 1 else 0)
    resumed = train.get_checkpoint()
    if resumed is not None:
        with resumed.as_directory() as d:
            load_app_state(trainer, d, same_world_size=True)
    return trainer, rank, None if resumed is None else trainer.state.step


def save(trainer: Any, tmp: Path, rank: int, metrics: dict) -> float:
    """Save the step in hand as Ray Train documents it (a collective); returns the seconds it took."""
    import torch.distributed.checkpoint as dcp
    from ray import train

    from raytrain_ckpt.checkpoint.recovery.state import app_state

    t0 = time.monotonic()
    d = tmp / f"rt-step-{trainer.state.step}"
    dcp.save(app_state(trainer), checkpoint_id=str(d))
    train.report(metrics, checkpoint=train.Checkpoint.from_directory(str(d)) if rank == 0 else None)
    return time.monotonic() - t0


def torch_trainer(loop: Callable[[dict], None], config: dict, tmp: Path, name: str, failure_config: Any,
                  torch_config: Any = None) -> Any:
    """A ``TorchTrainer`` running ``loop`` on 2 one-CPU workers, its storage under ``tmp``
    (``torch_config``: Ray Train's default ``TorchConfig`` when None)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # The loops live in the bench scripts and import this module: ship both by value, since the
    # workers' import path holds the repository, not bench/.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return TorchTrainer(
        loop, train_loop_config=config, torch_config=torch_config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(tmp / "storage"), name=name, failure_config=failure_config))
