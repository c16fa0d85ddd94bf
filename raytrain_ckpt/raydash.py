"""What a job shows on the Ray dashboard: its metadata in the Jobs view, and the line ``run``
logs at start saying where the dashboard is and how a browser gets in.

Ray keeps a driver job's ``JobConfig.metadata`` with the job (the dashboard's job page,
``ray list jobs --detail``); a job submitted with ``ray job submit --metadata-json`` keeps the
submitter's keys too (Ray merges them into the driver's). The metadata is fixed at connect time:
the job's live state is the ``job_state`` metric and ``raytrain-ckpt status --job``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raytrain_ckpt.spec import JobSpec

logger = logging.getLogger(__name__)

__all__ = ["dashboard_line", "job_metadata"]


def job_metadata(spec: JobSpec) -> dict[str, str]:
    """The job's keys in Ray's job metadata (strings only: Ray's ``JobConfig`` takes no other)."""
    root = f"{str(spec.checkpoint.dir).rstrip('/')}/{spec.name}" if spec.checkpoint.enabled else "-"
    return {"job_name": spec.name, "raytrain_ckpt.job": spec.name, "raytrain_ckpt.spec_hash": spec.spec_hash(),
            "raytrain_ckpt.workers": str(spec.world_size), "raytrain_ckpt.steps": str(spec.training.steps),
            "raytrain_ckpt.checkpoint_root": root, "raytrain_ckpt.status": f"raytrain-ckpt status --job {spec.name}"}


def dashboard_line(job: str) -> str | None:
    """``Ray dashboard: http://...`` with what to look at, and with token authentication on, how a
    browser gets in; None when this process has no node (Ray Client) or Ray runs no dashboard."""
    from ray._private import services, worker

    try:  # the head's dashboard as the cluster records it; a driver's own node knows none when it joined one
        url = services.get_webui_url_from_internal_kv() or worker.get_dashboard_url()
    except Exception:  # noqa: BLE001 - a Ray Client driver, or a Ray without these helpers: nothing to say
        return None
    if not url:
        return None
    url = url if "://" in url else f"http://{url}"
    line = (f"Ray dashboard: {url} (Actors: TrainWorker({job} rank r/n), CheckpointActor({job}), "
            f"CheckpointWriter({job}); live checkpoint progress: raytrain-ckpt status --job {job})")
    if _token_auth():
        line += ("; token authentication is on: when the browser asks for the token, paste what "
                 "`ray get-auth-token` prints on the head node")
    return line


def _token_auth() -> bool:
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token authentication
        return False
    return is_token_auth_enabled()
