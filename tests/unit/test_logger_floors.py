"""The W&B and MLflow loggers never log a step twice: W&B keeps its floor in a file beside its run
files (an offline run cannot say which steps it holds), hands each step's row over whole when the
next step begins, and drops the steps a restart or a guard rollback trains again; MLflow reads
each tag's floor from the run's history. A backend whose package is missing is one ``error:``
line and exit 2 from the real CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from raytrain_ckpt.observe.loggers import MlflowLogger, WandbLogger, read_floor, write_floor

REPO = Path(__file__).resolve().parents[2]


class _FakeRun:
    def __init__(self, files: Path) -> None:
        self.dir, self.step, self.rows, self.finished = str(files), 0, [], False  # offline: step 0
        files.mkdir(parents=True)

    def log(self, row: dict, step: int, commit: bool) -> None:
        assert commit
        self.rows.append((step, dict(row)))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch, tmp_path):
    """A ``wandb`` module whose init() makes a fresh _FakeRun in one W&B directory, as each
    offline process does (runs: every one made)."""
    runs: list[_FakeRun] = []

    def init(**kwargs) -> _FakeRun:
        runs.append(_FakeRun(Path(kwargs["dir"]) / "wandb" / f"offline-run-{len(runs)}-rid" / "files"))
        return runs[-1]

    module = types.SimpleNamespace(init=init, Settings=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "wandb", module)
    return runs


def _wandb(tmp_path: Path, run: str = "train") -> WandbLogger:
    return WandbLogger("job", "rid", run, "project", str(tmp_path), "offline")


def test_floor_file_round_trips_and_a_missing_or_torn_one_is_no_floor(tmp_path):
    path = tmp_path / "f.step"
    assert read_floor(path) == -1
    write_floor(path, 12)
    assert read_floor(path) == 12 and [p.name for p in tmp_path.iterdir()] == ["f.step"]
    path.write_text("1")
    path.write_text("")
    assert read_floor(path) == -1


def test_wandb_hands_a_row_over_when_the_next_step_begins_and_records_the_floor(fake_wandb, tmp_path):
    out = _wandb(tmp_path)
    out.scalar("train/loss", 1.0, 1)
    out.scalar("train/lr", 0.1, 1)
    assert fake_wandb[0].rows == []                  # step 1 may get more tags
    out.scalar("train/loss", 0.5, 2)
    assert fake_wandb[0].rows == [(1, {"train/loss": 1.0, "train/lr": 0.1})]
    assert read_floor(out.floor_file) == 1
    out.close()
    assert fake_wandb[0].rows[-1] == (2, {"train/loss": 0.5}) and fake_wandb[0].finished
    assert read_floor(out.floor_file) == 2


def test_wandb_drops_the_steps_a_guard_rollback_trains_again(fake_wandb, tmp_path):
    out = _wandb(tmp_path)
    for step in (1, 2, 3, 4, 2, 3, 4, 5):            # a rollback to step 1 after step 4
        out.scalar("train/loss", float(step), step)
    out.close()
    assert [s for s, _ in fake_wandb[0].rows] == [1, 2, 3, 4, 5]


def test_a_new_process_resumes_the_floor_of_its_kind_only(fake_wandb, tmp_path):
    first = _wandb(tmp_path)
    for step in range(1, 8):
        first.scalar("train/loss", float(step), step)
    # the process dies in step 7: its row never reached W&B, so the replay logs it
    again = _wandb(tmp_path)
    assert again.floor == 6
    for step in range(6, 10):                         # resumed from a step-5 checkpoint
        again.scalar("train/loss", float(step), step)
    again.close()
    assert [s for s, _ in fake_wandb[1].rows] == [7, 8, 9]
    assert _wandb(tmp_path, "driver").floor == -1      # the driver's steps are its own


def test_mlflow_floors_are_per_tag_from_the_history_and_follow_what_it_logs(tmp_path):
    pytest.importorskip("mlflow", reason='the mlflow extra is not installed: pip install -e ".[mlflow]"')
    from mlflow.tracking import MlflowClient

    uri = f"file:{tmp_path / 'mlruns'}"
    first = MlflowLogger("job", "rid", "project", uri, ("train/loss",))
    for step in (1, 2, 3, 2, 3, 4):                  # a rollback inside the process
        first.scalar("train/loss", float(step), step)
    first.scalar("job/failures/crash", 1.0, 4)
    again = MlflowLogger("job", "rid", "project", uri, ("train/loss",))
    assert again.run_id == first.run_id and again.floors == {"train/loss": 4}
    for step in (3, 4, 5):
        again.scalar("train/loss", float(step), step)
    again.scalar("job/failures/crash", 1.0, 4)       # not in its tags: its history is read first
    client = MlflowClient(tracking_uri=uri)
    assert [m.step for m in client.get_metric_history(first.run_id, "train/loss")] == [1, 2, 3, 4, 5]
    assert [m.step for m in client.get_metric_history(first.run_id, "job/failures/crash")] == [4]


def _cli_without(package: str | None, backend: str) -> subprocess.CompletedProcess:
    hide = f"sys.modules[{package!r}] = None; " if package else ""
    code = (f"import runpy, sys; {hide}sys.argv = ['raytrain-ckpt', 'run', 'jobs/llama_debug_fsdp.yaml', '--set', "
            f"'training.loggers.backends=[\"{backend}\"]']; runpy.run_module('raytrain_ckpt', run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


@pytest.mark.parametrize(("package", "backend", "says"), [
    ("wandb", "wandb", 'the wandb package is not installed; pip install -e ".[wandb]"'),
    ("mlflow", "mlflow", 'the mlflow package is not installed; pip install -e ".[mlflow]"'),
    (None, "no_such_package.loggers:make", "cannot import module 'no_such_package.loggers'"),
])
def test_a_missing_logger_package_is_one_error_line_and_exit_2(package, backend, says):
    proc = _cli_without(package, backend)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says in errors[0], proc.stderr[-3000:]


class _Recorder:
    def __init__(self) -> None:
        self.points, self.closed = [], False

    def scalar(self, tag: str, value: float, step: int) -> None:
        self.points.append((tag, value, step))

    def close(self) -> None:
        self.closed = True


def test_background_logger_sends_everything_in_order_and_closes(monkeypatch):
    import raytrain_ckpt.observe.loggers as loggers

    monkeypatch.setattr(loggers, "DRAIN_S", 0.0)
    inner = _Recorder()
    out = loggers.BackgroundLogger("rec", lambda: inner, 100, "job")
    for step in range(1, 31):
        out.scalar("train/loss", float(step), step)
    out.close()
    assert inner.points == [("train/loss", float(s), s) for s in range(1, 31)] and inner.closed and out.dropped == 0


def test_background_logger_counts_what_a_service_that_is_down_drops(monkeypatch):
    import threading

    import raytrain_ckpt.observe.loggers as loggers

    monkeypatch.setattr(loggers, "DRAIN_S", 0.0)
    gate = threading.Event()

    def unreachable():
        gate.wait()                       # the service does not answer while the points arrive
        raise ConnectionRefusedError("connection refused")

    out = loggers.BackgroundLogger("down", unreachable, 4, "job")
    for step in range(10):                # never blocks: 4 queued (or 5 taken), the rest dropped
        out.scalar("train/loss", 1.0, step)
    assert out.dropped >= 5
    gate.set()
    out.close()
    assert out.dropped == 10
