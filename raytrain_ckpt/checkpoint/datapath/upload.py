"""Uploading one rank's DCP shard files to S3 straight from the staging buffer, parts in parallel.

DCP's ``FsspecWriter`` (``dcp_storage.UploadingWriter``, kept for the other object stores)
streams each file through an fsspec file: ``torch.save`` appends to a growing ``BytesIO``,
s3fs copies each 50 MiB block out of it and uploads it as one part while nothing else
happens, and botocore computes its own CRC-32 of the body in Python-sized chunks. Measured on
one rank of 256 MiB (moto in another process, an idle writer): 84 MiB/s, 2.4 CPU s/GB, about
200,000 page faults (every block a fresh allocation), 90% of the wall time waiting for one
part at a time.

Here the files are the same (``filewrite.write_files``: the same items, order, offsets and
``WriteResult``s as ``FileSystemWriter``), serialised by ``torch.save`` into a
``ChecksumSink`` whose chunks are copied into reusable part buffers (one copy, no page faults
after the first save), and each full part is sent with ``upload_part`` from a thread pool
while the next one fills: at most ``inflight`` parts per file in flight, so memory stays
bounded at ``inflight x part_size`` per file. Each part carries its CRC-32C
(``ChecksumCRC32C``, the algorithm the manifest uses), which S3 verifies on receipt, so
botocore computes no checksum of its own, and no SHA-256 of the payload either (``_Client``).
A file smaller than a part is one ``put_object``. A failure aborts the multipart upload (no
partial object is ever completed) and raises.

The parts go through botocore's synchronous client (``_Client``, built from the s3fs
filesystem's settings), not s3fs's aiobotocore event loop: ``http.client`` hands a part's
buffer to ``sendall`` as it is, where asyncio on Python 3.11 joins the headers and the body
into a new 16 MiB object and copies what the socket did not take into its own buffer (fresh
pages, faulted in on every part). Measured on one rank of 256 MiB against moto in another
process: 1.40-1.56 CPU s/GB through the event loop, 0.86-0.97 there without the payload's
SHA-256, 0.96-1.01 through the synchronous client with it, 0.50-0.56 without it.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from collections.abc import Iterator
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import crc32c as _crc32c
from torch.distributed.checkpoint.planner import SavePlan

from raytrain_ckpt.checkpoint.datapath.filewrite import (ChecksumSink, Phases, RankFiles, Resolve, WriteProgress,
                                                         write_files)

__all__ = ["INFLIGHT", "PART_SIZE", "is_s3", "upload_rank_files"]

PART_SIZE = 16 << 20
"""Bytes per multipart part (S3's minimum is 5 MiB, its maximum part count 10,000: 156 GiB a file).
Measured against moto (one rank of 256 MiB, 2 or 4 parts in flight): 8 and 16 MiB cost the same,
32 and 64 MiB cost the server 20-30% more CPU per byte and took 30% longer."""
INFLIGHT = 4
"""Parts of one file uploading at once; with PART_SIZE, the memory one file's upload holds."""
_KEEP_BUFFERS = 16
"""Part buffers kept for the next save (their pages stay allocated: a fresh one faults every page):
at most 256 MiB of the writer process, enough for three files uploading at once."""

_free: list[bytearray] = []
_free_lock = threading.Lock()


def is_s3(fs: Any) -> bool:
    """Whether ``fs`` is s3fs's filesystem (the one this module uploads through)."""
    return type(fs).__name__ == "S3FileSystem" and hasattr(fs, "_call_s3")


def upload_rank_files(fs: Any, directory: str, plan: SavePlan, resolve: Resolve, threads: int = 1,
                      part_size: int = PART_SIZE, inflight: int = INFLIGHT,
                      progress: WriteProgress | None = None) -> RankFiles:
    """Upload the items of ``plan`` as DCP files under ``directory`` (``s3://bucket/prefix``) on ``fs``.

    The files, results and CRC-32C entries are those ``localfile.write_rank_files`` writes locally.
    """
    bucket, prefix, _ = fs.split_path(directory)

    def open_file(name: str, phases: Phases) -> Any:
        return _uploaded(_Upload(fs, bucket, f"{prefix.rstrip('/')}/{name}", part_size, inflight), phases)

    return write_files(plan, resolve, threads, open_file, progress)


@contextmanager
def _uploaded(upload: _Upload, phases: Phases) -> Iterator[ChecksumSink]:
    sink = _PartSink(upload, phases)
    try:
        yield sink
        t0 = time.perf_counter()
        upload.finish()
        phases.fsync_s += time.perf_counter() - t0  # the last parts and the completion: what makes it durable
    except BaseException:
        upload.abort()
        raise


class _PartSink(ChecksumSink):
    """Copies the bytes into part buffers; a full buffer is uploaded while the next fills."""

    def __init__(self, upload: _Upload, phases: Phases) -> None:
        super().__init__(phases)
        self.upload = upload

    def _put(self, chunk: memoryview) -> None:
        while chunk.nbytes:
            chunk = self.upload.fill(chunk)


class _Upload:
    """One object written part by part: a multipart upload once a part is full, else one PUT."""

    def __init__(self, fs: Any, bucket: str, key: str, part_size: int, inflight: int) -> None:
        self.fs, self.bucket, self.key = fs, bucket, key
        self.part_size, self.inflight = part_size, max(1, inflight)
        self.upload_id: str | None = None
        self.buffer, self.filled = _take(part_size), 0
        self.sent: list[tuple[Future, bytearray, int, str]] = []
        """(future of upload_part, its buffer, part number, CRC-32C in base64), oldest first."""
        self.parts: list[dict[str, Any]] = []

    def fill(self, chunk: memoryview) -> memoryview:
        """Copy what fits of ``chunk`` into the current part; returns the rest."""
        n = min(chunk.nbytes, self.part_size - self.filled)
        self.buffer[self.filled:self.filled + n] = chunk[:n]
        self.filled += n
        if self.filled == self.part_size:
            self._send_part()
        return chunk[n:]

    def _send_part(self) -> None:
        if self.upload_id is None:
            created = self._call("create_multipart_upload", Bucket=self.bucket, Key=self.key,
                                 ChecksumAlgorithm="CRC32C")
            self.upload_id = created["UploadId"]
        while len(self.sent) >= self.inflight:
            self._collect_oldest()
        number = len(self.parts) + len(self.sent) + 1
        body = _body(self.buffer, self.filled)
        crc = _b64_crc32c(body)
        future = self._start("upload_part", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                             PartNumber=number, Body=body, ChecksumCRC32C=crc)
        self.sent.append((future, self.buffer, number, crc))
        self.buffer, self.filled = _take(self.part_size), 0

    def _collect_oldest(self) -> None:
        future, buffer, number, crc = self.sent.pop(0)
        try:
            result = future.result()
        finally:
            _give(buffer)
        self.parts.append({"PartNumber": number, "ETag": result["ETag"], "ChecksumCRC32C": crc})

    def finish(self) -> None:
        """Send what is left and complete the object."""
        try:
            if self.upload_id is None:
                body = _body(self.buffer, self.filled)
                self._call("put_object", Bucket=self.bucket, Key=self.key, Body=body, ChecksumCRC32C=_b64_crc32c(body))
                return
            if self.filled:
                self._send_part()
            while self.sent:
                self._collect_oldest()
            self._call("complete_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                       MultipartUpload={"Parts": self.parts})
        finally:
            _give(self.buffer)
            self.buffer = bytearray()

    def abort(self) -> None:
        """Wait for the parts in flight and abort the multipart upload (best effort: a step that
        failed never commits, and leftovers under its temporary prefix are removed on start)."""
        for future, buffer, _, _ in self.sent:
            try:
                future.result()
            except Exception:  # noqa: BLE001 - the upload is being abandoned; its first error is raised already
                pass
            _give(buffer)
        self.sent = []
        if self.upload_id is not None:
            try:
                self._call("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id)
            except Exception:  # noqa: BLE001 - see the docstring
                pass

    def _start(self, method: str, **kwargs: Any) -> Future:
        client = _client(self.fs)
        if client is None:  # a session injected into s3fs: only its own event loop can use it
            return asyncio.run_coroutine_threadsafe(self.fs._call_s3(method, **kwargs), self.fs.loop)
        return _calls().submit(client.call, method, kwargs)

    def _call(self, method: str, **kwargs: Any) -> Any:
        return self._start(method, **kwargs).result()


class _Client:
    """botocore's synchronous S3 client with an s3fs filesystem's settings, called from threads.

    What s3fs's ``set_session`` gives aiobotocore (credentials or the default chain and profile,
    endpoint, ``client_kwargs``, ``config_kwargs``, timeouts, anonymous access), plus its extra
    request arguments (``s3_additional_kwargs``, requester pays), and two settings of its own:
    a connection per thread, and no SHA-256 of the payload unless ``config_kwargs`` asks for it
    (every body this module sends carries its CRC-32C, which the store verifies; botocore skips
    the SHA-256 on https for the same reason, and signs the headers either way). Errors are
    translated as s3fs translates them (``FileNotFoundError``, ``PermissionError``, ``OSError``).
    """

    def __init__(self, fs: Any) -> None:
        import botocore.config
        import botocore.session
        from s3fs.utils import ParamKwargsHelper

        config = {"connect_timeout": fs.connect_timeout, "read_timeout": fs.read_timeout,
                  "max_pool_connections": _THREADS, **fs.config_kwargs}
        config["s3"] = {"payload_signing_enabled": False, **config.get("s3", {})}
        init = {"aws_access_key_id": fs.key, "aws_secret_access_key": fs.secret, "aws_session_token": fs.token,
                "endpoint_url": fs.endpoint_url, "use_ssl": fs.use_ssl}
        init = {k: v for k, v in init.items() if v is not None}
        if fs.anon:
            from botocore import UNSIGNED

            init = {k: v for k, v in init.items() if not k.startswith("aws_")}
            config["signature_version"] = UNSIGNED
        session = botocore.session.Session(profile=fs.kwargs.get("profile"))
        self.s3 = session.create_client("s3", config=botocore.config.Config(**config), **{**init, **fs.client_kwargs})
        self.extra = {**fs.s3_additional_kwargs, **fs.req_kw}
        self.params = ParamKwargsHelper(self.s3)

    def call(self, method: str, kwargs: dict[str, Any]) -> Any:
        from botocore.exceptions import ClientError
        from s3fs.errors import translate_boto_error

        try:
            return getattr(self.s3, method)(**self.params.filter_dict(method, {**self.extra, **kwargs}))
        except ClientError as exc:
            raise translate_boto_error(exc) from exc


_THREADS = _KEEP_BUFFERS
"""Threads (and connections) sending parts, shared by every upload of the process."""
_clients: weakref.WeakKeyDictionary[Any, _Client | None] = weakref.WeakKeyDictionary()
_clients_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _client(fs: Any) -> _Client | None:
    """The client for ``fs``, made once per filesystem (its connections stay open between saves);
    None when s3fs was given a session object of the caller's."""
    with _clients_lock:
        if fs not in _clients:
            own_session = getattr(fs, "_session_is_owned", True) and set(fs.kwargs) <= {"profile"}
            _clients[fs] = _Client(fs) if own_session else None
        return _clients[fs]


def _calls() -> ThreadPoolExecutor:
    global _pool
    with _clients_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="rtc-upload")
        return _pool


def _body(buffer: bytearray, filled: int) -> bytearray:
    """The part's bytes as botocore accepts them (bytes, bytearray or a file; not a memoryview):
    a full buffer as it is, the short last part copied."""
    return buffer if filled == len(buffer) else buffer[:filled]


def _b64_crc32c(data: bytearray) -> str:
    return base64.b64encode(_crc32c.crc32c(data).to_bytes(4, "big")).decode("ascii")


def _take(size: int) -> bytearray:
    with _free_lock:
        for i, buffer in enumerate(_free):
            if len(buffer) == size:
                return _free.pop(i)
    return bytearray(size)


def _give(buffer: bytearray) -> None:
    with _free_lock:
        if buffer and len(_free) < _KEEP_BUFFERS:
            _free.append(buffer)
