"""The training guard in a real Ray job: a NaN injected on one rank never reaches a committed
step; the job rolls back to the certified step inside the attempt (no restart spent), skips the
exact sample window and finishes bit-identical to an uninterrupted run whose data stream excludes
exactly those samples; a loss spike injected through the data (random tokens written into a real
token shard) is detected, rolled back and skipped; a trip that recurs every window spends the budget
and fails with one report, and no certified step was deleted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from raytrain_ckpt.checkpoint.format.fingerprints import step_stats
from raytrain_ckpt.checkpoint.format.manifest import MANIFEST, Manifest
from raytrain_ckpt.control.controller import JobState
from raytrain_ckpt.data import TokenSource, build_data
from raytrain_ckpt.control.driver import run_job
from raytrain_ckpt.common.faults import ENV_VAR
from raytrain_ckpt.control.preflight import load_spec

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

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


def test_the_rollback_budget_is_per_job_a_restart_does_not_refill_it(tmp_path, monkeypatch, ray_cluster):
    # attempt 0 rolls back once (step 9) and then crashes (step 11); attempt 1 trips again (step 13):
    # with max_rollbacks=1 that trip is one too many, though it is attempt 1's first
    monkeypatch.setenv(ENV_VAR, "nan@step:rank=0,step=9;raise@step:rank=1,step=11;nan@step:rank=0,step=13,attempt=1")
    spec = _spec(tmp_path, "training.guard.max_rollbacks=1", "fault_tolerance.max_restarts=1")
    result = run_job(spec)
    assert result.state is JobState.FAILED, [f.headline for f in result.failures]
    assert result.attempts == 2
    rollbacks = [(f.attempt, f.kind) for f in result.failures if f.kind in ("rollback", "crash", "exception")]
    assert rollbacks[0] == (0, "rollback"), result.failures
    report = result.failures[-1].detail
    assert "non-finite loss on rank 0 at step 14" in report
    assert "max_rollbacks=1 rollbacks spent (1 in earlier attempts)" in report


TOKENS = "jobs/llama_debug_tokens.yaml"
SEQ, SPIKED_STEP = 32, 12  # the 13th step (0-based 12) reads only random tokens


def _token_spec(corpus: Path, ckpt_dir: Path):
    return load_spec(TOKENS, [
        "training.steps=16", f"training.seq_len={SEQ}", "training.log_every_steps=1", "lr_scheduler.warmup_steps=2",
        "eval.batches=1", f"data.path={corpus}", f"checkpoint.dir={ckpt_dir}", "checkpoint.interval_steps=2",
        "checkpoint.keep_latest_k=2", "checkpoint.keep_best=null", "fault_tolerance.max_restarts=0",
        "training.guard.spike=true", "training.guard.spike_window=6", "training.guard.spike_threshold=10",
        "training.guard.certify_after_steps=2"])


def _train_samples(corpus: Path, spec) -> TokenSource:
    """The job's training stream over ``corpus``, as its trainer builds it."""
    d, t = spec.data, spec.training
    return build_data(source=d.source, path=corpus, dtype=d.dtype, eval_path=None, eval_fraction=d.eval_fraction,
                      bos_id=d.bos_id, kwargs={}, seq_len=t.seq_len, seed=t.seed,
                      vocab_size=spec.model.overrides["vocab_size"]).train


def _poison(clean_dir: Path, dirty_dir: Path, spec) -> set[int]:
    """Write ``dirty_dir``'s shard: the shard of ``clean_dir`` whose windows read by step
    ``SPIKED_STEP`` hold random tokens (each window's inner tokens: the neighbours, which share its
    edge tokens, stay clean). Returns the samples that read a random token, among more samples
    than the run reads."""
    stream = np.fromfile(clean_dir / "00000-docs.bin", dtype=np.uint16)
    clean = _train_samples(clean_dir, spec)
    windows = np.lib.stride_tricks.sliding_window_view(stream, SEQ + 1)[::SEQ]
    gbs, rng = spec.training.global_batch_size, np.random.default_rng(0)
    dirty = stream.copy()
    for i in range(SPIKED_STEP * gbs, (SPIKED_STEP + 1) * gbs):
        [w] = np.flatnonzero((windows == clean.sample(i).numpy()).all(axis=1))  # the one window sample i reads
        dirty[w * SEQ + 1:(w + 1) * SEQ] = rng.integers(0, 512, SEQ - 1, dtype=np.uint16)
    dirty_dir.mkdir()
    dirty.tofile(dirty_dir / "00000-docs.bin")
    poisoned = _train_samples(dirty_dir, spec)
    reach = (spec.training.steps + SPIKED_STEP) * gbs  # past the last sample the run reads, skips included
    return {i for i in range(reach) if not torch.equal(clean.sample(i), poisoned.sample(i))}


def test_a_spike_from_random_tokens_in_a_shard_is_detected_rolled_back_and_skipped(tmp_path, ray_cluster):
    clean_dir = tmp_path / "clean"
    clean_dir.mkdir()
    shipped = sorted((REPO / "data" / "tokens-docs").glob("*.bin"))  # one stream, as one shard
    np.concatenate([np.fromfile(p, dtype=np.uint16) for p in shipped]).tofile(clean_dir / "00000-docs.bin")
    poisoned = _poison(clean_dir, tmp_path / "poisoned", _token_spec(clean_dir, tmp_path / "ckpt"))
    spec = _token_spec(tmp_path / "poisoned", tmp_path / "ckpt")
    gbs = spec.training.global_batch_size
    assert poisoned == set(range(SPIKED_STEP * gbs, (SPIKED_STEP + 1) * gbs))  # that step's samples, no other
    result = run_job(spec)
    assert result.state is JobState.SUCCEEDED, result.error
    assert result.attempts == 1 and result.results[0].steps == 16  # rolled back inside the attempt, finished
    [failure] = [f for f in result.failures if f.kind == "rollback"]  # reported once
    [rb] = result.results[0].rollbacks
    # the spike test tripped (a finite loss) at the poisoned step; of the saves at 2, 4, ..., 12,
    # step 10 had two healthy steps after it, step 12 none
    assert (rb.trip.metric, rb.trip.step, rb.to_step) == ("loss spike", SPIKED_STEP, 10), rb
    assert failure.headline == str(rb)
    assert rb.samples == (10 * gbs, (SPIKED_STEP + 1) * gbs)
    assert poisoned <= set(range(*rb.samples))  # every poisoned sample skipped: never trained on
    final = _manifests(tmp_path / "ckpt" / spec.name)[16]
    assert final.skipped_samples == [[10, 10 * gbs, (SPIKED_STEP + 1) * gbs]]
