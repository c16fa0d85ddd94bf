"""The job's scalar loggers besides TensorBoard (``training.loggers``): W&B, MLflow and a user
logger by import path, behind ``scalars.ScalarLogger``.

One run per job: its id is derived from the job's checkpoint root (``run_id``), so every attempt,
restart and resubmit of the job resumes the same run (W&B ``resume="allow"``, MLflow's run id).
Two processes write to it: rank 0 (``train/*``, ``eval/*``, and the resolved spec as the run's
config) and the driver (``checkpoint/*``, ``job/*``: commits, attempts, failures).

Steps are never logged twice: each logger knows the highest step its run already holds from
this kind of process (``floor``) and drops points at or below it, so the steps a restart or a
guard rollback trains again keep the first points (a restart's replay is deterministic: the same
values; a rollback's retrained steps see other samples, and the marker of the rollback is the
driver's ``job/rollback_steps``) and the run's x axis stays continuous. MLflow's floor is read per
tag from the run's metric history. W&B cannot say which steps an offline run holds (each process
writes a file of its own, and ``run.step`` starts from 0), so the W&B logger keeps its floor in
``raytrain-ckpt-<run id>-<train|driver>.step`` beside W&B's own run files (``wandb_dir``/wandb),
replaced atomically after each step's row is handed to W&B; a row is handed over whole, when the
next step begins, so a process that dies mid-step leaves that step to the replay.

A service that is down never stalls a step: W&B, MLflow and user loggers are opened and written
by a background thread from a bounded queue (``training.loggers.queue_size``); a full queue or a
failing backend drops points, warns once and counts them (``logger_dropped_total``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from raytrain_ckpt.observe.scalars import DRIVER_TAGS, TRAIN_TAGS, Fanout, ScalarLogger, open_logger

logger = logging.getLogger(__name__)

__all__ = ["DRAIN_S", "BackgroundLogger", "MlflowLogger", "WandbLogger", "open_backends", "open_job_loggers", "read_floor",
           "run_id", "write_floor"]

CLOSE_WAIT_S = 10.0
"""How long closing waits for a background logger to send what it holds (then it is left behind)."""
DRAIN_S = 0.5
"""How long a background logger lets points gather after the first before it sends them together."""


def run_id(root: str) -> str:
    """The run id of the job whose checkpoint root is ``root``: the same for every attempt and resubmit."""
    return "rtc-" + hashlib.sha256(root.encode()).hexdigest()[:16]


class WandbLogger:
    """``ScalarLogger`` over one W&B run (offline with WANDB_MODE=offline). ``run``: "train" or
    "driver", the process kind whose step floor this is (module docstring)."""

    def __init__(self, job: str, rid: str, run: str, project: str, directory: str | None, mode: str | None) -> None:
        import wandb

        self._run = wandb.init(project=project, id=rid, name=job, resume="allow", dir=directory, mode=mode,
                               settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))
        # <dir>/wandb/<offline-run-...>/files: the floor lives where W&B keeps the run's files
        self.floor_file = Path(self._run.dir).parents[1] / f"raytrain-ckpt-{rid}-{run}.step"
        self.floor = max(int(self._run.step) - 1, read_floor(self.floor_file))  # run.step: W&B's next step
        self._row: dict[str, float] = {}
        self._row_step: int | None = None

    def config(self, config: dict[str, Any]) -> None:
        self._run.config.update(config, allow_val_change=True)

    def scalar(self, tag: str, value: float, step: int) -> None:
        if step != self._row_step:
            self._flush()
            if step <= self.floor:
                return
            self._row_step = step
        self._row[tag] = value

    def close(self) -> None:
        self._flush()
        self._run.finish()

    def _flush(self) -> None:
        """The pending step's row to W&B as one committed row, then the floor to its file."""
        if self._row_step is None:
            return
        self._run.log(self._row, step=self._row_step, commit=True)
        self.floor, self._row, self._row_step = self._row_step, {}, None
        write_floor(self.floor_file, self.floor)


