"""The training guard in a real Ray job: a NaN injected on one rank never reaches a committed
step; the job rolls back to the certified step inside the attempt (no restart spent), skips the
exact sample window and finishes bit-identical to an uninterrupted run whose data stream excludes
exactly those samples; a trip that recurs every window spends the budget and fails with one report,
and no certified step was deleted."""

from __future__ import annotations

from pathlib import Path

import pytest

from raytrain_ckpt.checkpoint.format.fingerprints import step_stats
from raytrain_ckpt.checkpoint.format.manifest import MANIFEST, Manifest
from raytrain_ckpt.controller import JobState
from raytrain_ckpt.driver import run_job
from raytrain_ckpt.faults import ENV_VAR
from raytrain_ckpt.preflight import load_spec

pytestmark = pytest.mark.integration

DEMO = "jobs/llama_debug_fsdp.yaml"
GBS = 16
BASE = ["training.steps=16", "training.log_every_steps=1", "lr_scheduler.warmup_steps=2", "training.seq_len=32",
        "checkpoint.enabled=true", "checkpoint.interval_steps=2", "checkpoint.keep_latest_k=2",
        "training.guard.certify_after_steps=3", "fault_tolerance.max_restarts=0"]


def _spec(ckpt_dir: Path, *extra: str):
    return load_spec(DEMO, [*BASE, f"checkpoint.dir={ckpt_dir}", *extra])


def _manifests(root: Path) -> dict[int, Manifest]:
    return {int(p.parent.name.removeprefix("step-")): Manifest.from_json(p.read_text())
            for p in root.glob(f"step-*/{MANIFEST}") if p.parent.name.removeprefix("step-").isdigit()}


def test_nan_on_one_rank_rolls_back_skips_the_window_and_matches_a_run_without_it(tmp_path, monkeypatch, ray_cluster):
    monkeypatch.setenv(ENV_VAR, "nan@step:rank=1,step=9")
    spec = _spec(tmp_path)
    result = run_job(spec)
    assert result.state is JobState.SUCCEEDED, result.error
    # one attempt, no restart spent: the rollback happened inside it
    assert result.attempts == 1
    rollbacks = [f for f in result.failures if f.kind == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0].rank == 1
    rb = result.results[0].rollbacks[0]
    # saves at 2, 4, 6, 8; at step 9 (0-based) step 6 had 3 healthy steps after it, step 8 only 1
    assert (rb.to_step, rb.trip.step, rb.trip.metric) == (6, 9, "non-finite loss")
    assert rb.samples == (6 * GBS, 10 * GBS)  # steps 6..9 read [96, 160): never read again
    # no NaN reached any step on disk, committed or moved aside as the abandoned path
    root = tmp_path / spec.name
    on_disk = [p for p in root.iterdir() if p.name.startswith("step-")]
    assert any(".abandoned-" in p.name for p in on_disk), sorted(p.name for p in on_disk)
    for step_dir in on_disk:
        assert all(s.finite for s in step_stats(step_dir).values()), step_dir
    # the skip is recorded for later resumes; the newest certified step is kept by retention
    manifests = _manifests(root)
    final = manifests[16]
    assert final.skipped_samples == [[6, 96, 160]]
    assert final.certified_step is not None and final.certified_step in manifests
    # per-tensor fingerprints in the manifest, summed by the writers: they agree with the files
    read = step_stats(root / "step-00000016")
    assert final.tensors and set(final.tensors) <= set(read)
    for name, row in final.tensors.items():
        assert (row["numel"], row["nan"], row["inf"]) == (read[name].numel, 0, 0), name
        assert abs(row["norm"] - read[name].norm) <= 1e-6 * max(1.0, read[name].norm), name
    # bit-identical to an uninterrupted run whose data stream excludes exactly those samples
    monkeypatch.delenv(ENV_VAR)
    reference = run_job(_spec(tmp_path / "reference", "data.skip_samples=[[6, 96, 160]]"))
    assert reference.state is JobState.SUCCEEDED and not reference.failures, reference.error
    assert [r.fingerprint for r in result.results] == [r.fingerprint for r in reference.results]


def test_a_trip_every_window_spends_the_budget_and_fails_with_one_report(tmp_path, monkeypatch, ray_cluster):
    # each trip comes after a newer step was certified, so each rolls back; the third is one too many
    monkeypatch.setenv(ENV_VAR, "nan@step:rank=0,step=9;nan@step:rank=0,step=11;nan@step:rank=0,step=13")
    spec = _spec(tmp_path, "training.guard.max_rollbacks=2", "fault_tolerance.max_restarts=3")
    result = run_job(spec)
    assert result.state is JobState.FAILED
    assert result.attempts == 1  # never restarted: max_restarts=3 was not spent
    # the two rollbacks, each recorded as the controller saw it, then the trip that ended the job
    *rolled, final = [f for f in result.failures if f.kind == "rollback"]
    assert [f.headline.split(": rolled back to certified step ")[0] for f in rolled] == [
        "non-finite loss on rank 0 at step 10", "non-finite loss on rank 0 at step 12"], rolled
    report = final.detail
    assert "non-finite loss on rank 0 at step 14" in report and "max_rollbacks=2 rollbacks spent" in report
    assert "samples [" in report and report.count("earlier rollback") == 2
    # the newest certified step (step 10: healthy steps 10-12 followed it) was not deleted
    assert "newest certified step: 10 " in report
    assert 10 in _manifests(tmp_path / spec.name)
