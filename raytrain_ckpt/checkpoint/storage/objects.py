"""Object stores (``s3://``, ``gs://``, ``memory://``) through fsspec: ``ObjectStorage``, the
filesystem a URI needs, the reachability probe, and uploads that checksum what they stream.

An object store has no rename and no directories (a "directory" is a key prefix), but a PUT is
atomic and durable once it returns; the commit protocol built on it (``commit.py``) writes the
objects in place and the manifest last. Filesystem packages are optional extras: a missing one
is a ``StorageUnavailable`` naming the extra (``pip install raytrain-ckpt[s3]``).
"""

from __future__ import annotations

import io
import logging
import posixpath
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from raytrain_ckpt.checkpoint.errors import StorageUnavailable
from raytrain_ckpt.checkpoint.format.manifest import _ALGORITHMS, Checksum
from raytrain_ckpt.checkpoint.format.names import Location
from raytrain_ckpt.checkpoint.storage.retries import retry_transient
from raytrain_ckpt.common.locations import STORE_SCHEMES

logger = logging.getLogger(__name__)

__all__ = ["EXTRAS", "ObjectStorage", "checksummed_upload", "object_filesystem", "object_store_problem"]

EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
"""URI scheme -> the pip extra that installs its filesystem (``raytrain-ckpt[s3]``)."""

_READ_CHUNK = 8 << 20


def object_filesystem(uri: str, options: dict[str, Any]) -> Any:
    """The fsspec filesystem of ``uri`` with ``options``, shared with other users of the same
    options in this process (fsspec's instance cache: its connections stay open between saves)."""
    return _filesystem(uri, options)


def _filesystem(uri: str, options: dict[str, Any]) -> Any:
    """The fsspec filesystem of ``uri``; raises StorageUnavailable naming the extra to install, or
    the scheme when it is none of ``STORE_SCHEMES`` (fsspec's others, ftp:// or http://, are not
    stores a checkpoint lives on, and some print a traceback when made without their host)."""
    scheme = uri.split("://", 1)[0]
    if scheme not in STORE_SCHEMES:
        raise StorageUnavailable(f"{uri}: unknown storage scheme {scheme}://; the supported ones are local paths, "
                                 "s3://bucket/prefix and gs://bucket/prefix")
    try:
        import fsspec

        return fsspec.filesystem(scheme, **options)
    except ImportError as exc:
        extra = EXTRAS.get(scheme)
        hint = f"pip install 'raytrain-ckpt[{extra}]'" if extra else "install the fsspec filesystem for it"
        raise StorageUnavailable(f"{uri}: the {scheme}:// filesystem is not installed ({exc}); {hint}") from None
    except ValueError as exc:
        raise StorageUnavailable(f"{uri}: unknown storage scheme {scheme}:// ({exc}); use a local path, "
                                 "s3://bucket/prefix or gs://bucket/prefix") from None
    except TypeError as exc:
        raise StorageUnavailable(f"checkpoint.storage_options: not accepted by the {scheme}:// filesystem ({exc})") \
            from None


PROBE_TIMEOUT_S = 20.0
"""How long ``object_store_problem`` waits for the store to answer one listing: an endpoint that
accepts connections and never replies would otherwise hold the client in its retries for minutes."""

_HINTS = {"s3": "check the endpoint (AWS_ENDPOINT_URL or checkpoint.storage_options endpoint_url) and the "
                "credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE)",
          "gs": "check the credentials (GOOGLE_APPLICATION_CREDENTIALS) and checkpoint.storage_options"}


