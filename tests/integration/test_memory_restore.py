"""Restarts that load from the node's memory (the writer's committed in-memory copy) on a real
local Ray: a rank killed right after a commit, halfway through staging the next step, or while
the next step is being written, resumes from memory and ends bit-identical to an uninterrupted
run; a copy with a flipped bit or of an older step is refused and the restart loads from
storage, still bit-identical."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from raytrain_ckpt.control.controller import JobResult, JobState
from raytrain_ckpt.control.driver import run_job
from raytrain_ckpt.common.faults import ENV_VAR
from raytrain_ckpt.control.preflight import load_spec

pytestmark = pytest.mark.integration

DEMO = "jobs/llama_debug_fsdp.yaml"
# short sequences: the steps are a quarter of the demo's compute, the checkpointed state is the same
BASE = ["training.log_every_steps=1", "lr_scheduler.warmup_steps=2", "training.seq_len=32", "checkpoint.enabled=true",
        "checkpoint.interval_steps=5", "checkpoint.keep_latest_k=null", "training.steps=20"]


def _run(ckpt_dir: Path, *extra: str) -> JobResult:
    result = run_job(load_spec(DEMO, [*BASE, f"checkpoint.dir={ckpt_dir}", *extra]))
    assert result.state is JobState.SUCCEEDED, result.error
    return result


@pytest.fixture(scope="module")
def reference(reference_20) -> JobResult:
    """20 uninterrupted steps (the session's run of this module's ``BASE``)."""
    return reference_20


def _same_as_reference(result: JobResult, reference: JobResult, resumed_at: int) -> None:
    assert result.attempts == 2
    assert all(r.start_step == resumed_at for r in result.results)
    assert [r.fingerprint for r in result.results] == [r.fingerprint for r in reference.results]
    assert result.losses == {s: v for s, v in reference.losses.items() if s > resumed_at}


@pytest.mark.parametrize(("fault", "resumed_at"), [
    ("slow@step:rank=1,step=12;exit@step:rank=1,step=12", 10),         # after the commit of step 10
    ("exit@staging:rank=0,step=15", 10),                               # halfway through staging 15
    ("slow@persist:rank=1,step=15;exit@staged:rank=1,step=15", 15),    # while 15 is being written
])
def test_restart_loads_from_memory_bit_exact(reference, tmp_path, monkeypatch, caplog, fault, resumed_at):
    monkeypatch.setenv(ENV_VAR, fault)
    with caplog.at_level(logging.INFO, logger="raytrain_ckpt.checkpoint.roles.service"):
        result = _run(tmp_path, "fault_tolerance.max_restarts=1")
    _same_as_reference(result, reference, resumed_at)
    assert [r.timings["loaded_from_memory"] for r in result.results] == [1.0, 1.0]
    assert f"every rank loads step {resumed_at} from its node's in-memory copy" in caplog.text


@pytest.mark.parametrize(("fault", "extra", "why"), [
    # a bit of rank 0's copy flips after it was recorded: its checksum no longer matches
    ("exit@staging:rank=0,step=15;corrupt@restore:rank=0,step=10,attempt=1", (), None),
    # rank 1 is handed its writer's copy of step 5 for a restart from step 10
    ("slow@step:rank=1,step=12;exit@step:rank=1,step=12;stale@restore:rank=1,step=10,attempt=1", (),
     "rank 1: stale copy: it holds step 5, the resume step is 10"),
    # one buffer per rank: staging step 15 went over the copy of step 10
    ("exit@staging:rank=0,step=15", ("checkpoint.memory_copies=1",), "checkpoint.memory_copies=1"),
])
def test_a_copy_that_does_not_verify_falls_back_to_storage_bit_exact(reference, tmp_path, monkeypatch, caplog,
                                                                      fault, extra, why):
    monkeypatch.setenv(ENV_VAR, fault)
    with caplog.at_level(logging.INFO):
        result = _run(tmp_path, "fault_tolerance.max_restarts=1", *extra)
    _same_as_reference(result, reference, 10)
    assert [r.timings["loaded_from_memory"] for r in result.results] == [0.0, 0.0]
    if why is not None:
        assert f"loading step 10 from storage: {why}" in caplog.text


def test_a_refused_copy_never_loads_a_damaged_storage_step(reference, tmp_path, monkeypatch, caplog):
    """The driver checks storage only up to sizes when it hands out copies. Rank 0 refuses its
    copy (a flipped bit) and storage's step 10 has a flipped byte too: no rank loads step 10,
    the attempt fails, its writer forgot the refused copy, and the next attempt verifies storage
    in full, skips step 10 and resumes from step 5 (from memory: its copy is intact), still
    bit-identical."""
    root = tmp_path / "llama-debug-fsdp"
    monkeypatch.setenv(ENV_VAR, "hang@step:rank=1,step=12;corrupt@restore:rank=0,step=10,attempt=1")
    box: dict[str, JobResult] = {}
    job = threading.Thread(target=lambda: box.setdefault("r", run_job(load_spec(DEMO, [
        *BASE, f"checkpoint.dir={tmp_path}", "fault_tolerance.max_restarts=2", "fault_tolerance.hang_timeout_s=8",
        "fault_tolerance.poll_interval_s=0.2"]))))
    with caplog.at_level(logging.INFO):
        job.start()
        manifest = root / "step-00000010" / "manifest.json"
        deadline = time.monotonic() + 120
        while not manifest.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert manifest.exists(), "step 10 did not commit within 120 s"
        shard = root / "step-00000010" / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size: only a checksum catches it
        shard.write_bytes(bytes(data))
        job.join(timeout=400)
    result = box["r"]
    assert result.state is JobState.SUCCEEDED, result.error
    assert result.attempts == 3
    assert "cannot be loaded from memory or storage" in (result.error or "") or \
        "cannot be loaded from memory or storage" in caplog.text
    assert all(r.start_step == 5 for r in result.results)
    # step 5 is still held in memory (the second buffer), intact: the resume loads it from there
    assert "every rank loads step 5 from its node's in-memory copy" in caplog.text
    assert [r.timings["loaded_from_memory"] for r in result.results] == [1.0, 1.0]
    assert [r.fingerprint for r in result.results] == [r.fingerprint for r in reference.results]
    assert any(p.name.startswith("step-00000010.invalid-") for p in root.iterdir())


def test_a_writer_that_does_not_answer_costs_one_deadline(ray_cluster, tmp_path, monkeypatch, caplog):
    """A node's writer that stops answering (its node is going away: here the process is
    stopped with SIGSTOP) sends its ranks to storage after the one deadline that every copy
    question shares: it is not asked again for each rank, and no copy is pushed to it."""
    import os
    import signal

    from raytrain_ckpt.checkpoint.roles import service as service_mod
    from raytrain_ckpt.checkpoint.records import ResumePoint

    ray = ray_cluster
    monkeypatch.setattr(service_mod, "COPY_QUERY_TIMEOUT_S", 3.0)
    spec = load_spec(DEMO, [*BASE, f"checkpoint.dir={tmp_path}", "checkpoint.memory_copies=2",
                            "checkpoint.replication.mode=auto", f"name=stopped-writer-{os.getpid()}"])
    service = service_mod.CheckpointService(spec)
    node = ray.get_runtime_context().get_node_id()
    writer = service.writer_for(node)
    pid = ray.get(writer.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.INFO, logger="raytrain_ckpt"):
            t0 = time.monotonic()
            sources = service.recovery_sources(1, spec, ResumePoint(10, str(tmp_path / "step-10"), 2, 0),
                                               [node, node])
            elapsed = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGCONT)
        ray.kill(writer), ray.kill(service.actor)
    assert [s.source for s in sources] == ["storage", "storage"]
    assert "GetTimeoutError" in sources[0].why, sources[0].why
    assert not [r for r in caplog.records if "no copy of step 10 from node" in r.getMessage()]
    assert elapsed < 2 * service_mod.COPY_QUERY_TIMEOUT_S, elapsed   # one deadline, not one per rank
