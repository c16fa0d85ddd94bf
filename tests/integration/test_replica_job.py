"""Replica groups (``parallelism.dp_replicate``) in a real job on a local Ray: each group its own
process group, the groups averaging gradients through torchft and stepping on its commit vote,
the first group saving checkpoints that load into any layout."""

from __future__ import annotations

import pytest

from raytrain_ckpt.common.faults import ENV_VAR
from raytrain_ckpt.control.controller import JobState
from raytrain_ckpt.control.driver import run_job
from raytrain_ckpt.control.preflight import load_spec

pytestmark = pytest.mark.integration

DEMO = "jobs/llama_debug_fsdp.yaml"
SHORT = ["training.steps=6", "training.log_every_steps=1", "lr_scheduler.warmup_steps=2", "resources.num_workers=2",
         "parallelism.dp_shard=-1", "resources.cpus_per_worker=1", "fault_tolerance.max_restarts=0",
         "checkpoint.interval_steps=3", "checkpoint.mode=sync"]


@pytest.fixture(scope="module")
def sharded(ray_cluster):
    """The same job without replicas: one group sharding the global batch over two workers."""
    result = run_job(load_spec(DEMO, [*SHORT, "checkpoint.enabled=false"]))
    assert result.state is JobState.SUCCEEDED, result.error
    return result


def test_two_replica_groups_train_the_global_batch_save_and_resume_without_replicas(sharded, tmp_path, monkeypatch):
    """dp_replicate=2 x dp_shard=1 with fault_tolerance.min_replicas=2 (the job does not step on
    with one group), the second group's process killed at step 4: the whole job restarts from the
    first group's checkpoint of step 3 (every group loads it), the fallback; both groups end
    with the same parameters and optimizer state; each trained its own share of every global batch
    (the losses, global means, are those of the same job as one group sharded over both workers,
    step by step); the first group's checkpoint
    resumes at dp_replicate=1 on one worker with exactly the parameters and optimizer state the
    replicas ended with."""
    ckpt = [f"checkpoint.dir={tmp_path}"]
    monkeypatch.setenv(ENV_VAR, "exit@step:rank=1,step=4")  # the second group's process dies: the job restarts
    replicated = run_job(load_spec(DEMO, [*SHORT, *ckpt, "name=replicated", "parallelism.dp_replicate=2",
                                          "fault_tolerance.max_restarts=1", "fault_tolerance.min_replicas=2"]))
    monkeypatch.delenv(ENV_VAR)
    assert replicated.state is JobState.SUCCEEDED, replicated.error
    assert replicated.attempts == 2 and replicated.failures[0].rank == 1
    assert [(r.rank, r.start_step, r.steps) for r in replicated.results] == [(0, 3, 6), (1, 3, 6)]
    assert replicated.results[0].fingerprint == replicated.results[1].fingerprint
    assert replicated.checkpoints is not None and replicated.checkpoints["committed"][-1] == 6
    assert sorted(replicated.losses) == [4, 5, 6]  # the steps the restarted attempt trained
    assert replicated.losses == pytest.approx({s: sharded.losses[s] for s in (4, 5, 6)}, rel=1e-4, abs=1e-5)
    alone = run_job(load_spec(DEMO, [*SHORT, *ckpt, "name=replicated", "resources.num_workers=1",
                                     "checkpoint.resume=6"]))
    assert alone.state is JobState.SUCCEEDED, alone.error
    assert [(r.start_step, r.steps) for r in alone.results] == [(6, 6)]
    assert alone.results[0].fingerprint == replicated.results[0].fingerprint


def test_replica_groups_of_two_shards_average_each_shard_with_its_peer(sharded):
    """dp_replicate=2 x dp_shard=2 (FSDP2 inside each group): rank k of one group ends with the same
    shard as rank k of the other, the shards differ, and the losses are those of the same global
    batch on one group of two shards."""
    four = [*SHORT, "checkpoint.enabled=false", "resources.num_workers=4", "resources.cpus_per_worker=0.5"]
    replicated = run_job(load_spec(DEMO, [*four, "parallelism.dp_replicate=2"]))
    assert replicated.state is JobState.SUCCEEDED, replicated.error
    prints = [r.fingerprint for r in replicated.results]
    assert prints[0] == prints[2] != prints[1] == prints[3]
    assert replicated.losses == pytest.approx(sharded.losses, rel=1e-4, abs=1e-5)
