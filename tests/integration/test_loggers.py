"""W&B (offline) and MLflow (a file store) as the job's loggers, read back with each library's own
API: a job whose rank 0 gets a NaN at step 9 (the guard rolls back inside the attempt and trains
steps 7.. again on other samples) and whose rank 1 crashes after step 11 (the restart trains the
steps after the last commit again), then a resubmit of the same job to more steps. Each holds one
run for both submits, with one point per step from 1 to the end, the resolved spec as its config
and the driver's commits and failures.

wandb 0.31 has no Python reader for offline runs: its Go core writes each process's records to
``offline-run-<time>-<run id>/run-<run id>.wandb``, W&B's LevelDB-style log of ``wandb.proto``
``Record`` messages, which ``_wandb_records`` unframes and decodes with the library's own protos."""

from __future__ import annotations

import json
import struct
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

import raytrain_ckpt
from raytrain_ckpt.checkpoint.storage.backends import job_root
from raytrain_ckpt.common.faults import ENV_VAR
from raytrain_ckpt.observe.loggers import run_id

pytestmark = pytest.mark.integration

DEMO = "jobs/llama_debug_fsdp.yaml"
FAULTS = "nan@step:rank=0,step=9;exit@step:rank=1,step=11"


def _run(tmp_path: Path, steps: int) -> raytrain_ckpt.JobResult:
    return raytrain_ckpt.run(DEMO, [f"training.steps={steps}", "training.log_every_steps=1", "training.seq_len=32",
                                    "checkpoint.interval_steps=2", "training.guard.certify_after_steps=3",
                                    "resources.cpus_per_worker=1", "fault_tolerance.max_restarts=1",
                                    f"checkpoint.dir={tmp_path / 'ckpt'}",
                                    'training.loggers.backends=["mlflow", "wandb"]',
                                    f"training.loggers.mlflow_tracking_uri=file:{tmp_path / 'mlruns'}",
                                    f"training.loggers.wandb_dir={tmp_path / 'wandb'}",
                                    "training.loggers.wandb_mode=offline"])


def _wandb_records(path: Path) -> Iterator[object]:
    """The ``Record`` messages of one .wandb file: a 7-byte header (":W&B", magic, version), then
    32 KiB blocks of chunks, each a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle,
    4 last) and its bytes; a block's tail shorter than a header is padding."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B", data[:7]
    pos, parts = 7, []
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (kind == 0 and length == 0):
            pos += left
            continue
        parts.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def _wandb_run(directory: Path) -> tuple[set[str], list[dict], dict]:
    """Every offline process's run ids, history rows and config, read from its .wandb file."""
    ids, rows, config = set(), [], {}
    for path in sorted(directory.glob("offline-run-*/run-*.wandb")):
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
            elif kind == "config":
                config |= {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                           for item in record.config.update}
    return ids, rows, config


def test_one_run_per_job_across_a_rollback_a_crash_and_a_resubmit(ray_cluster, tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason='the mlflow extra is not installed: pip install -e ".[mlflow]"')
    pytest.importorskip("wandb", reason='the wandb extra is not installed: pip install -e ".[wandb]"')
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv(ENV_VAR, FAULTS)
    first = _run(tmp_path, 14)
    assert first.state is raytrain_ckpt.JobState.SUCCEEDED, first.error
    assert [f.kind for f in first.failures] == ["rollback", "crash"], first.failures
    monkeypatch.delenv(ENV_VAR)
    second = _run(tmp_path, 18)
    assert second.state is raytrain_ckpt.JobState.SUCCEEDED and second.results[0].start_step == 14
    rid = run_id(str(job_root(str(tmp_path / "ckpt"), "llama-debug-fsdp")))

    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    [experiment] = [e for e in client.search_experiments() if e.name == "raytrain-ckpt"]
    [run] = client.search_runs([experiment.experiment_id])                 # one run for both submits
    assert run.data.tags["raytrain_ckpt_run_id"] == rid
    loss = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in loss) == list(range(1, 19))             # continuous, never twice
    by_step = {m.step: m.value for m in loss}
    assert all(by_step[s] == pytest.approx(v, rel=1e-6) for s, v in second.losses.items())
    assert run.data.params["training.steps"] in ("14", "18") and run.data.params["name"] == "llama-debug-fsdp"
    commits = [m.step for m in client.get_metric_history(run.info.run_id, "checkpoint/committed_step")]
    assert sorted(commits) == sorted(set(commits)) and {10, 14, 18} <= set(commits), commits
    assert [m.value for m in client.get_metric_history(run.info.run_id, "job/failures/crash")] == [1.0]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "job/failures/rollback")] == [1.0]
    spec = json.loads(Path(client.download_artifacts(run.info.run_id, "spec.json", str(tmp_path / "dl"))).read_text())
    assert spec["training"]["loggers"]["backends"] == ["mlflow", "wandb"]

    ids, rows, config = _wandb_run(tmp_path / "wandb" / "wandb")
    assert ids == {rid}                        # rank 0 and the driver, in each attempt and submit: one run
    steps = Counter(row["_step"] for row in rows if "train/loss" in row)
    assert sorted(steps) == list(range(1, 19)) and set(steps.values()) == {1}, steps
    w_loss = {row["_step"]: row["train/loss"] for row in rows if "train/loss" in row}
    assert all(w_loss[s] == pytest.approx(v, rel=1e-6) for s, v in second.losses.items())
    assert all(w_loss[s] == pytest.approx(by_step[s], rel=1e-6) for s in w_loss)   # the same points as MLflow's
    w_commits = Counter(row["_step"] for row in rows if "checkpoint/committed_step" in row)
    # W&B's steps only go up in a process: a commit the driver learns of after it logged a later
    # step's failure is MLflow's only (the driver asks for commits before it logs a failure)
    assert set(w_commits.values()) == {1} and {14, 18} <= set(w_commits), w_commits
    assert config["name"] == "llama-debug-fsdp" and config["training"]["loggers"]["backends"] == ["mlflow", "wandb"]
