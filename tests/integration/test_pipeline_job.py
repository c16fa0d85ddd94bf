"""Pipeline-parallel jobs on a real local Ray: a killed stage restarts the group and the job
finishes bit-exact; its checkpoints (saved through the CheckpointActor) resume as pure FSDP."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.control.controller import JobResult, JobState
from raytrain_ckpt.control.driver import run_job
from raytrain_ckpt.common.faults import ENV_VAR
from raytrain_ckpt.control.preflight import load_spec

pytestmark = pytest.mark.integration

PP = "jobs/llama_debug_pp.yaml"
BASE = ["training.steps=10", "training.log_every_steps=1", "lr_scheduler.warmup_steps=2", "training.seq_len=32",
        "model.overrides.dim=64", "checkpoint.interval_steps=4", "checkpoint.keep_latest_k=null",
        "fault_tolerance.max_restarts=0"]


def _run(ckpt_dir: Path, *extra: str) -> JobResult:
    result = run_job(load_spec(PP, [*BASE, f"checkpoint.dir={ckpt_dir}", *extra]))
    assert result.state is JobState.SUCCEEDED, result.error
    return result


@pytest.fixture(scope="module")
def reference(ray_cluster, tmp_path_factory) -> tuple[Path, JobResult]:
    """10 uninterrupted pp=2 steps, checkpointing every 4."""
    root = tmp_path_factory.mktemp("pp-ref")
    return root, _run(root)


def test_killed_stage_restarts_the_group_and_finishes_bit_exact(reference, tmp_path, monkeypatch):
    _, ref = reference
    # rank 1 holds the last stage. Spares start once the driver has seen every rank training; the
    # pause at step 5 lets it see that before the crash on a tiny model whose steps take milliseconds.
    monkeypatch.setenv(ENV_VAR, "slow@step:rank=1,step=5;exit@step:rank=1,step=6")
    result = _run(tmp_path, "fault_tolerance.max_restarts=1")
    assert result.attempts == 2 and "worker process died" in (result.error or "")
    assert all(r.start_step == 4 for r in result.results)
    assert [r.fingerprint for r in result.results] == [r.fingerprint for r in ref.results]
    assert result.losses == {s: v for s, v in ref.losses.items() if s > 4}
    # the first stage's process was kept; the warm spare took the last stage
    assert [(r.served, r.was_spare) for r in result.results] == [((0, 1), False), ((1,), True)]


def test_pp_checkpoint_resumes_as_pure_fsdp(reference, tmp_path):
    root, ref = reference
    step8 = CheckpointLayout(root / "llama-debug-pp").step_dir(8)
    assert CheckpointLayout(step8.parent).verify(step8).pp_size == 2
    result = _run(tmp_path, "parallelism.pp=1", "parallelism.dp_shard=2", f"checkpoint.resume={step8}")
    assert all(r.start_step == 8 for r in result.results)
    # the same optimization continues (only the float reduction order differs)
    for step in (9, 10):
        assert result.losses[step] == pytest.approx(ref.losses[step], rel=1e-4)
