"""W&B (offline) and MLflow (a file store) as the job's loggers, read back with each library's own
API: a job whose rank 1 crashes after step 7 (step 5 committed: steps 6 and 7 are trained again),
then a resubmit of the same job to more steps. MLflow holds one run for both, with one point per
step from 1 to the end, the resolved spec as its config and the driver's commits and failure.
W&B holds one run id for every process of both submits (offline runs carry the id), with the config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import raytrain_ckpt
from raytrain_ckpt.checkpoint.storage.backends import job_root
from raytrain_ckpt.faults import ENV_VAR
from raytrain_ckpt.loggers import run_id

pytestmark = pytest.mark.integration

DEMO = "jobs/llama_debug_fsdp.yaml"


def _run(tmp_path: Path, steps: int) -> raytrain_ckpt.JobResult:
    return raytrain_ckpt.run(DEMO, [f"training.steps={steps}", "training.log_every_steps=1",
                                    "checkpoint.interval_steps=5", "resources.cpus_per_worker=1",
                                    "fault_tolerance.max_restarts=1", f"checkpoint.dir={tmp_path / 'ckpt'}",
                                    'training.loggers.backends=["mlflow", "wandb"]',
                                    f"training.loggers.mlflow_tracking_uri=file:{tmp_path / 'mlruns'}",
                                    f"training.loggers.wandb_dir={tmp_path / 'wandb'}",
                                    "training.loggers.wandb_mode=offline"])


def test_one_run_per_job_across_a_crash_and_a_resubmit(ray_cluster, tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason='the mlflow extra is not installed: pip install -e ".[mlflow]"')
    pytest.importorskip("wandb", reason='the wandb extra is not installed: pip install -e ".[wandb]"')
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv(ENV_VAR, "exit@step:rank=1,step=7")
    first = _run(tmp_path, 10)
    assert first.state is raytrain_ckpt.JobState.SUCCEEDED and [f.kind for f in first.failures] == ["crash"]
    monkeypatch.delenv(ENV_VAR)
    second = _run(tmp_path, 14)
    assert second.state is raytrain_ckpt.JobState.SUCCEEDED and second.results[0].start_step == 10

    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    [experiment] = [e for e in client.search_experiments() if e.name == "raytrain-ckpt"]
    [run] = client.search_runs([experiment.experiment_id])                 # one run for both submits
    rid = run_id(str(job_root(str(tmp_path / "ckpt"), "llama-debug-fsdp")))
    assert run.data.tags["raytrain_ckpt_run_id"] == rid
    loss = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in loss) == list(range(1, 15))             # continuous, never twice
    by_step = {m.step: m.value for m in loss}
    assert all(by_step[s] == pytest.approx(v, rel=1e-6) for s, v in second.losses.items())
    assert run.data.params["training.steps"] in ("10", "14") and run.data.params["name"] == "llama-debug-fsdp"
    commits = [m.step for m in client.get_metric_history(run.info.run_id, "checkpoint/committed_step")]
    assert sorted(commits) == sorted(set(commits)) and {5, 10, 14} <= set(commits), commits
    crashes = client.get_metric_history(run.info.run_id, "job/failures/crash")
    assert [m.value for m in crashes] == [1.0]
    spec = json.loads(Path(client.download_artifacts(run.info.run_id, "spec.json", str(tmp_path / "dl"))).read_text())
    assert spec["training"]["loggers"]["backends"] == ["mlflow", "wandb"]

    # wandb 0.31 writes offline runs from its Go core; each process's run directory is named
    # offline-run-<time>-<run id>, with the run's config in files/config.yaml
    runs = sorted((tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) >= 4, runs          # rank 0 and the driver, in each attempt and submit
    assert {r.name.rsplit("-", 1)[1] for r in runs} == {rid}               # one run id for the job
    configs = [r / "files" / "config.yaml" for r in runs if (r / "files" / "config.yaml").is_file()]
    assert configs and any("llama-debug-fsdp" in c.read_text() for c in configs)
