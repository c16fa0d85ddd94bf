"""The driver on a real local Ray: training, failures surfaced with rank and traceback,
restarts after a real process crash, hang detection, and determinism."""

from __future__ import annotations

import time

import pytest

from raytrain_ckpt.control.controller import JobState
from raytrain_ckpt.control.driver import ResourceError, run_job
from raytrain_ckpt.common.faults import ENV_VAR
from raytrain_ckpt.control.preflight import load_spec

pytestmark = pytest.mark.integration

DEMO = "jobs/llama_debug_fsdp.yaml"
SHORT = ["training.steps=6", "training.log_every_steps=1", "lr_scheduler.warmup_steps=2",
         "resources.cpus_per_worker=1", "checkpoint.enabled=false", "fault_tolerance.max_restarts=0"]


def _spec(*extra: str):
    return load_spec(DEMO, [*SHORT, *extra])


def test_demo_job_trains_and_loss_falls(ray_cluster):
    result = run_job(_spec("training.steps=12"))
    assert result.state is JobState.SUCCEEDED, result.error
    assert sorted(result.losses) == list(range(1, 13))
    assert result.losses[12] < result.losses[1] - 0.5
    assert [r.rank for r in result.results] == [0, 1]
    assert all(r.steps == 12 for r in result.results)


@pytest.fixture(scope="module")
def six_steps(ray_cluster):
    """An uninterrupted run of ``SHORT``: what other runs of the same spec must reproduce exactly."""
    result = run_job(_spec())
    assert result.state is JobState.SUCCEEDED, result.error
    return result


def test_same_seed_same_world_size_is_bit_identical(six_steps):
    a, b = six_steps, run_job(_spec())
    assert a.state is b.state is JobState.SUCCEEDED
    assert a.losses == b.losses
    assert [r.fingerprint for r in a.results] == [r.fingerprint for r in b.results]
    c = run_job(_spec("training.seed=1"))
    assert c.losses != a.losses


def test_worker_exception_is_reported_with_rank_and_traceback(ray_cluster, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "raise@step:rank=1,step=2")
    result = run_job(_spec())
    assert result.state is JobState.FAILED
    assert "rank 1" in result.error
    assert "Traceback" in result.error and "InjectedFault" in result.error
    # The failure is the rank that raised, not a peer whose collective broke as a consequence.
    first = result.failures[0]
    assert (first.kind, first.rank) == ("exception", 1) and "InjectedFault" in first.headline, first


def test_killed_worker_process_restarts_the_group(six_steps, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "exit@step:rank=0,step=3")
    result = run_job(_spec("fault_tolerance.max_restarts=1"))
    assert result.state is JobState.SUCCEEDED, result.error
    assert result.attempts == 2
    assert "worker process died" in result.error and "rank 0" in result.error
    # Without checkpoints (a later release) the restarted group retrains from step 0 and
    # must reproduce the uninterrupted run exactly.
    assert result.losses == six_steps.losses


def test_a_rank_that_cannot_join_fails_the_start_naming_it(ray_cluster, monkeypatch, tmp_path):
    """The start's join and setup: a rank whose join raises fails the start at once, named; in
    the restart, a kept rank whose new join is slow is not set up before it joined."""
    monkeypatch.setenv(ENV_VAR, "raise@join:rank=1,step=0;exit@step:rank=0,step=3,attempt=1;"
                                "slow@join:rank=1,step=0,attempt=2")
    result = run_job(_spec("fault_tolerance.max_restarts=2", "checkpoint.enabled=true", f"checkpoint.dir={tmp_path}",
                           "checkpoint.interval_steps=2"))
    assert result.state is JobState.SUCCEEDED, result.error
    start = result.failures[0]
    assert start.kind == "start" and "failed to join rank 1" in start.headline and "InjectedFault" in start.detail
    assert result.results[1].served == (1, 2)           # rank 1 was kept from attempt 1 and joined slowly


def test_a_rank_that_never_joins_is_named_when_the_rendezvous_times_out(ray_cluster, monkeypatch):
    """Rank 1 hangs before it joins; rank 0's rendezvous gives up first (join_timeout_s, shorter
    than the start's timeout): the start failure names rank 1, not only rank 0, in about join_timeout_s."""
    monkeypatch.setenv(ENV_VAR, "hang@join:rank=1,step=0")
    t0 = time.monotonic()
    result = run_job(_spec("fault_tolerance.hang_timeout_s=4", "fault_tolerance.join_timeout_s=8",
                           "fault_tolerance.start_timeout_s=60"))
    assert time.monotonic() - t0 < 50                    # well before the start's own timeout
    assert result.state is JobState.FAILED
    start = result.failures[0]
    assert start.kind == "start" and "failed to join rank 0" in start.headline, start
    assert "(rank 1 not done yet)" in start.headline, start


def test_hung_worker_is_detected(ray_cluster, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "hang@step:rank=1,step=2")
    result = run_job(_spec("fault_tolerance.hang_timeout_s=4", "fault_tolerance.poll_interval_s=0.5"))
    assert result.state is JobState.FAILED
    assert "hang_timeout_s" in result.error


