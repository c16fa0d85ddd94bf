"""The demo job checkpointing to a real S3 endpoint (moto's server on 127.0.0.1): saves, a worker
killed from outside, a resume from S3 bit-identical to an uninterrupted run, retention, a writer
killed mid-upload, transient S3 errors, then the CLI against the bucket; and a multi-node cluster
(no shared directory) that loses the node of a rank and resumes from the bucket."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_ckpt.checkpoint.storage.dcp import key_spread
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.cli.main import main
from raytrain_ckpt.control.controller import JobResult, JobState
from raytrain_ckpt.control.driver import run_job
from raytrain_ckpt.common.faults import ENV_VAR
from raytrain_ckpt.control.preflight import load_spec

pytestmark = pytest.mark.integration

NODE_LOSS = Path(__file__).with_name("object_store_node_loss_job.py")
DEMO = "jobs/llama_debug_fsdp.yaml"
JOB = "llama-debug-fsdp"
# short sequences: the steps are a quarter of the demo's compute, the checkpointed state is the same
BASE = ["training.log_every_steps=1", "lr_scheduler.warmup_steps=2", "training.seq_len=32", "checkpoint.enabled=true",
        "checkpoint.interval_steps=5", "fault_tolerance.max_restarts=0"]


def _spec(ckpt_dir: str, options: dict, *extra: str):
    opts = ",".join(f"{k}: {v}" for k, v in options.items())
    return load_spec(DEMO, [*BASE, f"checkpoint.dir={ckpt_dir}", f"checkpoint.storage_options={{{opts}}}", *extra])


def _ok(result: JobResult) -> JobResult:
    assert result.state is JobState.SUCCEEDED, result.error
    return result


@pytest.fixture(scope="module")
def reference(reference_20) -> JobResult:
    """20 uninterrupted steps, checkpointing every 5 to a local directory (the session's run)."""
    return reference_20


def test_killed_worker_resumes_from_s3_bit_exact(reference, s3_endpoint, s3_bucket, monkeypatch, tmp_path,
                                                 cli_stderr, capsys):
    monkeypatch.setenv(ENV_VAR, "slow@step:rank=1,step=12;exit@step:rank=1,step=12")  # 3 s: step 10 commits first
    root = f"{s3_bucket}/runs"
    result = _ok(run_job(_spec(root, s3_endpoint.options, "training.steps=20", "fault_tolerance.max_restarts=1",
                               "checkpoint.keep_latest_k=2")))
    assert result.attempts == 2 and all(r.start_step == 10 for r in result.results)
    # parameters and optimizer state after step 20 are bit-identical to the uninterrupted run
    assert [r.fingerprint for r in result.results] == [r.fingerprint for r in reference.results]
    assert result.losses == {s: v for s, v in reference.losses.items() if s > 10}
    # retention on the bucket: the newest two steps and the newest certified one (step 10: 10 healthy
    # steps followed it, training.guard.certify_after_steps), each verifying with its checksums from S3
    layout = CheckpointLayout(f"{root}/{JOB}", options=s3_endpoint.options)
    assert result.checkpoints["committed"] == [10, 15, 20]
    assert sorted(layout.valid_steps("checksum")) == [10, 15, 20]
    assert sorted(layout.step_dirs()) == [10, 15, 20]
    _cli_against_the_bucket(layout, tmp_path, cli_stderr, capsys)


def _cli_against_the_bucket(layout: CheckpointLayout, tmp_path: Path, cli_stderr, capsys) -> None:
    """ls, verify, status and export with s3:// arguments (endpoint and credentials from the environment)."""
    root = str(layout.root)
    capsys.readouterr()
    assert main(["ls", root]) == 0
    out = capsys.readouterr().out
    assert all(f"step-000000{n}" in out for n in (10, 15, 20)) and out.count("valid") == 3
    assert main(["status", root]) == 0
    assert f"resume point: step 20 ({root}/step-00000020)" in capsys.readouterr().out
    assert main(["verify", f"{root}/step-00000020"]) == 0
    assert "VALID" in capsys.readouterr().out
    # S3 -> a local Hugging Face directory, and S3 -> another S3 prefix
    local = tmp_path / "hf"
    assert main(["export", root, "--out", str(local)]) == 0
    assert (local / "config.json").is_file() and (local / "model.safetensors.index.json").is_file()
    other = f"{root.split('/')[0]}//{root.split('/')[2]}/exports/hf"
    assert main(["export", f"{root}/step-00000020", "--out", other]) == 0
    uploaded = sorted(layout.storage.listdir(other))
    assert uploaded == sorted(p.name for p in local.iterdir())
    for name in uploaded:
        assert layout.storage.read_bytes(f"{other}/{name}") == (local / name).read_bytes(), name
    # a flipped byte in a shard: verify says CORRUPT (exit 1), and export refuses the step
    # each rank's file names start with its two hex digits: the save's keys spread over the store's key ranges
    names = sorted(n for n in layout.storage.listdir(layout.step_dir(20)) if n.endswith(".distcp"))
    assert names == sorted(f"{key_spread(r)}__{r}_0.distcp" for r in range(2)), names
    shard = layout.storage.join(layout.step_dir(20), f"{key_spread(1)}__1_0.distcp")
    data = bytearray(layout.storage.read_bytes(shard))
    data[len(data) // 2] ^= 0xFF
    layout.storage.write_bytes(shard, bytes(data))
    assert main(["verify", f"{root}/step-00000020"]) == 1
    assert "CORRUPT" in capsys.readouterr().out
    assert main(["export", f"{root}/step-00000020", "--out", str(tmp_path / "bad")]) == 2
    assert "CRC-32C" in cli_stderr() and not (tmp_path / "bad").exists()


def test_a_second_run_into_the_same_s3_job_root_is_refused_at_start(ray_cluster, s3_endpoint, s3_bucket, capfd):
    """On S3 too: a run whose job root another live run holds stops before anything starts,
    with one line naming the holder, exit 2, and nothing written to the bucket."""
    import boto3

    from tests.integration.test_checkpoint import refused_while_held
    from tests.unit.test_object_run_lock import _holder

    root = f"{s3_bucket}/runs/{JOB}"
    opts = ",".join(f"{k}: {v}" for k, v in s3_endpoint.options.items())
    refused_while_held(_holder(root), root, capfd, f"checkpoint.dir={s3_bucket}/runs",
                       f"checkpoint.storage_options={{{opts}}}")

    listed = boto3.client("s3", endpoint_url=s3_endpoint.url).list_objects_v2(Bucket=s3_bucket.removeprefix("s3://"))
    assert [o["Key"] for o in listed.get("Contents", [])] == [f"runs/{JOB}/.run.lock"]  # nothing else written


def test_a_run_whose_s3_run_lock_another_run_took_over_stops(ray_cluster, s3_endpoint, s3_bucket):
    """Another run writes the job root's lock while this one trains (as a run does that took over
    a lock it judged stale): at its next renewal the driver finds the lock is not its own, stops
    its job (FAILED, one reason) and leaves the other run's lock in place."""
    import threading
    import time

    import boto3

    bucket, key = s3_bucket.removeprefix("s3://"), f"runs/{JOB}/.run.lock"
    client = boto3.client("s3", endpoint_url=s3_endpoint.url)
    other = json.dumps({"holder": "pid 1 on elsewhere", "id": "other", "beat": 0}).encode()

    def take_over() -> None:
        while True:
            try:
                client.head_object(Bucket=bucket, Key=key)
                break
            except client.exceptions.ClientError:
                time.sleep(0.2)
        client.put_object(Bucket=bucket, Key=key, Body=other)

    thief = threading.Thread(target=take_over, daemon=True)
    thief.start()
    t0 = time.monotonic()
    result = run_job(_spec(f"{s3_bucket}/runs", s3_endpoint.options, "training.steps=300"))
    thief.join(timeout=5)
    assert result.state is JobState.FAILED, result.state
    assert "another run took this job's root over" in (result.error or ""), result.error
    assert [f.kind for f in result.failures] == ["checkpoint"], result.failures
    assert time.monotonic() - t0 < 120                      # stopped, not trained to the end
    assert client.get_object(Bucket=bucket, Key=key)["Body"].read() == other  # its lock is not ours to delete


def test_writer_killed_mid_upload_never_loads_that_step(reference, s3_endpoint, s3_bucket, monkeypatch):
    # the node's writer dies after rank 0's shards of step 5 are in the bucket, before any manifest
    monkeypatch.setenv(ENV_VAR, "exit@uploaded:rank=0,step=5")
    result = _ok(run_job(_spec(s3_bucket, s3_endpoint.options, "training.steps=20", "checkpoint.keep_latest_k=null")))
    status = result.checkpoints
    assert 5 not in status["committed"] and 5 in status["failed"]
    assert {10, 15, 20} <= set(status["committed"])                         # the next steps commit
    layout = CheckpointLayout(f"{s3_bucket}/{JOB}", options=s3_endpoint.options)
    assert 5 not in layout.step_dirs()                                      # its uploads were removed
    assert sorted(layout.valid_steps("checksum")) == status["committed"]
    assert [r.fingerprint for r in result.results] == [r.fingerprint for r in reference.results]


def test_leftover_upload_is_removed_on_start_and_never_loaded(s3_endpoint, s3_bucket, ray_cluster):
    layout = CheckpointLayout(f"{s3_bucket}/{JOB}", options=s3_endpoint.options)
    _ok(run_job(_spec(s3_bucket, s3_endpoint.options, "training.steps=5")))
    # shards of a step 10 whose writer was killed before its manifest (another run's leftovers)
    for name, _ in layout.read_manifest(layout.step_dir(5)).files.items():
        layout.storage.copy_file(layout.storage.join(layout.step_dir(5), name),
                                 layout.storage.join(layout.step_dir(10), name))
    result = _ok(run_job(_spec(s3_bucket, s3_endpoint.options, "training.steps=10",
                               "checkpoint.final_export={format: hf}")))
    assert all(r.start_step == 5 for r in result.results)                  # not from the leftover 10
    assert result.checkpoints["committed"] == [5, 10]
    assert sorted(layout.valid_steps("checksum")) == [5, 10]
    # the final export lands next to the steps, in the bucket, its config.json uploaded last
    out = f"{layout.root}/export-step-00000010"
    assert result.checkpoints["final_export"] == out
    assert {"config.json", "model.safetensors.index.json"} <= set(layout.storage.listdir(out))


def test_transient_s3_errors_are_retried_and_steps_commit(reference, s3_endpoint, s3_bucket, flaky_s3):
    flaky_s3.fail(8, every=3)               # every third write request: 503 SlowDown or a reset, 8 in all
    options = {**s3_endpoint.options, "endpoint_url": flaky_s3.url}
    result = _ok(run_job(_spec(s3_bucket, options, "training.steps=20", "checkpoint.keep_latest_k=null")))
    assert flaky_s3.failed == 8
    assert result.checkpoints["committed"] == [5, 10, 15, 20] and result.checkpoints["failed"] == {}
    layout = CheckpointLayout(f"{s3_bucket}/{JOB}", options=s3_endpoint.options)
    assert sorted(layout.valid_steps("checksum")) == [5, 10, 15, 20]
    assert [r.fingerprint for r in result.results] == [r.fingerprint for r in reference.results]


def test_multi_node_job_on_s3_survives_the_loss_of_a_rank_node_bit_exact(reference, s3_endpoint, s3_bucket):
    # a 0-CPU head and three 1-CPU nodes (own Ray cluster, in a subprocess); a node hosting a rank
    # (the CheckpointActor's, when it hosts one) is removed once step 10 is committed in the bucket,
    # while rank 0 hangs after step 12
    out = subprocess.run([sys.executable, str(NODE_LOSS), s3_endpoint.url, f"{s3_bucket}/runs"],
                         capture_output=True, text=True, timeout=600, cwd=NODE_LOSS.parents[2])
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    r = json.loads(lines[-1])
    assert r["state"] == "SUCCEEDED", r
    assert r["attempts"] == 2 and "node has died" in r["error"], r
    assert r["removed_node"] not in r["alive_nodes"] and r["surviving_node"] in r["alive_nodes"]
    assert r["committed_before_loss"] == [5, 10] and r["start_steps"] == [10, 10]     # resumed from S3
    # the restarted ranks (one on the spare node) end bit-identical to the uninterrupted run
    assert r["fingerprints"] == [x.fingerprint for x in reference.results]
    assert {int(k): v for k, v in r["losses"].items()} == {s: v for s, v in reference.losses.items() if s > 10}
    assert r["committed"] == [5, 10, 15, 20] and r["valid_in_bucket"] == [5, 10, 15, 20]
