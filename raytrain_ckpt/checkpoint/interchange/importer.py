"""Import pretrained weights (a ``torch.save`` file or an HF safetensors directory) as a committed step.

``import FILE --to DIR`` writes ``DIR/step-00000000/``: a DCP checkpoint holding only
``model.<fqn>`` tensors, with a manifest, committed atomically like any saved step. ``DIR`` may
be an object-store URI (``s3://bucket/prefix``): DCP writes to a local temporary directory, the
files are uploaded into ``step-00000000/`` and the manifest is written last, the object-store
commit protocol of ``layout.py``. A job
resumes from it with ``checkpoint.resume: DIR/step-00000000`` (or by importing into
``<checkpoint.dir>/<job name>`` and resuming ``latest``); it loads the model only and starts
at step 0 with a fresh optimizer (see ``checkpoint/recovery/state.py``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from raytrain_ckpt.checkpoint.interchange.export import check_outside_checkpoints, progress_bar
from raytrain_ckpt.checkpoint.errors import ConversionError, InvalidCheckpoint, StorageUnavailable
from raytrain_ckpt.checkpoint.format.manifest import Manifest, describe_file
from raytrain_ckpt.checkpoint.format.names import Location
from raytrain_ckpt.checkpoint.format.prescan import check_torch_save
from raytrain_ckpt.data.suffixes import not_regular, open_regular
from raytrain_ckpt.common.locations import is_uri
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.models.hf import HFAdapter, hf_adapter
from raytrain_ckpt.common.events import headline

logger = logging.getLogger(__name__)

__all__ = ["ImportResult", "import_checkpoint"]


@dataclass
class ImportResult:
    """The committed step an import wrote."""

    path: Location
    """The committed step: a directory, or an object-store prefix."""
    tensors: int
    bytes: int
    seconds: float


def _read_torch(path: Path) -> dict[str, torch.Tensor]:
    try:
        with open_regular(path) as f:  # a FIFO or a device is refused, never read (it would block)
            check_torch_save(f, str(path))  # the work its pickle asks for is bounded, before torch reads it
    except InvalidCheckpoint as exc:
        raise ConversionError(f"{path}: not a readable torch.save file: {str(exc).removeprefix(str(path)).strip()}; "
                              "pass a model state_dict saved by torch.save") from None
    except ValueError as exc:
        raise ConversionError(f"{exc}; pass a model state_dict saved by torch.save") from None
    except OSError as exc:
        raise ConversionError(f"{path}: unreadable ({exc})") from None
    try:
        # mmap: the tensors stay file-backed until DCP writes them, whatever the file's size.
        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's input problem
        raise ConversionError(f"{path}: not a readable torch.save file ({type(exc).__name__}: "
                          f"{headline(str(exc))[:200]})") from None
    if isinstance(obj, dict) and isinstance(obj.get("model"), dict):
        obj = obj["model"]  # an export made --with-optimizer: the optimizer is not imported
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ConversionError(f"{path}: expected a dict of parameter name -> tensor (a model state_dict), "
                          f"got {type(obj).__name__}")
    for name, t in obj.items():
        # A view's shape is data: an expanded (broadcast) tensor declares more elements than the
        # bytes behind it, and saving it would write every one of them (600,000x the file).
        if t.numel() * t.element_size() > t.untyped_storage().nbytes():
            raise ConversionError(f"{path}: {str(name)[:200]} declares {list(t.shape)} ({t.numel() * t.element_size()} "
                                  f"bytes) over {t.untyped_storage().nbytes()} bytes of data (a broadcast or "
                                  "expanded view); save it with .contiguous() or .clone() first")
    return obj


def _read_safetensors(path: Path, adapter: HFAdapter) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConversionError(f"{path}: no *.safetensors files in it; pass an HF model directory or a torch.save file")
    for f in files:  # before any is read: a FIFO would block the import, a device read forever
        problem = not_regular(f)
        if problem is not None:
            raise ConversionError(f"{f} {problem}; remove it from the directory, or import a copy without it")
    out: dict[str, torch.Tensor] = {}
    source: dict[str, tuple[Path, str]] = {}  # our name -> the file and the name there that defined it
    bar = progress_bar(0, "import hf")
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                bar.total = (bar.total or 0) + len(st.keys())
                for name in st.keys():
                    ours = adapter.our_name(name)
                    if ours in source:
                        raise ConversionError(_defined_twice(ours, source[ours], (f, name)))
                    source[ours] = (f, name)
                    out[ours] = st.get_tensor(name)
                    bar.update(1)
        except (SafetensorError, OSError) as exc:
            raise ConversionError(f"{f}: not a readable safetensors file ({exc})") from None
    bar.close()
    return out


def _defined_twice(ours: str, first: tuple[Path, str], second: tuple[Path, str]) -> str:
    """One tensor in two places: which one is meant is not ours to guess (the later would win)."""
    (f1, n1), (f2, n2) = first, second
    names = f"{n1!r}" if n1 == n2 else f"{n1!r} and {n2!r}"
    return (f"{str(ours)[:200]} is defined twice: by {f1.name} and by {f2.name} (as {names[:400]}) in {f1.parent}; "
            "remove the stale file (an HF directory holds each tensor once), or import a copy without it")


def import_checkpoint(src: Path, to: Location) -> ImportResult:
    """Write the weights in ``src`` as the committed step 0 under ``to`` (a directory or a URI).

    Raises:
        ConversionError: A missing or unreadable source, an unusable URI, or ``to`` already holds a step 0.
    """
    t0 = time.monotonic()
    src = Path(src).expanduser().resolve()
    to = str(to).rstrip("/") if is_uri(to) else Path(to).expanduser().resolve()
    if not is_uri(to):
        check_outside_checkpoints(Path(to), "--to")  # a committed step is never written into
    if not src.exists():
        raise ConversionError(f"{src}: no such file or directory; pass a torch.save file or an HF safetensors directory")
    try:
        layout = CheckpointLayout(to)
    except StorageUnavailable as exc:
        raise ConversionError(str(exc)) from None
    if layout.is_committed_name(0):  # an object store's step-00000000/ without a manifest is a leftover, replaced
        raise ConversionError(f"--to {to} already holds {layout.storage.name(layout.step_dir(0))}; pass another "
                              "directory (a checkpoint is never overwritten)")
    model = _read_safetensors(src, hf_adapter()) if src.is_dir() else _read_torch(src)
    origin = hashlib.sha256(str(src).encode()).hexdigest()[:8]
    tmp: Location | None = None
    try:
        if layout.protocol.local_tmp:
            tmp = Path(layout.new_tmp_dir(0))
            files = _save(model, tmp)
        else:
            with tempfile.TemporaryDirectory(prefix="rtc-import-") as local:
                files = _save(model, Path(local))
                tmp = layout.new_tmp_dir(0)  # step-00000000/ itself; nothing is committed before the manifest
                for name in sorted(files):
                    layout.storage.put_file(Path(local) / name, layout.storage.join(tmp, name))
        manifest = Manifest(step=0, world_size=1, dp_size=1, spec_hash=f"import-{origin}", files=files)
        final = layout.commit(tmp, manifest)
    except BaseException:
        # a failed import (a full disk) leaves nothing: a partial step-00000000/ on an object store
        # would refuse the next import into the same place
        if tmp is not None and not layout.is_committed_name(0):
            with contextlib.suppress(Exception):
                layout.storage.remove_tree(tmp)
        raise
    result = ImportResult(final, len(model), sum(t.nbytes for t in model.values()), time.monotonic() - t0)
    logger.info("imported %d tensors (%.1f MB) from %s as %s in %.2fs", result.tensors, result.bytes / 1e6, src,
                final, result.seconds)
    return result


def _save(model: dict[str, torch.Tensor], directory: Path) -> dict[str, dict[str, int]]:
    """``model`` as a DCP checkpoint in ``directory`` (fsynced); the manifest entries of its files."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group is used: intended here
        dcp.save({"model": model}, storage_writer=FileSystemWriter(str(directory), sync_files=True), no_dist=True)
    return {p.name: describe_file(p) for p in directory.iterdir() if p.is_file()}
