"""A real Ray job on CUDA: NCCL, bf16 FSDP2, checkpoints staged through page-locked shared
memory on a side stream and written by the node's writer; a killed worker restarts the group,
which resumes from the newest committed step bit-identically on the same GPU and world size.
Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.control.controller import JobResult, JobState
from raytrain_ckpt.control.driver import run_job
from raytrain_ckpt.common.faults import ENV_VAR
from raytrain_ckpt.control.preflight import load_spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BASE = ["resources.use_gpu=true", "resources.num_workers=1", "parallelism.dp_shard=1", "training.deterministic=true",
        "training.steps=20", "training.log_every_steps=1", "lr_scheduler.warmup_steps=2", "checkpoint.enabled=true",
        "checkpoint.mode=async", "checkpoint.interval_steps=5", "checkpoint.keep_latest_k=null",
        "checkpoint.resume=none"]


def _run(ckpt_dir, *extra: str) -> JobResult:
    result = run_job(load_spec("jobs/llama_debug_fsdp.yaml", [*BASE, f"checkpoint.dir={ckpt_dir}", *extra]))
    assert result.state is JobState.SUCCEEDED, result.error
    return result


def test_killed_cuda_worker_resumes_bit_exact(ray_cluster, tmp_path, monkeypatch):
    reference = _run(tmp_path / "ref", "fault_tolerance.max_restarts=0")
    assert reference.checkpoints["committed"][-1] == 20
    assert reference.losses[20] < reference.losses[1]

    monkeypatch.setenv(ENV_VAR, "exit@step:rank=0,step=12")
    result = _run(tmp_path / "run", "fault_tolerance.max_restarts=1")
    assert result.attempts == 2 and "worker process died" in (result.error or "")
    assert [r.start_step for r in result.results] == [10]
    # parameters, optimizer state and every loss after the resume point equal the uninterrupted run
    assert [r.fingerprint for r in result.results] == [r.fingerprint for r in reference.results]
    assert result.losses == {s: v for s, v in reference.losses.items() if s > 10}
    # the CUDA run's checkpoints are ordinary, intact DCP steps
    layout = CheckpointLayout(tmp_path / "run" / "llama-debug-fsdp")  # <checkpoint.dir>/<job name>
    assert {10, 15, 20} <= set(result.checkpoints["committed"])
    assert layout.verify(layout.step_dir(20), "checksum").step == 20
