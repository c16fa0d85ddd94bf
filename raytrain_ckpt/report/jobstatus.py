"""Where ``raytrain-ckpt status --job NAME`` gets a job's status, running or ended.

In order:

1. the job's bulletin in its cluster's GCS (which cluster: ``report/clusteraddress.py``) (``checkpoint/roles/bulletin.py``), read with a
   plain GCS client: no ``ray.init``, so no driver job joins the Ray dashboard's Jobs list. It
   is posted while the job runs and holds the final state once it ended, as long as the
   cluster lives;
2. the job's record on this machine (``report/jobrecord.py``), once the cluster is gone or no longer
   knows the job (a local Ray ``run`` started stops with the job): how it ended, and its root,
   whose steps are then read from storage;
3. what a ``--watch`` saw last, when neither answers any more.

A ``ray://`` address (Ray Client) has no GCS to read: the job's CheckpointActor is asked
(``inventory.live_status``), which does register a driver.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from raytrain_ckpt.report import jobrecord
from raytrain_ckpt.checkpoint.errors import StorageUnavailable
from raytrain_ckpt.checkpoint.roles.summary import failed_saves_text, resume_refused_text, summary_line
from raytrain_ckpt.report.clusteraddress import resolve
from raytrain_ckpt.report.inventory import UsageError, ending_line, interval_text, live_rows, live_status, root_dir, scan, table

__all__ = ["JobView", "job_report", "job_status", "status_line"]


@dataclass(frozen=True)
class JobView:
    """A job's status as ``status`` shows it, and where it came from."""

    data: dict[str, Any]
    """The status's JSON view (``ActorStatus.to_dict``), ``job_info.state`` the job's state."""
    source: str
    """``cluster`` (its bulletin or its actor), ``record`` (this machine's record), ``last-seen``."""
    note: str | None = None
    """Why the view is not the cluster's (the cluster is gone, the job recorded no end)."""
    cluster_gone: bool = False
    """No cluster answers: nothing newer will come."""
    cluster: str | None = None
    """The cluster asked, as ``status`` names it (``http://h:8265 (GCS h:6379)``, ``auto, found h:p``)."""

    @property
    def state(self) -> str:
        return str((self.data.get("job_info") or {}).get("state", "?"))

    @property
    def ended(self) -> bool:
        """The job reached its final state, or nothing will tell more (its cluster is gone)."""
        return jobrecord.is_ended(self.data) or self.cluster_gone


def job_status(job: str, address: str | None, last: JobView | None = None) -> JobView:
    """The status of ``job`` (see the module docstring); raises UsageError when nothing knows it."""
    given = address or os.environ.get("RAY_ADDRESS") or "auto"
    if given.startswith("ray://"):
        return JobView(live_status(job, given).to_dict(), "cluster", cluster=given)
    record = jobrecord.read_local(job)
    target = resolve(job, address, (record or {}).get("ray_address"))
    problem = target.problem
    if target.gcs is not None:
        from raytrain_ckpt.checkpoint.roles import bulletin

        try:
            data = bulletin.read(target.gcs, job)
        except ConnectionError as exc:
            problem = str(exc)
        except PermissionError as exc:  # the cluster is there but does not let this process in
            raise UsageError(f"--job {job}: {exc}") from None
        else:
            if data is not None:
                return JobView(data, "cluster", cluster=target.describe())
    named = target.describe()
    gone = (f"the Ray cluster at {named} is gone ({problem})" if problem is not None else
            f"the Ray cluster at {named} knows no job {job}")
    is_gone = problem is not None
    if record is not None:
        how = ""
        if not jobrecord.is_ended(record):
            how = ("; the job recorded no end (its driver was stopped or lost)" if is_gone else
                   "; the job has not posted its status yet (starting), or its driver was lost")
        return JobView(record, "record", f"{gone}: from the job's record {jobrecord.local_path(job)}{how}", is_gone,
                       named)
    if last is not None:
        return JobView(last.data, "last-seen", f"{gone}: its last status seen", True, named)
    if problem is not None:
        raise UsageError(f"--job {job}: cannot reach a Ray cluster at {named} ({problem}) and this machine has no "
                         "record of that job; start the cluster, pass --address / RAY_ADDRESS, or give the job's "
                         "checkpoint root: raytrain-ckpt status DIR")
    raise UsageError(f"--job {job}: no running job of that name on the cluster at {named} (none posted a status) and "
                     "this machine has no record of it; check the name and --address, or give the job's checkpoint "
                     "root: raytrain-ckpt status DIR")


