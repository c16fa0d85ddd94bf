"""The hand-off made as the staging copy begins, with real parts: a real CheckpointActor and
CheckpointWriter (``CheckpointService``), a trainer that is a real Ray actor with a real
process group and ``CheckpointClient``, real DCP files on disk.

A trainer that dies halfway through its copy (the process exits) or whose copy fails must not
leave the writer waiting forever or write a step it never finished staging: the writer aborts
that step itself (no restart happens here, so nothing else would), the step's files are gone,
and the step committed before it is untouched and loads.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from raytrain_ckpt.checkpoint.errors import StepAborted
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.checkpoint.roles.service import CheckpointService
from raytrain_ckpt.common.faults import ENV_VAR
from raytrain_ckpt.spec import JobSpec

pytestmark = pytest.mark.integration


def _trainer_class() -> type:
    """The trainer actor's class, defined here so that Ray ships it by value (tests are not a package)."""

    class _Trainer:
        """One rank (world size 1) saving a state of 16 tensors of 1 MiB through a CheckpointClient."""

        def setup(self, actor, writer, root: str) -> None:
            import datetime

            import torch.distributed as dist

            from raytrain_ckpt.checkpoint.roles.client import CheckpointClient
            from raytrain_ckpt.spec import CheckpointSpec

            # one rank: an in-process store, no port to race another process for
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=60))
            torch.manual_seed(0)
            self.state = {"model": {f"w{i}": torch.randn(512, 512) for i in range(16)}}
            cfg = CheckpointSpec(enabled=True, dir=root, keep_latest_k=None, interval_steps=50)
            self.client = CheckpointClient(cfg, 0, 0, 100, actor, writer, torch.device("cpu"))

        def save(self, step: int, faults: str = "") -> None:
            """Save ``step`` and wait for its commit; with ``faults``, the staging thread meets them."""
            os.environ[ENV_VAR] = faults
            for t in self.state["model"].values():
                t.add_(1.0)
            self.client.save(step, self.state)
            self.client.wait_committed()

        def pid(self) -> int:
            return os.getpid()

    return _Trainer


@contextmanager
def _job(tmp_path: Path, name: str) -> Iterator[tuple[CheckpointService, Any, Any]]:
    """A job's CheckpointService (actor and this node's writer) and one trainer set up against it."""
    spec = JobSpec.model_validate({"name": name, "resources": {"num_workers": 1},
                                   "checkpoint": {"enabled": True, "dir": str(tmp_path), "keep_latest_k": None}})
    service = CheckpointService(spec)
    try:
        service.acquire(0, spec)
        writer = service.writer_for(ray.get_runtime_context().get_node_id())
        trainer = ray.remote(_trainer_class()).options(num_cpus=0, max_restarts=0).remote()
        ray.get(trainer.setup.remote(service.actor, writer, str(tmp_path)))
        yield service, writer, trainer
        ray.kill(trainer)
    finally:
        service.shutdown()


def _values(saves: int) -> dict[str, torch.Tensor]:
    """The trainer's tensors as its ``saves``-th save saved them."""
    torch.manual_seed(0)
    out = {f"w{i}": torch.randn(512, 512) for i in range(16)}
    for t in out.values():
        for _ in range(saves):
            t.add_(1.0)
    return out


@pytest.mark.parametrize(("kind", "why"), [
    ("exit", "the trainer went away"),           # the process dies mid-copy: its lease on the buffer ends
    ("raise", "staging copy failed"),            # the copy raises: the buffer's progress says so
])
def test_a_copy_that_never_completes_aborts_its_step_and_keeps_the_committed_one(
        ray_cluster, tmp_path: Path, kind: str, why: str) -> None:
    with _job(tmp_path, "handoff") as (service, writer, trainer):
        ray.get(trainer.save.remote(5))                                   # committed before the fault

        # The hand-off to the writer is a call the copy thread sends as it begins; a process that
        # exits a few milliseconds later may take it down unsent (then no writer holds the step,
        # and a restart's settle aborts it). This test is about a writer that holds the step, so
        # the exit waits 3 s after the hand-off (``slow`` goes on to the next fault at the point).
        faults = f"{kind}@staging:rank=0,step=10"
        if kind == "exit":
            faults = f"slow@staging:rank=0,step=10,seconds=3;{faults}"
        with pytest.raises(ray.exceptions.RayError):
            ray.get(trainer.save.remote(10, faults), timeout=120)
        # No restart and no settle: only the writer can give step 10 up, and it must, at once.
        with pytest.raises(StepAborted, match=why):
            ray.get(service.actor.wait_committed.remote(10, 30))
        assert not ray.get(writer.holds.remote(0, 10))

        layout = CheckpointLayout(tmp_path / "handoff")
        assert set(layout.valid_steps()) == {5}
        assert not list((tmp_path / "handoff").glob("step-10*"))         # its temporary directory is removed
        import torch.distributed.checkpoint as dcp

        loaded = {"model": {f"w{i}": torch.empty(512, 512) for i in range(16)}}
        dcp.load(loaded, checkpoint_id=str(layout.step_dir(5)))
        assert all(torch.equal(loaded["model"][k], v) for k, v in _values(1).items())
        if kind == "raise":  # the trainer lives on, and its next save commits
            ray.get(trainer.save.remote(15))
            assert set(layout.valid_steps()) == {5, 15}


def test_the_writer_writes_each_tensor_only_once_the_copy_has_reached_it(ray_cluster, tmp_path: Path) -> None:
    """The copy pauses halfway (``slow@staging``: 3 s) after the writer already holds the step:
    the committed files hold the second half's new values, not what the buffer held before."""
    with _job(tmp_path, "paused") as (_, _, trainer):
        ray.get(trainer.save.remote(5))                 # the buffer now holds step 5's values
        ray.get(trainer.save.remote(10, "slow@staging:rank=0,step=10"))
        layout = CheckpointLayout(tmp_path / "paused")
        assert set(layout.valid_steps(level="checksum")) == {5, 10}
        import torch.distributed.checkpoint as dcp

        for step, saves in ((5, 1), (10, 2)):
            loaded = {"model": {f"w{i}": torch.empty(512, 512) for i in range(16)}}
            dcp.load(loaded, checkpoint_id=str(layout.step_dir(step)))
            assert all(torch.equal(loaded["model"][k], v) for k, v in _values(saves).items()), step
