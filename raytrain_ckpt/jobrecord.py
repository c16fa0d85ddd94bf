"""A job's record: how it stands, and how it ended, where ``status --job`` finds it once no Ray
cluster knows the job any more.

The driver writes it when the job starts and when it ends, to two places:

- ``<checkpoint root>/.job.json``, beside the steps (``status DIR`` reads it; a dot name, so no
  step scan sees it);
- ``$XDG_STATE_HOME/raytrain_ckpt/jobs/<job>.json`` (``~/.local/state/...``) on the driver's
  machine: how ``status --job NAME`` finds the job's root after its cluster is gone (a local
  Ray that ``run`` started stops with the job).

Its content is the status's JSON view (``ActorStatus.to_dict``, what the bulletin in the GCS
holds) with ``job_info.state`` the job's state, plus ``ended_unix`` (None while it runs) and
``error`` (the headline of the last error of a FAILED job) and ``stopped`` (what a STOPPED job
saved before it stopped: ``SIGTERM: step 95 is committed and safe``). Torch-free and Ray-free.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

from raytrain_ckpt.checkpoint.format.names import Location
from raytrain_ckpt.checkpoint.storage.backends import open_storage

logger = logging.getLogger(__name__)

__all__ = ["RECORD", "TERMINAL", "clamped", "ended", "is_ended", "local_path", "read_local", "read_root", "started",
           "write"]

RECORD = ".job.json"
"""The record's name under the job's checkpoint root."""

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
"""The job states a record ends with (``JobState``'s terminal members)."""


def local_path(job: str) -> Path:
    """The record of ``job`` on this machine."""
    base = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return base / "raytrain_ckpt" / "jobs" / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', job)}.json"


def started(job: str, root: str, ray_address: str | None = None) -> dict[str, Any]:
    """The record of a job that is starting: its root and the GCS address of its Ray cluster
    (where ``status --job`` looks first), nothing committed yet known."""
    return {"root": root, "job": job, "ray_address": ray_address, "committed": [], "latest": None, "world_size": 0, "steps": {},
            "failed": {}, "in_flight": [], "inflight": {"step": None, "phase": "idle", "ranks": {}},
            "failed_saves": {}, "job_info": {"state": "STARTING", "attempt": 0, "train_step": None},
            "at_risk": {"seconds": 0.0, "steps": 0}, "interval": None, "started_unix": time.time(),
            "ended_unix": None, "error": None, "stopped": None}


def is_ended(record: dict[str, Any]) -> bool:
    """Whether the record is of a job that reached its final state."""
    return (record.get("job_info") or {}).get("state") in TERMINAL


def write(root: Location, job: str, record: dict[str, Any]) -> None:
    """Write ``record`` under ``root`` and on this machine. A record that cannot be written is
    logged, never raised: it only serves ``status`` after the end, the job goes on."""
    data = json.dumps(record, default=str).encode()
    try:
        storage = open_storage(root)
        storage.write_bytes(storage.join(root, RECORD), data)
    except Exception as exc:  # noqa: BLE001 - a read-only or full root: the local copy may still be written
        logger.warning("could not write the job record under %s: %s", root, exc)
    path = local_path(job)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    except OSError as exc:
        logger.warning("could not write the job record %s: %s", path, exc)


def read_local(job: str) -> dict[str, Any] | None:
    """The record of ``job`` on this machine, or None."""
    return _parse(local_path(job).read_bytes) if local_path(job).is_file() else None


def read_root(root: Location) -> dict[str, Any] | None:
    """The record under a job's checkpoint root, or None."""
    storage = open_storage(root)
    path = storage.join(root, RECORD)
    return _parse(lambda: storage.read_bytes(path)) if storage.is_file(path) else None


def _parse(read: Any) -> dict[str, Any] | None:
    try:
        value = json.loads(read())
    except (OSError, ValueError) as exc:  # a torn or foreign file: as if there were none, said once
        logger.warning("ignoring an unreadable job record: %s", exc)
        return None
    return value if isinstance(value, dict) else None


def ended(record: dict[str, Any], status: dict[str, Any] | None, info: dict[str, Any],
          error: str | None, stopped: str | None = None) -> dict[str, Any]:
    """The record of a job that reached its final state: ``record`` (its start) updated with
    the CheckpointActor's last status and the controller's summary ``info``; ``stopped``: what a
    job a signal stopped saved."""
    out = {**record, **(status or {})}
    out["job_info"] = clamped(info, out.get("latest"))
    out |= {"ended_unix": time.time(), "error": error, "stopped": stopped}
    return out


def clamped(info: dict[str, Any], latest: int | None) -> dict[str, Any]:
    """``info`` with its training step never below the newest committed step: the slowest rank's
    step is unknown (None) or older between polls and after a restart, but a committed step was
    trained by every rank."""
    step = info.get("train_step")
    if latest is not None and (step is None or step < latest):
        return {**info, "train_step": latest}
    return info
