"""Where checkpoint bytes live: a local (POSIX) directory or an object store, behind one protocol.

``open_storage(root, options)`` picks the implementation from the root's spelling:

- a path or ``file://...``: ``PosixStorage`` (``posix.py``): rename is atomic, files and
  directories are fsynced.
- ``s3://``, ``gs://`` and ``memory://`` (``STORE_SCHEMES``: the schemes a job spec accepts
  and the commands read; any other is refused by name): ``ObjectStorage`` (``objects.py``): no
  rename, no directories, but a PUT is atomic and durable once it returns.

This module only moves bytes. What a valid step is belongs to ``format``; the order of writes
that commits one (rename, or manifest last) to ``commit.py``, chosen from the same spelling.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Protocol

from raytrain_ckpt.checkpoint.format.names import Location

from raytrain_ckpt.common.locations import is_uri
from raytrain_ckpt.checkpoint.format.verify import StepFiles
from raytrain_ckpt.checkpoint.storage.objects import ObjectStorage
from raytrain_ckpt.checkpoint.storage.posix import PosixStorage

__all__ = ["Storage", "job_root", "local_path", "open_storage"]


def local_path(root: str | os.PathLike) -> Path:
    """A local root as a Path (``file://`` stripped, ``~`` expanded)."""
    text = os.fspath(root)
    return Path(text.removeprefix("file://")).expanduser()


def job_root(base: str | os.PathLike, job: str) -> Location:
    """``<checkpoint.dir>/<job>``: an absolute Path for a local base, a URI string otherwise."""
    if is_uri(base):
        return f"{os.fspath(base).rstrip('/')}/{job}"
    return local_path(base).resolve() / job


class Storage(StepFiles, Protocol):
    """Byte access under a checkpoint root: what verification reads (``StepFiles``), and the
    writes, moves and listings ``commit.py`` and ``layout.py`` build the commit protocols on."""

    def listdir(self, path: Location) -> list[str]: ...
    def read_at_most(self, path: Location, n: int) -> bytes: ...
    def write_bytes(self, path: Location, data: bytes) -> None: ...
    def makedirs(self, path: Location) -> None: ...
    def remove_tree(self, path: Location) -> None: ...
    def remove_file(self, path: Location) -> None: ...
    def copy_file(self, src: Location, dst: Location) -> None: ...
    def put_file(self, local: Path, dst: Location) -> None: ...
    def snapshot(self, path: Location) -> frozenset[tuple[str, int, str]]: ...


def open_storage(root: str | os.PathLike, options: dict[str, Any] | None = None) -> Storage:
    """The storage a checkpoint root lives on; raises StorageUnavailable for an unusable URI."""
    if not is_uri(root):
        return PosixStorage()
    return ObjectStorage(os.fspath(root), options or {})
