"""Where checkpoint bytes live: a local (POSIX) directory or an object store, behind one protocol.

``open_storage(root, options)`` picks the implementation from the root's spelling:

- a path or ``file://...``: ``PosixStorage``: rename is atomic, files and directories are
  fsynced. The commit protocol built on it is "write a temporary directory, rename it".
- ``s3://``, ``gs://`` and ``memory://`` (the schemes a job spec accepts; the commands read
  any fsspec protocol): ``ObjectStorage``. An
  object store has no rename and no directories (a "directory" is a key prefix), but a PUT is
  atomic and durable once it returns. The commit protocol built on it is "write the objects in
  place, the manifest last". Filesystem packages are optional extras: a missing one is a
  ``StorageUnavailable`` naming the extra (``pip install raytrain-ckpt[s3]``).

This module only moves bytes. What a valid step is, and the order of writes that commits one,
belong to ``layout.py``, which uses this protocol for every access.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import posixpath
import random
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

from raytrain_ckpt.checkpoint.format.manifest import _ALGORITHMS, Checksum, checksum_file

logger = logging.getLogger(__name__)

__all__ = ["EXTRAS", "Location", "NotOwnFile", "ObjectStorage", "PosixStorage", "Storage", "StorageUnavailable",
           "checksummed_upload", "home_problem", "open_own_file", "replace_file",
           "is_transient", "is_uri", "job_root", "local_path", "object_filesystem", "object_store_problem", "open_storage",
           "parent_of", "retry_transient"]

Location = Path | str
"""A path under a storage: a ``Path`` on POSIX storage, a URI string on an object store."""


class NotOwnFile(OSError):
    """A name under a checkpoint root that this code writes is a symbolic link, another name of
    a file (a hard link: a shard, a user's file) or not a regular file: it is never written
    through, whoever planted it."""


def open_own_file(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags)`` for a file under a checkpoint root that this code creates or
    rewrites in place (locks, a manifest put back): never through a link planted at the name.
    Raises NotOwnFile for a symbolic link, a file with more than one name, or not a regular file."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotOwnFile(errno.ELOOP, "a symbolic link, which is never written through", str(path)) from None
        raise
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_nlink <= 1:
        return fd
    os.close(fd)
    what = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"a file with {st.st_nlink} names (hard links)"
    raise NotOwnFile(errno.EPERM, f"{what}, which is never written through", str(path))


def replace_file(path: Path, data: bytes, durable: bool = False) -> None:
    """Replace ``path`` with a file holding ``data``, whole: written under a new name of its own
    (created exclusively, so no planted link is followed) and renamed over ``path`` (a link at
    ``path`` is replaced, not followed). ``durable``: fsync the file before the rename."""
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:12]}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk: created, not written; leave nothing behind
        tmp.unlink(missing_ok=True)
        raise

EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
"""URI scheme -> the pip extra that installs its filesystem (``raytrain-ckpt[s3]``)."""

_READ_CHUNK = 8 << 20
_T = TypeVar("_T")


class StorageUnavailable(ValueError):
    """A checkpoint URI whose filesystem cannot be used here (package missing, unknown scheme)."""


def is_uri(root: str | os.PathLike) -> bool:
    """True for ``<scheme>://...`` other than ``file://`` (a local path in URI spelling)."""
    text = os.fspath(root)
    return "://" in text and not text.startswith("file://")


def parent_of(path: Location) -> Location:
    """The directory holding ``path`` (a step's checkpoint root): the URI's prefix for a URI."""
    return str(path).rstrip("/").rsplit("/", 1)[0] if isinstance(path, str) else path.parent


def home_problem(path: str | os.PathLike) -> str | None:
    """Why a leading ``~`` or ``~user`` of a local path cannot be expanded, as the line a user reads;
    None when it can (pathlib raises a RuntimeError deep in whatever expands it)."""
    local = Path(os.fspath(path))
    try:
        local.expanduser()
    except RuntimeError:
        first = local.parts[0]
        why = ("cannot be expanded (no HOME, and no home for this user id)" if first == "~"
               else "names no user of this machine")
        return f"{first} {why}; write the path out in full"
    return None


def local_path(root: str | os.PathLike) -> Path:
    """A local root as a Path (``file://`` stripped, ``~`` expanded)."""
    text = os.fspath(root)
    return Path(text.removeprefix("file://")).expanduser()


def job_root(base: str | os.PathLike, job: str) -> Location:
    """``<checkpoint.dir>/<job>``: an absolute Path for a local base, a URI string otherwise."""
    if is_uri(base):
        return f"{os.fspath(base).rstrip('/')}/{job}"
    return local_path(base).resolve() / job


class Storage(Protocol):
    """Byte access under a checkpoint root; ``layout.py`` builds the commit protocols on it."""

    atomic_rename: bool
    """True: a directory rename is atomic (POSIX; layout.py renames and fsyncs itself). False: no
    rename; layout.py commits by writing the manifest last."""

    def join(self, base: Location, *names: str) -> Location: ...
    def name(self, path: Location) -> str: ...
    def listdir(self, path: Location) -> list[str]: ...
    def is_dir(self, path: Location) -> bool: ...
    def is_file(self, path: Location) -> bool: ...
    def size(self, path: Location) -> int | None: ...
    def read_bytes(self, path: Location) -> bytes: ...
    def write_bytes(self, path: Location, data: bytes) -> None: ...
    def open_read(self, path: Location) -> IO[bytes]: ...
    def makedirs(self, path: Location) -> None: ...
    def remove_tree(self, path: Location) -> None: ...
    def remove_file(self, path: Location) -> None: ...
    def copy_file(self, src: Location, dst: Location) -> None: ...
    def put_file(self, local: Path, dst: Location) -> None: ...
    def checksum(self, path: Location, algorithm: Checksum,
                 progress: Callable[[int], None] | None = None) -> int: ...
    def snapshot(self, path: Location) -> frozenset[tuple[str, int, str]]: ...


def open_storage(root: str | os.PathLike, options: dict[str, Any] | None = None) -> Storage:
    """The storage a checkpoint root lives on; raises StorageUnavailable for an unusable URI."""
    if not is_uri(root):
        return PosixStorage()
    return ObjectStorage(os.fspath(root), options or {})


# --- POSIX ----------------------------------------------------------------------------


class PosixStorage:
    """A local or shared-mount directory: atomic rename, fsync for durability."""

    atomic_rename = True

    def join(self, base: Location, *names: str) -> Path:
        return Path(base).joinpath(*names)

    def name(self, path: Location) -> str:
        return Path(path).name

    def listdir(self, path: Location) -> list[str]:
        p = Path(path)
        return sorted(c.name for c in p.iterdir()) if p.is_dir() else []

    def is_dir(self, path: Location) -> bool:
        return Path(path).is_dir()

    def is_file(self, path: Location) -> bool:
        """A regular file, not a symlink: a step holds only files its save wrote."""
        p = Path(path)
        return p.is_file() and not p.is_symlink()

    def size(self, path: Location) -> int | None:
        return Path(path).stat().st_size if self.is_file(path) else None

    def read_bytes(self, path: Location) -> bytes:
        return Path(path).read_bytes()

    def write_bytes(self, path: Location, data: bytes) -> None:
        """Write and fsync the file (the caller fsyncs its directory when the name must be durable);
        never through a link planted at the name (``open_own_file``)."""
        fd = open_own_file(Path(path), os.O_WRONLY | os.O_CREAT)
        with os.fdopen(fd, "wb") as f:
            f.truncate(0)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def open_read(self, path: Location) -> IO[bytes]:
        return open(path, "rb")

    def makedirs(self, path: Location) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)

    def remove_tree(self, path: Location) -> None:
        shutil.rmtree(path, ignore_errors=True)

    def remove_file(self, path: Location) -> None:
        Path(path).unlink(missing_ok=True)

    def copy_file(self, src: Location, dst: Location) -> None:
        shutil.copyfile(src, dst)

    def put_file(self, local: Path, dst: Location) -> None:
        self.makedirs(Path(dst).parent)
        shutil.copyfile(local, dst)

    def checksum(self, path: Location, algorithm: Checksum, progress: Callable[[int], None] | None = None) -> int:
        return checksum_file(Path(path), algorithm, progress)

    def snapshot(self, path: Location) -> frozenset[tuple[str, int, str]]:
        """(name, size, mtime) of every file under ``path``: compared with a later snapshot, it
        tells whether anything is still writing there (the mtime is only compared with itself)."""
        out = set()
        for f in Path(path).rglob("*"):
            try:
                st = f.lstat()
            except FileNotFoundError:
                continue  # removed while listing
            out.add((str(f.relative_to(path)), st.st_size, str(st.st_mtime_ns)))
        return frozenset(out)


