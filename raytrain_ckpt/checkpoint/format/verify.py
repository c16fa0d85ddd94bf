"""How a step is verified: the one place that decides whether a step directory may be loaded.

A step directory is valid only if ``manifest.json`` parses into a valid ``Manifest``, names
this step, and every file it lists is a regular file with the recorded size (and checksum when
verifying checksums; ``.metadata``, which is unpickled on load, is always checksummed and then
read with the restricted unpickler: a step whose metadata asks for code is invalid).

Every reader (the registry, resume, a restart from memory, export, ``status``/``ls``/``verify``)
calls ``verify_step`` or ``step_problems`` here, with the storage the step lives on: any
``StepFiles`` (the storage backends satisfy it), so this module needs nothing of ``storage``.
"""

from __future__ import annotations

import os
from contextlib import nullcontext
from collections import deque
from collections.abc import Callable, Generator, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Literal, Protocol

from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint, StepUnreadable

from raytrain_ckpt.checkpoint.format.manifest import Checksum, checksum_name, FileEntry, MANIFEST, Manifest
from raytrain_ckpt.checkpoint.format.names import Location, parse_entry
from raytrain_ckpt.checkpoint.format.tensorblob import CHUNK_PARSES
from raytrain_ckpt.checkpoint.format.prescan import read_bounded
from raytrain_ckpt.checkpoint.format.unpickling import MetadataChecks, check_metadata_stream

__all__ = ["MAX_MANIFEST_BYTES", "StepFiles", "Verify", "check_file", "metadata_problem", "read_manifest",
           "step_problems", "verify_step", "verify_steps"]

Verify = Literal["size", "checksum"]
"""How deep a step is verified: file sizes (cheap), or also every file's checksum (reads every byte)."""

MAX_MANIFEST_BYTES = 64 << 20
"""Largest manifest.json read: a manifest lists each file in about 80 bytes, so even 100,000 ranks
stay far below; a bigger file in a step directory is refused before it is read into memory."""

_VERIFY_THREADS = min(4, os.cpu_count() or 1)
"""Files of one step checksummed at once."""


class StepFiles(Protocol):
    """What verifying a step reads of the storage it lives on (``storage.backends.Storage`` has it all)."""

    def join(self, base: Location, *names: str) -> Location: ...
    def name(self, path: Location) -> str: ...
    def is_dir(self, path: Location) -> bool: ...
    def is_file(self, path: Location) -> bool: ...
    def size(self, path: Location) -> int | None: ...
    def read_bytes(self, path: Location) -> bytes: ...
    def open_read(self, path: Location) -> IO[bytes]: ...
    def checksum(self, path: Location, algorithm: Checksum,
                 progress: Callable[[int], None] | None = None) -> int: ...


def verify_step(path: Location, level: Verify, files: StepFiles) -> Manifest:
    """Check a step directory against its manifest; raises InvalidCheckpoint naming the first problem."""
    manifest = read_manifest(files, path)
    problem = next(_problems(files, path, manifest, level), None)
    if problem is not None:
        raise InvalidCheckpoint(f"{path}: {problem}")
    return manifest


def step_problems(path: Location, files: StepFiles, progress: Callable[[int], None] | None = None,
                  level: Verify = "checksum") -> list[str]:
    """Every problem of a step directory against its manifest; [] means valid."""
    try:
        manifest = read_manifest(files, path)
    except InvalidCheckpoint as exc:
        return [str(exc)]
    return list(_problems(files, path, manifest, level, progress))


def metadata_problem(files: StepFiles, path: Location, manifest: Manifest) -> str | None:
    """The problem loading would find in a step's ``.metadata`` against ``manifest``'s file sizes
    (the check ``verify_step`` ends with at the ``size`` level, whose pass is remembered by content),
    or None. Not the files' sizes or checksums: the caller knows them."""
    return next(_metadata_problems(files, path, {n: e.size for n, e in manifest.files.items()}, False), None)


def read_manifest(files: StepFiles, path: Location) -> Manifest:
    """The validated manifest of a step directory; raises InvalidCheckpoint."""
    mpath = files.join(path, MANIFEST)
    if not files.is_file(mpath):
        if not files.is_dir(path):
            raise InvalidCheckpoint(f"{path} is not a directory")
        raise InvalidCheckpoint(f"{path} has no {MANIFEST} (never committed)")
    size = files.size(mpath)
    if size is not None and size > MAX_MANIFEST_BYTES:  # data, not trusted: never read a huge file whole
        raise InvalidCheckpoint(f"{mpath} is {size} bytes, more than any manifest holds "
                                f"({MAX_MANIFEST_BYTES >> 20} MiB); it is not one this project wrote")
    try:
        text = files.read_bytes(mpath).decode("utf-8")
        return Manifest.from_json(text)
    except PermissionError as exc:
        raise StepUnreadable(f"{mpath}: {exc.strerror}; fix its permissions or run as a user who can read "
                             "the checkpoint") from None
    except (InvalidCheckpoint, OSError, UnicodeDecodeError) as exc:
        raise InvalidCheckpoint(f"{mpath} is unreadable: {exc}") from None


