"""Checkpointing on a real local Ray with real processes and real DCP files: exact resume
after a killed rank, a trainer killed right after staging, a killed writer, a killed
CheckpointActor, resharding, corrupt steps, and interop with plain DCP."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.checkpoint.roles.names import actor_name, NAMESPACE
from raytrain_ckpt.control.controller import JobResult, JobState
from raytrain_ckpt.control.driver import run_job
from raytrain_ckpt.common.faults import ENV_VAR, STAMP_VAR
from raytrain_ckpt.control.preflight import load_spec

pytestmark = pytest.mark.integration

DEMO = "jobs/llama_debug_fsdp.yaml"
# short sequences: the steps are a quarter of the demo's compute, the checkpointed state is the same
BASE = ["training.log_every_steps=1", "lr_scheduler.warmup_steps=2", "training.seq_len=32", "checkpoint.enabled=true",
        "checkpoint.interval_steps=5", "checkpoint.keep_latest_k=null", "fault_tolerance.max_restarts=0"]


def _spec(ckpt_dir: Path, *extra: str):
    return load_spec(DEMO, [*BASE, f"checkpoint.dir={ckpt_dir}", *extra])


def _ok(result: JobResult) -> JobResult:
    assert result.state is JobState.SUCCEEDED, result.error
    return result


@pytest.fixture(scope="module")
def reference(reference_20) -> JobResult:
    """20 uninterrupted steps, checkpointing every 5 (the session's run of this module's ``BASE``)."""
    return reference_20


@pytest.fixture(scope="module")
def ten_steps(ray_cluster, tmp_path_factory) -> Path:
    """The job root of a 10-step run (steps 5 and 10 committed); tests that damage it take a ``_copy``."""
    ckpt_dir = tmp_path_factory.mktemp("ten")
    _ok(run_job(_spec(ckpt_dir, "training.steps=10")))
    return ckpt_dir / "llama-debug-fsdp"


@pytest.fixture(scope="module")
def died_after_ten(ray_cluster, tmp_path_factory) -> Path:
    """The job root of a 20-step run that died at step 11, not restarted: step 10 is its last commit."""
    ckpt_dir = tmp_path_factory.mktemp("died")
    with pytest.MonkeyPatch.context() as mp:
        # 3 s before the exit: the save of step 10 is in flight a step after it (commits under load can take a step)
        mp.setenv(ENV_VAR, "slow@step:rank=0,step=11;exit@step:rank=0,step=11")
        assert run_job(_spec(ckpt_dir, "training.steps=20")).state is JobState.FAILED
    return ckpt_dir / "llama-debug-fsdp"


def _copy(root: Path, ckpt_dir: Path) -> Path:
    """A copy of job root ``root`` under ``ckpt_dir``: the job's own root there (a checkpoint is data)."""
    return Path(shutil.copytree(root, ckpt_dir / root.name))


@pytest.mark.parametrize(("fault", "resumed_at", "dead"), [
    # a 3 s pause before a fault at a step boundary: the save before it commits first on a loaded machine
    ("slow@step:rank=1,step=12;exit@step:rank=1,step=12", 10, 1),  # between checkpoints: 11-12 are replayed
    ("slow@step:rank=0,step=17;exit@step:rank=0,step=17", 15, 0),
    ("exit@staged:rank=0,step=10", 10, 0),    # the trainer dies right after handing step 10 off
    ("exit@staging:rank=0,step=10", 5, 0),    # ... or halfway through staging it: step 10 never commits
    ("slow@step:rank=1,step=12;raise@step:rank=1,step=12", 10, None),  # an exception: no process died
])
def test_killed_rank_resumes_bit_exact(reference, tmp_path, monkeypatch, fault, resumed_at, dead):
    monkeypatch.setenv(ENV_VAR, fault)
    result = _ok(run_job(_spec(tmp_path, "training.steps=20", "fault_tolerance.max_restarts=1")))
    assert result.attempts == 2
    assert ("worker process died" in (result.error or "")) is (dead is not None)
    assert all(r.start_step == resumed_at for r in result.results)
    # parameters and optimizer state after step 20 are bit-identical to the uninterrupted run
    assert [r.fingerprint for r in result.results] == [r.fingerprint for r in reference.results]
    # and so is every loss after the resume point
    assert result.losses == {s: v for s, v in reference.losses.items() if s > resumed_at}
    assert resumed_at in result.checkpoints["committed"] and 20 in result.checkpoints["committed"]
    # every process that survived was kept and reused; a dead rank was replaced by the warm spare
    for r in result.results:
        assert (r.served, r.was_spare) == (((1,), True) if r.rank == dead else ((0, 1), False)), r