# --- object stores ----------------------------------------------------------------------


def object_filesystem(uri: str, options: dict[str, Any]) -> Any:
    """The fsspec filesystem of ``uri`` with ``options``, shared with other users of the same
    options in this process (fsspec's instance cache: its connections stay open between saves)."""
    return _filesystem(uri, options)


def _filesystem(uri: str, options: dict[str, Any]) -> Any:
    """The fsspec filesystem of ``uri``; raises StorageUnavailable naming the extra to install."""
    scheme = uri.split("://", 1)[0]
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

    atomic_rename = False

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

    def size(self, path: Location) -> int | None:
        try:
            info = self.fs.info(str(path), refresh=True) if self.scheme in ("s3", "s3a") else self.fs.info(str(path))
        except (FileNotFoundError, OSError):
            return None
        return int(info["size"]) if info.get("type") == "file" else None

    def read_bytes(self, path: Location) -> bytes:
        return self.fs.cat_file(str(path))

    def write_bytes(self, path: Location, data: bytes) -> None:
        """One PUT: the object appears whole or not at all, durable once this returns."""
        retry_transient(lambda: self.fs.pipe_file(str(path), data), f"write {path}")

    def open_read(self, path: Location) -> IO[bytes]:
        return self.fs.open(str(path), "rb")

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


