"""The driver's path for Ray workers (every entry absolute, none empty, each once), Ray
addresses it cannot join said in one line, and the job's checkpoints read after the end's settle."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raytrain_ckpt.checkpoint.format.rankresults import RankResults
from raytrain_ckpt.checkpoint.format.plannumbers import own_central

REPO = Path(__file__).resolve().parents[2]


def test_the_workers_path_is_the_drivers_with_every_entry_absolute(tmp_path, monkeypatch):
    from raytrain_ckpt.control.driver import _worker_path

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["src", "", "/opt/site", str(tmp_path), "src"]))
    # a relative entry means the driver's directory; an empty one (the worker's own cwd) is dropped
    assert _worker_path().split(os.pathsep) == [str(tmp_path), str(tmp_path / "src"), "/opt/site"]
    monkeypatch.delenv("PYTHONPATH")
    assert _worker_path() == str(tmp_path)


@pytest.mark.parametrize(("args", "env", "expected"), [
    (["--address", "bogus"], {}, "Ray cluster bogus: Invalid address format"),
    (["--address", "127.0.0.1:1"], {}, "nothing answers at 127.0.0.1:1"),
    (["--address", "ray://127.0.0.1:1"], {}, "nothing answers at 127.0.0.1:1"),
    ([], {"RAY_ADDRESS": "garbage"}, "Ray cluster RAY_ADDRESS=garbage"),
    ([], {"RAY_ADDRESS": "127.0.0.1:1"}, "Ray cluster RAY_ADDRESS=127.0.0.1:1: nothing answers"),
], ids=["not_an_address", "nothing_listens", "ray_client_nothing_listens", "env_not_an_address",
        "env_nothing_listens"])
def test_a_ray_address_that_cannot_be_joined_is_one_line_and_exit_2_within_seconds(tmp_path, args, env, expected):
    """Ray's own client raises a traceback for a malformed address and retries one where nothing
    listens for minutes; `run` says which address and how to fix it, at once."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "raytrain_ckpt", "run", str(REPO / "jobs" / "llama_debug_fsdp.yaml"),
                           "--set", f"checkpoint.dir={tmp_path / 'ckpt'}", *args],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0] and "--address local" in errors[0], proc.stderr[-3000:]
    assert time.monotonic() - started < 60
    assert not (tmp_path / "ckpt").exists()  # nothing created for a run that never started


class _ActorService:
    """The driver's handle on checkpointing (``CheckpointService``) over a real CheckpointActor
    driven without Ray: its status and the end check (``CheckpointService.unsaved``) as they are."""

    def __init__(self, spec, actor) -> None:
        self.spec, self.actor, self.started_unix = spec, actor, time.time() - 60

    def status(self):
        import asyncio

        return asyncio.run(self.actor.status())

    def unsaved(self, results, status):
        from raytrain_ckpt.checkpoint.roles.service import CheckpointService

        return CheckpointService.unsaved(self, results, status)


def _ended(spec, finish: bool):
    """A controller whose job ended: finished (SUCCEEDED), or failed on a crash (no restarts)."""
    from raytrain_ckpt.control.controller import Controller
    from tests.unit.test_controller import FakeWorkerGroup

    FakeWorkerGroup.created = []
    ctrl = Controller(spec, FakeWorkerGroup, sleep=lambda s: None)
    ctrl.step()
    group = FakeWorkerGroup.created[-1]
    group.step = spec.training.steps
    if finish:
        group.finish()
    else:
        group.kill(1)
    ctrl.run()
    return ctrl