def test_more_workers_than_the_cluster_has_is_a_user_error(ray_cluster):
    with pytest.raises(ResourceError, match="resources:.*CPU needed"):
        run_job(_spec("resources.num_workers=8", "parallelism.dp_shard=8", "training.global_batch_size=32"))


def test_spent_budget_fails_with_a_summary_of_every_failure(ray_cluster, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "exit@step:rank=1,step=2;raise@step:rank=0,step=3,attempt=1")
    result = run_job(_spec("fault_tolerance.max_restarts=1"))
    assert result.state is JobState.FAILED and result.attempts == 2
    assert len(result.failures) == 2
    crash, exc = result.failures
    assert (crash.attempt, crash.kind, crash.rank) == (0, "crash", 1)
    assert crash.headline.startswith("worker process died")
    assert (exc.attempt, exc.kind, exc.rank) == (1, "exception", 0)
    assert "InjectedFault" in exc.headline and "Traceback" in exc.detail


@pytest.mark.parametrize(("resume", "expected"), [
    ("99", "no committed step 99 in {root} (have [2, 4, 6])"),
    ("6", "step 6 does not verify ({root}/step-00000006: __0_0.distcp fails its CRC-32C check (corrupt)); "
          "name another step (committed: [2, 4]), or use latest for the newest valid one"),
])
def test_a_resume_step_that_cannot_start_the_run_is_one_line_and_exit_2(ray_cluster, tmp_path, cli_stderr,
                                                                        resume, expected):
    from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
    from raytrain_ckpt.cli.main import main
    from tests.unit.test_checkpoint_layout import _commit

    root = tmp_path / "llama-debug-fsdp"
    layout = CheckpointLayout(root)
    for step in (2, 4, 6):
        _commit(layout, step)
    (layout.step_dir(6) / "__0_0.distcp").write_bytes(b"y" * 1000)   # same size, other bytes
    before = sorted(p.name for p in root.glob("step-*"))
    args = ["run", DEMO, *[f"--set={o}" for o in SHORT], "--set=checkpoint.enabled=true",
            f"--set=checkpoint.dir={tmp_path}", f"--set=checkpoint.resume={resume}"]
    assert main(args) == 2
    errors = [line for line in cli_stderr().splitlines() if line.startswith("error: ")]
    assert errors == [f"error: checkpoint.resume={resume}: " + expected.format(root=root)]
    assert sorted(p.name for p in root.glob("step-*")) == before   # nothing moved aside, nothing trained


def test_a_checkpoint_of_another_model_shape_fails_at_once_with_one_line_and_exit_2(ray_cluster, tmp_path,
                                                                                   cli_stderr, caplog):
    """The resume step is valid but was saved from another model shape: no restart can change
    that, so the job fails on its first attempt (exit 2, the mismatch in one line, no
    traceback) instead of spending its restart budget, and the step stays as it was."""
    from raytrain_ckpt.cli.main import main

    saved = run_job(_spec("training.steps=2", "checkpoint.enabled=true", "checkpoint.interval_steps=2",
                          f"checkpoint.dir={tmp_path}"))
    assert saved.state is JobState.SUCCEEDED and saved.checkpoints["committed"] == [2], saved.error
    root = tmp_path / "llama-debug-fsdp"
    before = {p.name: p.stat().st_size for p in (root / "step-00000002").iterdir()}
    cli_stderr()
    caplog.set_level("INFO", logger="raytrain_ckpt.control.controller")
    args = ["run", DEMO, *[f"--set={o}" for o in SHORT], "--set=checkpoint.enabled=true",
            f"--set=checkpoint.dir={tmp_path}", "--set=fault_tolerance.max_restarts=2",
            "--set=model.overrides.dim=96"]
    assert main(args) == 2
    err = cli_stderr()
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "has shape" in errors[0] and "checkpoint.resume=none" in errors[0], err
    assert "Traceback" not in err, err
    driver_log = "\n".join(r.getMessage() for r in caplog.records if r.name == "raytrain_ckpt.control.controller")
    assert "mismatch; 0/2 restarts used" in driver_log and "attempt 1" not in driver_log, driver_log
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000002"]
    assert {p.name: p.stat().st_size for p in (root / "step-00000002").iterdir()} == before
    # Resumed from another root's step of the other shape: the same refusal, and this root's own
    # steps stay on its timeline (a new timeline moves them aside only once every rank loaded its start)
    other = run_job(_spec("training.steps=2", "checkpoint.enabled=true", "checkpoint.interval_steps=2",
                          f"checkpoint.dir={tmp_path / 'other'}", "model.overrides.dim=96"))
    assert other.state is JobState.SUCCEEDED, other.error
    foreign = tmp_path / "other" / "llama-debug-fsdp" / "step-00000002"
    assert main([*args[:-1], f"--set=checkpoint.resume={foreign}"]) == 2
    errors = [line for line in cli_stderr().splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "has shape" in errors[0], errors
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-00000002"]
    assert {p.name: p.stat().st_size for p in (root / "step-00000002").iterdir()} == before
