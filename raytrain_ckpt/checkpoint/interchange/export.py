"""Export a committed step as Hugging Face safetensors or a single ``torch.save`` file.

The export streams: one tensor at a time is read from the DCP checkpoint (DCP loads a single
key into a pre-allocated full-size tensor, in one process, without a process group), cast,
and written. Peak memory is about the largest tensor (twice, for the cast), whatever the model.

- ``hf``: ``model-0000i-of-0000N.safetensors`` sharded by size, ``model.safetensors.index.json``
  (``metadata.total_size``, ``weight_map``) and ``config.json``, tensors under the Hugging Face
  Llama names. The safetensors header is computed from the DCP metadata before any data is
  read, so each shard is written front to back, one tensor at a time.
- ``torch``: ``model.pt``, ``{fqn: tensor}`` as ``format_utils.dcp_to_torch_save`` gives for
  the ``model`` part; with the optimizer ``{"model": {...}, "optim": {...}}`` (the flattened,
  FQN-keyed optimizer state dict). ``torch.save`` needs every tensor at once, so the file is
  written in its zip format directly (``torch._C.PyTorchFileWriter``, what ``torch.save`` uses):
  the pickle refers to storages by record name and each storage record is written as its
  tensor is read.

The step is verified against its manifest first (checksums by default): a corrupt step is
refused, never exported. DCP's ``.metadata`` is read with the restricted unpickler of
``checkpoint/format/metadata.py``: nothing in the checkpoint is executed.

The output is written to ``<out>.tmp-<id>``, every file and the directory fsynced, and renamed
to ``<out>`` at the end (the parent fsynced): a directory named ``<out>`` is always a complete,
durable export.

Object stores: the step may be a URI (``s3://.../step-00000040``; read through fsspec with the
same verification and restricted unpickling), and so may ``out``: the export is then written to
a local temporary directory and uploaded, ``config.json`` / the index / ``model.pt`` last, so a
prefix holding that last file holds a complete export. The lease is then an object under the
job's root (see ``leases.py``). Whatever the storage, the step is checked against its manifest
again after the last tensor is read and before the export is put in place: a step deleted or
changed meanwhile fails the export, never produces a wrong one.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import resource
import shutil
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from raytrain_ckpt.checkpoint.errors import ConversionError, InvalidCheckpoint, NotOwnFile
from raytrain_ckpt.checkpoint.format.manifest import MANIFEST, Manifest
from raytrain_ckpt.checkpoint.format.metadata import SafeLoadPlanner, empty_safe_planner, safe_reader
from raytrain_ckpt.checkpoint.format.names import Location, parent_of, parse_entry, step_name
from raytrain_ckpt.common.locations import is_uri
from raytrain_ckpt.checkpoint.format.verify import Verify, verify_step
from raytrain_ckpt.checkpoint.interchange.formats import lazy_tensor, stream_torch_save
from raytrain_ckpt.checkpoint.interchange.hf_export import write_hf
from raytrain_ckpt.checkpoint.interchange.steps import named_as_given, resolve, resolve_step
from raytrain_ckpt.checkpoint.storage.backends import open_storage
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.checkpoint.storage.leases import FileLease
from raytrain_ckpt.checkpoint.storage.posix import fsync_dir
from raytrain_ckpt.common.events import headline
from raytrain_ckpt.models import describe_model
from raytrain_ckpt.models.config import LlamaConfig
from raytrain_ckpt.models.hf import hf_adapter
from raytrain_ckpt.spec import JobSpec

logger = logging.getLogger(__name__)

__all__ = ["DTYPES", "ExportResult", "check_outside_checkpoints", "export_checkpoint", "final_export", "parse_size", "peak_rss_bytes",
           "progress_bar"]

Format = Literal["hf", "torch"]
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class ExportResult:
    """What an export wrote and what it cost."""

    step: int
    out: Path | str
    """The export's directory, or its object-store prefix."""
    files: list[str]
    tensors: int
    bytes_written: int
    peak_tensor_bytes: int
    """Most bytes of tensor data held in process memory at once (a read tensor and its cast)."""
    max_rss_bytes: int
    """Peak resident set size of this process, the interpreter and torch included."""
    seconds: float
    source: Location
    """The step directory that was exported."""
    selected: str = ""
    """Why this step: the step given, the newest valid one, or the best by a metric."""


