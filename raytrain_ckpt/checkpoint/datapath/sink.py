"""Where a rank's staged bytes go: the ``ShardSink`` protocol and its three sinks.

The node writer hands every save to one sink, picked once from the checkpoint root
(``pick_sink``); the sink writes the rank's DCP shard files of a plan under the step's
temporary directory and returns what it wrote (``RankFiles``: DCP's write results, each file's
size and CRC-32C as the bytes went out), checked, durable on return:

* ``LocalFileSink``: a local (POSIX) directory, one pass from the staging buffer, ``O_DIRECT``,
  fsynced (``localfile.py``).
* ``MultipartUploadSink``: S3, parts in parallel from the staging buffer (``upload.py``).
* ``FsspecSink``: any other object store, through DCP's fsspec writer, checksummed as it
  streams (``storage/dcp.py``'s ``UploadingWriter``).

The object-store sinks upload the whole rank again on a transient error (the staging buffer is
intact). Changing where staged bytes go means changing this module and the one that does the
writing; the writer only runs the sink it was given.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult

from raytrain_ckpt.checkpoint.datapath.filewrite import RankFiles, WriteProgress
from raytrain_ckpt.checkpoint.datapath.localfile import write_rank_files
from raytrain_ckpt.checkpoint.errors import StagingAborted
from raytrain_ckpt.checkpoint.datapath.upload import is_s3, upload_rank_files
from raytrain_ckpt.common.locations import is_uri
from raytrain_ckpt.checkpoint.storage.objects import object_filesystem
from raytrain_ckpt.checkpoint.storage.retries import is_transient, retry_transient
from raytrain_ckpt.checkpoint.storage.dcp import UploadingWriter

__all__ = ["FsspecSink", "LocalFileSink", "MultipartUploadSink", "ShardSink", "check_written", "pick_sink"]


class ShardSink(Protocol):
    """Where one rank's shard files of a step are written."""

    fault_point: str | None
    """The named fault point (``raytrain_ckpt.common.faults``) right after a write to this sink is
    durable and recorded, before it is reported (None: none)."""

    def write(self, dest: str, plan: SavePlan, planner: SavePlanner, rank: int, step: int,
              on_retry: Callable[[], None], progress: WriteProgress | None = None) -> RankFiles:
        """Write the items of ``plan`` (rank ``rank``'s central plan of ``step``), resolved by
        ``planner``, under ``dest``; checked (``check_written``) and durable on return.
        ``on_retry``: called before the rank is written again after a transient error.
        ``progress``: advanced as bytes go out (DCP's fsspec writer does not: it stays still)."""
        ...


def pick_sink(root: str, options: dict[str, Any], threads: int) -> ShardSink:
    """The sink for a checkpoint root: a local directory, S3, or another fsspec store."""
    if not is_uri(root):
        return LocalFileSink(threads)
    if is_s3(object_filesystem(root, options)):
        return MultipartUploadSink(options, threads)
    return FsspecSink(options, threads)


def check_written(plan: SavePlan, results: list[WriteResult], sizes: dict[str, int]) -> None:
    """Raise OSError unless every planned write has a result whose bytes are all in its file.

    DCP's I/O threads other than the caller's drop their exceptions (ENOSPC, EIO): what they
    failed to write is then missing from ``results`` and its file is short. The local writer
    (``filewrite``) raises instead; this check stays as the last line before a report. Without this check
    the short file's real size and CRC-32 would go into the manifest of a step that cannot load.
    ``sizes``: file name -> bytes on disk, for the files of this rank.
    """
    missing = {item.index for item in plan.items} - {r.index for r in results}
    if missing or len(results) != len(plan.items):
        raise OSError(f"{len(missing)} of {len(plan.items)} planned writes have no result ({len(results)} results): "
                      "an I/O thread failed (disk full? I/O error? see the writer's log)")
    for r in results:
        where = r.storage_data
        size, end = sizes.get(where.relative_path, -1), where.offset + where.length
        if size < end:
            raise OSError(f"{where.relative_path}: {size} bytes on disk, the write of {r.index.fqn} ends at {end}")


class LocalFileSink:
    """A local directory: the one-pass writer, fsynced (``localfile.write_rank_files``)."""

    fault_point = None

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def write(self, dest: str, plan: SavePlan, planner: SavePlanner, rank: int, step: int,
              on_retry: Callable[[], None], progress: WriteProgress | None = None) -> RankFiles:
        tmp = Path(dest)
        written = write_rank_files(tmp, plan, planner.resolve_data, self.threads, progress)
        check_written(plan, written.results, {p.name: p.stat().st_size for p in tmp.iterdir()})
        return written


class _ObjectStoreSink:
    """An object store: the rank is uploaded again, whole, on a transient error."""

    fault_point = "uploaded"

    def __init__(self, options: dict[str, Any], threads: int) -> None:
        self.options, self.threads = options, threads

    def write(self, dest: str, plan: SavePlan, planner: SavePlanner, rank: int, step: int,
              on_retry: Callable[[], None], progress: WriteProgress | None = None) -> RankFiles:
        return retry_transient(lambda: self._write_checked(dest, plan, planner, rank, progress),
                               f"upload of rank {rank} step {step}", on_retry=lambda exc: on_retry(),
                               transient=_retryable)

    def _write_checked(self, dest: str, plan: SavePlan, planner: SavePlanner, rank: int,
                       progress: WriteProgress | None) -> RankFiles:
        written = self._write_once(dest, plan, planner, rank, progress)
        check_written(plan, written.results, {name: f["size"] for name, f in written.files.items()})
        prefix = plan.storage_data.prefix
        written.files = {n: f for n, f in written.files.items() if n.startswith(prefix)}
        return written

    def _write_once(self, dest: str, plan: SavePlan, planner: SavePlanner, rank: int,
                    progress: WriteProgress | None) -> RankFiles:
        raise NotImplementedError


class MultipartUploadSink(_ObjectStoreSink):
    """S3: parts in parallel from the staging buffer (``upload.upload_rank_files``)."""

    def _write_once(self, dest: str, plan: SavePlan, planner: SavePlanner, rank: int,
                    progress: WriteProgress | None) -> RankFiles:
        fs = object_filesystem(dest, self.options)
        return upload_rank_files(fs, dest, plan, planner.resolve_data, self.threads, progress=progress)


class FsspecSink(_ObjectStoreSink):
    """Another fsspec store: DCP's writer, each file checksummed as it streams (``UploadingWriter``)."""

    def _write_once(self, dest: str, plan: SavePlan, planner: SavePlanner, rank: int,
                    progress: WriteProgress | None) -> RankFiles:
        writer = UploadingWriter(dest, self.options, self.threads)
        writer.set_up_storage_writer(False, rank=rank)
        return RankFiles(results=writer.write_data(plan, planner).wait(), files=writer.files, sums=None)


def _retryable(exc: BaseException) -> bool:
    """Upload errors worth another try: transient ones, and a write that an I/O thread dropped
    (DCP loses those threads' exceptions, so check_written's OSError may hide a transient one)."""
    if isinstance(exc, (FileNotFoundError, PermissionError, StagingAborted)):
        return False
    return is_transient(exc) or isinstance(exc, OSError)