def test_the_job_result_lists_a_save_the_settle_aborted_as_failed_not_in_flight(tmp_path):
    """Rank 1 crashed before it handed step 2 off: the settle at the job's end aborts the save.
    ``JobResult.checkpoints`` is read after it: step 2 failed, nothing in flight."""
    import asyncio

    from raytrain_ckpt.control.controller import JobState
    from raytrain_ckpt.control.driver import _end_checkpoints
    from raytrain_ckpt.spec import JobSpec
    from tests.unit.test_checkpoint_actor import _actor

    spec = JobSpec(name="t", training={"steps": 4}, checkpoint={"dir": str(tmp_path), "interval_steps": 2},
                   fault_tolerance={"max_restarts": 0})
    actor = _actor(tmp_path / "root")
    asyncio.run(actor.accepted(2, rank=0, attempt=0))
    ctrl = _ended(spec, finish=False)
    assert ctrl.state is JobState.FAILED
    _end_checkpoints(ctrl, _ActorService(spec, actor), lambda: asyncio.run(actor.settle(5)))
    checkpoints = ctrl.result.checkpoints
    assert checkpoints["in_flight"] == [] and "never handed it off" in checkpoints["failed"][2]


def test_a_final_save_that_commits_in_the_settle_is_in_the_job_result_and_passes_the_end_check(tmp_path):
    """The last step's save was handed off when the ranks finished; its writer reports while the
    end-of-job settle waits: the job succeeded, and its result lists the step as committed."""
    import asyncio
    import zlib

    import torch
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from raytrain_ckpt.checkpoint.records import RankReport
    from raytrain_ckpt.control.controller import JobState
    from raytrain_ckpt.control.driver import _end_checkpoints
    from raytrain_ckpt.spec import JobSpec
    from tests.unit.test_checkpoint_actor import _single_rank_actor

    spec = JobSpec(name="t", training={"steps": 4}, checkpoint={"dir": str(tmp_path), "interval_steps": 2},
                   fault_tolerance={"max_restarts": 0})
    actor = _single_rank_actor(tmp_path / "root", None)

    async def hand_off() -> RankReport:  # plan, hand off and write step 4; its report comes later
        state, planner = {"w": torch.arange(64.0), "step": 4}, DefaultSavePlanner()
        planner.set_up_planner(state, is_coordinator=True)
        local = planner.create_local_plan()
        central = await actor.plan(0, 4, 0, local, timeout_s=5)
        tmp = Path(await actor.accepted(4, 0, 0))
        writer = FileSystemWriter(tmp, sync_files=False)
        writer.set_up_storage_writer(False, rank=0)
        results = writer.write_data(planner.finish_plan(own_central(central.plan, local)), planner).wait()
        files = {p.name: {"size": p.stat().st_size, "crc32": zlib.crc32(p.read_bytes())} for p in tmp.iterdir()}
        return RankReport(4, 0, 0, central.plan_id, RankResults.of(results), files)

    report = asyncio.run(hand_off())

    async def settle_while_the_writer_reports() -> None:
        async def late_report() -> None:
            await asyncio.sleep(0.2)
            assert await actor.report(report) == "committed"

        await asyncio.gather(actor.settle(5), late_report())

    ctrl = _ended(spec, finish=True)
    assert ctrl.state is JobState.SUCCEEDED
    _end_checkpoints(ctrl, _ActorService(spec, actor), lambda: asyncio.run(settle_while_the_writer_reports()))
    assert ctrl.result.state is JobState.SUCCEEDED, ctrl.result.error
    assert ctrl.result.checkpoints["committed"] == [4] and ctrl.result.checkpoints["save_error"] is None