def read_floor(path: Path) -> int:
    """The step floor ``write_floor`` left in ``path``; -1: none (a new run, or an unreadable file)."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):  # no file yet, or one from a torn disk: the run's own step counts
        return -1


def write_floor(path: Path, step: int) -> None:
    """``step`` into ``path``, atomically: a reader sees the old floor or the new, never a torn one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{step}\n")
    os.replace(tmp, path)


class MlflowLogger:
    """``ScalarLogger`` over one MLflow run (a server, or a ``file:`` store offline)."""

    def __init__(self, job: str, rid: str, project: str, uri: str | None, tags: tuple[str, ...]) -> None:
        from mlflow.tracking import MlflowClient

        if (uri or os.environ.get("MLFLOW_TRACKING_URI") or "").startswith("file:"):
            # a file store, asked for by name (offline): MLflow 3 refuses one unless told it is wanted
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name(project)
        eid = experiment.experiment_id if experiment is not None else self._client.create_experiment(project)
        found = self._client.search_runs([eid], filter_string=f"tags.raytrain_ckpt_run_id = '{rid}'", max_results=1)
        run = found[0] if found else self._client.create_run(eid, run_name=job, tags={"raytrain_ckpt_run_id": rid})
        self.run_id = run.info.run_id
        self.floors = {t: max((m.step for m in self._client.get_metric_history(self.run_id, t)), default=-1)
                       for t in tags}

    def config(self, config: dict[str, Any]) -> None:
        import json

        self._client.log_dict(self.run_id, config, "spec.json")
        for key, value in _flat(config).items():
            try:
                self._client.log_param(self.run_id, key, value)
            except Exception:  # noqa: BLE001 - MLflow refuses to change a param a resubmit changed: the artifact has it
                pass
        self._client.set_tag(self.run_id, "raytrain_ckpt.spec", json.dumps(config)[:5000])

    def scalar(self, tag: str, value: float, step: int) -> None:
        if tag not in self.floors:  # a tag of its own kind (job/failures/<kind>): its history, once
            self.floors[tag] = max((m.step for m in self._client.get_metric_history(self.run_id, tag)), default=-1)
        if step > self.floors[tag]:
            self._client.log_metric(self.run_id, tag, float(value), step=step)
            self.floors[tag] = step

    def close(self) -> None:
        """The run stays open: the next attempt or resubmit resumes it."""


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = str(value)[:500]
    return out


