"""Preemptions on real Ray: a node drained with the real `ray drain-node` (a multi-node
ray.cluster_utils.Cluster, in a subprocess so it does not share the session's Ray): a rank's node,
a node without ranks, a drain with no replacement (shrink, then grow back); a real SIGTERM to a
driver run from the command line and to one rank's worker process. Nothing trained before the
notice is lost."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from raytrain_ckpt.common.faults import ENV_VAR
from tests.conftest import REFERENCE_20, ray_tmpdir

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("preemption_job.py")


def test_drain_of_a_rank_node_resumes_at_the_notice_bit_identical(reference_20_run, tmp_path):
    """25 s notice on the node of a rank, interval 50, max_restarts 0, a replacement node joins."""
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "replace"], capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    r = json.loads(lines[-1])
    ref, run = reference_20_run[0], r["drained"]   # the same job, uninterrupted, on the session's Ray
    assert r["victim"] in r["draining_seen"]                  # Ray's own drain record, raised by the CLI
    assert run["state"] == "SUCCEEDED", run
    assert run["kinds"] == ["preemption"] and run["attempts"] == 2     # no restart spent (max_restarts=0)
    [p] = run["preemptions"]
    assert p["node"] == r["victim"] and p["tier"] == "durable" and p["steps_lost"] == 0
    assert 20 < p["time_left_s"] <= 25
    saved = p["saved_step"]
    assert 7 <= saved < 20 and saved in run["committed"]       # the step in hand: no interval save fell before it
    assert run["start_steps"] == [saved, saved]                 # resumed there: nothing trained twice
    assert sorted(map(int, run["losses"])) == list(range(saved + 1, 21))
    assert run["fingerprints"] == [x.fingerprint for x in ref.results]    # bit-identical to the uninterrupted run
    assert all(v == ref.losses[int(k)] for k, v in run["losses"].items())


@pytest.mark.parametrize("mode, group", [("replicas", 1), ("replicas0", 0)])
def test_drain_of_a_replica_groups_node_moves_that_group_while_the_other_trains_on(reference_20_run, tmp_path,
                                                                                   mode, group):
    """dp_replicate 2 of one rank each, one group's node drained (25 s notice) and a replacement
    node added: no preemption save, no restart; that group alone is replaced on the new node and
    healed from the other, which never stops; both end with the same parameters. The first group
    (the one that saves) too: its replacement saves the last step from the new node."""
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), mode], capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    r = json.loads(lines[-1])
    run = r["drained"]
    assert r["victim"] in r["draining_seen"]
    assert run["state"] == "SUCCEEDED", run
    assert run["attempts"] == 1 and run["preemptions"] == [] and run["kinds"] == [], run
    assert [(h["replica"], h["rank"], h["kind"]) for h in run["heals"]] == [(group, group, "drain")]
    assert run["heals"][0]["healed_s"] > 0
    assert run["steps"] == [20, 20] and run["fingerprints"][0] == run["fingerprints"][1]
    skipped = run["replicas"][1 - group]["skipped"]
    assert skipped and all(g == group for _, g in skipped) and run["replicas"][group]["healed_at"] == skipped[-1][0]
    assert run["committed"] == [20] and "step-00000020" in r["committed_after"]  # the final save, after the move


def test_a_deadline_too_short_for_a_durable_save_resumes_from_ram_on_a_surviving_node(reference_20_run, tmp_path):
    """12 s notice after a durable save that took 15 s (step 5's write slowed): the RAM tier. The
    step in hand is pushed from the draining node to the surviving one, storage is left as it was,
    and the next attempt loads that step from memory, bit-identical to the uninterrupted run."""
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "ram"], capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    r = json.loads(lines[-1])
    ref, run = reference_20_run[0], r["drained"]
    assert r["victim"] in r["draining_seen"] and run["state"] == "SUCCEEDED", run
    assert run["kinds"] == ["preemption"] and run["attempts"] == 2
    [p] = run["preemptions"]
    assert p["node"] == r["victim"] and p["tier"] == "ram" and p["steps_lost"] == 0, (p, out.stderr[-3000:])
    saved = p["saved_step"]
    assert 5 < saved < 20 and "tier ram" in run["failures"][0] and "held in RAM on nodes not draining" in run["failures"][0]
    # the copy of the draining node's rank went to the surviving node's writer, before the deadline
    assert re.search(rf"rank \d+'s copy of step {saved} pushed from draining node {r['victim'][:12]} to node", out.stderr)
    assert f"resuming from step {saved} held in RAM" in out.stderr
    assert run["start_steps"] == [saved, saved] and run["loaded_from_memory"] == [1.0, 1.0]
    assert sorted(map(int, run["losses"])) == list(range(saved + 1, 21))
    assert run["fingerprints"] == [x.fingerprint for x in ref.results]    # bit-identical to the uninterrupted run
    assert all(v == ref.losses[int(k)] for k, v in run["losses"].items())
    # storage: step 5 was the only committed step at the notice, and stayed byte for byte; the RAM
    # step never reached it
    assert list(r["committed_before"]) == ["step-00000005"]
    assert r["committed_after"]["step-00000005"] == r["committed_before"]["step-00000005"]
    assert f"step-{saved:08d}" not in r["committed_after"] and saved not in run["committed"]


_STATE_HOME = ray_tmpdir("rtc-state-")
"""This module's drivers write their job records here, not in the user's ~/.local/state."""


def _cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONPATH=str(REPO), RAY_AUTH_MODE="disabled", RAY_TMPDIR=ray_tmpdir(),
               XDG_STATE_HOME=_STATE_HOME)
    return env


def _run_cli(ckpt: Path, steps: int, faults: str = "") -> subprocess.Popen:
    sets = [*REFERENCE_20, f"training.steps={steps}", f"checkpoint.dir={ckpt}", "fault_tolerance.poll_interval_s=0.2"]
    args = [sys.executable, "-m", "raytrain_ckpt", "run", "jobs/llama_debug_fsdp.yaml", "--address", "local"]
    for s in sets:
        args += ["--set", s]
    return subprocess.Popen(args, cwd=REPO, env=_cli_env() | {ENV_VAR: faults}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_sigterm_to_the_driver_commits_the_step_in_hand_and_a_rerun_resumes_there(tmp_path):
    root = tmp_path / "llama-debug-fsdp"
    # a save every 5 steps; rank 0 pauses 3 s after steps 6, 7 and 8: the signal comes mid-run
    proc = _run_cli(tmp_path, 40, ";".join(f"slow@step:rank=0,step={s}" for s in (6, 7, 8)))
    try:
        deadline = time.monotonic() + 300
        while not (root / "step-00000005").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert (root / "step-00000005").exists(), proc.communicate(timeout=60)[1][-3000:]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err[-3000:]                  # 128 + SIGTERM: stopped, not failed (1)
    m = re.search(r"stopped: job llama-debug-fsdp: SIGTERM: step (\d+) is committed and safe", err)
    assert m, err[-3000:]
    safe = int(m.group(1))
    assert 5 < safe < 10 and (root / f"step-{safe:08d}" / "manifest.json").exists()   # not the interval save
    line = f"SIGTERM: step {safe} is committed and safe"
    assert f"RUNNING -> STOPPED ({line})" in err and "-> FAILED" not in err, err[-3000:]
    record = json.loads((root / ".job.json").read_text())
    assert record["job_info"]["state"] == "STOPPED" and record["stopped"] == line and record["error"] is None, record
    # this machine's record (the local Ray the driver started is gone; an address where nothing
    # answers, so that no other cluster on this machine is asked), and the root's record
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{s.getsockname()[1]}"
    for args in (["--job", "llama-debug-fsdp", "--address", nowhere], [str(root)]):
        shown = subprocess.run([sys.executable, "-m", "raytrain_ckpt", "status", *args], cwd=REPO, env=_cli_env(),
                               capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0, shown.stderr[-2000:]
        assert "STOPPED" in shown.stdout and f"stopped by {line}" in shown.stdout, shown.stdout
        assert "FAILED" not in shown.stdout and "error:" not in shown.stdout, shown.stdout
    rerun = _run_cli(tmp_path, safe + 2)
    out, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err[-3000:]
    assert f"resumed at step {safe}" in out


def test_sigterm_to_a_rank_process_saves_the_step_in_hand_and_resumes_there(reference_20_run, tmp_path, monkeypatch):
    """A pod eviction: a real SIGTERM to one rank's worker process, max_restarts 0, on the session's Ray."""
    import psutil
    import ray

    from raytrain_ckpt.checkpoint.roles.names import NAMESPACE, actor_name
    from raytrain_ckpt.control.driver import run_job
    from raytrain_ckpt.control.preflight import load_spec

    spec = load_spec(REPO / "jobs" / "llama_debug_fsdp.yaml", [
        *REFERENCE_20, f"checkpoint.dir={tmp_path}", "checkpoint.interval_steps=50",
        "fault_tolerance.poll_interval_s=0.2", "fault_tolerance.stop_grace_s=30"])
    # rank 0 pauses 3 s after steps 8, 9 and 10: the signal comes mid-run whatever the machine's speed
    monkeypatch.setenv(ENV_VAR, ";".join(f"slow@step:rank=0,step={s}" for s in (8, 9, 10)))
    box: dict = {}
    job = threading.Thread(target=lambda: box.setdefault("result", run_job(spec)))
    job.start()
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and job.is_alive():
        try:
            note = ray.get(ray.get_actor(actor_name(spec.name), namespace=NAMESPACE).status.remote(), timeout=10).job_info
        except Exception:  # noqa: BLE001 - not up yet: ask again
            note = None
        if note is not None and (note.train_step or 0) >= 7:
            break
        time.sleep(0.1)
    # this session's Ray was started by this process: its workers are this process's descendants
    ranks = [p for p in psutil.Process().children(recursive=True) if "ray::TrainWorker" in " ".join(p.cmdline())]
    assert len(ranks) == 2, [p.cmdline() for p in ranks]
    os.kill(ranks[1].pid, signal.SIGTERM)
    job.join(timeout=300)
    r = box["result"]
    ref = reference_20_run[0]
    assert r.state.value == "SUCCEEDED", r.error
    assert [f.kind for f in r.failures] == ["preemption"] and r.attempts == 2     # no restart spent
    assert "got SIGTERM" in r.failures[0].headline, r.failures[0].headline
    [p] = r.preemptions
    assert p["cause"] == "sigterm" and p["steps_lost"] == 0 and 25 < p["time_left_s"] <= 30
    saved = p["saved_step"]
    assert 7 <= saved < 20 and saved in r.checkpoints["committed"]
    assert [x.start_step for x in r.results] == [saved, saved]   # resumed at the step reached
    assert [x.fingerprint for x in r.results] == [x.fingerprint for x in ref.results]
    assert all(v == ref.losses[k] for k, v in r.losses.items())


def _job(tmp_path: Path, mode: str) -> dict:
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), mode], capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    return json.loads(lines[-1])


def test_a_drain_of_a_node_without_ranks_keeps_training_and_every_committed_step(reference_20_run, tmp_path):
    """Three 1-CPU nodes for two ranks: the third hosts a checkpoint writer and no rank (the start
    probes every node that may host a rank), and the CheckpointActor when Ray put it there (it asks
    for no resources; mostly it is on the head). Draining it stops neither the job nor its saves:
    the writer is stopped before the deadline, the actor (if there) restarts elsewhere, committed
    steps stay."""
    r = _job(tmp_path, "rankless")
    ref, run = reference_20_run[0], r["drained"]
    assert r["writer_before"] and r["writer_gone_after_s"] is not None and r["writer_gone_after_s"] < 25, r
    if r["actor_node"] == r["victim"]:
        assert r["actor_node_after"] not in (None, r["victim"]), r
    assert run["state"] == "SUCCEEDED" and run["failures"] == [] and run["attempts"] == 1, run
    assert r["committed_before"] and set(r["committed_before"]) <= set(run["committed"]), r
    assert run["committed"] == [5, 10, 15, 20], r                  # no save lost to the drain
    assert run["fingerprints"] == [x.fingerprint for x in ref.results], r


def test_shrink_to_min_workers_then_grow_back_at_the_next_save_with_the_data_position_exact(tmp_path):
    """No replacement for the drained node: the job shrinks to min_workers=1 (global batch kept); a
    node joins, the group grows back to 2 workers at the next step boundary (the step in hand saved),
    and finishes with every step trained once."""
    r = _job(tmp_path, "shrink")
    run = r["drained"]
    assert run["state"] == "SUCCEEDED", run
    assert r["shrunk_at_step"] is not None, r
    assert run["kinds"] == ["preemption"] and run["attempts"] == 3, run   # drain, then grow (not a failure)
    assert any("grow" in e for e in run["events"]), run["events"]
    assert run["world_sizes"] == [2]                                     # back at num_workers
    [p] = run["preemptions"]
    grown_at = run["start_steps"][0]
    assert p["saved_step"] < grown_at < 60 and grown_at in run["committed"] and p["saved_step"] in run["committed"]
    assert sorted(map(int, run["losses"])) == list(range(grown_at + 1, 61))   # nothing trained twice or skipped
    assert len(set(run["tokens_seen"])) == 1 and run["tokens_seen"][0] == 60 * r["tokens_per_step"]
