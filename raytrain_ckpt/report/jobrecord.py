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
from raytrain_ckpt.checkpoint.storage.posix import read_small_file

logger = logging.getLogger(__name__)

__all__ = ["MAX_RECORD_BYTES", "RECORD", "TERMINAL", "clamped", "ended", "is_ended", "local_path", "read_local", "read_root", "started",
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


MAX_RECORD_BYTES = 16 << 20
"""Largest record read back (a 1,024-rank job's is well under a megabyte); a bigger one is ignored."""

_TYPES: dict[str, tuple[type, ...]] = {
    "root": (str,), "job": (str,), "committed": (list,), "latest": (int, type(None)), "world_size": (int,),
    "steps": (dict,), "failed": (dict,), "in_flight": (list,), "inflight": (dict,), "failed_saves": (dict,),
    "job_info": (dict,), "at_risk": (dict,), "interval": (int, float, type(None)),
    "started_unix": (int, float, type(None)), "ended_unix": (int, float, type(None)), "error": (str, type(None))}
"""The type of each field a reader of the record uses (``started``'s fields)."""
_INFO_TYPES: dict[str, tuple[type, ...]] = {"state": (str,), "attempt": (int,), "train_step": (int, type(None))}


def read_local(job: str) -> dict[str, Any] | None:
    """The record of ``job`` on this machine, or None."""
    path = local_path(job)

    def read() -> bytes:
        with open(path, "rb") as f:
            return f.read(MAX_RECORD_BYTES + 1)

    return _parse(read, str(path)) if path.is_file() else None


def read_root(root: Location) -> dict[str, Any] | None:
    """The record under a job's checkpoint root, or None."""
    storage = open_storage(root)
    path = storage.join(root, RECORD)
    if not storage.is_file(path):
        return None
    size = storage.size(path)
    if size is not None and size > MAX_RECORD_BYTES:
        logger.warning("ignoring the job record %s: %d bytes, over the %d a record may be", path, size,
                       MAX_RECORD_BYTES)
        return None
    # no link followed, no FIFO swapped in since the check blocked on, bounded (``read_small_file``:
    # a larger file is a ValueError, as ``_parse`` makes it of the other reads)
    return _parse(lambda: read_small_file(storage, path, MAX_RECORD_BYTES), str(path))


def _parse(read: Any, where: str) -> dict[str, Any] | None:
    try:
        data = read()
        if len(data) > MAX_RECORD_BYTES:
            raise ValueError(f"over {MAX_RECORD_BYTES} bytes")
        value = json.loads(data)
    except (OSError, ValueError, RecursionError) as exc:  # a torn or foreign file: as if there were none
        logger.warning("ignoring the unreadable job record %s: %s", where, str(exc)[:200] or type(exc).__name__)
        return None
    problem = _type_problem(value)
    if problem is not None:
        logger.warning("ignoring the job record %s: %s", where, problem)
        return None
    return value


def _type_problem(value: Any) -> str | None:
    if not isinstance(value, dict):
        return f"a JSON {type(value).__name__}, not an object"
    for key, types in _TYPES.items():
        if key in value and (not isinstance(value[key], types) or isinstance(value[key], bool) and bool not in types):
            return f"{key} is a {type(value[key]).__name__}"
    info = value.get("job_info") or {}
    for key, types in _INFO_TYPES.items():
        if key in info and (not isinstance(info[key], types) or isinstance(info[key], bool)):
            return f"job_info.{key} is a {type(info[key]).__name__}"
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in value.get("committed") or ()):
        return "committed holds a value that is not a step"
    return None


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
