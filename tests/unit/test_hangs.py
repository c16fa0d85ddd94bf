"""Hangs: the learned timeout and its phase budgets; stacks read from outside a real process that
holds the GIL in a C call; the culprit named from what the ranks answered and their stacks (a real
gloo collective: tests/distributed/test_hang_culprit.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from raytrain_ckpt.control.watch.hangs import (FIRST_STEPS_S, FLOOR_S, HangClock, auto_text, blame, dump_stacks,
                                                py_spy, training_thread)
from raytrain_ckpt.report.jobstatus import status_line
from raytrain_ckpt.spec import JobSpec

pytestmark = pytest.mark.skipif(py_spy() is None, reason="py-spy is a dependency of the project")


def _spec(**ft) -> JobSpec:
    return JobSpec(name="h", training={"steps": 1000}, fault_tolerance=ft)


def test_auto_is_the_default_and_a_number_still_means_a_fixed_timeout():
    clock = HangClock(_spec())
    assert clock.fixed is None and clock.budget(1) == (FIRST_STEPS_S, "the attempt's first step")
    fixed = HangClock(_spec(hang_timeout_s=7))
    assert fixed.budget(1) == (7.0, "fixed") and fixed.budget(50, {0: "saving"}) == (7.0, "fixed")
    assert "auto, 10 x p99" in auto_text(_spec()) and "fixed 7 s" in auto_text(_spec(hang_timeout_s=7))


def test_the_learned_budget_follows_the_step_times_with_a_floor_and_phase_budgets():
    clock = HangClock(_spec())
    clock.attempt_started()
    clock.observe(0, 0.0)                 # the attempt's starting step
    clock.observe(1, 40.0)                # its first step (warm-up): not measured
    assert clock.budget(2)[0] == FIRST_STEPS_S
    t = 40.0
    for step in range(2, 9):              # 0.5 s steps: 10 x 0.5 is under the floor
        t += 0.5
        clock.observe(step, t)
    assert clock.budget(9) == (FLOOR_S, "10 x p99 step time 0.5 s, at least 30 s")
    for step in range(9, 30):             # 6 s steps: the percentile follows them
        t += 6.0
        clock.observe(step, t)
    assert clock.budget(30)[0] == pytest.approx(60.0)
    assert clock.budget(30, {0: "training", 1: "saving"}) == (600.0, "a save (checkpoint.commit_timeout_s)")
    clock.attempt_started()               # a restart: its first step gets the first-step budget again
    clock.observe(30, t)
    assert clock.budget(31)[0] == FIRST_STEPS_S


def test_steps_faster_than_the_polls_are_measured_by_the_steps_they_cover():
    # 0.2 s steps polled every 1 s: a poll sees 5 steps at once; after 3 polls 10 steps were
    # measured, so the learned budget (the floor) applies, not the first-steps budget
    clock = HangClock(_spec())
    clock.attempt_started()
    clock.observe(0, 0.0)
    clock.observe(1, 2.0)                 # the first step: not measured
    clock.observe(6, 3.0)
    assert clock.budget(7)[0] == FLOOR_S
    clock.observe(11, 4.0)
    assert clock.budget(12) == (FLOOR_S, "10 x p99 step time 0.2 s, at least 30 s")


def test_an_eval_step_has_its_own_budget(tmp_path: Path):
    (tmp_path / "shard.bin").write_bytes(bytes(2 * 129 * 2000))   # 2,000 samples of uint16 tokens
    spec = JobSpec(name="h", training={"steps": 100}, data={"source": "tokens", "path": str(tmp_path),
                                                             "eval_fraction": 0.1},
                   eval={"every_steps": 10, "batches": 1})
    clock = HangClock(spec)
    clock.attempt_started()
    for step, t in ((0, 0.0), (1, 5.0), *((s, 5.0 + 0.1 * (s - 1)) for s in range(2, 10))):
        clock.observe(step, t)
    assert clock.budget(10) == (FIRST_STEPS_S, "an eval step")
    clock.observe(10, 5.8 + 20.0)         # the eval step took 20 s
    assert clock.budget(11)[0] == FLOOR_S and clock.budget(20)[0] == pytest.approx(200.0)


def _start(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], stdout=subprocess.PIPE, text=True)


def _wait_line(proc: subprocess.Popen, expected: str) -> None:
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == expected


def test_a_process_holding_the_gil_in_a_c_call_is_dumped_from_outside():
    # catastrophic backtracking: minutes inside the regex engine, the GIL held throughout
    proc = _start("""
        import re
        def stuck_in_c():
            print("ready", flush=True)
            re.match(r"(a+)+$", "a" * 60 + "b")
        stuck_in_c()
    """)
    try:
        _wait_line(proc, "ready")
        time.sleep(0.3)
        t0 = time.monotonic()
        text = dump_stacks(proc.pid)
        assert time.monotonic() - t0 < 15
        assert "stuck_in_c (<string>" in text, text
    finally:
        proc.kill()
        proc.wait()


def test_the_culprit_rules_in_order():
    waiting = 'Thread 1 (idle): "MainThread"\n    all_reduce (torch/distributed/c10d.py:2)\n    <module> (x.py:1)\n'
    busy = 'Thread 1 (active): "MainThread"\n    forward (model.py:3)\n'
    assert blame(3, {0: 5, 2: 5}, {}).ranks == (1,)                                  # did not answer
    assert blame(3, {0: 5, 1: 4, 2: 5}, {}).reason == "rank 1 behind at step 4 while others reached step 5"
    assert blame(2, {0: 5, 1: 5}, {0: waiting, 1: busy}).ranks == (1,)               # outside the collective
    none = blame(2, {0: 5, 1: 5}, {0: waiting, 1: waiting})
    assert none.ranks == () and none.rank is None
    assert none.reason == "no single rank can be blamed: every rank at step 5, every rank waits in a collective"
    assert "stacks of rank 1 could not be read" in blame(2, {0: 5, 1: 5}, {0: waiting}).reason
    assert blame(2, {}, {}).ranks == ()
    # replica groups: a rank waiting on another group (torchft's quorum or average) waits on its peers too
    quorum = 'Thread 1 (idle): "MainThread"\n    Manager.wait_quorum (torchft/manager.py:627)\n'
    assert blame(4, {r: 8 for r in range(4)}, {0: quorum, 1: quorum, 2: waiting, 3: busy}).ranks == (3,)
    # an actor's training thread is not its main thread: the one running TrainWorker._run is read
    actor = ('Thread 9 (idle): "MainThread"\n    Worker.main_loop (ray/_private/worker.py:1069)\n'
             'Thread 11 (idle): "Dummy-1"\n    maybe_inject (raytrain_ckpt/common/faults.py:151)\n'
             '    TrainWorker._run (raytrain_ckpt/rank/worker.py:329)\n')
    assert training_thread(actor) == ["maybe_inject (raytrain_ckpt/common/faults.py:151)",
                                      "TrainWorker._run (raytrain_ckpt/rank/worker.py:329)"]


def test_a_dump_of_a_gone_process_says_why():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert dump_stacks(proc.pid).startswith("(no stacks: py-spy dump --pid")
    assert os.path.exists(py_spy() or "")


def test_validate_says_what_auto_chose_and_the_cli_lists_a_hang_s_diagnostics(tmp_path: Path, capsys):
    from raytrain_ckpt.cli.main import main

    assert main(["validate", "jobs/llama_debug_fsdp.yaml"]) == 0
    out = capsys.readouterr().out
    assert "hang_timeout_s: auto" in out
    assert "# hang timeout: auto, 10 x p99 of the measured step times, at least 30 s; 300 s for" in out
    folder = tmp_path / "job" / "diagnostics" / "attempt-0"
    folder.mkdir(parents=True)
    (folder / "rank-1.stacks.txt").write_text("Thread 1 (idle)\n")
    reason = "reason: rank 1 behind at step 4 while others reached step 5"
    (folder / "verdict.txt").write_text(f"culprit: rank 1\n{reason}\n")
    assert main(["diagnostics", str(tmp_path / "job")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:3] == [str(folder), "  culprit: rank 1", f"  {reason}"]
    assert f"  {folder / 'rank-1.stacks.txt'}" in lines and lines[-1].startswith("1 hang(s) with diagnostics under")
    assert main(["diagnostics", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.startswith("error: diagnostics ")


def test_every_failed_rank_s_text_is_kept_and_listed_by_diagnostics(tmp_path: Path, capsys):
    from raytrain_ckpt.cli.main import main
    from raytrain_ckpt.common.events import Failure
    from raytrain_ckpt.control.watch.hangs import keep_failures

    crash = Failure(2, "crash", 1, "worker process died", "rank 1: worker process died")
    reset = Failure(2, "exception", 0, "RuntimeError: Connection reset by peer",
                    "Traceback (most recent call last):\n  File \"x.py\"\nRuntimeError: Connection reset by peer")
    path = keep_failures(tmp_path / "job" / "diagnostics", 2, [crash, reset])
    assert path == str(tmp_path / "job" / "diagnostics" / "attempt-2" / "failure.txt")
    text = Path(path).read_text()
    assert "attempt 2 crash: rank 1: worker process died" in text and "Traceback (most recent call last)" in text
    assert main(["diagnostics", str(tmp_path / "job")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:3] == ["  attempt 2 crash: rank 1: worker process died",
                          "  attempt 2 exception: rank 0: RuntimeError: Connection reset by peer"]
    assert lines[-1].endswith("; 1 attempt(s) with every failed rank's text (failure.txt)")
    (tmp_path / "file").write_text("")
    assert keep_failures(tmp_path / "file", 0, [crash]) is None   # not writable: the failure is still handled


def test_the_status_line():
    assert status_line({}) is None
    info = {"hang_timeout_s": 31.2, "hang_timeout_why": "10 x p99 step time 3.12 s, at least 30 s", "goodput": 0.912,
            "stragglers": [1], "last_hang": "rank 1: stuck in f (x.py:1): ..."}
    assert status_line(info) == ("hang timeout 31s (10 x p99 step time 3.12 s, at least 30 s); goodput so far 91.2%; "
                                 "straggler rank(s) 1; last hang: rank 1: stuck in f (x.py:1): ...")
    replicas = {**info, "stragglers": None, "last_hang": None, "replica_heals": 2, "replicas_healing": [1]}
    assert status_line(replicas) == ("hang timeout 31s (10 x p99 step time 3.12 s, at least 30 s); goodput so far "
                                     "91.2%; 2 replica group(s) replaced while the others trained on; healing now: "
                                     "replica group(s) 1")


def test_a_driver_that_polls_seldom_learns_the_pace_from_the_ranks_own_step_times():
    # a loaded driver: its first poll sees step 5, its second step 12, then the group hangs. The
    # poll times alone measured no step (the first advance is the warm-up); the ranks' own step
    # times (0.1 s) teach the floor, not the first-steps budget of 300 s
    clock = HangClock(_spec())
    clock.attempt_started()
    clock.observe(5, 3.0, step_s=0.1)
    assert clock.budget(6)[0] == FIRST_STEPS_S          # one step measured: too few
    clock.observe(12, 9.0, step_s=0.1)
    assert clock.budget(13) == (FLOOR_S, "10 x p99 step time 0.1 s, at least 30 s")
    slow = HangClock(_spec())
    slow.attempt_started()
    slow.observe(5, 3.0)
    slow.observe(12, 9.0)                                 # without them: still the warm-up budget
    assert slow.budget(13)[0] == FIRST_STEPS_S

