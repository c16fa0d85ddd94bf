"""Every metric raytrain_ckpt exports, and the plumbing that records them.

Metrics go through ``ray.util.metrics``: each process records into Ray's per-node metrics
agent, which serves them in Prometheus format on the node's ``metrics_export_port`` (Ray
prefixes every name with ``ray_``). ``METRICS`` is the one list of names, kinds, tags and
help texts; the Grafana dashboard in ``cluster/`` is tested against it. ``record`` is the one
way a value is recorded.

Who emits what: each recorder lives beside the code of the process that emits it, and records
through this module's ``record``:

* ``TrainerMetrics`` (each TrainWorker, ``rank/metrics.py``): step, loss, eval loss, tokens/s,
  step time, checkpoint stall, the training guard's rollbacks.
* ``CheckpointMetrics`` (the CheckpointActor, ``checkpoint/roles/metrics.py``): committed and
  in-flight step, phase and per-rank progress, phase durations, bytes, throughput, purges,
  aborts, failed saves (in a row and in all), work at risk, the interval ``interval_steps: auto``
  chose.
* ``WriterMetrics`` (each node's CheckpointWriter, ``checkpoint/roles/metrics.py``): bytes and
  write time per rank, upload retries, and the copies it sent to its peer node (step, bytes,
  time, failures).
* ``ControllerMetrics`` (the driver, called after every controller step, ``control/metrics.py``):
  state, attempt, failures and restarts by cause, preemptions, goodput, the hang timeout,
  stragglers, and the training step it polled.
* the scalar loggers' dropped points (the process that logs, ``observe/loggers.py``).

Recording never raises into the caller: a metrics problem must not stop training.

Ray's metrics agent drops a gauge value once it has been scraped, and a process reports only
the values recorded since its last report (Ray 2.60), so a gauge that is set once (the
committed step of a job that stopped saving) would vanish from Prometheus. Each process
therefore re-records its gauges' last values on a background thread every
``keepalive_interval_s()``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

from raytrain_ckpt.checkpoint.records import IN_FLIGHT_PHASES

logger = logging.getLogger(__name__)

__all__ = ["METRICS", "PHASES", "MetricDef", "exported_names", "record"]

Kind = Literal["gauge", "counter", "histogram"]
SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
PHASES = ("idle", *(p.value for p in IN_FLIGHT_PHASES))
"""Phases of the in-flight step, in order (``raytrain_ckpt_checkpoint_inflight_phase`` has one series each):
``idle`` when none is in flight, else its ``StepPhase``."""
PREFIX = "raytrain_ckpt_"


@dataclass(frozen=True)
class MetricDef:
    """One exported metric: its name (without Ray's ``ray_`` prefix), kind, tags and help text."""

    name: str
    kind: Kind
    help: str
    tags: tuple[str, ...] = ("job",)
    boundaries: tuple[float, ...] = SECONDS


def _m(name: str, kind: Kind, help_text: str, *tags: str) -> MetricDef:
    return MetricDef(PREFIX + name, kind, help_text, ("job", *tags))


METRICS: dict[str, MetricDef] = {m.name.removeprefix(PREFIX): m for m in (
    # trainer side
    _m("train_step", "gauge", "Last finished optimizer step of a rank.", "rank"),
    _m("train_loss", "gauge", "Global mean loss at the last logging step (rank 0)."),
    _m("eval_loss", "gauge", "Validation loss on the held-out samples at the last eval step (rank 0)."),
    _m("train_tokens_per_second", "gauge", "Tokens per second of the last step (whole job, seen by a rank).", "rank"),
    _m("train_step_seconds", "gauge", "Wall time of the last step of a rank.", "rank"),
    _m("checkpoint_stall_seconds", "histogram", "Seconds one save blocked a rank's training thread.", "rank"),
    _m("checkpoint_last_stall_seconds", "gauge", "Seconds the last save blocked a rank's training thread.", "rank"),
    _m("train_rollbacks_total", "counter", "Rollbacks of the training guard to a certified step (rank 0)."),
    _m("train_skipped_samples_total", "counter", "Samples the training guard's rollbacks skipped (rank 0)."),
    # checkpoint actor
    _m("checkpoint_committed_step", "gauge", "Newest committed checkpoint step (-1: none)."),
    _m("checkpoint_last_commit_timestamp_seconds", "gauge", "Unix time of the newest commit (0: none)."),
    _m("checkpoint_inflight_step", "gauge", "Step being saved (-1: none)."),
    _m("checkpoint_inflight_phase", "gauge", "1 for the phase the in-flight step is in, 0 for the others.",
       "phase"),
    _m("checkpoint_inflight_ranks", "gauge", "Ranks of the in-flight step that reached a stage (handed_off, "
       "written).", "stage"),
    _m("checkpoint_rank_progress", "gauge", "Per rank, for the in-flight step: 0 staging, 1 handed off to its "
       "writer, 2 written.", "rank"),
    _m("checkpoint_phase_seconds", "histogram", "Duration of a save phase (plan, stage, write, persist, commit, "
       "total).", "phase"),
    _m("checkpoint_last_bytes", "gauge", "Bytes of the newest committed step (every file its manifest lists)."),
    _m("checkpoint_bytes_written_total", "counter", "Bytes of every step committed by this job."),
    _m("checkpoint_throughput_bytes_per_second", "gauge", "Bytes of the newest step divided by its save time "
       "(hand-off of the first rank to the commit)."),
    _m("checkpoint_commits_total", "counter", "Steps committed."),
    _m("checkpoint_aborted_total", "counter", "Steps aborted (a writer died, a commit failed, a restart)."),
    _m("checkpoint_purged_total", "counter", "Committed steps removed by retention."),
    _m("checkpoint_failed_saves_total", "counter", "Saves that did not commit, for any reason (counted once per "
       "step)."),
    _m("checkpoint_consecutive_failed_saves", "gauge", "Saves that failed since the last commit (0 after a "
       "commit): alert when it stays above 0."),
    _m("checkpoint_interval_steps", "gauge", "Steps between saves chosen by checkpoint.interval_steps=auto "
       "(Young-Daly from the measured save cost and the failure rate)."),
    _m("work_at_risk_seconds", "gauge", "Seconds since the newest commit (since the job started when none): "
       "the training time a failure now would repeat."),
    _m("work_at_risk_steps", "gauge", "Steps trained since the newest committed step."),
    # writer
    _m("checkpoint_rank_bytes_written_total", "counter", "Bytes of shard files a node's writer wrote for a rank.",
       "rank", "node"),
    _m("checkpoint_rank_write_seconds", "gauge", "Seconds a writer took to write, fsync and checksum a rank's "
       "files of the last step.", "rank", "node"),
    _m("checkpoint_rank_upload_retries_total", "counter", "Uploads of a rank's shards to an object store tried "
       "again after a transient error (5xx, throttling, a dropped connection).", "rank", "node"),
    _m("checkpoint_replica_step", "gauge", "Newest step of a rank's committed copy that a node's writer sent to "
       "its peer node (checkpoint.replication; the last send, not what the peer still holds).", "rank", "node"),
    _m("checkpoint_replica_seconds", "gauge", "Seconds the last send of a rank's copy to the peer node took.",
       "rank", "node"),
    _m("checkpoint_replica_bytes_total", "counter", "Bytes of a rank's committed copies sent to the peer node.",
       "rank", "node"),
    _m("checkpoint_replica_failures_total", "counter", "Sends of a rank's copy to the peer node that failed "
       "(also one overtaken by a newer step, whose staging reused the buffer: that step's send follows); until "
       "a send succeeds, losing this node restores its ranks from storage.", "rank", "node"),
    # controller
    _m("logger_dropped_total", "counter", "Scalar points a W&B, MLflow or user logger dropped (its service down or "
       "slow: training never waits on it).", "logger"),
    _m("job_state", "gauge", "1 for the controller's current state, 0 for the others.", "state"),
    _m("job_attempt", "gauge", "Attempt number of the running worker group (0: the first)."),
    _m("job_failures_total", "counter", "Worker group failures, by cause (crash, exception, hang, start).",
       "cause"),
    _m("job_restarts_total", "counter", "Worker group restarts, by the cause of the failure.", "cause"),
    _m("job_replica_heals_total", "counter", "Replica groups replaced and healed from a live group while the "
       "others trained on (parallelism.dp_replicate), by the cause of the failure.", "cause"),
    _m("job_preemption_steps_lost_total", "counter", "Steps trained that no committed step held when a drained node "
       "(or a stop signal) stopped the group: trained again."),
    _m("job_preemption_notice_seconds", "gauge", "Seconds between the latest drain notice and its deadline (-1: no "
       "deadline)."),
    _m("job_wall_seconds_total", "counter", "Seconds of the job's wall time, by the cause they went to (goodput "
       "ledger: training, checkpoint_stall, eval, redone, degraded, first_step, placement, rendezvous, load, detection, "
       "teardown, waiting).", "cause"),
    _m("job_goodput_ratio", "gauge", "Training seconds / wall seconds of the job so far."),
    _m("job_hang_timeout_seconds", "gauge", "The hang timeout in force (learned from the step times when "
       "fault_tolerance.hang_timeout_s is auto)."),
    _m("job_step_skew_seconds", "gauge", "How much later the last rank began the latest step than the first "
       "(per-rank step-time skew; a persistent one names a straggler)."),
    _m("job_stragglers", "gauge", "Ranks reported as stragglers (fault_tolerance.straggler_margin)."),
)}


def exported_names() -> set[str]:
    """Every series name Prometheus sees: ``ray_`` + name, ``_bucket``/``_sum``/``_count`` for histograms."""
    out = set()
    for m in METRICS.values():
        base = "ray_" + m.name
        out |= {base + s for s in ("_bucket", "_sum", "_count")} if m.kind == "histogram" else {base}
    return out


_objects: dict[str, Any] = {}
_warned = False
_gauges: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
_lock = threading.Lock()
_create_lock = threading.Lock()
_keepalive: threading.Thread | None = None


def keepalive_interval_s() -> float:
    """Half of Ray's metrics report interval (``RAY_metrics_report_interval_ms``, default 10 s)."""
    report_ms = float(os.environ.get("RAY_metrics_report_interval_ms", "10000"))
    return min(5.0, max(0.2, report_ms / 2000.0))


def _keep_gauges_alive() -> None:
    while True:
        time.sleep(keepalive_interval_s())
        with _lock:
            values = list(_gauges.items())
        for (name, tags), value in values:
            _set(name, value, dict(tags))


def _warn_once(name: str, exc: Exception) -> None:
    global _warned
    if not _warned:
        _warned = True
        logger.warning("could not record metric %s (further errors in this process are not logged): %s: %s",
                       name, type(exc).__name__, exc)


def _set(name: str, value: float, tags: dict[str, str]) -> None:
    try:
        _metric(name).set(value, tags=tags)
    except Exception as exc:  # metrics are best effort: never fail a training step or a commit over them
        _warn_once(name, exc)


def _metric(name: str) -> Any:
    with _create_lock:  # the keepalive thread records too: create each metric once
        return _objects.get(name) or _objects.setdefault(name, _create(METRICS[name]))


def _create(d: MetricDef) -> Any:
    from ray.util import metrics as rm

    if d.kind == "gauge":
        return rm.Gauge(d.name, d.help, tag_keys=d.tags)
    if d.kind == "counter":
        return rm.Counter(d.name, d.help, tag_keys=d.tags)
    return rm.Histogram(d.name, d.help, boundaries=list(d.boundaries), tag_keys=d.tags)


def record(name: str, value: float, tags: dict[str, str]) -> None:
    """Set a gauge, add to a counter or observe a histogram, by the metric's kind."""
    global _keepalive
    tags = {k: str(v) for k, v in tags.items()}
    if METRICS[name].kind == "gauge":
        with _lock:
            _gauges[(name, tuple(sorted(tags.items())))] = float(value)
            if _keepalive is None:
                _keepalive = threading.Thread(target=_keep_gauges_alive, name="rtc-metrics", daemon=True)
                _keepalive.start()
        _set(name, float(value), tags)
        return
    try:
        obj = _metric(name)
        if METRICS[name].kind == "counter":
            if value > 0:
                obj.inc(float(value), tags=tags)
        else:
            obj.observe(float(value), tags=tags)
    except Exception as exc:  # metrics are best effort: never fail a training step or a commit over them
        _warn_once(name, exc)
