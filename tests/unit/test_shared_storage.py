"""The shared-storage preflight's decision (nodes expected vs probes seen) and the failed-save
counters the CheckpointActor reports in ``status``, the metrics and the job's end."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from raytrain_ckpt.observe import metrics
from raytrain_ckpt.checkpoint.roles.steps import SaveFailures
from raytrain_ckpt.checkpoint.records import NodeProbe
from raytrain_ckpt.checkpoint.storage.probe import local_root, missing_probes, probe_name, unshared_message
from raytrain_ckpt.checkpoint.roles.summary import failed_saves_text
from tests.unit.test_checkpoint_actor import _save, _single_rank_actor

A = NodeProbe("a" * 56, "10.0.0.1", probe_name("a" * 56, "n1"))
B = NodeProbe("b" * 56, "10.0.0.2", probe_name("b" * 56, "n1"))
C = NodeProbe("c" * 56, "10.0.0.3", probe_name("c" * 56, "n1"))


@pytest.mark.parametrize(("expected", "seen", "missing"), [
    ([A, B, C], {A.name, B.name, C.name}, []),                       # one shared filesystem
    ([A, B, C], {A.name}, [B, C]),                                   # the actor sits on A's private disk
    ([A, B], {A.name, probe_name(B.node_id, "older")}, [B]),         # a leftover of another start is not B's probe
    ([A], set(), [A]),                                               # even one node: the actor's node may differ
    ([], set(), []),
])
def test_missing_probes(expected, seen, missing) -> None:
    assert missing_probes(expected, seen) == missing


@pytest.mark.parametrize(("root", "local"), [
    ("/mnt/ckpt/job", "/mnt/ckpt/job"),
    ("relative/job", "relative/job"),
    ("file:///mnt/ckpt/job", "/mnt/ckpt/job"),   # a local path still: may be a node-local disk
    ("s3://bucket/prefix/job", None),            # one namespace for every node: nothing to probe
    ("gs://bucket/job", None),
])
def test_only_local_roots_are_probed(root, local) -> None:
    assert local_root(root) == local


def test_probe_names_are_dot_files_unique_per_node_and_start() -> None:
    names = {probe_name(n, nonce) for n in ("a", "b") for nonce in ("1", "2")}
    assert len(names) == 4 and all(n.startswith(".") for n in names)


def test_unshared_message_names_the_nodes_and_the_fix() -> None:
    text = unshared_message("/mnt/ckpt", [B, C], A.node_id)
    assert "\n" not in text and text.startswith("checkpoint.dir=/mnt/ckpt: ")
    assert f"{B.node_id[:12]} (10.0.0.2)" in text and f"{C.node_id[:12]} (10.0.0.3)" in text
    assert A.node_id[:12] in text and "10.0.0.1" not in text          # A is the actor's node, not a culprit
    assert "NFS" in text and "s3://bucket/prefix" in text


@pytest.mark.parametrize(("events", "total", "consecutive", "last"), [
    ([], 0, 0, None),
    ([("fail", 10)], 1, 1, 10),
    ([("fail", 10), ("fail", 20), ("fail", 30)], 3, 3, 30),
    ([("fail", 10), ("commit", 20), ("fail", 30)], 2, 1, 30),
    ([("fail", 10), ("fail", 20), ("commit", 30)], 2, 0, 20),
])
def test_save_failures_table(events, total, consecutive, last) -> None:
    saves = SaveFailures()
    for kind, step in events:
        saves.failed(step, f"why {step}") if kind == "fail" else saves.committed()
    assert (saves.total, saves.consecutive, saves.last_step) == (total, consecutive, last)
    assert saves.last_error == (f"why {last}" if last is not None else None)


def test_actor_counts_each_failed_step_once_and_a_commit_resets_the_run(tmp_path: Path, monkeypatch) -> None:
    recorded: list[tuple[str, float]] = []
    monkeypatch.setattr(metrics, "record", lambda name, value, tags: recorded.append((name, value)))
    actor = _single_rank_actor(tmp_path, k=None)

    async def scenario() -> list[dict]:
        seen = []
        await _save(actor, 1)
        for step in (2, 3):
            await actor.open_step(step, 0)
            await actor.abort(step, f"rank 0: disk full at step {step}")
            await actor.abort(step, f"rank 1: step {step} is not in flight")  # a second rank: same step
        seen.append((await actor.status()).to_dict())
        await _save(actor, 4)
        seen.append((await actor.status()).to_dict())
        return seen

    failing, recovered = asyncio.run(scenario())
    assert failing["failed_saves"] == {"total": 2, "consecutive": 2, "last_step": 3,
                                       "last_error": "rank 0: disk full at step 3"}   # the cause, not the echo
    assert failing["failed"] == {2: "rank 0: disk full at step 2", 3: "rank 0: disk full at step 3"}
    assert failed_saves_text(failing) == ("2 save(s) failed in a row since the last commit (2 in all); "
                                          "the newest: step 3: rank 0: disk full at step 3")
    assert recovered["failed_saves"]["consecutive"] == 0 and recovered["failed_saves"]["total"] == 2
    assert failed_saves_text(recovered) is None
    assert [v for n, v in recorded if n == "checkpoint_failed_saves_total"] == [1, 1]
    gauge = [v for n, v in recorded if n == "checkpoint_consecutive_failed_saves"]
    assert gauge[-3:] == [1, 2, 0]


def test_restarts_without_checkpoints_warn_at_start(caplog) -> None:
    from raytrain_ckpt.control.driver import _warn_restarts_without_checkpoints
    from raytrain_ckpt.spec import JobSpec

    caplog.set_level(logging.WARNING)
    _warn_restarts_without_checkpoints(JobSpec(name="x", checkpoint={"enabled": False},
                                               fault_tolerance={"max_restarts": 2}))
    assert "every restart begins again at step 0" in caplog.text and "checkpoint.enabled=true" in caplog.text
    caplog.clear()
    _warn_restarts_without_checkpoints(JobSpec(name="x", fault_tolerance={"max_restarts": 0}))
    _warn_restarts_without_checkpoints(JobSpec(name="x", checkpoint={"enabled": True},
                                               fault_tolerance={"max_restarts": 2}))
    assert caplog.text == ""


@pytest.mark.parametrize(("checkpoint", "warns"), [
    ({"interval_steps": None}, True),                            # only save_final: nothing to restart from
    ({"interval_steps": 100}, True),                             # the interval falls on the last step only
    ({"interval_steps": 250}, True),
    ({"interval_steps": None, "interval_seconds": 60}, False),   # the time trigger saves before the end
    ({"interval_steps": 99}, False),
    ({"interval_steps": "auto"}, False),
])
def test_restarts_with_no_save_before_the_last_step_warn_at_start(caplog, checkpoint, warns) -> None:
    from raytrain_ckpt.control.driver import _warn_restarts_without_checkpoints
    from raytrain_ckpt.spec import JobSpec

    caplog.set_level(logging.WARNING)
    spec = JobSpec(name="x", training={"steps": 100}, checkpoint={"enabled": True, **checkpoint},
                   fault_tolerance={"max_restarts": 2})
    _warn_restarts_without_checkpoints(spec)
    assert ("no save falls before the last step" in caplog.text) is warns, caplog.text


def test_status_of_a_live_job_shows_failing_saves(tmp_path: Path, monkeypatch, capsys) -> None:
    from raytrain_ckpt.report import jobstatus
    from raytrain_ckpt.cli.main import main

    actor = _single_rank_actor(tmp_path / "job", k=None)

    async def fail_two() -> dict:
        await _save(actor, 1)
        for step in (2, 3):
            await actor.abort(step, f"rank 0: [Errno 28] No space left on device (step {step})")
        return await actor.status()

    snapshot = asyncio.run(fail_two())
    view = jobstatus.JobView(snapshot.to_dict(), "cluster")  # the actor's bulletin, without Ray
    monkeypatch.setattr(jobstatus, "job_status", lambda job, address, last=None: view)
    assert main(["status", "--job", "job"]) == 0
    out = capsys.readouterr().out
    assert ("saves failing: 2 save(s) failed in a row since the last commit (2 in all); the newest: step 3: "
            "rank 0: [Errno 28] No space left on device (step 3)") in out
    assert main(["status", "--job", "job", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["failed_saves"]["consecutive"] == 2


@pytest.mark.parametrize(("outcome", "code", "stream", "line"), [
    ("unshared", 2, "err", "error: checkpoint.dir=/mnt/ckpt: not shared by every node"),
    ("saves failing", 0, "err", "warning: 2 save(s) failed in a row since the last commit (3 in all); the newest: "
                                "step 6: rank 1: boom"),
    ("saves fine", 0, "out", "committed steps [2, 4]"),
])
def test_run_reports_an_unshared_dir_and_failing_saves(monkeypatch, capsys, outcome, code, stream, line) -> None:
    from raytrain_ckpt import api
    from raytrain_ckpt.cli import main as cli
    from raytrain_ckpt.checkpoint.errors import StorageNotShared
    from raytrain_ckpt.control.controller import JobResult, JobState
    from raytrain_ckpt.spec import JobSpec

    failing = {"total": 3, "consecutive": 2 if outcome == "saves failing" else 0, "last_step": 6,
               "last_error": "rank 1: boom"}

    def fake_run(spec: JobSpec, address: str | None = None) -> JobResult:
        if outcome == "unshared":
            raise StorageNotShared(unshared_message("/mnt/ckpt", [B], A.node_id))
        return JobResult(JobState.SUCCEEDED, 1, checkpoints={"root": "/r", "committed": [2, 4],
                                                             "failed_saves": failing})

    monkeypatch.setattr(api, "run", fake_run)
    monkeypatch.setattr(cli, "setup_logging", lambda: None)
    assert cli._run(JobSpec(name="x"), None) == code
    out = capsys.readouterr()
    text = out.err if stream == "err" else out.out
    assert line in text and "Traceback" not in out.err
    if outcome != "saves failing":
        assert "warning:" not in out.err
    if outcome == "unshared":
        assert out.err.count("\n") == 1 and out.out == ""
