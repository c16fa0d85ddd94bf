"""What a job shows on the Ray dashboard: its metadata in the Jobs view, and the line ``run``
logs at start saying where the dashboard is and how a browser gets in.

Ray keeps a driver job's ``JobConfig.metadata`` with the job (the dashboard's job page,
``ray list jobs --detail``). A submitted job (`ray job submit`) is shown from another record: the
job's submission info (``JobInfo``, in the GCS's key-value store under the ``job`` namespace),
which holds only the submitter's ``--metadata-json``; Ray has no call that changes it after the
submit. So the driver of a submitted job adds its keys to that record itself once connected
(``name_submitted_job``), the submitter's keys winning, the same read-modify-write Ray's job
supervisor does for each status change (which keeps them: it replaces the status only). Where that
cannot be done, the warning names the submit flag that does the same. The dashboard's Jobs page
shows the ``job_name`` key in its Name column. The metadata is fixed at start: the job's live
state is the ``job_state`` metric and ``raytrain-ckpt status --job``.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from raytrain_ckpt.spec import JobSpec

logger = logging.getLogger(__name__)

__all__ = ["dashboard_line", "job_metadata", "metadata_flag", "name_submitted_job"]

_SUBMITTED = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Set by Ray's job supervisor for a submitted job's entrypoint: its runtime_env and metadata."""
_SUBMISSION_ID = "job_submission_id"
"""The metadata key holding a submitted job's id (``ray.dashboard.modules.job.common.JOB_ID_METADATA_KEY``)."""
_JOB_INFO_KEY = "_ray_internal_job_info_{}"
"""A submitted job's info in the GCS key-value store (``JobInfoStorageClient.JOB_DATA_KEY``)."""


def job_metadata(spec: JobSpec, gcs_address: str | None = None) -> dict[str, str]:
    """The job's keys in Ray's job metadata (strings only: Ray's ``JobConfig`` takes no other);
    ``gcs_address``: the cluster's, where ``status --address <dashboard URL>`` reads the job."""
    root = f"{str(spec.checkpoint.dir).rstrip('/')}/{spec.name}" if spec.checkpoint.enabled else "-"
    gcs = {"raytrain_ckpt.gcs_address": gcs_address} if gcs_address else {}
    return {**gcs, "job_name": spec.name, "raytrain_ckpt.job": spec.name, "raytrain_ckpt.spec_hash": spec.spec_hash(),
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


def metadata_flag(metadata: dict[str, str]) -> str:
    """``--metadata-json '{...}'``: the `ray job submit` flag that gives a submitted job these keys."""
    return f"--metadata-json {shlex.quote(json.dumps(metadata, separators=(',', ':')))}"


def name_submitted_job(metadata: dict[str, str]) -> str | None:
    """Add ``metadata`` to the submission record of the job this driver runs for (`ray job submit`),
    keys the submitter gave kept as they are; returns its submission id (None: not a submitted
    job). Never raises: a record that cannot be changed is a warning naming the submit flag."""
    submitted = os.environ.get(_SUBMITTED)
    if submitted is None:
        return None
    sub_id = (json.loads(submitted).get("metadata") or {}).get(_SUBMISSION_ID)
    if not sub_id:
        return None
    from ray.experimental import internal_kv

    key = _JOB_INFO_KEY.format(sub_id)
    try:
        raw = internal_kv._internal_kv_get(key, namespace="job")
        info = json.loads(raw) if raw else None
        if not isinstance(info, dict):
            raise ValueError("no submission record")
        info["metadata"] = {**metadata, **(info.get("metadata") or {})}
        internal_kv._internal_kv_put(key, json.dumps(info), overwrite=True, namespace="job")
    except Exception as exc:  # noqa: BLE001 - a Ray whose record differs: the job runs on, without its name
        logger.warning("the Ray dashboard shows submitted job %s without its name (%s); submit with %s to give it "
                       "one", sub_id, exc, metadata_flag(metadata))
        return None
    return sub_id