def test_a_job_whose_end_fails_after_it_succeeded_is_failed_in_its_result_and_record(tmp_path, monkeypatch):
    """The workers finished, then the job's end failed (here the actor's status call raises, as
    an unreachable actor's does): the error goes on to the caller, and the result, and so the
    job's record and metrics, say FAILED with that error, not SUCCEEDED."""
    import asyncio

    from raytrain_ckpt.control import driver
    from raytrain_ckpt.control.controller import JobState
    from raytrain_ckpt.report import jobrecord
    from raytrain_ckpt.spec import JobSpec
    from tests.unit.test_checkpoint_actor import _actor

    spec = JobSpec(name="t", training={"steps": 4}, checkpoint={"dir": str(tmp_path), "interval_steps": 2},
                   fault_tolerance={"max_restarts": 0})
    actor = _actor(tmp_path / "root")
    ctrl = _ended(spec, finish=True)
    assert ctrl.state is JobState.SUCCEEDED

    class Unreachable(_ActorService):
        def status(self):
            raise ConnectionError("the actor's node is gone")

    service = Unreachable(spec, actor)
    monkeypatch.setattr(driver, "_settle", lambda s: asyncio.run(actor.settle(5)))
    with pytest.raises(ConnectionError):
        driver._finish(spec, ctrl, service)
    result = ctrl.result
    assert result.state is JobState.FAILED and "the job's end failed" in result.error
    assert "the actor's node is gone" in result.error
    written = {}
    monkeypatch.setattr(driver.bulletin, "post", lambda job, record: None)
    monkeypatch.setattr(driver.jobrecord, "write", lambda root, job, record: written.update(record))
    service.root = str(tmp_path / "root")
    driver._record_end(spec, service, jobrecord.started("t", service.root), result, False)
    assert written["job_info"]["state"] == "FAILED" and "the job's end failed" in written["error"]


def test_a_settle_that_gave_up_at_the_jobs_end_is_not_waited_for_again(tmp_path, monkeypatch):
    """The actor did not answer the settle at the job's end (gone or stuck: ``ray.get`` timed out):
    ``_finish`` says so, and the driver's shutdown then does not wait ``settle_timeout_s`` again."""
    import ray

    from raytrain_ckpt.control import driver
    from raytrain_ckpt.control.controller import JobState
    from raytrain_ckpt.spec import JobSpec
    from tests.unit.test_checkpoint_actor import _actor

    spec = JobSpec(name="t", training={"steps": 4}, checkpoint={"dir": str(tmp_path), "interval_steps": 2},
                   fault_tolerance={"max_restarts": 0})
    ctrl = _ended(spec, finish=False)
    assert ctrl.state is JobState.FAILED

    class Stuck:
        class settle:  # noqa: N801 - the actor method's shape
            @staticmethod
            def remote(timeout):
                return "ref"

    waited = []

    def get(ref, timeout=None):
        waited.append(timeout)
        raise ray.exceptions.GetTimeoutError("timed out")

    monkeypatch.setattr(ray, "get", get)
    service = _ActorService(spec, _actor(tmp_path / "root"))
    service.actor_for_status, service.actor = service.actor, Stuck
    service.status = lambda: __import__("asyncio").run(service.actor_for_status.status())
    assert driver._finish(spec, ctrl, service) is False
    assert waited == [spec.checkpoint.settle_timeout_s + 30]


def test_a_job_end_whose_failure_report_fails_too_raises_the_first_error(tmp_path, monkeypatch):
    """The job's end failed, and rejecting the job failed as well (its observer: metrics, the job's
    note): the error raised is the job's end's, not the report's."""
    import asyncio

    from raytrain_ckpt.control import driver
    from raytrain_ckpt.spec import JobSpec
    from tests.unit.test_checkpoint_actor import _actor

    spec = JobSpec(name="t", training={"steps": 4}, checkpoint={"dir": str(tmp_path), "interval_steps": 2},
                   fault_tolerance={"max_restarts": 0})
    actor = _actor(tmp_path / "root")
    ctrl = _ended(spec, finish=True)

    class Unreachable(_ActorService):
        def status(self):
            raise ConnectionError("the actor's node is gone")

    def observer(_):
        raise RuntimeError("the metrics agent is gone too")

    ctrl._observer = observer
    monkeypatch.setattr(driver, "_settle", lambda s: asyncio.run(actor.settle(5)) or True)
    with pytest.raises(ConnectionError, match="the actor's node is gone"):
        driver._finish(spec, ctrl, Unreachable(spec, actor))
