"""A failure local to one replica group ends that group only: the others train on, the group is
replaced and healed from a live one at the rejoin step the membership rule fixes (a real Ray job,
dp_replicate=2 x dp_shard=2, a rank of the second group killed by a real exit)."""

from __future__ import annotations

import pytest

from raytrain_ckpt.common.faults import ENV_VAR
from raytrain_ckpt.control.controller import JobState
from raytrain_ckpt.control.driver import run_job
from raytrain_ckpt.control.preflight import load_spec
from tests.conftest import ray_tmpdir

pytestmark = pytest.mark.integration

DEMO = "jobs/llama_debug_fsdp.yaml"
STEPS, FAIL_AT, HEAL = 24, 8, 6
JOB = [f"training.steps={STEPS}", "training.log_every_steps=1", "lr_scheduler.warmup_steps=2",
       "resources.num_workers=4", "resources.cpus_per_worker=0.5", "parallelism.dp_replicate=2",
       "parallelism.dp_shard=2", f"fault_tolerance.heal_steps={HEAL}", "fault_tolerance.max_restarts=1",
       "checkpoint.enabled=false"]


def _run(monkeypatch, name: str, fault: str = "exit"):
    monkeypatch.setenv(ENV_VAR, f"{fault}@step:rank=3,step={FAIL_AT}")  # rank 1 of replica group 1, at step index 8
    result = run_job(load_spec(DEMO, [*JOB, f"name={name}"]))
    monkeypatch.delenv(ENV_VAR)
    return result


@pytest.mark.parametrize("fault, kind", [("exit", "crash"), ("nan", "rollback"), ("hang", "hang")])
def test_a_failed_replica_group_is_replaced_and_healed_while_the_other_trains_on(ray_cluster, monkeypatch, fault, kind):
    """A crash (a real exit), or a NaN loss that trips the training guard in the second group (a
    group that does not save has no rollback of its own: a live group's state replaces its own)."""
    first = _run(monkeypatch, f"heal-{fault}", fault)
    assert first.state is JobState.SUCCEEDED, first.error
    # one attempt: the healthy group never went back to an earlier step
    assert first.attempts == 1
    assert [f.kind for f in first.failures] == [kind] and first.failures[0].rank == 3
    assert [(h["replica"], h["rank"], h["kind"]) for h in first.heals] == [(1, 3, kind)]
    assert first.heals[0]["healed_s"] > 0  # the failure's detection -> the replacement trained a step
    # the goodput ledger: the time group 0 trained alone, half of it the share group 1 did not train
    assert 0 < first.goodput["seconds"]["degraded"] < first.goodput["seconds"]["training"]
    by_rank = {r.rank: r for r in first.results}
    assert sorted(by_rank) == [0, 1, 2, 3] and all(r.steps == STEPS for r in by_rank.values())
    # both groups end with the same shards, bit for bit (rank k of one group = rank k of the other)
    assert by_rank[0].fingerprint == by_rank[2].fingerprint != by_rank[1].fingerprint == by_rank[3].fingerprint
    # the rule: the group failed in step FAIL_AT+1 (1-based), is out of it and of the H steps after,
    # and its replacement was healed at step FAIL_AT+1+H
    s = FAIL_AT + 1
    skipped = [(step, g) for step, g in by_rank[0].replicas["skipped"]]
    assert skipped == [(step, 1) for step in range(s, s + HEAL + 1)]
    assert by_rank[2].replicas["healed_at"] == s + HEAL and by_rank[0].replicas["healed_at"] is None
    assert by_rank[2].replicas["skipped"] == by_rank[0].replicas["skipped"]
    # every sample accounted for: tokens seen are the trained ones, the skipped share named above
    job = load_spec(DEMO, [*JOB, "name=heal-x"])
    t = job.training
    per_group = t.global_batch_size // 2
    assert by_rank[0].tokens_seen == (STEPS * t.global_batch_size - len(skipped) * per_group) * t.seq_len
    assert by_rank[2].tokens_seen == by_rank[0].tokens_seen
    # the samples each skipped share held: the second half of every skipped step's global batch
    assert by_rank[0].replicas["skipped_samples"] == [(step, 1, (step - 1) * t.global_batch_size + per_group,
                                                      step * t.global_batch_size) for step, _ in skipped]
    if fault != "exit":
        return
    # the same fault again: the same membership, the same parameters, bit for bit
    second = _run(monkeypatch, "heal-again")
    assert second.state is JobState.SUCCEEDED, second.error
    assert [r.fingerprint for r in second.results] == [r.fingerprint for r in first.results]
    assert second.results[0].replicas["skipped"] == first.results[0].replicas["skipped"]


