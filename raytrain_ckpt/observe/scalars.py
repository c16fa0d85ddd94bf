"""Scalar logs for the tools training users watch loss curves in: TensorBoard, behind a small
interface (``ScalarLogger``) another backend (W&B, MLflow) can implement.

With ``training.tensorboard_dir`` set, a job writes two TensorBoard runs under
``<tensorboard_dir>/<job name>/``:

- ``train``, from rank 0: ``train/loss``, ``train/lr``, ``train/tokens_per_s``,
  ``train/step_time_s`` on log steps, ``eval/loss`` on eval steps;
- ``driver``, from the driver: ``checkpoint/committed_step``, ``checkpoint/stall_s``,
  ``checkpoint/persist_s`` and ``checkpoint/bytes`` at each committed step, ``job/attempt`` at
  the step each attempt resumes from, and ``job/failures/<kind>`` (the running count of
  failures of that kind: crash, exception, hang, checkpoint, ...) at the step the failure
  stopped.

The x axis is the training step. After a restart the steps after the resume point are trained
again: each attempt writes a new event file that starts with a purge marker at the first step
it writes (``SummaryWriter(purge_step=...)``), and TensorBoard's reader drops the earlier
files' points from that step on, so every step has one point, the replayed run's.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from raytrain_ckpt.rank.trainer import StepReport

logger = logging.getLogger(__name__)

__all__ = ["DRIVER_TAGS", "FLUSH_S", "TRAIN_TAGS", "Fanout", "JobScalars", "ScalarLogger", "TensorBoardLogger", "log_step", "open_logger", "run_dir"]

FLUSH_S = 2
"""Seconds between flushes of the event file: a rank killed mid-run loses at most this much."""
TRAIN_TAGS = ("train/loss", "train/lr", "train/tokens_per_s", "train/step_time_s", "eval/loss")
"""Rank 0's tags."""
DRIVER_TAGS = ("checkpoint/committed_step", "checkpoint/bytes", "checkpoint/persist_s", "checkpoint/stall_s",
               "job/restarts", "job/rollback_steps", "job/attempt")
"""The driver's tags (and ``job/failures/<kind>``)."""


class ScalarLogger(Protocol):
    """Where scalars go, one (tag, value, step) at a time."""

    def scalar(self, tag: str, value: float, step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardLogger:
    """``ScalarLogger`` over TensorBoard's ``SummaryWriter`` (the ``tensorboard`` extra)."""

    def __init__(self, log_dir: Path, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # raises ImportError without the tensorboard package

        self.log_dir = log_dir
        self._writer = SummaryWriter(str(log_dir), purge_step=purge_step, flush_secs=FLUSH_S)

    def scalar(self, tag: str, value: float, step: int) -> None:
        self._writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self._writer.close()


class Fanout:
    """One ``ScalarLogger`` over several (TensorBoard, W&B, MLflow, a user's): each point to each."""

    def __init__(self, outs: list[ScalarLogger]) -> None:
        self.outs = outs

    def config(self, config: dict[str, Any]) -> None:
        """The resolved spec, as the run's config, to the loggers that keep one (not TensorBoard)."""
        for out in self.outs:
            if hasattr(out, "config"):
                out.config(config)

    def scalar(self, tag: str, value: float, step: int) -> None:
        for out in self.outs:
            out.scalar(tag, value, step)

    def close(self) -> None:
        for out in self.outs:
            out.close()


def run_dir(base: str, job: str, run: str) -> Path:
    """``<tensorboard_dir>/<job>/<run>``: one TensorBoard run of a job (``train`` or ``driver``)."""
    return Path(base).expanduser() / job / run


def open_logger(base: str | None, job: str, run: str, resume_step: int) -> ScalarLogger | None:
    """The logger of one run of a job, or None when ``base`` is None. ``resume_step``: the step
    this attempt starts after (0: a fresh start); every point after it, from an earlier attempt
    or an earlier run of the job, is replaced."""
    if base is None:
        return None
    path = run_dir(base, job, run)
    path.mkdir(parents=True, exist_ok=True)
    return TensorBoardLogger(path, purge_step=resume_step + 1)


def log_step(out: ScalarLogger, report: StepReport) -> None:
    """Rank 0's scalars of one finished step (loss, lr, tokens/s on log steps; eval loss on eval steps)."""
    if report.loss is not None:
        for tag, value in (("train/loss", report.loss), ("train/lr", report.lr),
                           ("train/tokens_per_s", report.tokens_per_s), ("train/step_time_s", report.step_time_s)):
            out.scalar(tag, value, report.step)
    if report.eval_loss is not None:
        out.scalar("eval/loss", report.eval_loss, report.step)


class JobScalars:
    """The driver's run: failures and rollbacks as the controller sees them, and each committed
    step's stall, persist time and size as the CheckpointActor reports them (asked at most every
    ``every_s``)."""

    def __init__(self, out: ScalarLogger, status: Callable[[], dict[str, Any]] | None, every_s: float = 5.0) -> None:
        self.out, self._status, self._every_s = out, status, every_s
        self._failures: Counter[str] = Counter()
        self._seen_failures = 0
        self._committed: set[int] = set()
        self._latest: int | None = None
        self._asked = float("-inf")

    def observe(self, failures: list[Any], train_step: int | None, now: float) -> None:
        """After each controller step: ``failures`` is the job's list so far (``Failure`` records)."""
        new_failures = len(failures) > self._seen_failures
        # a failure asks at once: the commits before it are logged first, so a logger whose steps
        # only go up (W&B) keeps them, and job/rollback_steps counts from the newest one
        if self._status is not None and (new_failures or now - self._asked >= self._every_s):
            self._asked = now
            self.commits(self._status())
        step = train_step if train_step is not None else (self._latest or 0)
        for failure in failures[self._seen_failures:]:
            self._failures[failure.kind] += 1
            self.out.scalar(f"job/failures/{failure.kind}", self._failures[failure.kind], step)
            self.out.scalar("job/restarts", sum(self._failures.values()), step)
            self.out.scalar("job/rollback_steps", max(0, step - (self._latest or 0)), step)
        self._seen_failures = len(failures)

    def commits(self, status: dict[str, Any]) -> None:
        """One point per tag at each step committed since the last call."""
        steps = {int(s): info for s, info in (status.get("steps") or {}).items()}
        for step in sorted(set(steps) - self._committed):
            wall = steps[step].get("wall") or {}
            self.out.scalar("checkpoint/committed_step", step, step)
            self.out.scalar("checkpoint/bytes", steps[step].get("bytes") or 0, step)
            for tag, key in (("checkpoint/persist_s", "total_s"), ("checkpoint/stall_s", "stall_s")):
                if wall.get(key) is not None:
                    self.out.scalar(tag, wall[key], step)
        self._committed |= set(steps)
        if steps:
            self._latest = max(self._latest or 0, max(steps))