# --- transient errors -----------------------------------------------------------------

RETRIES = 5
"""Attempts of one object-store operation on a transient error, beyond the client's own retries."""
BACKOFF_S = 0.2
"""First backoff; doubles each retry, with jitter."""
_TRANSIENT_WORDS = ("SlowDown", "reduce your request rate", "Throttl", "ServiceUnavailable", "InternalError", "RequestTimeout", "503", "500",
                    "502", "504", "reset", "Connection", "timed out", "Timeout")


_TRANSIENT_ERRNOS = (errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE)
"""s3fs translates SlowDown to EBUSY; the others are dropped or stalled connections."""


def is_transient(exc: BaseException) -> bool:
    """Errors worth retrying: server errors, throttling, dropped connections, timeouts (the
    exception or what caused it: fsspec wraps the client's errors)."""
    if isinstance(exc, (FileNotFoundError, PermissionError, StorageUnavailable)):
        return False
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return True
        if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
            return True
        text = f"{type(exc).__name__} {exc}"
        if any(word in text for word in _TRANSIENT_WORDS):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def retry_transient(fn: Callable[[], _T], what: str, on_retry: Callable[[BaseException], None] | None = None,
                    retries: int = RETRIES, backoff_s: float = BACKOFF_S,
                    transient: Callable[[BaseException], bool] = is_transient) -> _T:
    """``fn()``, retried with exponential backoff while it fails with a ``transient`` error."""
    for attempt in range(retries + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt == retries or not transient(exc):
                raise
            delay = backoff_s * (2 ** attempt) * (0.5 + random.random())
            logger.warning("%s: transient error (%s), retry %d/%d in %.2fs", what, exc, attempt + 1, retries, delay)
            if on_retry is not None:
                on_retry(exc)
            time.sleep(delay)
    raise AssertionError("unreachable")


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
