"""Reading DCP checkpoints without running anything they contain.

DCP's ``.metadata`` is a pickle, and DCP loads non-tensor entries (``BytesStorageMetadata``:
optimizer hyper-parameters, the step, Python RNG state) with ``torch.load(weights_only=False)``.
Unpickling is code execution, and a checkpoint directory is data: anyone who can write to it
would otherwise run code in every process that resumes, exports or inspects it.

- ``.metadata`` goes through ``SafeUnpickler``, which resolves only the globals a DCP metadata
  file needs (the ``torch.distributed.checkpoint`` metadata dataclasses, ``torch.Size``, torch
  dtypes and layouts, paths, builtin containers; the list is in ``unpickling.py``) and refuses
  any other with ``UnsafeCheckpoint`` naming it. ``SafeFileSystemReader`` is DCP's
  ``FileSystemReader`` with that unpickler and ``SafeFsspecReader`` DCP's ``FsspecReader``
  (object stores) with it; every load in this project uses one of them (``safe_reader`` picks
  by location).
- Non-tensor entries go through ``torch.load(weights_only=True)`` (``SafeLoadPlanner``), whose
  restricted unpickler allows tensors and primitive containers only.
- Every one of these pickles is first pre-scanned for the work it would do (``prescan.py``: shared
  references, nesting, size), so that no file runs forever or allocates without bound either.
"""

from __future__ import annotations

import io
import pickle

from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.futures import Future
from torch.distributed.checkpoint._traverse import set_element

from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint, UnsafeCheckpoint

from raytrain_ckpt.checkpoint.format.chunks import layout_problem
from raytrain_ckpt.checkpoint.format.manifest import MANIFEST, Manifest
from raytrain_ckpt.common.locations import is_uri
from raytrain_ckpt.checkpoint.format.prescan import check_torch_save
from raytrain_ckpt.checkpoint.format.tensorblob import FileSlice, load_chunk
from raytrain_ckpt.checkpoint.format.verify import MAX_MANIFEST_BYTES
from raytrain_ckpt.checkpoint.format.unpickling import (allowed_global, check_data_files, checked_pickle, refusal,
                                                        resolve_builtin, unpickle)
from raytrain_ckpt.common.events import headline

__all__ = ["SafeFileSystemReader", "SafeFsspecReader", "SafeLoadPlanner", "SafeUnpickler", "empty_safe_planner",
           "read_metadata", "safe_reader"]


class SafeUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals DCP metadata is made of."""

    def find_class(self, module: str, name: str) -> Any:
        if allowed_global(module, name):
            return resolve_builtin(module, name, super().find_class)
        raise refusal(module, name)


def load_metadata(stream: IO[bytes], where: str) -> Metadata:
    """Unpickle DCP metadata from ``stream`` with ``SafeUnpickler``, pre-scanned for the work it
    would do (``prescan.py``); raises InvalidCheckpoint."""
    metadata = unpickle(SafeUnpickler(checked_pickle(stream, where)), where)
    if not isinstance(metadata, Metadata):
        raise InvalidCheckpoint(f"{where} holds a {type(metadata).__name__}, not DCP Metadata")
    check_data_files(metadata.storage_data, where)  # DCP joins these to the step directory and reads them
    return metadata


def read_metadata(step_dir: Path) -> Metadata:
    """The DCP metadata of a step directory, read safely."""
    path = Path(step_dir) / ".metadata"
    try:
        with open(path, "rb") as f:
            return load_metadata(f, str(path))
    except OSError as exc:
        raise InvalidCheckpoint(f"{path} is unreadable ({exc})") from None


class _SafeMetadata:
    """``read_metadata`` that never runs code from the file, for DCP's file system readers."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # Same file choice as the base class (a rank-local ``__<rank>.metadata`` where DCP asks for one).
        locate = getattr(self, "_get_metadata_path", None)
        path = locate(kwargs.get("rank")) if locate is not None else self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f, str(path))
        self._check_listed(metadata, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _check_listed(self, metadata: Metadata, where: str) -> None:
        """Every file the metadata makes DCP read is one the step's manifest lists, as the check
        before loading found (``unpickling.check_metadata_stream``): said again here, on the objects
        loading built, so that no difference between the two parsers lets unchecked bytes in; and
        every tensor is tiled exactly by its chunks, whose bytes lie inside those files
        (``chunks.layout_problem``), before loading allocates a tensor for them."""
        manifest_path = self.fs.concat_path(self.path, MANIFEST)
        sizes = None
        if self.fs.exists(manifest_path):  # (a step without a manifest is refused before any load)
            with self.fs.create_stream(manifest_path, "rb") as f:
                text = f.read(MAX_MANIFEST_BYTES + 1)
            if len(text) > MAX_MANIFEST_BYTES:
                raise InvalidCheckpoint(f"{manifest_path} is over {MAX_MANIFEST_BYTES >> 20} MiB, more than any "
                                        "manifest holds")
            manifest = Manifest.from_json(text.decode("utf-8", errors="replace"))
            sizes = {name: entry.size for name, entry in manifest.files.items()}
            check_data_files(metadata.storage_data, where, set(sizes))
        problem = layout_problem(metadata, sizes)
        if problem is not None:
            raise InvalidCheckpoint(f"{where}: {problem}")

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's ``read_data``, each tensor chunk parsed by ``tensorblob`` instead of ``torch.load``
        (no unpickler runs over a chunk's opcodes); bytes entries go to ``planner.load_bytes``."""
        per_file: dict[str, list[ReadItem]] = {}
        for read_item in plan.items:
            per_file.setdefault(self.storage_data[read_item.storage_index].relative_path, []).append(read_item)
        for relative_path, reqs in per_file.items():
            where = self.fs.concat_path(self.path, relative_path)
            with self.fs.create_stream(where, "rb") as stream:
                for req in reqs:
                    self._read_item(stream, req, planner, f"{where} (chunk of {req.storage_index.fqn})")
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_item(self, stream: IO[bytes], req: ReadItem, planner: LoadPlanner, where: str) -> None:
        item_md = self.storage_data[req.storage_index]
        if item_md.transform_descriptors:
            raw: IO[bytes] = io.BytesIO(self.transforms.transform_load_stream(
                req, item_md.transform_descriptors, self._slice_file(stream, item_md)).read(-1))
        else:
            raw = FileSlice(stream, item_md.offset, item_md.length)
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(raw.read(-1)))
            return
        tensor = load_chunk(raw, where)
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise InvalidCheckpoint(f"{where} holds a chunk of {list(tensor.size())}, the metadata says "
                                    f"{list(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)


class SafeFileSystemReader(_SafeMetadata, FileSystemReader):
    """DCP's ``FileSystemReader`` whose ``read_metadata`` never runs code from the file."""


class SafeFsspecReader(_SafeMetadata, FsspecReader):
    """DCP's ``FsspecReader`` (s3://, gs://, ...) whose ``read_metadata`` never runs code from the file."""


def safe_reader(path: str | Path, storage_options: dict[str, Any] | None = None) -> FileSystemReader:
    """The safe DCP reader of a step directory: local path or object-store URI."""
    if is_uri(path):
        return SafeFsspecReader(str(path), **(storage_options or {}))
    return SafeFileSystemReader(str(path))


def _load_bytes_safely(planner: DefaultLoadPlanner, read_item: ReadItem, value: io.BytesIO) -> None:
    # DefaultLoadPlanner.load_bytes with weights_only=True: tensors and primitive containers only,
    # once the pickle's work is known to be bounded (torch's restricted unpickler bounds nothing).
    check_torch_save(value, f"entry {read_item.dest_index.fqn}")
    try:
        obj = torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpoint(f"entry {read_item.dest_index.fqn} is not plain data, refused: "
                               f"{headline(str(exc))[:200]}") from None
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[read_item.dest_index.fqn], obj)
    else:
        planner.state_dict[read_item.dest_index.fqn] = obj


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor entries without running code."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _load_bytes_safely(self, read_item, value)


class _SafeEmptyStateDictLoadPlanner(_EmptyStateDictLoadPlanner):
    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        _load_bytes_safely(self, read_item, value)


def empty_safe_planner(keys: set[str]) -> DefaultLoadPlanner:
    """A planner that rebuilds ``keys`` from the metadata alone (no pre-allocated state dict), safely."""
    return _SafeEmptyStateDictLoadPlanner(keys=keys)
