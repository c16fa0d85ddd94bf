"""DCP's storage writers for a checkpoint location: a local directory or an object store.

DCP already writes through fsspec (``FsspecWriter``); this module only picks the writer for a
location and, for the node writer's uploads, records each file's size and CRC-32C as its
bytes stream out, so an uploaded shard is never downloaded again to be checksummed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecWriter
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.planner import SavePlan

from raytrain_ckpt.checkpoint.format.names import Location

from raytrain_ckpt.common.locations import is_uri
from raytrain_ckpt.checkpoint.storage.objects import checksummed_upload

__all__ = ["UploadingWriter", "dcp_writer", "key_spread", "rank_prefix", "spread_names"]


def key_spread(rank: int) -> str:
    """Two hex digits, even over the ranks, that start rank ``rank``'s file names in an object
    store's step prefix (``spread_names``)."""
    return hashlib.sha1(str(rank).encode()).hexdigest()[:2]


def spread_names(plans: list[SavePlan]) -> list[SavePlan]:
    """``FileSystemWriter.prepare_global_plan``'s plans with each rank's file names starting with
    ``key_spread(rank)`` (``07__17_0.distcp`` for DCP's ``__17_0.distcp``): an object store
    partitions its keys by range, and DCP's names order the ranks by their leading digit (at 4096
    ranks, 1,111 ranks start ``__1``, 207 ``__4``); hashed, each of 16 first characters after the
    step's prefix takes about 1/16 of the save's requests. Still plain names in the step's
    directory: the commit and every reader (DCP's included, by ``.metadata``) take them as they are."""
    return [dataclasses.replace(p, storage_data=rank_prefix(i, p.storage_data, spread=True))
            for i, p in enumerate(plans)]


def rank_prefix(rank: int, storage_data: Any, spread: bool) -> Any:
    """Rank ``rank``'s central plan's ``storage_data``, as ``FileSystemWriter.prepare_global_plan``
    (a plan's own, else ``__<rank>_``) and then, on an object store, ``spread_names`` give it."""
    if spread:
        return _StoragePrefix(f"{key_spread(rank)}__{rank}_")
    return _StoragePrefix(f"__{rank}_") if storage_data is None else storage_data


def dcp_writer(path: Location, options: dict[str, Any] | None = None, threads: int = 1) -> FileSystemWriter:
    """A DCP writer into ``path``: fsynced files locally; one PUT / multipart upload per file on
    an object store (durable when it completes, so no fsync, which DCP would turn into os.sync())."""
    if not is_uri(path):
        return FileSystemWriter(path, thread_count=threads, sync_files=True)
    return FsspecWriter(str(path), thread_count=threads, sync_files=False, **(options or {}))


class _RecordingFileSystem(FileSystem):
    """DCP's fsspec filesystem whose written files record their size and CRC-32C."""

    def __init__(self, fs: Any, files: dict[str, dict[str, int]]) -> None:
        super().__init__()
        self.fs = fs
        self.files = files

    def _record(self, name: str, size: int, crc: int) -> None:
        self.files[name] = {"size": size, "crc32c": crc}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with checksummed_upload(self.fs, os.fspath(path), self._record) as stream:
            yield stream


class UploadingWriter(FsspecWriter):
    """DCP's ``FsspecWriter`` streaming each file to the store (s3fs: a multipart upload, one
    part buffered at a time); ``files`` maps each written file name to its size and CRC-32C."""

    def __init__(self, path: str, options: dict[str, Any] | None = None, threads: int = 1) -> None:
        super().__init__(path, thread_count=threads, sync_files=False, **(options or {}))
        self.files: dict[str, dict[str, int]] = {}
        self.fs = _RecordingFileSystem(self.fs.fs, self.files)
