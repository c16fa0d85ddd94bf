"""A spec checked against the machine that loads it: paths it will write, memory it needs, the
object store it names. ``load_spec`` here is the one entry for a spec file: read, validate, check.

Outside ``spec/`` because the checks reach into the checkpoint storage (an object store's
reachability), and the spec package imports nothing of the checkpoint machinery. They run where
the spec enters (``load_spec``: the CLI's ``validate`` and ``run``, the driver, the Python API),
not in the pydantic validators, because a worker re-validates the spec on its own node and
must not judge the driver's paths or RAM. A spec for a cluster is best validated where its
driver runs (the head node), which sees the same shared ``checkpoint.dir`` as the workers.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from raytrain_ckpt.spec.job import JobSpec
from raytrain_ckpt.spec.loading import parse_spec, read_spec
from raytrain_ckpt.spec.memory import MemoryEstimate, memory_estimate
from raytrain_ckpt.spec.sections import RESUME_VALUES, SpecError, is_ascii_digits

__all__ = [
    "check_environment",
    "environment_problems",
    "gpu_memory_bytes",
    "host_memory_bytes",
    "load_spec",
    "validate_spec",
]

def load_spec(path: str | Path, overrides: list[str] | None = None) -> JobSpec:
    """Read a YAML, JSON or TOML job spec, apply ``--set`` overrides, validate it and check it
    against this machine.

    Args:
        path: The spec file.
        overrides: ``dotted.path=value`` strings; values are parsed as YAML scalars/lists.

    Returns:
        The validated spec.

    Raises:
        SpecError: The file is missing or unreadable, the spec is invalid, or it does not fit
            this machine.
    """
    return validate_spec(read_spec(path, overrides), base_dir=Path(path).resolve().parent)


def validate_spec(raw: dict, base_dir: Path) -> JobSpec:
    """Validate a spec shaped as the file is (overrides applied), then check it against this machine.

    Raises:
        SpecError: One line per problem.
    """
    spec = parse_spec(raw, base_dir)
    check_environment(spec)
    return spec


def check_environment(spec: JobSpec) -> None:
    """Raise ``SpecError`` with every problem of a valid spec on this machine (paths, memory)."""
    problems = environment_problems(spec)
    if problems:
        raise SpecError([f"{where}: {what}" for where, what in problems])


def environment_problems(spec: JobSpec) -> list[tuple[str, str]]:
    """Every ``(field path, message)`` about directories the job writes and memory it needs."""
    out: list[tuple[str, str]] = []
    ckpt = spec.checkpoint
    if ckpt.enabled and isinstance(ckpt.dir, Path):
        problem = writable_dir_problem(ckpt.dir.expanduser())
        if problem:
            out.append((f"checkpoint.dir={ckpt.dir}", f"{problem}; point it at a writable directory "
                                          "(on a cluster: storage every node mounts)"))
    elif ckpt.enabled and _in_process_store(ckpt.dir):
        out.append((f"checkpoint.dir={ckpt.dir}", _IN_PROCESS_STORE))
    elif ckpt.enabled:  # an object store: its filesystem installed, and the store answers a listing
        out += _object_store_problems(str(ckpt.dir), ckpt.storage_options)
    if ckpt.final_export is not None and _in_process_store(ckpt.final_export.dir):
        out.append((f"checkpoint.final_export.dir={ckpt.final_export.dir}", _IN_PROCESS_EXPORT))
    if ckpt.final_export is not None and isinstance(ckpt.final_export.dir, Path):
        problem = _export_dir_problem(ckpt.final_export.dir.expanduser())
        if problem:
            out.append((f"checkpoint.final_export.dir={ckpt.final_export.dir}",
                        f"{problem}; point it at a new or empty directory, or null for <checkpoint.dir>/<name>"))
    resume = ckpt.resume
    if resume not in ("latest", "none") and not is_ascii_digits(resume) and "://" not in resume:
        path = Path(resume)  # (a file's spec had this checked and resolved when it was read)
        try:
            found = path.is_dir()
        except OSError:
            found = False
        if not found:
            out.append((f"checkpoint.resume={resume}", RESUME_VALUES))
    out += _memory_problems(spec)
    return out


_IN_PROCESS_STORE = ("memory:// is a store inside one process, but a job's checkpoint actor, writers and ranks are "
                     "separate processes that would each see their own empty store, so no save could commit; use a "
                     "directory every node shares, or an object store (s3://bucket/prefix, gs://bucket/prefix)")
_IN_PROCESS_EXPORT = ("memory:// is a store inside one process: the export would be gone when the job ends; use a "
                      "directory or an object store (s3://bucket/prefix), or null for <checkpoint.dir>/<name>")


def _in_process_store(location: Path | str | None) -> bool:
    """fsspec's memory:// lives in the process that opened it; a job spans many processes."""
    return isinstance(location, str) and location.lower().startswith("memory://")