def test_a_rank_killed_in_the_first_step_is_replaced_by_a_spare_started_with_the_group(ray_cluster, tmp_path,
                                                                                        monkeypatch):
    """The local Ray has cores the ranks' bundles do not take: the spare starts with the group,
    before any step, so a rank that dies in the very first step is replaced by it (a spare that
    waited for every rank to train a step would not exist yet)."""
    monkeypatch.setenv(ENV_VAR, "exit@step:rank=1,step=0")
    result = _ok(run_job(_spec(tmp_path, "training.steps=3", "fault_tolerance.max_restarts=1")))
    assert result.attempts == 2 and [f.kind for f in result.failures] == ["crash"]
    assert [(r.rank, r.served, r.was_spare) for r in result.results] == [(0, (0, 1), False), (1, (1,), True)]


def test_hung_rank_is_detected_in_time_and_the_job_resumes_bit_exact(reference, tmp_path, monkeypatch):
    """The default hang timeout (auto, learned from the step times): rank 1 hangs after step 12 and
    is found within 60 s, named, with its stacks kept; the restarted attempt then loses a process
    (a crash), and in the last one rank 0 is slow at every step (a straggler, reported). The job
    ends bit-identical, and the goodput ledger accounts for its wall time."""
    stamp = tmp_path / "hang-started"
    monkeypatch.setenv(ENV_VAR, "hang@step:rank=1,step=12;exit@step:rank=0,step=14,attempt=1;"
                                "slow@step:rank=0,step=-1,seconds=1,attempt=2")
    monkeypatch.setenv(STAMP_VAR, str(stamp))
    result = _ok(run_job(_spec(tmp_path, "training.steps=20", "fault_tolerance.max_restarts=2")))
    detected = next(t for t, what in result.events if what == "attempt 0 hang detected")
    assert detected - float(stamp.read_text()) <= 60
    hang, crash = result.failures
    assert (hang.kind, hang.rank, crash.kind) == ("hang", 1, "crash"), result.failures
    assert hang.headline.startswith("stuck in maybe_inject (raytrain_ckpt/common/faults.py:"), hang.headline
    assert "not in the collective that rank 0 wait in" in hang.headline and "hang_timeout_s=auto" in hang.headline
    folder = tmp_path / "llama-debug-fsdp" / "diagnostics" / "attempt-0"
    # the hang's folder, then the crash's failure record (every rank's text of attempt 1)
    crash_record = tmp_path / "llama-debug-fsdp" / "diagnostics" / "attempt-1" / "failure.txt"
    assert result.diagnostics == [str(folder), str(crash_record)]
    assert crash_record.is_file()
    stuck = (folder / "rank-1.stacks.txt").read_text()
    assert "maybe_inject (raytrain_ckpt/common/faults.py" in stuck, stuck
    assert "TrainWorker._run (raytrain_ckpt/rank/worker.py" in stuck, stuck
    assert "torch/distributed" in (folder / "rank-0.stacks.txt").read_text()
    verdict = (folder / "verdict.txt").read_text()
    assert "culprit: rank 1" in verdict and "rank 1 nccl trace: none (no flight recorder: backend gloo)" in verdict
    assert [r.fingerprint for r in result.results] == [r.fingerprint for r in reference.results]
    assert all(r.start_step == 10 for r in result.results)
    ledger = result.goodput
    assert abs(sum(ledger["seconds"].values()) - result.elapsed_s) <= 0.01 * result.elapsed_s, ledger
    assert ledger["seconds"]["detection"] >= 25 and ledger["seconds"]["training"] > 0, ledger
    assert [(a["attempt"], a["ended_by"]) for a in ledger["attempts"]] == [(0, "hang"), (1, "crash"), (2, None)]
    assert all({"placement", "rendezvous", "load", "first_step"} <= set(a["phases"]) for a in ledger["attempts"])
    assert ledger["attempts"][2]["phases"]["redone"] > 0         # steps 11-14 trained again
    (straggler,) = result.stragglers
    assert straggler.startswith("attempt 2: rank 0 is a straggler: it begins its steps "), straggler


def test_killed_writer_aborts_only_that_step(ray_cluster, reference, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "exit@persist:rank=0,step=5")
    result = _ok(run_job(_spec(tmp_path, "training.steps=20")))
    assert result.attempts == 1
    status = result.checkpoints
    assert 5 not in status["committed"] and 5 in status["failed"]
    assert {10, 15, 20} <= set(status["committed"])
    assert result.results[0].checkpoint["aborted"] == 1
    assert [r.fingerprint for r in result.results] == [r.fingerprint for r in reference.results]
    assert not any(".tmp-" in p.name for p in (tmp_path / "llama-debug-fsdp").iterdir())