def test_the_saving_group_failing_alone_is_healed_and_its_replacement_saves_on(ray_cluster, monkeypatch, tmp_path):
    """Rank 1 (of the first group, the one that saves) exits at step 9 of 24, a checkpoint every 4
    steps: the second group trains on alone, no step is saved while the first is out (steps
    9-15), its replacement is healed at step 15 from the second group and saves steps 16, 20 and
    24; the manifests name the first group's skipped shares and the last one resumes."""
    import json

    ckpt = ["checkpoint.enabled=true", f"checkpoint.dir={tmp_path}", "checkpoint.interval_steps=4",
            "checkpoint.keep_latest_k=10", "name=heal-first"]
    monkeypatch.setenv(ENV_VAR, f"exit@step:rank=1,step={FAIL_AT}")
    result = run_job(load_spec(DEMO, [*JOB, *ckpt]))
    monkeypatch.delenv(ENV_VAR)
    assert result.state is JobState.SUCCEEDED, result.error
    assert result.attempts == 1 and [(h["replica"], h["rank"], h["kind"]) for h in result.heals] == [(0, 1, "crash")]
    by_rank = {r.rank: r for r in result.results}
    assert sorted(by_rank) == [0, 1, 2, 3] and all(r.steps == STEPS for r in by_rank.values())
    assert by_rank[0].fingerprint == by_rank[2].fingerprint and by_rank[1].fingerprint == by_rank[3].fingerprint
    s = FAIL_AT + 1
    assert by_rank[2].replicas["skipped"] == [(step, 0) for step in range(s, s + HEAL + 1)]
    assert by_rank[0].replicas["healed_at"] == s + HEAL
    committed = result.checkpoints["committed"]
    assert {4, 16, 20, 24} <= set(committed) and 12 not in committed, committed
    t = load_spec(DEMO, [*JOB, *ckpt]).training
    per_group = t.global_batch_size // 2
    rows = [[step, 0, (step - 1) * t.global_batch_size, (step - 1) * t.global_batch_size + per_group]
            for step in range(s, s + HEAL + 1)]
    last = json.loads((tmp_path / "heal-first" / f"step-{STEPS:08d}" / "manifest.json").read_text())
    assert last["replica_skips"] == rows
    assert last["tokens_seen"] == by_rank[0].tokens_seen == (STEPS * t.global_batch_size - len(rows) * per_group) * t.seq_len
    # the replacement saved the healed state: loaded into one group, it is the job's last state bit for bit
    resumed = run_job(load_spec(DEMO, [*JOB, *ckpt, "parallelism.dp_replicate=1", "resources.num_workers=2"]))
    assert resumed.state is JobState.SUCCEEDED, resumed.error
    assert [(r.start_step, r.fingerprint) for r in resumed.results] == [(STEPS, by_rank[0].fingerprint),
                                                                         (STEPS, by_rank[1].fingerprint)]


def test_an_evicted_rank_moves_its_replica_group_while_the_other_trains_on(ray_cluster, monkeypatch, tmp_path):
    """A pod eviction in a replicated job: a real SIGTERM to the process of rank 3 (the second
    group) mid-run. That group alone is replaced and healed from the first: no preemption save,
    no restart, and both groups end with the same shards."""
    import json
    import os
    import signal
    import threading
    import time

    import psutil

    from raytrain_ckpt.rank.progress import _dir

    spec = load_spec(DEMO, [*JOB, "training.steps=40", "fault_tolerance.poll_interval_s=0.2", "name=heal-evict",
                            "checkpoint.enabled=true", "checkpoint.interval_steps=50", f"checkpoint.dir={tmp_path}"])
    # rank 0 pauses 1 s after steps 6-9: the signal comes mid-run whatever the machine's speed
    monkeypatch.setenv(ENV_VAR, ";".join(f"slow@step:rank=0,step={s},seconds=1" for s in (6, 7, 8, 9)))
    box: dict = {}
    job = threading.Thread(target=lambda: box.setdefault("result", run_job(spec)))
    job.start()
    victim, deadline = None, time.monotonic() + 240
    while victim is None and job.is_alive() and time.monotonic() < deadline:
        mine = {p.pid for p in psutil.Process().children(recursive=True)}  # this session's Ray: this process's
        for f in _dir().glob("*.rank3.json") if _dir().exists() else ():
            try:
                record = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            if record["step"] >= 6 and record["pid"] in mine:
                victim = record["pid"]
        time.sleep(0.1)
    assert victim is not None, "rank 3 never reached step 6"
    os.kill(victim, signal.SIGTERM)
    job.join(timeout=300)
    monkeypatch.delenv(ENV_VAR)
    r = box["result"]
    assert r.state is JobState.SUCCEEDED, r.error
    assert r.attempts == 1 and r.preemptions == [] and r.failures == []
    assert [(h["replica"], h["rank"], h["kind"]) for h in r.heals] == [(1, 3, "eviction")]
    by_rank = {x.rank: x for x in r.results}
    assert all(x.steps == 40 for x in by_rank.values())
    assert by_rank[0].fingerprint == by_rank[2].fingerprint and by_rank[1].fingerprint == by_rank[3].fingerprint
    assert by_rank[2].replicas["healed_at"] is not None and all(g == 1 for _, g in by_rank[0].replicas["skipped"])