def _object_store_problems(uri: str, options: dict) -> list[tuple[str, str]]:
    from raytrain_ckpt.checkpoint.storage.objects import object_store_problem

    problem = object_store_problem(uri, options)
    return [(f"checkpoint.dir={uri}", problem.removeprefix(f"{uri}: "))] if problem else []


def writable_dir_problem(path: Path) -> str | None:
    """Why a directory cannot be created or written at ``path``, or None.

    An existing path must be a directory we can write; a missing one is created later, so its
    nearest existing ancestor must be such a directory. ``os.access`` answers EROFS for a
    read-only mount even for root, which ignores permission bits.
    """
    path = Path(os.path.abspath(path))
    try:
        if path.exists() and not path.is_dir():
            return "exists and is not a directory (a file or a device)"
        probe = path
        while not probe.exists():
            probe = probe.parent
        if not probe.is_dir():
            return f"{probe} is a file, so nothing can be created under it"
    except OSError as exc:  # a name too long, a directory on the way that cannot be searched
        return f"cannot be looked up ({exc.strerror or exc})"
    if not os.access(probe, os.W_OK | os.X_OK):
        why = "a read-only filesystem" if _read_only(probe) else "no write permission"
        return f"{probe} is not writable ({why})"
    return None


def _export_dir_problem(path: Path) -> str | None:
    try:
        if path.is_dir() and any(path.iterdir()):
            return "exists and is not empty (an export never overwrites)"
    except OSError as exc:  # a name too long, a directory that cannot be listed
        return f"cannot be looked up ({exc.strerror or exc})"
    return writable_dir_problem(path)


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError as exc:
        return exc.errno == errno.EROFS


# --- memory -------------------------------------------------------------------------


def host_memory_bytes() -> int:
    """Physical memory of this machine."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _has_gpu_device_files() -> bool:
    """Whether this machine has an NVIDIA or AMD GPU driver's device files (torch.cuda serves both)."""
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd"))


def _memory_problems(spec: JobSpec) -> list[tuple[str, str]]:
    est = memory_estimate(spec)
    if est is None:
        return []
    out = []
    host = host_memory_bytes()
    if spec.resources.use_gpu:
        gpu = gpu_memory_bytes()
        if gpu is None:
            return []  # a driver without a GPU does not know the workers' machines
        if est.device > gpu:
            out.append(_too_big(spec, est.device, gpu, "GPU memory of this machine's GPU 0", est))
        if est.staging > host:
            out.append(_too_big(spec, est.staging, host, "RAM of this machine (checkpoint staging)", est))
    elif est.device + est.staging > host:
        out.append(_too_big(spec, est.device + est.staging, host, "RAM of this machine", est))
    return out


def gpu_memory_bytes() -> int | None:
    """Memory of GPU 0 of this machine, or None when it has none (checked without torch first)."""
    # The driver often has no GPU, and then the workers' devices are unknown here. Looking for
    # a GPU driver's device files first keeps `validate` torch-free on such a machine.
    if not _has_gpu_device_files():
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory


def _too_big(spec: JobSpec, need: int, limit: int, what: str, est: MemoryEstimate) -> tuple[str, str]:
    gib = 1 << 30
    return ("model.name", f"'{spec.model.name}' needs about {need / gib:.1f} GiB per rank "
                          f"(parameters {est.parameters / gib:.1f}, gradients {est.gradients / gib:.1f}, "
                          f"optimizer {est.optimizer / gib:.1f}, activations {est.activations / gib:.1f}, "
                          f"staging {est.staging / gib:.1f} GiB over {spec.world_size} ranks), more than the "
                          f"{limit / gib:.1f} GiB {what}; use more workers (resources.num_workers), GPUs, "
                          "training.activation_checkpointing, a smaller micro_batch_size or a smaller model")