def job_report(view: JobView) -> tuple[str, dict[str, Any]]:
    """The text and the JSON form of ``status --job``. For a job the cluster no longer knows, the
    steps are read from its checkpoint root (the record's root), where they still are."""
    st = view.data
    info = jobrecord.clamped(st.get("job_info") or {}, st.get("latest"))
    rows, root = live_rows(st), st.get("root")
    if view.source != "cluster" and root:
        with contextlib.suppress(UsageError, OSError, StorageUnavailable):  # the root is gone too: the record's rows
            rows = scan(root_dir(root))
    valid = [r.step for r in rows if r.status == "valid"]
    latest = max(valid) if valid else st.get("latest")
    info = jobrecord.clamped(info, latest)
    risk = st.get("at_risk") or {"steps": 0, "seconds": 0.0}
    if view.ended:
        head = ending_line({**st, "job_info": info, "latest": latest})
    else:
        head = (f"job {st.get('job', '?')}: {info.get('state', '?')}, attempt {info.get('attempt', 0)}, training step "
                f"{info.get('train_step') if info.get('train_step') is not None else '?'}; {summary_line(st)}; "
                f"work at risk {risk['steps']} steps, {risk['seconds']:.0f}s")
    if view.source == "cluster" and view.cluster:
        head += f"\ncluster: {view.cluster}"
    if view.note:
        head += f"\nnote: {view.note}"
    if info.get("preemption"):
        head += f"\npreemption: {info['preemption']}"
    failing = failed_saves_text(st)
    if failing is not None:
        head += f"\nsaves failing: {failing}"
    refused = resume_refused_text(st)
    if refused is not None:
        head += f"\nnot resumable: {refused}"
    if st.get("interval") is not None:
        head += f"\n{interval_text(st['interval'])}"
    if not view.ended and (hangs := status_line(info)) is not None:
        head += f"\n{hangs}"
    point = f"step {latest}" if latest is not None else "none (a fresh start)"
    if latest is not None and str(latest) in {str(s) for s in st.get("resume_refused") or {}}:
        point += " (its .metadata was refused: a restart skips it, see above)"
    data = {"root": root, "job": info, "summary": summary_line({**st, "latest": latest}), "at_risk": risk,
            "failed_saves": st.get("failed_saves") or {}, "interval": st.get("interval"), "ended": view.ended,
            "source": view.source, "cluster": view.cluster, "note": view.note, "ended_unix": st.get("ended_unix"), "error": st.get("error"),
            "resume_step": latest, "steps": [asdict(r) for r in rows]}
    return f"{head}\n{table(rows)}\nresume point: {point}", data


def status_line(info: Mapping[str, Any]) -> str | None:
    """The hang line of ``status --job`` from the controller's summary (None: nothing to say)."""
    value, why = info.get("hang_timeout_s"), info.get("hang_timeout_why")
    if value is None:
        return None
    line = f"hang timeout {value:.0f}s ({why})"
    if info.get("goodput") is not None:
        line += f"; goodput so far {100 * info['goodput']:.1f}%"
    if info.get("stragglers"):
        line += f"; straggler rank(s) {', '.join(map(str, info['stragglers']))}"
    if info.get("stuck"):
        line += f"; {info['stuck']}"
    if info.get("replica_heals"):
        line += f"; {info['replica_heals']} replica group(s) replaced while the others trained on"
    if info.get("replicas_healing"):
        line += f"; healing now: replica group(s) {', '.join(map(str, info['replicas_healing']))}"
    hang = info.get("last_hang")
    if hang:
        line += f"; last hang: {hang}"
    return line