def peak_rss_bytes() -> int:
    """This process's peak RSS: ``VmHWM`` (reset by exec, unlike ``getrusage``'s ``ru_maxrss``,
    which a child started by a large parent inherits)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass  # not Linux: fall back to getrusage
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"64KiB"`` or a byte count -> bytes."""
    m = re.fullmatch(r"\s*([-+]?\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise ConversionError(f"--max-shard-size={text}: not a size; use e.g. 5GB, 500MB or a byte count")
    unit = (m.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    size = int(float(m.group(1)) * base**power)
    if size < 1:  # 0 would put every tensor in a file of its own
        raise ConversionError(f"--max-shard-size={text}: must be at least one byte; use e.g. 5GB or 500MB")
    return size


# --- reading one tensor at a time ----------------------------------------------------


class _Reader:
    """Reads single keys of a DCP checkpoint as full tensors, and tracks how much it holds."""

    def __init__(self, path: Location) -> None:
        self.path = path
        try:
            self.meta: Metadata = safe_reader(path).read_metadata()
        except InvalidCheckpoint as exc:
            raise ConversionError(f"{path} is not a valid committed checkpoint: {exc}") from None
        except OSError as exc:
            raise ConversionError(f"{path}/.metadata is unreadable ({exc}); the checkpoint is corrupt") from None
        self.held = 0
        self.peak = 0

    def tensor_keys(self, prefix: str) -> dict[str, TensorStorageMetadata]:
        return {k: v for k, v in self.meta.state_dict_metadata.items()
                if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)}

    def bytes_keys(self, prefix: str) -> list[str]:
        return [k for k, v in self.meta.state_dict_metadata.items()
                if k.startswith(prefix) and isinstance(v, BytesStorageMetadata)]

    def read(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full tensor ``key``, cast to ``dtype`` (None: as saved)."""
        md = self.tensor_keys(key)[key]
        out = torch.empty(md.size, dtype=md.properties.dtype)
        self._track(out.nbytes)
        self.load({key: out})
        if dtype is not None and dtype != out.dtype:
            cast = out.to(dtype)
            self._track(cast.nbytes)
            self.held -= out.nbytes
            out = cast
        return out

    def load(self, state: dict[str, Any]) -> None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # DCP warns that no process group is used: intended here
                dcp.load(state, storage_reader=safe_reader(self.path), planner=SafeLoadPlanner(),
                         no_dist=True)
        except Exception as exc:  # noqa: BLE001 - a shard that does not read back is a torn checkpoint
            raise ConversionError(f"{self.path}: reading {', '.join(list(state)[:3])} failed "
                              f"({type(exc).__name__}: {headline(str(exc))[:200]}); the checkpoint is torn "
                              "or corrupt; export another step") from None

    def release(self, t: torch.Tensor) -> None:
        self.held -= t.nbytes

    def _track(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)


def progress_bar(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not sys.stderr.isatty(), leave=False)


# --- torch -----------------------------------------------------------------------------


def _write_torch(reader: _Reader, tmp: Path, dtype: torch.dtype, with_optimizer: bool) -> tuple[int, int]:
    plan: list[tuple[str, str, torch.dtype | None]] = []

    def lazy(key: str, cast: torch.dtype | None) -> Any:
        md = reader.tensor_keys(key)[key]
        plan.append((str(len(plan)), key, cast))
        return lazy_tensor(plan[-1][0], cast or md.properties.dtype, tuple(md.size))

    model = {k.removeprefix("model."): lazy(k, dtype) for k in sorted(reader.tensor_keys("model."))}
    obj: dict[str, Any] = model
    if with_optimizer:
        # Optimizer moments stay in the dtype they were saved in: a cast would change the optimization.
        optim: dict[str, Any] = {k.removeprefix("optim."): lazy(k, None) for k in sorted(reader.tensor_keys("optim."))}
        optim.update(_bytes_entries(reader, "optim."))
        obj = {"model": model, "optim": optim}
    bar = progress_bar(len(plan), "export torch")

    def records() -> Iterator[tuple[str, torch.Tensor]]:
        for record, key, cast in plan:
            t = reader.read(key, cast)
            yield record, t
            reader.release(t)
            bar.update(1)

    stream_torch_save(tmp / "model.pt", obj, records())
    bar.close()
    return len(plan), (tmp / "model.pt").stat().st_size


def _bytes_entries(reader: _Reader, prefix: str) -> dict[str, Any]:
    """Non-tensor entries (e.g. ``param_groups.<fqn>.lr``) under ``prefix``, unprefixed."""
    keys = reader.bytes_keys(prefix)
    if not keys:
        return {}
    loaded: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(loaded, storage_reader=safe_reader(reader.path),
                 planner=empty_safe_planner(set(keys)), no_dist=True)
    return {k.removeprefix(prefix): v for k, v in _flatten(loaded).items() if k in keys}


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# --- the export ------------------------------------------------------------------------


@contextmanager
def _staged_output(out: Path) -> Iterator[Path]:
    """A temporary sibling of ``out`` renamed to ``out`` on success and removed on failure."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConversionError(f"--out {out} exists and is not empty; pass a new directory (an export never "
                          "overwrites files)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(tmp)  # every file in it was fsynced as it was written
    if out.exists():
        out.rmdir()  # empty, checked above
    os.rename(tmp, out)
    fsync_dir(out.parent)


def export_checkpoint(ckpt: Path, out: Path, fmt: Format = "hf", dtype: str = "bf16",
                      model_cfg: LlamaConfig | None = None, with_optimizer: bool = False,
                      max_shard_bytes: int = 5 * 10**9, verify: Verify = "checksum",
                      lease_root: Location | None = None, select: str | None = None) -> ExportResult:
    """Export one committed step, holding a lease on it against the job's retention.

    Args:
        ckpt: A step directory, or a job's checkpoint root (its newest valid step).
        out: Output directory; must not exist or be empty.
        fmt: ``hf`` or ``torch``.
        dtype: ``bf16``, ``fp16`` or ``fp32``: what the weights are cast to.
        model_cfg: The built-in Llama's shape (required for ``hf``: names and ``config.json``).
        with_optimizer: ``torch`` only: add the optimizer state.
        max_shard_bytes: ``hf`` only: size bound of one safetensors file.
        verify: How the step is checked before reading: ``checksum`` (default) or ``size``.
        lease_root: Where the lease goes (default: the step's parent, the job's checkpoint root; a
            directory or an object-store prefix).
        select: With a checkpoint root: ``latest`` (default), ``best`` (by the job's
            ``checkpoint.keep_best`` metric) or a step number.

    Raises:
        ConversionError: Bad arguments or a missing, invalid or torn checkpoint.
    """
    t0 = time.monotonic()
    if not is_uri(out):
        check_outside_checkpoints(Path(out), "--out")
    step_dir, manifest, why = resolve(ckpt, verify, select)
    if model_cfg is None and fmt == "hf" and manifest.model is not None:
        model_cfg = _manifest_model(manifest)
    _check_args(fmt, dtype, model_cfg, with_optimizer)
    args = (fmt, DTYPES[dtype], model_cfg, with_optimizer, max_shard_bytes, t0)
    lease = _take_lease(lease_root if lease_root is not None else parent_of(step_dir), manifest.step)
    try:
        result = _export_to(step_dir, manifest, out, args)
        result.selected = why
        return result
    finally:
        if lease is not None:
            lease.__exit__(None, None, None)


def check_outside_checkpoints(out: Path, flag: str) -> None:
    """An export or an import (``flag``: its option) is never written into a step directory
    (retention would delete it with the step, and the step would no longer be what its manifest
    lists) nor as a step-like entry of a checkpoint root (read as a torn save)."""
    p = named_as_given(out)
    for d in (p, *p.parents):
        if (d / MANIFEST).is_file() and parse_entry(d.name) is not None:
            raise ConversionError(f"{flag} {out} is inside the step directory {d}; pass a directory outside "
                                  "every checkpoint (a committed step is never changed)")
    if parse_entry(p.name) is not None and p.parent.is_dir() and CheckpointLayout(p.parent).entries():
        raise ConversionError(f"{flag} {out} would be a step entry of the checkpoint root {p.parent}; pass a "
                              "directory outside it, or another name")


def _take_lease(root: Location, step: int) -> FileLease | None:
    """A lease on ``step`` against the job's retention. An exporter that may read the root but not
    write to it (read-only credentials on an object store; a read-only mount or a directory of
    another user on a file system, e.g. an archived checkpoint; a full disk) exports without one
    (logged), protected only by the re-check of the step at the end (``_check_still_committed``)."""
    try:
        return FileLease(root, step).__enter__()
    except InvalidCheckpoint as exc:
        raise ConversionError(str(exc)) from None
    except NotOwnFile as exc:  # a link planted in the root: refused, never written through
        raise ConversionError(f"cannot lease step {step}: {exc}; remove it (the root's leases/ is a directory "
                              "this tool creates)") from None
    except OSError as exc:
        if not is_uri(root) and exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT):
            raise
        logger.warning("could not write an export lease under %s (%s); exporting without one: a step that "
                       "retention deletes meanwhile fails the export", root, exc)
        return None


_LAST = ("config.json", "model.safetensors.index.json", "model.pt")
"""Uploaded last: a prefix that holds one of these holds a complete export."""


def _export_to(step_dir: Location, manifest: Manifest, out: Location, args: tuple) -> ExportResult:
    """Export to a local directory, or through a local temporary directory to an object-store prefix."""
    if not is_uri(out):
        local = Path(out).expanduser().resolve()
        if args[0] == "torch" and local.suffix in _FILE_SUFFIXES:
            return _export_file(step_dir, manifest, local, args)
        return _export_leased(step_dir, manifest, local, *args)
    target = str(out).rstrip("/")
    storage = open_storage(target)
    if storage.listdir(target):
        raise ConversionError(f"--out {target} is not empty; pass a new prefix (an export never overwrites files)")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rtc-export-") as local:
        result = _export_leased(step_dir, manifest, Path(local) / "out", *args)
        for name in sorted(result.files, key=lambda n: n in _LAST):
            storage.put_file(Path(local) / "out" / name, storage.join(target, name))
    result.out = target
    return result


_FILE_SUFFIXES = (".pt", ".pth")
"""``--format torch --out NAME.pt``: the export is that file, not a directory holding ``model.pt``."""


def _export_file(step_dir: Location, manifest: Manifest, out: Path, args: tuple) -> ExportResult:
    """A ``torch`` export written as the file ``out``: exported into a hidden sibling directory,
    then linked into place (never over an existing file) and the directory removed."""
    if os.path.lexists(out):
        raise ConversionError(f"--out {out} exists; pass a new file name (an export never overwrites files)")
    staging = out.with_name(f".{out.name}.export-{uuid.uuid4().hex[:8]}")
    try:
        result = _export_leased(step_dir, manifest, staging, *args)
        try:
            os.link(staging / "model.pt", out)
        except FileExistsError:
            raise ConversionError(f"--out {out} was created meanwhile; pass a new file name") from None
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    result.out, result.files = out, [out.name]
    return result


def _check_still_committed(step_dir: Location) -> None:
    """The step is still committed and whole after every tensor was read: an export that raced a
    delete its lease did not stop (a lease judged stale) fails, it never writes a wrong model."""
    try:
        verify_step(step_dir, "size", open_storage(step_dir))
    except InvalidCheckpoint as exc:
        raise ConversionError(f"{step_dir} changed while it was being exported ({exc}); nothing was written; "
                              "export another step") from None


def _manifest_model(manifest: Manifest) -> LlamaConfig | None:
    """The built-in Llama shape the manifest records (None: a user factory model)."""
    model = manifest.model or {}
    try:
        return describe_model(model.get("name", ""), model.get("overrides") or {})
    except (ValueError, TypeError, OverflowError) as exc:  # data: any shape of field may be in it
        raise ConversionError(f"step {manifest.step}: the manifest's model {model} is not usable: {exc}; "
                              "pass the job spec with --spec") from None


def _check_args(fmt: str, dtype: str, model_cfg: LlamaConfig | None, with_optimizer: bool) -> None:
    if fmt not in ("hf", "torch"):
        raise ConversionError(f"--format={fmt}: use hf or torch")
    if dtype not in DTYPES:
        raise ConversionError(f"--dtype={dtype}: use one of {', '.join(DTYPES)}")
    if fmt == "hf" and model_cfg is None:
        raise ConversionError("--format hf needs the built-in Llama's shape, which this step's manifest does not "
                          "record (imported weights, or an older checkpoint): pass the job spec with --spec (a user "
                          "factory model has no Hugging Face mapping; use --format torch)")
    if fmt == "hf" and with_optimizer:
        raise ConversionError("--with-optimizer works with --format torch only (HF safetensors hold weights)")


def _export_leased(step_dir: Location, manifest: Manifest, out: Path, fmt: Format, dtype: torch.dtype,
                   model_cfg: LlamaConfig | None, with_optimizer: bool, max_shard: int,
                   t0: float) -> ExportResult:
    # Verified again under the lease: retention may have raced us before the lease was taken. A
    # deletion shows in the sizes; the checksums were read by resolve_step already.
    try:
        verify_step(step_dir, "size", open_storage(step_dir))
    except InvalidCheckpoint as exc:
        raise ConversionError(f"{step_dir} is not a valid committed checkpoint: {exc}") from None
    reader = _Reader(step_dir)
    if not reader.tensor_keys("model."):
        raise ConversionError(f"{step_dir} holds no model.* tensors; it is not a raytrain_ckpt checkpoint")
    if model_cfg is not None and model_cfg.n_layers > len(reader.tensor_keys("model.")):
        # a shape from a manifest (or a spec) is data: checked against the step before a model
        # of that shape is described tensor by tensor (n_layers 2^31 would never finish)
        raise ConversionError(f"the model's n_layers={model_cfg.n_layers} cannot be this step's: it holds "
                              f"{len(reader.tensor_keys('model.'))} model tensors; pass the spec the job ran with "
                              "(--spec, --set)")
    with _staged_output(out) as tmp:
        if fmt == "hf":
            assert model_cfg is not None
            n, nbytes = write_hf(reader, tmp, hf_adapter(model_cfg), dtype, max_shard, progress_bar)
        else:
            n, nbytes = _write_torch(reader, tmp, dtype, with_optimizer)
        files = sorted(p.name for p in tmp.iterdir())
        _check_still_committed(step_dir)  # before the export is renamed into place (or uploaded)
    rss = peak_rss_bytes()
    result = ExportResult(manifest.step, out, files, n, nbytes, reader.peak, rss, time.monotonic() - t0, step_dir)
    logger.info("exported step %d (%s, %d tensors, %.1f MB) to %s in %.2fs; peak tensor memory %.1f MB, "
                "max RSS %.0f MB", result.step, fmt, n, nbytes / 1e6, out, result.seconds, reader.peak / 1e6,
                rss / 1e6)
    return result


def _final_out(configured: Path | str | None, root: Location, step: int) -> Location:
    """``final_export.dir``, or ``<root>/export-step-N`` (a URI under a URI root)."""
    if configured is not None:
        return configured if is_uri(configured) else Path(configured).expanduser()
    name = f"export-{step_name(step)}"
    return f"{root}/{name}" if is_uri(root) else Path(root) / name


def final_export(spec: JobSpec, root: Location) -> Location | None:
    """``checkpoint.final_export``: export the newest committed step under ``root`` once (driver side).

    A failure is logged with the command that retries it; the trained checkpoint stays as it is.
    """
    fe = spec.checkpoint.final_export
    if fe is None:
        return None
    try:
        step_dir, manifest = resolve_step(root)
        out = _final_out(fe.dir, root, manifest.step)
        storage = open_storage(out)
        if storage.is_file(storage.join(out, "model.pt" if fe.format == "torch" else "config.json")):
            logger.info("final export: %s already holds an export; not exporting again", out)
            return out
        result = export_checkpoint(step_dir, out, fe.format, fe.dtype, describe_model(spec.model.name,
                                   spec.model.overrides) if fe.format == "hf" else None)
    except (ConversionError, OSError) as exc:
        logger.error("final export failed: %s; retry with: raytrain-ckpt export <step dir> --format %s --dtype %s "
                     "--out DIR", exc, fe.format, fe.dtype)
        return None
    return result.out