def test_a_step_whose_writer_died_is_aborted_at_once_on_restart(ray_cluster, reference, tmp_path, monkeypatch):
    # both ranks hand step 10 off; rank 1 dies at step 12 while the writer is still (slowly) writing
    # step 10, so nobody waits on it; then the writer dies. The restart waits while the writer holds
    # the step, and must not wait settle_timeout_s once the step cannot commit
    monkeypatch.setenv(ENV_VAR, "slow@persist:rank=0,step=10;exit@persist:rank=0,step=10;exit@step:rank=1,step=12")
    result = _ok(run_job(_spec(tmp_path, "training.steps=20", "fault_tolerance.max_restarts=1",
                               "fault_tolerance.poll_interval_s=0.1", "checkpoint.settle_timeout_s=120")))
    detected = next(t for t, what in result.events if what.startswith("attempt 0 ") and what.endswith(" detected"))
    restarted = next(t for t, what in result.events if what == "attempt 1 running")
    assert restarted - detected < 60, result.events   # well under settle_timeout_s (120) with the restart's process starts
    assert {5, 10, 15, 20} <= set(result.checkpoints["committed"])   # 10 saved again by the restart
    assert all(r.start_step == 5 for r in result.results)               # attempt 0's step 10 never committed
    assert [r.fingerprint for r in result.results] == [r.fingerprint for r in reference.results]
    assert result.losses == {s: v for s, v in reference.losses.items() if s > 5}
    assert not any(".tmp-" in p.name for p in (tmp_path / "llama-debug-fsdp").iterdir())


def test_checkpoint_actor_killed_during_commit(ray_cluster, reference, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "exit@commit:rank=0,step=10")
    result = _ok(run_job(_spec(tmp_path, "training.steps=20")))
    assert result.attempts == 1
    committed = result.checkpoints["committed"]
    assert 10 not in committed and {5, 15, 20} <= set(committed)   # 5 rebuilt from disk after the restart
    assert not (tmp_path / "llama-debug-fsdp" / "step-00000010").exists()
    assert not any(".tmp-" in p.name for p in (tmp_path / "llama-debug-fsdp").iterdir())
    assert [r.fingerprint for r in result.results] == [r.fingerprint for r in reference.results]


def test_killed_checkpoint_actor_recovers_from_storage(ray_cluster, tmp_path):
    import ray

    root = tmp_path / "llama-debug-fsdp"
    box: dict[str, JobResult] = {}
    job = threading.Thread(target=lambda: box.setdefault("r", run_job(_spec(tmp_path, "training.steps=30"))))
    job.start()
    deadline = time.monotonic() + 120
    while not (root / "step-00000010").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (root / "step-00000010").exists(), "no commit within 120 s"
    ray.kill(ray.get_actor(actor_name("llama-debug-fsdp"), namespace=NAMESPACE), no_restart=False)
    job.join(timeout=300)
    result = _ok(box["r"])
    # the restarted actor rebuilt 5 and 10 from disk and went on committing
    assert {5, 10, 30} <= set(result.checkpoints["committed"])
    assert sorted(CheckpointLayout(root).valid_steps("checksum")) == result.checkpoints["committed"]