def _problems(files: StepFiles, path: Location, manifest: Manifest, level: Verify = "checksum",
              progress: Callable[[int], None] | None = None) -> Iterator[str]:
    """Every problem of a step directory against its manifest, lazily (stop at the first to fail fast)."""
    intact = yield from _file_problems(files, path, manifest, level, progress)
    if intact and ".metadata" in manifest.files:
        yield from _metadata_problems(files, path, {n: e.size for n, e in manifest.files.items()}, level == "checksum")


def _file_problems(files: StepFiles, path: Location, manifest: Manifest, level: Verify,
                   progress: Callable[[int], None] | None = None,
                   pool: ThreadPoolExecutor | None = None) -> Generator[str, None, bool]:
    """The problems of a step's name and files (all but what ``.metadata`` holds); returns
    whether every listed file is intact. A checksum-level check runs on ``pool`` (one of its own
    when None: ``verify_steps`` passes one for all its steps, each step's threads no longer
    started and joined)."""
    name = files.name(path)
    entry = parse_entry(name)
    if entry is None or not entry.kind.is_loadable or entry.step != manifest.step:
        yield f"{name} holds the manifest of step {manifest.step} (not its committed step-N name)"
    if ".metadata" not in manifest.files:
        yield "the manifest lists no .metadata"
    intact = True
    items = sorted(manifest.files.items())
    if level != "checksum" or len(items) < 2:  # sizes (and one CRC of .metadata): no threads to start
        checks: Iterator[str | None] = (check_file(files, files.join(path, n), e, level == "checksum" or
                                                   n == ".metadata", progress) for n, e in items)
        for problem in checks:
            if problem is not None:
                intact = False
                yield problem
        return intact
    # Files are checked on a few threads (CRC-32C releases the GIL), results in manifest order.
    own = pool is None
    if pool is None:
        pool = ThreadPoolExecutor(max_workers=min(_VERIFY_THREADS, len(items) or 1))
    checks = None
    try:
        checks = pool.map(lambda item: check_file(files, files.join(path, item[0]), item[1], True, progress), items)
        for problem in checks:
            if problem is not None:
                intact = False
                yield problem
    finally:
        if own:
            pool.shutdown(wait=True, cancel_futures=True)
        elif checks is not None:  # stopped at a problem: this step's checks not begun are dropped
            checks.close()
    return intact


def verify_steps(paths: list[Location], level: Verify, files: StepFiles,
                 progress: Callable[[int], None] | None = None) -> list[Manifest | InvalidCheckpoint]:
    """``verify_step`` of many step directories: per step its manifest, or the InvalidCheckpoint
    naming its first problem. The ``.metadata`` checks go to the reader processes in groups
    (``unpickling.MetadataChecks``), two groups at a time, while the next steps' files are checked
    here."""
    out: list[Manifest | InvalidCheckpoint | None] = [None] * len(paths)
    group: list[tuple[int, Manifest, bytes]] = []
    sent: deque[tuple[list[tuple[int, Manifest, bytes]], MetadataChecks]] = deque()
    # one pool for every step's checksum reads (CRC-32C releases the GIL); not started per step
    with ThreadPoolExecutor(max_workers=_VERIFY_THREADS) if level == "checksum" else nullcontext() as pool:
        size = 0
        for i, path in enumerate(paths):
            if progress is not None:
                progress(1)
            try:
                manifest = read_manifest(files, path)
            except InvalidCheckpoint as exc:
                out[i] = exc
                continue
            checks = _file_problems(files, path, manifest, level, pool=pool)
            problem = next(checks, None)
            checks.close()
            if problem is None:
                data, problem = _metadata_bytes(files, path)
            if problem is not None:
                out[i] = InvalidCheckpoint(f"{path}: {problem}")
                continue
            group.append((i, manifest, data))
            size += len(data)
            if len(group) >= _GROUP_FILES or size >= _GROUP_BYTES:
                if len(sent) >= _IN_FLIGHT:
                    _settle(sent.popleft(), out, paths, files)
                sent.append((group, _send(group, paths, files, level)))
                group, size = [], 0
        if group:
            sent.append((group, _send(group, paths, files, level)))
        while sent:
            _settle(sent.popleft(), out, paths, files)
    return out  # type: ignore[return-value]  (every entry is set above)


