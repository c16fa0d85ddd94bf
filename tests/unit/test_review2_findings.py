"""Findings of the second review of the commits after c41d943 (each a failing test, then its fix)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

from raytrain_ckpt.checkpoint.errors import StepAborted
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy
from raytrain_ckpt.checkpoint.records import GroupLayout


# --- coordinator.plan: a retried call after the gather was dropped ---------------------------

W = 2


@pytest.fixture(scope="module")
def small_plans() -> list:
    from bench.scale_ranks import local_plan, template
    from raytrain_ckpt.control.preflight import load_spec
    from raytrain_ckpt.models.config import PRESETS

    spec = load_spec("jobs/llama_debug_fsdp.yaml", [])
    shape = template(spec, PRESETS["debug"])
    return [local_plan(shape, r, W) for r in range(W)]


def test_a_retried_plan_call_after_every_rank_took_its_plan_gets_it_again(tmp_path: Path, small_plans: list) -> None:
    """``CheckpointClient._ensure_layout`` calls ``plan`` through ``call_restarting``: on
    ActorUnavailableError (the reply lost, the actor still the same) it calls again. Before the
    gather was dropped, the retry found the central plan at once. Now, once every rank took its
    plan, the retry opens a new gather that no other rank joins: it waits ``commit_timeout_s``
    (while the other ranks wait for it in their collectives) and the save is aborted."""
    from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor

    actor = CheckpointActor(str(tmp_path / "job"), RetentionPolicy(None))
    asyncio.run(actor.configure(GroupLayout(W, W, "h", None)))

    async def scenario() -> None:
        first = await asyncio.gather(*(actor.plan(0, 10, r, small_plans[r], 30) for r in range(W)))
        t0 = time.monotonic()
        again = await actor.plan(0, 10, 1, small_plans[1], 1.0)  # rank 1's call, sent again
        assert time.monotonic() - t0 < 0.5
        assert again.plan_id == first[1].plan_id and again.plan == first[1].plan  # (what rank 1 makes its plan from)

    asyncio.run(scenario())


# --- driver: a failed settle followed by a failing end is still not waited for twice ----------


def test_a_settle_that_gave_up_is_not_waited_for_again_when_the_jobs_end_then_fails(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """The actor is stuck or gone: the settle at the job's end gives up (False), and then the
    status call in ``_end_checkpoints`` raises too (the same unreachable actor). ``_finish``
    raises before its return value reaches ``settled`` in ``_run_controller``, which stays True:
    the shutdown waits for the settle a second time (up to ``settle_timeout_s + 30``)."""
    from raytrain_ckpt.control import driver
    from raytrain_ckpt.control.controller import JobState
    from raytrain_ckpt.spec import JobSpec

    spec = JobSpec(name="t", training={"steps": 4}, checkpoint={"dir": str(tmp_path), "interval_steps": 2},
                   fault_tolerance={"max_restarts": 0})
    shutdowns: list[bool] = []

    class Service:
        root = str(tmp_path / "t")

        def __init__(self, *a, **k) -> None:
            self.spec = spec

        def preflight(self) -> None:
            pass

        def status(self):
            raise ConnectionError("the actor's node is gone")

        def shutdown(self, settle: bool = True) -> None:
            shutdowns.append(settle)

    class Result:
        state, checkpoints, results, failures, error = JobState.SUCCEEDED, {}, [], [], None

    class Ctrl:
        def __init__(self, *a, **k) -> None:
            self.result = Result()
            self.state = JobState.SUCCEEDED

        def run(self):
            return self.result

        def reject(self, kind, message) -> None:
            self.state = self.result.state = JobState.FAILED
            self.result.error = message

    class Pool:
        def __init__(self, *a, **k) -> None:
            pass

        def close(self) -> None:
            pass

    class Progress:
        def update(self, *a) -> None:
            pass

        def close(self) -> None:
            pass

    monkeypatch.setattr(driver, "CheckpointService", Service)
    monkeypatch.setattr(driver, "WorkerPool", Pool)
    monkeypatch.setattr(driver, "Controller", Ctrl)
    monkeypatch.setattr(driver, "ControllerMetrics", lambda *a, **k: (lambda ctrl: None))
    monkeypatch.setattr(driver, "_progress_line", lambda spec: Progress())
    monkeypatch.setattr(driver, "_job_scalars", lambda spec, service: None)
    monkeypatch.setattr(driver, "preemption_guard", lambda spec, service: None)
    monkeypatch.setattr(driver, "stop_signals", lambda guard, grace: contextlib.nullcontext())
    monkeypatch.setattr(driver.jobrecord, "write", lambda *a, **k: None)
    monkeypatch.setattr(driver, "_record_end", lambda *a, **k: None)
    monkeypatch.setattr(driver, "_settle", lambda service: False)  # ray.get timed out: the actor is stuck

    with pytest.raises(ConnectionError):
        driver._run_controller(spec)
    assert shutdowns == [False]


# --- cli: the URI a mangled file: path is told to be ---------------------------------------------


def test_a_mangled_file_uri_is_told_the_uri_of_its_absolute_path() -> None:
    """``file:/tmp/x`` (one slash, as ``pathlib`` folds ``file:///tmp/x``) is refused, and the line
    says what to write instead. It said ``file://tmp/x``: the CLI takes that as the relative path
    ``tmp/x`` (``file_uris_as_paths`` strips ``file://``), not ``/tmp/x``."""
    from raytrain_ckpt.common.locations import mangled_uri

    assert mangled_uri("file:/tmp/x") == "looks like a URI missing a slash; write file:///tmp/x"
    assert mangled_uri("s3:/bucket/x") == "looks like a URI missing a slash; write s3://bucket/x"


@pytest.mark.parametrize("argv", [["diff", "s3:/bucket/job/step-00000010", "s3:/bucket/job/step-00000020"],
                                  ["diagnostics", "s3:/bucket/job"]])
def test_every_command_refuses_a_store_uri_missing_a_slash(tmp_path, monkeypatch, capsys, argv):
    """``file_uris_as_paths`` covers ``ckpt out file to dir step_dir``, not ``diff``'s two steps or
    ``diagnostics``' root: there ``s3:/bucket/x`` is a local path (no such directory) and
    ``file:///x`` is not the path ``/x``, unlike in ``stats``, ``verify`` or ``ls``."""
    from raytrain_ckpt.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "looks like a URI missing a slash; write s3://bucket/job" in err, err
