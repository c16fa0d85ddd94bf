"""The Python API: run a job and look at checkpoints from a notebook or a script.

``raytrain-ckpt run``/``validate``/``status``/``ls``/``verify`` are thin layers over these
functions. Importing this module imports neither torch nor Ray; ``run`` does, when called.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_ckpt.spec import JobSpec, apply_overrides

from raytrain_ckpt.control.preflight import check_environment, load_spec, validate_spec

if TYPE_CHECKING:
    from raytrain_ckpt.control.controller import JobResult
    from raytrain_ckpt.report.inventory import StepRow

__all__ = ["ls", "resolve_spec", "run", "status", "verify"]

SpecLike = JobSpec | Mapping[str, Any] | str | Path
"""A job spec: a ``JobSpec``, a dict shaped like the spec file, or the path of a .yaml/.json/.toml file."""


def resolve_spec(spec: SpecLike, overrides: list[str] | None = None) -> JobSpec:
    """The validated ``JobSpec`` for ``spec`` with ``overrides`` (``"training.steps=20"``, as ``--set``) applied.

    Precedence, as on the command line: overrides > the spec given > field defaults. Relative
    paths in a dict or a ``JobSpec`` are relative to the working directory. Every spec is also
    checked against this machine (writable directories, memory), as ``load_spec`` does.

    Raises:
        SpecError: the spec or an override is invalid; ``problems`` has one line per problem.
    """
    if isinstance(spec, (str, Path)):
        return load_spec(spec, overrides)
    if isinstance(spec, JobSpec) and not overrides:
        check_environment(spec)
        return spec
    raw = spec.model_dump(mode="json") if isinstance(spec, JobSpec) else _copy(spec)
    return validate_spec(apply_overrides(raw, overrides), base_dir=Path.cwd())


def run(spec: SpecLike, overrides: list[str] | None = None, address: str | None = None) -> JobResult:
    """Run a job to a terminal state and return its ``JobResult`` (``.state``, ``.losses``, ``.failures``).

    Args:
        spec: a ``JobSpec``, a dict, or a spec file path.
        overrides: ``path.to.field=value`` strings, as the CLI's ``--set``.
        address: Ray address; None uses an already initialised Ray as it is, else ``RAY_ADDRESS``,
            else starts a local Ray for the job.

    Raises:
        SpecError: the spec is invalid.
        ResourceError: the spec asks for more than a cluster that cannot grow has.
        StorageNotShared: checkpoint.dir is a local path that not every node shares.
        ResumeRefused: checkpoint.resume names a step that is missing or not intact.
    """
    import os

    from raytrain_ckpt.control.driver import run_job

    job = resolve_spec(spec, overrides)
    return run_job(job, address=address or os.environ.get("RAY_ADDRESS"))


def ls(root: str | Path, checksum: bool = False) -> list[StepRow]:
    """Every step entry under a job's checkpoint root with its status (valid, torn, corrupt, ...).

    ``checksum`` also checks every file's CRC-32 (reads every byte); otherwise file sizes.
    """
    from raytrain_ckpt.report.inventory import StepRow, status_report

    data = status_report(str(root), "checksum" if checksum else "size")[1]
    return [StepRow(**row) for row in data["steps"]]


def verify(step_dir: str | Path) -> list[str]:
    """The problems of one step directory against its manifest (sizes and CRC-32); [] when it is intact.

    Raises:
        ValueError: ``step_dir`` is not a directory.
    """
    from raytrain_ckpt.report.inventory import UsageError, verify_step

    path = Path(step_dir)
    if not path.is_dir():
        raise UsageError(f"{path}: no such step directory; pass one like checkpoints/<job>/step-00000040")
    return verify_step(path)


def status(root: str | Path | None = None, job: str | None = None, address: str | None = None) -> dict[str, Any]:
    """Checkpoint progress as ``raytrain-ckpt status --json`` prints it: of a checkpoint root on
    disk, or (``job``) of a running job, asked of its CheckpointActor on the Ray cluster."""
    from raytrain_ckpt.report.inventory import UsageError, status_report
    from raytrain_ckpt.report.jobstatus import job_report, job_status

    if job is not None and root is not None:
        raise UsageError("status: give either a checkpoint root or a job, not both")
    return job_report(job_status(job, address))[1] if job is not None else status_report(str(root) if root is not None else None)[1]


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    return list(map(_copy, value)) if isinstance(value, list) else value
