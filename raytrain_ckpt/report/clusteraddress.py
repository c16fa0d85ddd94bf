"""Which Ray cluster ``status --job NAME`` asks, from what the user gave, and how it says so.

``--address`` (else RAY_ADDRESS) may be:

- a dashboard URL, ``http://host:8265`` (what `ray job` takes and ``cluster/start_head.sh``
  prints): the dashboard's job list (``/api/jobs/``) has the job's metadata, and in it the GCS
  address its driver connected to (``raytrain_ckpt.gcs_address``);
- a GCS address, ``host:6379``;
- ``auto`` (or nothing): the cluster the job's record on this machine names (the local Ray a
  ``run`` started records its address there), else Ray's own ``auto`` (RAY_ADDRESS, the cluster
  `ray start` recorded, any Ray on this machine).

A cluster with token authentication that started on this machine (a local ``run`` makes the token
file ``~/.ray/auth_token``) is read with that token, as `ray` commands do, without the user
setting RAY_AUTH_MODE.

Torch-free; Ray is imported inside the functions.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

__all__ = ["GCS_KEY", "Target", "local_token", "resolve"]

GCS_KEY = "raytrain_ckpt.gcs_address"
"""The job metadata key holding the GCS address its driver connected to."""
HTTP_TIMEOUT_S = 5.0
"""How long a dashboard has to answer."""


@dataclass(frozen=True)
class Target:
    """The cluster to ask: its GCS address (None: none found) and how it was found."""

    gcs: str | None
    named: str
    """What the user gave, or where it came from: ``http://h:8265``, ``h:6379``, ``auto``, ``the job's record``."""
    problem: str | None = None
    """Why there is no GCS address (None: there is one)."""

    def describe(self) -> str:
        """``http://127.0.0.1:8300 (GCS 127.0.0.1:6379)``: what was used."""
        if self.gcs is None or self.gcs == self.named:
            return self.named
        return f"{self.named} (GCS {self.gcs})"


def local_token() -> str | None:
    """The token a Ray on this machine takes, as Ray finds it (RAY_AUTH_TOKEN, the file
    RAY_AUTH_TOKEN_PATH names, ``~/.ray/auth_token``), or None."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def resolve(job: str, address: str | None, recorded: str | None) -> Target:
    """The cluster to ask about ``job`` (see the module docstring). ``recorded``: the GCS address
    in the job's record on this machine."""
    given = address or os.environ.get("RAY_ADDRESS")
    if given and given.startswith(("http://", "https://")):
        return _from_dashboard(job, given.rstrip("/"))
    if not given or given == "auto":
        if recorded:
            return _checked(recorded, f"the job's record ({recorded})")
        return _checked("auto", "auto")
    return _checked(given, given)


def _checked(target: str, named: str) -> Target:
    from ray._private import services

    from raytrain_ckpt.report.inventory import unreachable_address

    problem = unreachable_address(target)  # as the user wrote it: Ray's client would retry a dead GCS for a minute
    if problem:
        return Target(None, named, problem)
    try:
        gcs = services.canonicalize_bootstrap_address(target)
    except Exception as exc:  # noqa: BLE001 - Ray's ConnectionError / ValueError: no cluster found or a bad address
        return Target(None, named, " ".join(str(exc).split())[:200])
    if gcs is None:
        return Target(None, named, "no Ray cluster runs on this machine")
    problem = unreachable_address(gcs)  # (the cluster `auto` found)
    named = f"auto, found {gcs}" if named == "auto" else named
    return Target(None, named, problem) if problem else Target(gcs, named)


def _from_dashboard(job: str, url: str) -> Target:
    """The GCS address of the newest run of ``job`` the dashboard at ``url`` lists."""
    request = urllib.request.Request(f"{url}/api/jobs/")
    if (token := local_token()) is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            jobs = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        why = "refused this process's token (RAY_AUTH_TOKEN or ~/.ray/auth_token)" if exc.code in (401, 403) else \
            f"answered HTTP {exc.code}"
        return Target(None, url, f"the dashboard {why}")
    except (OSError, ValueError) as exc:
        return Target(None, url, f"no Ray dashboard answers there ({getattr(exc, 'reason', exc)})")
    runs = [j for j in jobs if isinstance(j, dict) and (j.get("metadata") or {}).get("raytrain_ckpt.job") == job]
    runs.sort(key=lambda j: j.get("start_time") or 0)
    gcs = next(((r.get("metadata") or {}).get(GCS_KEY) for r in reversed(runs) if (r.get("metadata") or {}).get(GCS_KEY)),
               None)
    if gcs is None:
        return Target(None, url, f"its job list has no run of {job} naming its GCS address" if not runs else
                      f"its job list has {job}, but not the GCS address it ran on; pass that (host:6379)")
    target = _checked(gcs, url)
    return Target(target.gcs, url, target.problem)