def test_corrupt_latest_step_is_skipped_on_resume(ten_steps, tmp_path):
    step10 = _copy(ten_steps, tmp_path) / "step-00000010"
    shard = next(step10.glob("__1_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum catches it
    shard.write_bytes(bytes(data))
    result = _ok(run_job(_spec(tmp_path, "training.steps=12")))  # checksum verification is the default
    assert all(r.start_step == 5 for r in result.results)
    # the corrupt step was moved aside when step 10 was saved again, never loaded or deleted
    assert any(p.name.startswith("step-00000010.invalid-") for p in step10.parent.iterdir())
    assert 12 in result.checkpoints["committed"]


@pytest.mark.parametrize("workers", [1, 4])
def test_reshard_resume_at_another_world_size(reference, died_after_ten, tmp_path, workers):
    _copy(died_after_ten, tmp_path)  # a 2-worker run's steps 5 and 10
    result = _ok(run_job(_spec(tmp_path, "training.steps=20", f"resources.num_workers={workers}",
                               "parallelism.dp_shard=-1")))
    assert all(r.start_step == 10 for r in result.results)
    assert len(result.results) == workers
    # the same global samples from step 11 on: losses match the 2-worker run within float tolerance
    assert sorted(result.losses) == list(range(11, 21))
    for step, loss in result.losses.items():
        assert loss == pytest.approx(reference.losses[step], rel=1e-4), step


def test_plain_dcp_reads_our_checkpoint_in_another_process(ten_steps, tmp_path):
    step = ten_steps / "step-00000005"  # only read
    code = f"""
import torch, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from raytrain_ckpt.models import build_model
model = build_model("debug", {{}})
init = {{k: v.clone() for k, v in model.state_dict().items()}}
sd = {{"model": model.state_dict()}}
dcp.load(sd, checkpoint_id="{step}")          # no process group: plain single-process DCP
dcp_to_torch_save("{step}", "{tmp_path}/full.pt")
full = torch.load("{tmp_path}/full.pt", weights_only=False)
assert set(full["model"]) == set(init)
for k, v in sd["model"].items():
    assert torch.equal(v, full["model"][k]), k
assert any(not torch.equal(v, init[k]) for k, v in sd["model"].items())
assert full["train"]["step"] == 5 and full["train"]["samples_seen"] == 5 * 16
assert "state.tok_embeddings.weight.exp_avg" in full["optim"]
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_sync_mode_commits_before_training_goes_on(ray_cluster, tmp_path):
    result = _ok(run_job(_spec(tmp_path, "training.steps=10", "checkpoint.mode=sync")))
    assert result.checkpoints["committed"] == [5, 10]
    assert all(r.checkpoint["saves"] == 2 for r in result.results)


@pytest.mark.parametrize("on_busy", ["skip", "wait"])
def test_save_due_while_the_previous_is_writing(ray_cluster, tmp_path, monkeypatch, on_busy):
    # the writer of rank 0 takes 3 s more for step 2, while a save is due every step
    monkeypatch.setenv(ENV_VAR, "slow@persist:rank=0,step=2")
    result = _ok(run_job(_spec(tmp_path, "training.steps=8", "checkpoint.interval_steps=1",
                               f"checkpoint.on_busy={on_busy}")))
    committed = result.checkpoints["committed"]
    skipped = [r.checkpoint["skipped"] for r in result.results]
    if on_busy == "skip":
        assert skipped[0] >= 1 and len(set(skipped)) == 1, result.checkpoints   # every rank skipped the same saves
        # which saves were skipped depends on write speed; the final save is never skipped
        assert 8 in committed and len(committed) == 8 - skipped[0], (skipped, result.checkpoints)
    else:
        assert skipped == [0, 0] and committed == list(range(1, 9))


@pytest.mark.parametrize(("faults", "extra", "why"), [
    # the save of the last step fails: the job fails, the earlier step stays
    ("raise@persist:rank=0,step=10", ["checkpoint.interval_steps=5"], "the final checkpoint (step 10) did not commit"),
    # the last step is not due, but no save of the run committed
    ("raise@persist:rank=0,step=4;raise@persist:rank=1,step=8",
     ["checkpoint.interval_steps=4", "checkpoint.save_final=false"], "no checkpoint of this run committed"),
])
def test_a_run_whose_saves_did_not_commit_fails(ray_cluster, tmp_path, monkeypatch, faults, extra, why):
    monkeypatch.setenv(ENV_VAR, faults)
    result = run_job(_spec(tmp_path, "training.steps=10", *extra))
    assert result.state is JobState.FAILED, result.checkpoints
    assert why in (result.error or "") and why in result.checkpoints["save_error"]
    assert any(str(f).startswith("attempt 0 checkpoint: ") for f in result.failures), result.failures
    assert all(r.steps == 10 for r in result.results)     # training itself finished
    failed_steps = [int(f.split("step=")[1]) for f in faults.split(";")]
    saves = result.checkpoints["failed_saves"]           # each failed step once, none committed since
    assert saves["total"] == saves["consecutive"] == len(failed_steps), saves
    assert saves["last_step"] == failed_steps[-1] and "rank" in saves["last_error"], saves


def test_resuming_an_older_step_starts_a_new_timeline(reference, tmp_path, monkeypatch):
    root = tmp_path / "llama-debug-fsdp"
    keep2 = "checkpoint.keep_latest_k=2"
    # the reference's step 5 (a 20-step run that dies after it; 3 s after, so that the save of step 5,
    # still in flight a step later on a loaded machine, commits first) ...
    monkeypatch.setenv(ENV_VAR, "slow@step:rank=0,step=6;exit@step:rank=0,step=6")
    assert run_job(_spec(tmp_path, "training.steps=20", keep2)).state is JobState.FAILED
    assert sorted(CheckpointLayout(root).step_dirs()) == [5]
    # ... and an abandoned run from it on other data, so that its step 10 differs from the reference's
    monkeypatch.setenv(ENV_VAR, "slow@step:rank=0,step=11;exit@step:rank=0,step=11")
    assert run_job(_spec(tmp_path, "training.steps=20", keep2, "training.seed=1")).state is JobState.FAILED
    assert sorted(CheckpointLayout(root).step_dirs()) == [5, 10]
    # Its first attempt dies while loading step 5: the restart starts at 5 again (step 10 of the run
    # it leaves is still in place until a start succeeded), then dies after the new step 10 commits
    monkeypatch.setenv(ENV_VAR, "exit@setup:rank=1,step=0,attempt=0;"
                       "slow@step:rank=1,step=12,attempt=1;exit@step:rank=1,step=12,attempt=1")
    result = _ok(run_job(_spec(tmp_path, "training.steps=20", keep2, "checkpoint.resume=5",
                               "fault_tolerance.max_restarts=2")))
    assert result.attempts == 3
    # the last restart resumed from the new run's step 10, not the abandoned one: bit-exact with the reference
    assert all(r.start_step == 10 for r in result.results)
    assert [r.fingerprint for r in result.results] == [r.fingerprint for r in reference.results]
    assert result.losses == {s: v for s, v in reference.losses.items() if s > 10}
    # keep_latest_k=2 keeps 15 and 20; 10 is the newest certified step (10 healthy steps followed it,
    # training.guard.certify_after_steps), which retention never deletes
    assert result.checkpoints["committed"] == [10, 15, 20] and result.checkpoints["failed"] == {}
    # the abandoned step 10 is kept aside, intact, never deleted
    aside = [p for p in root.iterdir() if p.name.startswith("step-00000010.abandoned-")]
    assert len(aside) == 1
    manifest = CheckpointLayout(root).read_manifest(aside[0])
    assert manifest.step == 10 and all((aside[0] / name).stat().st_size == f.size
                                       for name, f in manifest.files.items())


@pytest.mark.parametrize("how", ["number", "path"])
def test_resuming_a_damaged_step_asked_for_fails_the_start(ten_steps, tmp_path, capfd, how):
    from raytrain_ckpt.cli import main as cli

    root = _copy(ten_steps, tmp_path)
    shard = next((root / "step-00000010").glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the checksum catches it
    shard.write_bytes(bytes(data))
    before = sorted(p.name for p in root.iterdir())
    resume = "10" if how == "number" else str(root / "step-00000010")
    capfd.readouterr()
    # the step asked for is damaged: the job does not start (at step 0 or anywhere else)
    code = cli.main(["run", DEMO, *[a for s in [*BASE, f"checkpoint.dir={tmp_path}", "training.steps=12",
                                                 f"checkpoint.resume={resume}"] for a in ("--set", s)]])
    err = capfd.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"checkpoint.resume={resume}" in lines[0] and "__0_" in lines[0], err
    assert "Traceback" not in err
    # nothing was trained, moved aside or deleted
    assert sorted(p.name for p in root.iterdir()) == before
    assert sorted(CheckpointLayout(root).valid_steps("size")) == [5, 10]


def test_a_second_run_into_the_same_job_root_is_refused_at_start(ray_cluster, tmp_path, capfd):
    """Two runs of one job on one checkpoint root mixed their steps in one timeline (each
    committing where the other had, each start removing the other's saves in flight)."""
    from tests.unit.test_lease_liveness import _hold_run_lock

    root = tmp_path / "llama-debug-fsdp"
    refused_while_held(_hold_run_lock(root), str(root), capfd, f"checkpoint.dir={tmp_path}")
    assert sorted(p.name for p in root.iterdir()) == [".run.lock"]  # nothing started, nothing written


def refused_while_held(holder, root: str, capfd, *overrides: str) -> None:
    """``run`` of the demo job (``overrides`` on BASE, 5 steps) while ``holder``, a process holding
    the run lock of job root ``root``, lives: exit 2, one line naming the holder, no traceback."""
    from raytrain_ckpt.cli import main as cli

    try:
        capfd.readouterr()
        code = cli.main(["run", DEMO, *[a for s in [*BASE, "training.steps=5", *overrides] for a in ("--set", s)]])
        err = capfd.readouterr().err
    finally:
        holder.kill()
        holder.wait()
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(
        f"error: checkpoint.dir: another run of this job is training into {root} (pid {holder.pid} "), err
    assert "Traceback" not in err
