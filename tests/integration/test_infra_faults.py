"""Faults of the job's infrastructure while it trains, on a real local Ray with real processes: a
checkpoint writer stopped for real (SIGSTOP) mid-run is named in the job's status, replaced within
the learned timeout as a ``writer_hang`` (the group is not restarted, max_restarts=0 is not spent)
and the job ends bit-identical with every step committed before the stall; a rank made slow at
every step is reported as a straggler and, with fault_tolerance.replace_stragglers, replaced by a
new process at a committed step, the job ending bit-identical too."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

from raytrain_ckpt.checkpoint.roles import bulletin
from raytrain_ckpt.checkpoint.roles.names import NAMESPACE, actor_name, writer_name
from raytrain_ckpt.control.controller import JobResult, JobState
from raytrain_ckpt.control.driver import run_job
from raytrain_ckpt.common.faults import ENV_VAR
from raytrain_ckpt.report.jobstatus import status_line
from raytrain_ckpt.control.preflight import load_spec

pytestmark = pytest.mark.integration

DEMO = "jobs/llama_debug_fsdp.yaml"
BASE = ["training.steps=20", "training.log_every_steps=1", "lr_scheduler.warmup_steps=2", "training.seq_len=32",
        "checkpoint.enabled=true", "checkpoint.interval_steps=5", "checkpoint.keep_latest_k=null",
        "fault_tolerance.max_restarts=0"]


def _pid(handle) -> int:
    return ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def _in_thread(spec) -> tuple[threading.Thread, dict[str, JobResult]]:
    out: dict[str, JobResult] = {}
    thread = threading.Thread(target=lambda: out.setdefault("result", run_job(spec)), daemon=True)
    thread.start()
    return thread, out


def test_a_writer_stopped_mid_run_is_named_replaced_and_the_job_finishes(ray_cluster, reference_20, tmp_path: Path,
                                                                          monkeypatch):
    # rank 0 pauses 1.5 s after steps 6-9: the writer is stopped after step 5's commit and before step 10's save
    # is handed to it however busy the machine is (the steps alone leave well under a second for it)
    monkeypatch.setenv(ENV_VAR, ";".join(f"slow@step:rank=0,step={s},seconds=1.5" for s in (6, 7, 8, 9)))
    spec = load_spec(DEMO, [*BASE, f"checkpoint.dir={tmp_path}"])
    thread, out = _in_thread(spec)
    node = ray.get_runtime_context().get_node_id()
    stopped, stuck_seen = None, []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and thread.is_alive():
            try:
                status = ray.get(ray.get_actor(actor_name(spec.name), NAMESPACE).status.remote(), timeout=10)
            except (ValueError, ray.exceptions.RayError):  # not created yet
                status = None
            if status is not None and 5 in status.committed:
                break
            time.sleep(0.2)
        # The commit comes before the writer's answer to the last rank's hand-off: stopped in
        # between, the writer would hold that answer (the rank then waits for it at step 10, and
        # step 10 goes to the replacement writer). Its answer takes milliseconds; the pauses above
        # leave seconds before step 10.
        time.sleep(1.5)
        writer = ray.get_actor(writer_name(spec.name, node), NAMESPACE)
        stopped = _pid(writer)
        os.kill(stopped, signal.SIGSTOP)                       # the node's writer stops after step 5 committed
        stopped_at = time.time()
        while thread.is_alive() and time.time() - stopped_at < 300:
            info = (bulletin.posted(spec.name) or {}).get("job_info") or {}
            if info.get("stuck"):
                stuck_seen.append(status_line(info))
            time.sleep(0.5)
        thread.join(timeout=60)
    finally:
        if stopped is not None:
            for sig in (signal.SIGCONT, signal.SIGKILL):      # the old process, if Ray left it
                try:
                    os.kill(stopped, sig)
                except ProcessLookupError:
                    break
    result = out["result"]
    assert result.state is JobState.SUCCEEDED, result.error
    assert result.attempts == 1                                # no restart of the group, max_restarts=0 kept
    (failure,) = result.failures
    assert (failure.kind, failure.rank) == ("writer_hang", None), failure
    # the save it holds up is step 10 (handed to it, never accepted); the ranks wait at step 15's
    assert failure.headline.startswith(f"stuck: step 10 (its save), checkpoint writer on node {node[:12]} has not "
                                       "answered for "), failure.headline
    assert "replaced, training continues" in failure.headline
    detected = next(t for t, what in result.events if what == "attempt 0 writer_hang detected")
    assert detected - stopped_at <= 60                         # within the step timeout (30 s here: learned or the floor)
    assert f"attempt 0: checkpoint writer on node {node[:12]} did not answer within 10s: replaced" in \
        [what for _, what in result.events]
    assert any("stuck: step " in line and f"writer on node {node[:12]}" in line for line in stuck_seen), stuck_seen
    committed = set(result.checkpoints["committed"])
    assert {5, 15, 20} <= committed and 10 not in committed, committed   # nothing committed before it lost
    assert [r.fingerprint for r in result.results] == [r.fingerprint for r in reference_20.results]


def test_a_straggler_is_replaced_at_a_committed_step_and_the_run_finishes(ray_cluster, reference_20, tmp_path: Path,
                                                                          monkeypatch):
    monkeypatch.setenv(ENV_VAR, "slow@step:rank=1,step=-1,seconds=0.6")   # every step of the first attempt
    spec = load_spec(DEMO, [*BASE, f"checkpoint.dir={tmp_path}", "fault_tolerance.replace_stragglers=true"])
    result = run_job(spec)
    assert result.state is JobState.SUCCEEDED, result.error
    (straggler,) = result.stragglers
    assert straggler.startswith("attempt 0: rank 1 is a straggler: it begins its steps "), straggler
    (failure,) = result.failures                               # max_restarts=0: a restart would have failed the job
    assert (failure.kind, failure.rank) == ("straggler", 1), failure
    resumed = result.results[0].start_step
    assert failure.headline.startswith(f"rank 1 replaced at committed step {resumed} "), failure.headline
    assert result.attempts == 2 and resumed in result.checkpoints["committed"]
    served = {r.rank: r.served for r in result.results}
    assert served == {0: (0, 1), 1: (1,)}, served              # rank 0's process kept, rank 1's replaced
    assert [r.fingerprint for r in result.results] == [r.fingerprint for r in reference_20.results]


def test_a_write_stuck_while_its_writer_answers_is_named_and_its_writer_replaced(ray_cluster, reference_20,
                                                                                 tmp_path: Path, monkeypatch):
    """Rank 1's write of step 10 is held in the writer's write thread (a hang at the ``persist``
    point: before any byte moves) while the writer's other threads answer every ping: the
    stalled write is named in the job's status with its rank and step, then its writer is
    replaced within the step timeout as a ``writer_hang`` (the group is not restarted) and the
    job ends bit-identical to the uninterrupted run."""
    monkeypatch.setenv(ENV_VAR, "hang@persist:rank=1,step=10")
    spec = load_spec(DEMO, [*BASE, f"checkpoint.dir={tmp_path}"])
    thread, out = _in_thread(spec)
    node = ray.get_runtime_context().get_node_id()
    stuck_seen = []
    started = time.time()
    while thread.is_alive() and time.time() - started < 400:
        info = (bulletin.posted(spec.name) or {}).get("job_info") or {}
        if info.get("stuck"):
            stuck_seen.append(status_line(info))
        time.sleep(0.5)
    thread.join(timeout=60)
    result = out["result"]
    assert result.state is JobState.SUCCEEDED, result.error
    assert result.attempts == 1                                # no restart of the group, max_restarts=0 kept
    (failure,) = result.failures
    assert (failure.kind, failure.rank) == ("writer_hang", None), failure
    writer = f"checkpoint writer on node {node[:12]}"
    assert f"{writer} moved no bytes of its write of rank 1 step 10 for " in failure.headline, failure.headline
    assert any(f"{writer} moved no bytes of its write of rank 1 step 10" in line for line in stuck_seen), stuck_seen
    replaced = [what for _, what in result.events if what.startswith(f"attempt 0: {writer} ")]
    assert replaced and "moved no bytes of its write of rank 1 step 10" in replaced[0], result.events
    committed = set(result.checkpoints["committed"])
    assert {5, 15, 20} <= committed and 10 not in committed, committed
    assert [r.fingerprint for r in result.results] == [r.fingerprint for r in reference_20.results]