def test_a_stop_signal_stops_every_replica_group_at_the_saved_step_and_a_rerun_resumes_there(tmp_path):
    """SIGTERM to the driver of a replicated job (the path a drain notice takes too): the first group
    saves the step in hand and stops, the second stops at once without holding the first back (its
    Manager's heartbeat ends with it), the job ends STOPPED with the step committed, and a rerun
    resumes there in every group."""
    import os
    import re
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", ENV_VAR)}
    env.update(PYTHONPATH=str(repo), RAY_AUTH_MODE="disabled", RAY_TMPDIR=ray_tmpdir(),
               XDG_STATE_HOME=str(tmp_path / "state"))

    def cli(steps: int) -> subprocess.Popen:
        sets = [*JOB, "checkpoint.enabled=true", f"checkpoint.dir={tmp_path}", "checkpoint.interval_steps=5",
                f"training.steps={steps}", "fault_tolerance.poll_interval_s=0.2", "name=replica-stop"]
        args = [sys.executable, "-m", "raytrain_ckpt", "run", DEMO, "--address", "local"]
        for s in sets:
            args += ["--set", s]
        return subprocess.Popen(args, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    root = tmp_path / "replica-stop"
    proc = cli(400)
    try:
        deadline = time.monotonic() + 300
        while not (root / "step-00000005").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert (root / "step-00000005").exists(), proc.communicate(timeout=60)[1][-3000:]
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        stopped_s = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]
    m = re.search(r"stopped: job replica-stop: SIGTERM: step (\d+) is committed and safe", err)
    assert m, err[-3000:]
    safe = int(m.group(1))
    assert (root / f"step-{safe:08d}" / "manifest.json").exists()
    assert "did not stop before the deadline" not in err and stopped_s < 25, (stopped_s, err[-3000:])
    rerun = cli(safe + 3)
    out, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err[-3000:]
    assert f"resumed at step {safe}" in out + err


def test_a_group_failing_too_close_to_the_end_to_rejoin_is_not_waited_for(ray_cluster, monkeypatch, tmp_path):
    """The second group fails at step 21 of 24 with heal_steps 6: its rejoin step is past the last
    step, so the first group finishes alone and the job succeeds without the replacement. The
    manifests name the skipped shares: none at step 20, steps 21-24's at step 24, and a resume
    (into one group of two ranks) carries them on to its own manifests."""
    import json

    ckpt = ["checkpoint.enabled=true", f"checkpoint.dir={tmp_path}", "checkpoint.interval_steps=4",
            "checkpoint.keep_latest_k=10", "name=heal-late"]
    monkeypatch.setenv(ENV_VAR, "exit@step:rank=3,step=20")
    result = run_job(load_spec(DEMO, [*JOB, *ckpt]))
    monkeypatch.delenv(ENV_VAR)
    assert result.state is JobState.SUCCEEDED, result.error
    assert result.attempts == 1 and [(h["replica"], h["rank"]) for h in result.heals] == [(1, 3)]
    assert "healed_s" not in result.heals[0]
    assert [(r.rank, r.steps) for r in result.results] == [(0, STEPS), (1, STEPS)]
    assert result.results[0].replicas["skipped"] == [(step, 1) for step in range(21, STEPS + 1)]
    rows = [list(r) for r in result.results[0].replicas["skipped_samples"]]
    t = load_spec(DEMO, [*JOB, *ckpt]).training
    assert rows == [[step, 1, (step - 1) * t.global_batch_size + t.global_batch_size // 2, step * t.global_batch_size]
                    for step in range(21, STEPS + 1)]

    def manifest(step: int) -> dict:
        return json.loads((tmp_path / "heal-late" / f"step-{step:08d}" / "manifest.json").read_text())

    assert "replica_skips" not in manifest(20)
    last = manifest(STEPS)
    assert last["replica_skips"] == rows
    # every sample accounted for: the trained ones in tokens_seen, the skipped ones named
    assert last["tokens_seen"] == (last["samples_seen"] - sum(hi - lo for _, _, lo, hi in rows)) * t.seq_len
    resumed = run_job(load_spec(DEMO, [*JOB, *ckpt, f"training.steps={STEPS + 4}", "parallelism.dp_replicate=1",
                                       "resources.num_workers=2"]))
    assert resumed.state is JobState.SUCCEEDED, resumed.error
    assert manifest(STEPS + 4)["replica_skips"] == rows