_GROUP_FILES, _GROUP_BYTES = 32, 64 << 20
"""The most ``.metadata`` files (and bytes of them) ``verify_steps`` sends to the reader process at once."""
_IN_FLIGHT = 2
"""Groups sent and not yet answered: two reader processes check two groups at once
(``sandbox.submit_decodes``)."""


def _send(group: list[tuple[int, Manifest, bytes]], paths: list[Location], files: StepFiles,
          level: Verify) -> MetadataChecks:
    return MetadataChecks([(data, str(files.join(paths[i], ".metadata")), {n: e.size for n, e in m.files.items()})
                           for i, m, data in group], chunks=level == "checksum")


def _settle(sent: tuple[list[tuple[int, Manifest, bytes]], MetadataChecks],
            out: list[Manifest | InvalidCheckpoint | None], paths: list[Location], files: StepFiles) -> None:
    group, checks = sent
    for (i, manifest, _), answer in zip(group, checks.results()):
        path = paths[i]
        if isinstance(answer, InvalidCheckpoint):
            problem: str | None = str(answer).replace(f"{path}/", "", 1)
        else:
            problem = next(_chunk_problems(files, path, answer), None)
        out[i] = manifest if problem is None else InvalidCheckpoint(f"{path}: {problem}")


def _metadata_bytes(files: StepFiles, path: Location) -> tuple[bytes, str | None]:
    """A step's ``.metadata`` (bounded), or the problem reading it."""
    where = files.join(path, ".metadata")
    try:
        with files.open_read(where) as f:
            return read_bounded(f, str(where)), None
    except InvalidCheckpoint as exc:
        return b"", str(exc).replace(f"{path}/", "", 1)
    except OSError as exc:
        return b"", f".metadata or a data file is unreadable ({exc})"


def check_file(files: StepFiles, path: Location, want: FileEntry, checksum: bool,
               progress: Callable[[int], None] | None = None) -> str | None:
    """The problem of one listed file against its manifest entry, or None."""
    name = files.name(path)
    size = files.size(path)
    if size is None:
        _advance(progress, want.size)
        if isinstance(path, Path) and path.is_symlink():
            return f"{name} is a symlink, not a file the save wrote"
        if isinstance(path, Path) and path.exists():
            return f"{name} is not a regular file (a directory, FIFO, socket or device), not a file the save wrote"
        return f"{name} is missing"
    if size != want.size:
        _advance(progress, want.size)
        return f"{name} has {size} bytes, the manifest says {want.size} (truncated or overwritten)"
    if not checksum:
        _advance(progress, want.size)
        return None
    algorithm, value = want.checksum
    if files.checksum(path, algorithm, progress) != value:
        return f"{name} fails its {checksum_name(algorithm)} check (corrupt)"
    return None


def _metadata_problems(files: StepFiles, path: Location, listed: Mapping[str, int], chunks: bool) -> Iterator[str]:
    # loading's verdict, without torch (and every tensor tiled by its chunks, in its files' sizes);
    # with ``chunks`` (a checksum-level verify, which reads every byte anyway) also every tensor
    # chunk's torch.save header, parsed as loading parses it (``tensorblob.py``)
    where = files.join(path, ".metadata")
    try:
        with files.open_read(where) as f:
            ranges = check_metadata_stream(f, str(where), listed, chunks=chunks)
    except InvalidCheckpoint as exc:
        yield str(exc).replace(f"{path}/", "", 1)
        return
    except OSError as exc:
        yield f".metadata or a data file is unreadable ({exc})"
        return
    yield from _chunk_problems(files, path, ranges)


def _chunk_problems(files: StepFiles, path: Location, ranges: list | None) -> Iterator[str]:
    """The problem of the first tensor chunk (``[file, offset, length]``) whose header loading would refuse."""
    by_file: dict[str, list[tuple[int, int]]] = {}
    for name, offset, length in ranges or ():
        by_file.setdefault(name, []).append((offset, length))
    try:
        for name, spans in sorted(by_file.items()):
            with files.open_read(files.join(path, name)) as f:
                CHUNK_PARSES.parse_file(f, sorted(spans), lambda at, name=name: f"{name} (the chunk at byte {at})")
    except InvalidCheckpoint as exc:
        yield str(exc).replace(f"{path}/", "", 1)
    except OSError as exc:
        yield f".metadata or a data file is unreadable ({exc})"


def _advance(progress: Callable[[int], None] | None, n: int) -> None:
    if progress is not None:
        progress(n)