def object_store_problem(root: str, options: dict[str, Any], timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the object store holding ``root`` cannot be used, in one line, or None when it answers.

    One listing of ``root`` (and of its bucket when ``root`` does not exist yet), given
    ``timeout_s`` to answer: a wrong endpoint, missing credentials, a bucket that does not exist
    or no permission to list fails here, before a job starts or a command reads anything.
    """
    outcome: list[BaseException | None] = []

    def probe() -> None:
        try:
            fs = ObjectStorage(root, options).fs
            try:
                fs.ls(root, detail=False, refresh=True)
            except FileNotFoundError:  # a new prefix: fine if the bucket exists
                fs.ls(root.split("://", 1)[0] + "://" + fs._strip_protocol(root).split("/", 1)[0],
                      detail=False, refresh=True)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller as the problem
            outcome.append(exc)

    # A daemon thread: a store that never answers must not keep the process alive at exit.
    thread = threading.Thread(target=probe, name="rtc-storage-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    hint = _HINTS.get(EXTRAS.get(root.split("://", 1)[0], ""), "check checkpoint.storage_options")
    if not outcome:
        return f"{root}: no answer from the object store within {timeout_s:.0f} s; {hint}"
    exc = outcome[0]
    if exc is None:
        return None
    if isinstance(exc, StorageUnavailable):
        return str(exc)
    if isinstance(exc, FileNotFoundError):
        return f"{root}: the bucket does not exist; create it or fix the URI"
    text = " ".join(str(exc).split())[:300]
    return f"{root}: cannot use the object store ({type(exc).__name__}: {text}); {hint}"


class ObjectStorage:
    """An object store through fsspec (s3fs, gcsfs, memory). Locations are full URIs.

    Listings are never cached: other processes (every node's writer) add objects under the
    same prefixes, and a stale listing would hide a committed step or a leftover.
    """


    def __init__(self, root: str, options: dict[str, Any]) -> None:
        self.scheme = root.split("://", 1)[0]
        self.options = dict(options)
        self.fs = _filesystem(root, {**self.options, "use_listings_cache": False, "skip_instance_cache": True})

    def join(self, base: Location, *names: str) -> str:
        return posixpath.join(str(base).rstrip("/"), *names)

    def name(self, path: Location) -> str:
        return posixpath.basename(str(path).rstrip("/"))

    def _uri(self, key: str) -> str:
        return key if "://" in key else f"{self.scheme}://{key.lstrip('/')}"

    def listdir(self, path: Location) -> list[str]:
        try:
            found = self.fs.ls(str(path), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        base = self.fs._strip_protocol(str(path)).rstrip("/")
        return sorted({posixpath.basename(p.rstrip("/")) for p in found
                       if self.fs._strip_protocol(p).rstrip("/") != base})

    def is_dir(self, path: Location) -> bool:
        return bool(self.listdir(path))

    def is_file(self, path: Location) -> bool:
        return self.size(path) is not None

    def _info(self, path: Location) -> dict[str, Any]:
        """The store's answer on the object ``path`` (never a cached one on S3)."""
        return self.fs.info(str(path), refresh=True) if self.scheme in ("s3", "s3a") else self.fs.info(str(path))

    def size(self, path: Location) -> int | None:
        try:
            info = self._info(path)
        except (FileNotFoundError, OSError):
            return None
        return int(info["size"]) if info.get("type") == "file" else None

    def surely_absent(self, path: Location) -> bool:
        """Whether the object ``path`` is known not to exist: the store answered "not found"
        (transient errors retried). Any other error raises: what decides a deletion must not take
        a failed request (a 500, a 503 past its retries) for an answer."""
        try:
            retry_transient(lambda: self._info(path), f"look up {path}")
        except FileNotFoundError:
            return True
        return False

    def read_bytes(self, path: Location) -> bytes:
        return self.fs.cat_file(str(path))

    def write_bytes(self, path: Location, data: bytes) -> None:
        """One PUT: the object appears whole or not at all, durable once this returns."""
        retry_transient(lambda: self.fs.pipe_file(str(path), data), f"write {path}")

    def open_read(self, path: Location) -> IO[bytes]:
        return self.fs.open(str(path), "rb")

    def read_at_most(self, path: Location, n: int) -> bytes:
        """The first ``n`` bytes of an object in one ranged GET: one version of it, never parts of
        two (a file object's HEAD then GET fails when a writer replaces the object in between)."""
        try:
            return self.fs.cat_file(str(path), start=0, end=n)
        except FileNotFoundError:
            raise
        except OSError:
            if self.size(path) == 0:  # no range of an empty object is satisfiable (416)
                return b""
            raise

    def makedirs(self, path: Location) -> None:
        """Nothing to create on an object store (prefixes exist through their objects)."""

    def remove_tree(self, path: Location) -> None:
        """Delete every object under ``path/`` (and nothing under a sibling such as ``path.x/``:
        some filesystems match a recursive delete by bare prefix)."""
        prefix = self.fs._strip_protocol(str(path)).rstrip("/") + "/"
        try:
            found = [p for p in self.fs.find(prefix) if self.fs._strip_protocol(p).startswith(prefix)]
        except FileNotFoundError:
            return  # already gone: removing is idempotent
        if found:
            retry_transient(lambda: self.fs.rm([self._uri(p) for p in found]), f"delete {path}")

    def remove_file(self, path: Location) -> None:
        try:
            self.fs.rm_file(str(path))
        except FileNotFoundError:
            pass  # already gone: removing is idempotent

    def copy_file(self, src: Location, dst: Location) -> None:
        """Server-side copy where the store has one."""
        retry_transient(lambda: self.fs.copy(str(src), str(dst)), f"copy {src}")

    def put_file(self, local: Path, dst: Location) -> None:
        """Upload a local file (multipart for a large one)."""
        retry_transient(lambda: self.fs.put_file(str(local), str(dst)), f"upload {dst}")

    def snapshot(self, path: Location) -> frozenset[tuple[str, int, str]]:
        """(key, size, last modified) of every object under ``path/``: compared with a later
        snapshot, it tells whether anything is still uploading there (the store's timestamps are
        only compared with themselves, never with a local clock)."""
        prefix = self.fs._strip_protocol(str(path)).rstrip("/") + "/"
        try:
            found = self.fs.find(prefix, detail=True)
        except FileNotFoundError:
            return frozenset()
        return frozenset((p, int(info.get("size") or 0), str(info.get("LastModified") or info.get("mtime")
                                                             or info.get("created") or ""))
                         for p, info in found.items() if self.fs._strip_protocol(p).startswith(prefix))

    def checksum(self, path: Location, algorithm: Checksum, progress: Callable[[int], None] | None = None) -> int:
        """Stream the object through the checksum (no local copy)."""
        update, value = _ALGORITHMS[algorithm], 0
        with self.fs.open(str(path), "rb", block_size=_READ_CHUNK) as f:
            while chunk := f.read(_READ_CHUNK):
                value = update(chunk, value)
                if progress is not None:
                    progress(len(chunk))
        return value


# --- streaming with checksums -----------------------------------------------------------


class ChecksumStream(io.RawIOBase):
    """A write-only stream that forwards to ``inner`` and keeps the size and CRC-32C of what passed."""

    def __init__(self, inner: IO[bytes]) -> None:
        super().__init__()
        self.inner = inner
        self.nbytes = 0
        self.crc = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.crc = _ALGORITHMS["crc32c"](view, self.crc)
        self.nbytes += view.nbytes
        self.inner.write(view)
        return view.nbytes

    def tell(self) -> int:
        return self.nbytes


@contextmanager
def checksummed_upload(fs: Any, path: str, record: Callable[[str, int, int], None]) -> Iterator[ChecksumStream]:
    """Open ``path`` for writing on ``fs``; on a clean close, ``record(name, size, crc32c)``.

    fsspec buffers one block (s3fs: a multipart part) at a time, so memory stays bounded; on
    an error the partial object is removed (an incomplete multipart upload is aborted).
    """
    inner = fs.open(path, "wb")
    stream = ChecksumStream(inner)
    try:
        yield stream
        inner.close()  # uploads the last part and completes the multipart upload
    except BaseException:
        _discard(fs, inner, path)
        raise
    record(posixpath.basename(path), stream.nbytes, stream.crc)


def _discard(fs: Any, inner: Any, path: str) -> None:
    # Best effort: the step never commits without this file, and leftovers are removed on start.
    try:
        if hasattr(inner, "discard"):
            inner.discard()
        inner.closed = True  # a close() now would complete the upload of a partial file
        fs.rm_file(path)
    except Exception as exc:  # noqa: BLE001 - see above
        logger.debug("could not remove partial upload %s: %s", path, exc)
