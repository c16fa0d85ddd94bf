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
import importlib.util
import logging
import os
import stat
from pathlib import Path

from raytrain_ckpt.spec.job import JobSpec
from raytrain_ckpt.spec.loading import parse_spec, read_spec
from raytrain_ckpt.spec.memory import MemoryEstimate, memory_estimate
from raytrain_ckpt.spec.sections import RESUME_VALUES, SpecError, is_ascii_digits, results_dir
from raytrain_ckpt.common.locations import mask_uri

logger = logging.getLogger(__name__)

__all__ = [
    "check_environment",
    "environment_problems",
    "gpu_memory_bytes",
    "host_memory_bytes",
    "load_spec",
    "persistent_paths",
    "protection_line",
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
    spec = persistent_paths(parse_spec(raw, base_dir))
    check_environment(spec)
    return spec


_SUBMITTED_JOB = "RAY_JOB_CONFIG_JSON_ENV_VAR"
"""Set by Ray's job supervisor for a submitted job's entrypoint (ray._private.runtime_env.constants)."""


def in_ray_package_dir(cwd: str | None = None, environ: dict[str, str] | None = None) -> bool:
    """Whether relative paths here land in a directory Ray made up for this job: the entrypoint of
    ``ray job submit`` (its working directory is a copy of the code under Ray's
    ``runtime_resources/.../_ray_pkg_<hash>``, a new one whenever the code changes, removed with
    the session), or any process working inside such a copy."""
    env = os.environ if environ is None else environ
    parts = Path(cwd if cwd is not None else os.getcwd()).parts
    return _SUBMITTED_JOB in env or "runtime_resources" in parts or any(p.startswith("_ray_pkg_") for p in parts)


def persistent_paths(spec: JobSpec, cwd: str | None = None, environ: dict[str, str] | None = None) -> JobSpec:
    """``spec`` whose relative checkpoint.dir and final_export.dir are under the results base
    (``$RAYTRAIN_CKPT_RESULTS``, else ``~/raytrain_results``) when the working directory is Ray's
    temporary package directory (``in_ray_package_dir``); ``spec`` itself otherwise.

    Resolved rather than refused: the job files' ``dir: checkpoints`` then means the same place
    at every submit, so a second submit after a code change resumes instead of starting over in a
    new, empty package directory. Logged, so the user sees where the steps go.
    """
    ckpt = spec.checkpoint
    moved: dict[str, Path | str] = {}
    for name, value in (("dir", ckpt.dir), ("final_export.dir", ckpt.final_export and ckpt.final_export.dir)):
        if isinstance(value, Path) and not value.expanduser().is_absolute():
            base = results_dir()
            moved[name] = f"{base}/{value.as_posix()}" if isinstance(base, str) else base / value
    if not moved or not in_ray_package_dir(cwd, environ):
        return spec
    for name, value in moved.items():
        logger.info("checkpoint.%s is relative and this is a submitted Ray job, whose working directory is a "
                    "temporary copy of the code: using %s (set RAYTRAIN_CKPT_RESULTS or an absolute path to "
                    "choose another place)", name, value)
    export = ckpt.final_export
    if export is not None and "final_export.dir" in moved:
        export = export.model_copy(update={"dir": moved["final_export.dir"]})
    update = {"final_export": export, **({"dir": moved["dir"]} if "dir" in moved else {})}
    return spec.model_copy(update={"checkpoint": ckpt.model_copy(update=update)})


def protection_line(spec: JobSpec) -> str:
    """One line for the start of a job: the failures it recovers from, and what it is not
    protected against (each with the setting that decides it)."""
    ckpt, ft = spec.checkpoint, spec.fault_tolerance
    window = f"within {ft.failure_window_s:g} s" if ft.failure_window_s is not None else "in the whole job"
    gaps: list[str] = []
    if ft.max_restarts == 0:
        gaps.append("any worker failure ends the job (fault_tolerance.max_restarts=0)")
    else:
        gaps.append(f"more than {ft.max_restarts} failures {window} (fault_tolerance.max_restarts, failure_window_s)")
        gaps += [f"{kind} failures, not in fault_tolerance.retry_on" for kind in ("crash", "exception", "hang", "start")
                 if kind not in ft.retry_on]
    if not ckpt.enabled:
        gaps.append("losing progress: no checkpoints, a restart begins at step 0 (checkpoint.enabled=false)")
    elif ckpt.interval_steps is None and ckpt.interval_seconds is None:
        gaps.append("losing progress before the final save (no checkpoint.interval_steps or interval_seconds)")
    if ckpt.enabled:
        gaps.append(f"the loss of the storage under checkpoint.dir={mask_uri(str(ckpt.dir))}")
    gaps.append("a failure of this driver process (running the same command again "
                + ("resumes from the newest checkpoint)" if ckpt.enabled else "starts over)"))
    saves = (f"checkpoints every {ckpt.interval_steps} steps" if isinstance(ckpt.interval_steps, int)
             else "checkpoints at an auto interval" if ckpt.interval_steps == "auto" else "checkpoints")
    recovers = (f"restarts up to {ft.max_restarts} times {window}" if ft.max_restarts else "no restarts")
    recovers += f", {saves}" if ckpt.enabled else ", no checkpoints"
    return f"fault tolerance: {recovers}; not protected against: {'; '.join(gaps)}"


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
    if spec.parallelism.dp_replicate > 1 and importlib.util.find_spec("torchft") is None:
        out.append(("parallelism.dp_replicate", f"{spec.parallelism.dp_replicate} needs torchft, which is not "
                    "installed; pip install -e \".[replicas]\" (or torchft), or set dp_replicate=1"))
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
    problem = _existing_dir_problem(path)
    virtual = _virtual_fs(path) if problem is None else None
    if virtual is not None:  # (root passes the access checks on /proc itself)
        return f"is under {virtual}, a view of the kernel's state that holds no files"
    return problem


def _existing_dir_problem(path: Path) -> str | None:
    """``writable_dir_problem`` of the nearest existing directory at or above ``path``."""
    probe = path
    while True:
        try:  # os.stat, not Path.exists: exists() answers False for a symlink loop, which mkdir then fails on
            st = os.stat(probe)
            break
        except (FileNotFoundError, NotADirectoryError):  # (a file on the way: found when the walk reaches it)
            probe = probe.parent
        except OSError as exc:  # a symlink loop, a name too long, a directory on the way that cannot be searched
            return f"cannot be looked up ({exc.strerror or exc}{': a symbolic link loop' if exc.errno == errno.ELOOP else ''})"
    if not stat.S_ISDIR(st.st_mode):
        if probe == path:
            return "exists and is not a directory (a file or a device)"
        return f"{probe} is a file, so nothing can be created under it"
    if not os.access(probe, os.W_OK | os.X_OK):
        why = "a read-only filesystem" if _read_only(probe) else "no write permission"
        return f"{probe} is not writable ({why})"
    return None


_VIRTUAL_ROOTS = (Path("/proc"), Path("/sys"), Path("/dev"))
_DEV_SHM = Path("/dev/shm")  # (a tmpfs: real files, e.g. a one-node job's checkpoints in RAM)


def _virtual_fs(path: Path) -> Path | None:
    """The kernel's pseudo file system ``path`` lies under (/proc, /sys, /dev but /dev/shm), links
    resolved, or None."""
    real = Path(os.path.realpath(path))
    for top in _VIRTUAL_ROOTS:
        if (real == top or top in real.parents) and not (real == _DEV_SHM or _DEV_SHM in real.parents):
            return top
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
