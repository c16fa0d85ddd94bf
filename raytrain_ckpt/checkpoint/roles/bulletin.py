"""The job's bulletin: its status, posted in the Ray cluster's GCS key-value store.

The CheckpointActor posts its ``ActorStatus.to_dict()`` there at each note of the driver, and
the driver posts the final one when the job ends. ``raytrain-ckpt status --job`` reads it with
a plain GCS client, which is not a Ray driver: asking the actor itself would need ``ray.init``,
which registers a driver job, and every ``status`` call would add a finished "job" to the Ray
dashboard's Jobs list. The entry outlives the job for as long as the cluster lives, so a
``status`` after the end still says how it ended.

Torch-free; Ray is imported inside the functions.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from raytrain_ckpt.checkpoint.roles.names import NAMESPACE

logger = logging.getLogger(__name__)

__all__ = ["GCS_TIMEOUT_S", "key", "oldest_in_flight", "post", "posted", "read"]

GCS_TIMEOUT_S = 5.0
"""How long a read waits for the GCS to answer."""


def key(job: str) -> bytes:
    """The bulletin's key of a job in the ``raytrain_ckpt`` KV namespace."""
    return f"status:{job}".encode()


def post(job: str, data: dict[str, Any]) -> None:
    """Post ``data`` (JSON-able) as the job's bulletin, from a process connected to Ray; a
    process that is not (a test driving the actor as a plain object) posts nothing."""
    import ray

    if not ray.is_initialized():
        return
    from ray.experimental.internal_kv import _internal_kv_initialized, _internal_kv_put

    if not _internal_kv_initialized():
        return
    try:
        _internal_kv_put(key(job), json.dumps(data, default=str).encode(), overwrite=True, namespace=NAMESPACE)
    except Exception as exc:  # noqa: BLE001 - a GCS restarting: status shows the previous post, training goes on
        logger.debug("could not post the status of %s: %s", job, exc)


def posted(job: str) -> dict[str, Any] | None:
    """The job's bulletin as this process, connected to Ray (the driver), reads it; None when
    there is none or the GCS does not answer now."""
    from ray.experimental.internal_kv import _internal_kv_get, _internal_kv_initialized

    if not _internal_kv_initialized():
        return None
    try:
        raw = _internal_kv_get(key(job), namespace=NAMESPACE)
    except Exception:  # noqa: BLE001 - a GCS restarting: the progress line shows no committed step this time
        return None
    return json.loads(raw) if raw else None


def oldest_in_flight(job: str) -> int | None:
    """The oldest step the job's CheckpointActor has in flight, as its bulletin last said (None:
    none or unknown)."""
    steps = (posted(job) or {}).get("in_flight") or []
    return min(steps) if steps else None


def read(gcs_address: str, job: str) -> dict[str, Any] | None:
    """The job's bulletin on the cluster whose GCS is at ``gcs_address`` (``host:port``), or None
    when it has none. Raises ConnectionError when the GCS does not answer, PermissionError when
    it refuses this process's authentication token."""
    try:
        raw = _get(gcs_address, job)
    except Exception as exc:  # Ray raises its own RpcError / GetTimeoutError kinds for a GCS that is gone
        if type(exc).__name__ == "AuthenticationError" and _adopt_token():
            return read(gcs_address, job)  # with the token of a Ray started on this machine, once
        if type(exc).__name__ == "AuthenticationError":
            raise PermissionError(f"the cluster at {gcs_address} uses token authentication and refused this "
                                  "process's token: set RAY_AUTH_MODE=token and the cluster's token (RAY_AUTH_TOKEN, "
                                  "or the file `ray get-auth-token` reads)") from None
        raise ConnectionError(f"the GCS at {gcs_address} does not answer ({type(exc).__name__})") from None
    return json.loads(raw) if raw else None


def _get(gcs_address: str, job: str) -> bytes | None:
    from ray._raylet import GcsClient

    return GcsClient(address=gcs_address).internal_kv_get(key(job), NAMESPACE.encode(), timeout=GCS_TIMEOUT_S)


def _adopt_token() -> bool:
    """Turn token authentication on for this process when RAY_AUTH_MODE is unset and a token is
    at hand (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token: the one a local ``run``'s Ray
    made), as `ray` commands do; returns whether it did. A mode the user set is kept."""
    if os.environ.get("RAY_AUTH_MODE") is not None:
        return False
    from ray._raylet import AuthenticationTokenLoader, Config

    if not AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
        return False
    os.environ["RAY_AUTH_MODE"] = "token"
    Config.initialize("")  # Ray reads the mode from its cached config: refresh it
    return True
