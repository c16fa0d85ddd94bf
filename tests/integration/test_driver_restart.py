"""The driver dies (SIGKILL to it and the local Ray it started), the same job is submitted
again, and it resumes from the latest valid step: the final checkpoint is bit-identical to
an uninterrupted run's."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.conftest import REFERENCE_20

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _cli(ckpt_dir: Path) -> list[str]:
    """``REFERENCE_20`` (the session's uninterrupted run) through the CLI, into ``ckpt_dir``."""
    return [sys.executable, "-m", "raytrain_ckpt", "run", "jobs/llama_debug_fsdp.yaml",
            *[a for o in [*REFERENCE_20, f"checkpoint.dir={ckpt_dir}"] for a in ("--set", o)]]


def _env(**faults: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAYTRAIN_CKPT_")}
    env.pop("RAY_ADDRESS", None)
    return env | faults


def _final_state(ckpt_dir: Path, tmp: Path) -> dict:
    out = tmp / f"{ckpt_dir.parent.name}-{ckpt_dir.name}.pt"
    dcp_to_torch_save(ckpt_dir / "llama-debug-fsdp" / "step-00000020", out)
    return torch.load(out, weights_only=False)


def test_resubmitting_after_the_driver_died_resumes_bit_exact(reference_20_run, tmp_path):
    _, clean = reference_20_run  # the same job, uninterrupted, run in this process on the session's Ray
    crashed = tmp_path / "crashed"
    # rank 0 pauses 3 s before step 16: the driver is killed in that pause, after step 15 committed
    driver = subprocess.Popen(_cli(crashed), cwd=REPO, env=_env(RAYTRAIN_CKPT_FAULTS="slow@step:rank=0,step=16"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    step15 = crashed / "llama-debug-fsdp" / "step-00000015"
    deadline = time.monotonic() + 240
    try:
        while not step15.exists() and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.2)
        assert step15.exists(), "the first run never committed step 15"
    finally:  # (a failed wait leaves no driver and Ray behind either)
        with contextlib.suppress(ProcessLookupError):  # (a driver that exited on its own, with its group)
            os.killpg(driver.pid, signal.SIGKILL)  # the driver and every process of the Ray it started
        driver.wait(timeout=30)
    assert not (crashed / "llama-debug-fsdp" / "step-00000020").exists()

    again = subprocess.run(_cli(crashed), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed at step" in again.stdout, again.stdout
    resumed = int(again.stdout.split("resumed at step ")[1].split(",")[0])
    assert 15 <= resumed < 20

    a, b = _final_state(clean, tmp_path), _final_state(crashed, tmp_path)
    for section in ("model", "optim"):
        assert a[section].keys() == b[section].keys()
        for k, v in a[section].items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, b[section][k]), (section, k)
    assert a["train"] == b["train"]


def test_ctrl_c_stops_the_run_in_one_line_and_the_next_run_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    root = ckpt / "llama-debug-fsdp"
    args = _cli(ckpt) + ["--set", "training.steps=2000", "--set", "checkpoint.keep_latest_k=2",
                         "--set", "training.log_every_steps=100"]
    # as from a terminal: SIGINT at its default (a shell's background job, as CI may run, inherits it ignored)
    driver = subprocess.Popen(args, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))

    def committed() -> list[int]:
        return sorted(int(p.name[5:]) for p in root.glob("step-*") if p.name[5:].isdigit())

    # any step from 10 on: with keep_latest_k=2 step 10 itself lives only until step 20 commits
    deadline = time.monotonic() + 240
    while not any(s >= 10 for s in committed()) and time.monotonic() < deadline and driver.poll() is None:
        time.sleep(0.2)
    assert any(s >= 10 for s in committed()), "the run never committed step 10"
    os.killpg(driver.pid, signal.SIGINT)  # a terminal's Ctrl-C goes to the whole foreground group
    out, err = driver.communicate(timeout=120)
    assert driver.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    steps = committed()
    # the step in hand was saved first (fault_tolerance.stop_grace_s), and the line names it
    assert err.splitlines()[-1] == (f"stopped: job llama-debug-fsdp: SIGINT: step {steps[-1]} is committed and safe; "
                                    "running the same command again resumes from the newest committed step")
    assert steps and steps[-1] < 2000
    check = subprocess.run([sys.executable, "-m", "raytrain_ckpt", "verify", str(root / f"step-{steps[-1]:08d}")],
                           cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr     # the newest committed step is intact

    again = subprocess.run(args[:-6] + ["--set", f"training.steps={steps[-1] + 5}"], cwd=REPO, env=_env(),
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed at step {steps[-1]}" in again.stdout, again.stdout