class BackgroundLogger:
    """A ``ScalarLogger`` that opens and writes ``open_inner()`` on its own thread, from a bounded
    queue: the caller never waits on the service. Drops (a full queue, a backend that fails to
    open or to write) warn once and are counted in ``dropped`` and ``logger_dropped_total``."""

    _STOP = object()

    def __init__(self, name: str, open_inner: Callable[[], ScalarLogger], size: int, job: str) -> None:
        self.name, self.job, self.dropped = name, job, 0
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=size)
        self._warned = False
        self._thread = threading.Thread(target=self._serve, args=(open_inner,), name=f"rtc-logger-{name}", daemon=True)
        self._thread.start()

    def config(self, config: dict[str, Any]) -> None:
        self._put(("config", config))

    def scalar(self, tag: str, value: float, step: int) -> None:
        self._put(("scalar", (tag, value, step)))

    def close(self) -> None:
        try:
            self._queue.put(self._STOP, timeout=CLOSE_WAIT_S)
        except queue.Full:
            pass
        self._thread.join(CLOSE_WAIT_S)

    def _put(self, item: tuple[str, Any]) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._drop(1, f"its queue is full ({self._queue.maxsize} points)")

    def _drop(self, n: int, why: str) -> None:
        from raytrain_ckpt.observe.metrics import record

        self.dropped += n
        record("logger_dropped_total", n, {"job": self.job, "logger": self.name})
        if not self._warned:
            self._warned = True
            logger.warning("logger %s: dropping points, training goes on: %s", self.name, why)

    def _serve(self, open_inner: Callable[[], ScalarLogger]) -> None:
        try:
            inner: ScalarLogger | None = open_inner()
        except Exception as exc:  # noqa: BLE001 - a service down or refusing: training must not notice
            inner, why = None, f"it could not be opened: {type(exc).__name__}: {exc}"
        while True:
            batch = self._take()
            items = [item for item in batch if item is not self._STOP]
            if inner is None:
                if items:
                    self._drop(len(items), why)
            else:
                self._send(inner, items)
            if len(items) < len(batch):
                break
        if inner is not None:
            try:
                inner.close()
            except Exception as exc:  # noqa: BLE001 - closing a run on a service that went away
                logger.warning("logger %s: could not close its run: %s", self.name, exc)

    def _take(self) -> list[Any]:
        """The next batch: wait for one item, let ``DRAIN_S`` pass, then take all that came. The
        thread wakes at most twice per ``DRAIN_S`` whatever the step rate, so it does not contend
        for the GIL with the training thread at every point."""
        batch = [self._queue.get()]
        if batch[0] is not self._STOP:
            time.sleep(DRAIN_S)
        while batch[-1] is not self._STOP:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _send(self, inner: ScalarLogger, items: list[tuple[str, Any]]) -> None:
        failed, why = 0, ""
        for kind, args in items:
            try:
                inner.config(args) if kind == "config" else inner.scalar(*args)  # type: ignore[attr-defined]
            except Exception as exc:  # noqa: BLE001 - one failed write: dropped and counted, the next tried
                failed, why = failed + 1, f"{type(exc).__name__}: {exc}"
        if failed:
            self._drop(failed, why)


def open_backends(spec: Any, run: str, resume_step: int, root: str, tags: tuple[str, ...]) -> list[ScalarLogger]:
    """The W&B, MLflow and user loggers ``spec.training.loggers`` names, for ``run`` ("train": rank
    0, "driver") of the job whose checkpoint root is ``root``; ``tags``: the tags this process
    writes (MLflow's floor is the highest step of these already in the run)."""
    cfg, rid, out = spec.training.loggers, run_id(root), []
    for name in cfg.backends:
        if name == "tensorboard":
            continue  # scalars.open_logger: its own runs, train and driver
        opener = _opener(name, spec.name, run, rid, resume_step, cfg, tags)
        out.append(BackgroundLogger(name, opener, cfg.queue_size, spec.name))
    return out


def _opener(name: str, job: str, run: str, rid: str, resume_step: int, cfg: Any,
            tags: tuple[str, ...]) -> Callable[[], ScalarLogger]:
    if name == "wandb":
        return lambda: WandbLogger(job, rid, run, cfg.project, cfg.wandb_dir, cfg.wandb_mode)
    if name == "mlflow":
        return lambda: MlflowLogger(job, rid, cfg.project, cfg.mlflow_tracking_uri, tags)
    from raytrain_ckpt.models import resolve_factory

    factory = resolve_factory(name, "logger")
    return lambda: factory(job, run, rid, resume_step)


def open_job_loggers(spec: Any, run: str, resume_step: int, root: str) -> Fanout | None:
    """Every logger of ``run`` ("train": rank 0, "driver") the spec asks for (TensorBoard by
    ``training.tensorboard_dir``, the others by ``training.loggers``), or None: none. The train
    run's loggers get the resolved spec as their config; ``root``, the job's checkpoint root
    (``job_root``), names their run."""
    outs = []
    if (tb := open_logger(spec.training.tensorboard_dir, spec.name, run, resume_step)) is not None:
        outs.append(tb)
    outs += open_backends(spec, run, resume_step, root, TRAIN_TAGS if run == "train" else DRIVER_TAGS)
    if not outs:
        return None
    fan = Fanout(outs)
    if run == "train":
        fan.config(spec.model_dump(mode="json"))
    return fan
