"""What a DCP ``.metadata`` pickle may refer to, and checking a file against that without torch.

The allow-list is the one ``metadata.SafeUnpickler`` loads with. ``check_metadata_file`` parses
the whole pickle with the same list, but builds inert stand-ins for the torch classes instead
of importing torch: it decides exactly what loading would refuse for a name outside the list,
and lets ``status``, ``ls`` and ``verify`` judge a step without the seconds torch takes to
import. Loading itself still goes through ``SafeUnpickler``, which builds the real objects.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import threading
from collections.abc import Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint, UnsafeCheckpoint

from raytrain_ckpt.checkpoint.format.chunks import layout_problem, tensor_ranges
from raytrain_ckpt.checkpoint.format.names import check_file_name
from raytrain_ckpt.checkpoint.format import sandbox, scancache
from raytrain_ckpt.checkpoint.format.prescan import DEFAULT_BUDGET, read_bounded
from raytrain_ckpt.checkpoint.format.scandiff import PassedScans
from raytrain_ckpt.common.gcpause import collector_paused

__all__ = ["ALLOWED_GLOBALS", "MetadataChecks", "metadata_decode_key", "vouch_for", "vouching", "TORCH_DTYPES", "allowed_global", "check_data_files", "check_metadata_file",
           "check_metadata_stream", "checked_pickle", "data_bytearray", "metadata_verdict", "refusal",
           "resolve_builtin", "unpickle"]

ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}),
    "torch.serialization": frozenset({"_get_layout"}),  # looks a torch.layout up by name
    "pathlib": frozenset({"Path", "PosixPath", "PurePath", "PurePosixPath"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "bytearray", "complex", "slice"}),
}
"""Module -> names a DCP metadata file is made of (its dataclasses, ``torch.Size``, layouts, paths)."""

TORCH_DTYPES = frozenset({
    "bfloat16", "bit", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "cdouble", "cfloat", "chalf",
    "complex128", "complex32", "complex64", "double", "float", "float16", "float32", "float4_e2m1fn_x2",
    "float64", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "half",
    "int", "int1", "int16", "int2", "int3", "int32", "int4", "int5", "int6", "int64", "int7", "int8", "long",
    "qint32", "qint8", "quint2x4", "quint4x2", "quint8", "short", "uint1", "uint16", "uint2", "uint3", "uint32",
    "uint4", "uint5", "uint6", "uint64", "uint7", "uint8"})
"""``torch.<name>`` dtypes, pickled as globals. Spelled out so the check needs no torch; a unit test
holds the set equal to the installed torch's dtypes."""

def allowed_global(module: str, name: str) -> bool:
    """Whether DCP metadata may refer to ``module.name``."""
    return name in ALLOWED_GLOBALS.get(module, ()) or (module == "torch" and name in TORCH_DTYPES)


def data_bytearray(*args: Any) -> bytearray:
    """``bytearray`` as a pickle may call it: from bytes (what pickling a bytearray writes), never
    from a length (``bytearray(10**10)``: a few bytes of pickle would allocate gigabytes)."""
    if len(args) > 2 or (args and not isinstance(args[0], (bytes, str))) or any(not isinstance(a, str) for a in args[1:]):
        raise UnsafeCheckpoint("calls bytearray with a length or an object, which allocates from a number "
                               "the file gives; DCP metadata never does")
    return bytearray(*args)


_SIZE_FREE = {("builtins", "bytearray"): data_bytearray}
"""Allowed globals that take a size, replaced by versions that do not (the others take none: sets
and paths are built from items the pickle holds, which the pre-scan has counted)."""


def resolve_builtin(module: str, name: str, find: Any) -> Any:
    """``find(module, name)``, the builtin replaced by its size-free version where it has one."""
    return _SIZE_FREE.get((module, name)) or find(module, name)


_VOUCH = threading.local()


@contextlib.contextmanager
def vouching(every: bool = False) -> Iterator[list[str]]:
    """The decode keys (``metadata_decode_key``) of every ``.metadata`` whose check passed on this
    thread inside the block: what a resume plan that verified a step can vouch for to the ranks
    that load it (``vouch_for``). ``every``: each pass's check key too, before its decode key
    (what a later check of the same bytes against the same files asks for: ``roles/seals.py``)."""
    keys: list[str] = []
    sinks = getattr(_VOUCH, "sinks", None)
    if sinks is None:
        sinks = _VOUCH.sinks = []
    sinks.append((keys, every))
    try:
        yield keys
    finally:
        sinks[:] = [sink for sink in sinks if sink[0] is not keys]


def _vouchable(data: bytes, check: str, decode: str | None = None) -> None:
    sinks = getattr(_VOUCH, "sinks", None)
    if not sinks:
        return
    decode = decode or _decode_key(data)
    for keys, every in sinks:
        keys.extend((check, decode) if every else (decode,))


def vouch_for(keys: Iterable[str]) -> None:
    """Take the ``.metadata`` decodes of ``keys`` as passed, in this process only: a rank loading a
    step its job's resume plan verified (``ResumePoint.metadata_key``, over the trusted channel
    that named the step). The bytes the rank reads are hashed as ever: a file changed since the
    plan checked it has another key and is decoded in the reader process first."""
    scancache.remember_in_process([k for k in keys if isinstance(k, str)])


def metadata_decode_key(data: bytes) -> str:
    """The key a passed check of ``.metadata`` bytes ``data`` remembers for loading's decode."""
    return _decode_key(data)


def checked_pickle(f: BinaryIO, where: str) -> io.BytesIO:
    """All of ``f`` (bounded), once a check of it as DCP metadata passed in the reader process
    (``sandbox.py``), so that unpickling it here costs at most that process's limits."""
    data = read_bounded(f, where)
    key = _decode_key(data)
    if not scancache.passed_before(key):
        sandbox.decode_in_sandbox("metadata", data, where, {"decode_only": True})
        scancache.remember_pass(key)
    return io.BytesIO(data)


def refusal(module: str, name: str) -> UnsafeCheckpoint:
    """The error for a global outside the allow-list."""
    return UnsafeCheckpoint(f"refers to {module}.{name}, which DCP metadata never contains; refusing to "
                            "unpickle it (a checkpoint is data and is never executed)")


class _StandIn:
    """An inert object in place of a torch class: takes any arguments and state, runs nothing.

    Arguments are noted (``_called_with``), not applied: the real class would apply them, so a
    check that reads fields must refuse an object built from arguments rather than judge the
    fields it does not see (DCP pickles its dataclasses without any: a new object, then state)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _StandIn:
        obj = object.__new__(cls)
        if args or kwargs:
            obj.__dict__["_called_with"] = True
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # (a call with arguments was noted by __new__, which every construction passes through)

    def __setstate__(self, state: Any) -> None:
        # Kept as plain data (never called or resolved) so that checks can read the file names
        # the metadata points at; a dataclass with slots pickles its state as (dict, slots).
        if isinstance(state, tuple) and len(state) == 2:
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            # (never ``_called_with``: a state could otherwise clear the note that arguments were given)
            fields = self.__dict__
            for k, v in state.items():
                if isinstance(k, str) and k[:2] != "__" and k != "_called_with":
                    fields[k] = v
        elif isinstance(state, tuple):
            self.__dict__["_state"] = state  # TensorProperties' state: (dtype, layout, ...)


def _size(dims: Any = ()) -> tuple[int, ...]:
    """``torch.Size`` as the check reads it: the tuple of ints the real one is (it refuses the rest too)."""
    dims = tuple(dims)
    for d in dims:  # (a loop, not all() over a generator: once per tensor and chunk of a .metadata)
        if type(d) is not int:
            raise TypeError("torch.Size() takes an iterable of ints")
    return dims


class _CheckingUnpickler(pickle.Unpickler):
    """Resolves allowed torch names to stand-ins (torch stays unimported), the others as loading does."""

    def find_class(self, module: str, name: str) -> Any:
        if not allowed_global(module, name):
            raise refusal(module, name)
        if (module, name) == ("torch", "Size"):
            return _size
        if module.partition(".")[0] == "torch":
            return _stand_in(module, name)
        return resolve_builtin(module, name, super().find_class)


_STAND_INS: dict[tuple[str, str], type] = {}


def _stand_in(module: str, name: str) -> type:
    """The stand-in class for the allowed torch name ``module.name``, made once per process (a
    class is 10-20 us to make, and a ``.metadata`` names about ten)."""
    cls = _STAND_INS.get((module, name))
    if cls is None:
        cls = _STAND_INS[(module, name)] = type(f"{module}.{name}", (_StandIn,), {})
    return cls


def check_metadata_file(path: Path) -> None:
    """Parse a ``.metadata`` file as loading would, without torch; raise if loading would refuse it.

    Raises:
        UnsafeCheckpoint: It refers to a global outside ``ALLOWED_GLOBALS`` (code it would run).
        InvalidCheckpoint: It is unreadable, not a pickle, or does not hold DCP ``Metadata``.
    """
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise InvalidCheckpoint(f"{path} is unreadable ({type(exc).__name__}: {exc})") from None
    with f:
        check_metadata_stream(f, str(path))


def unpickle(unpickler: pickle.Unpickler, where: str) -> Any:
    """``unpickler.load()`` with its failures as checkpoint errors naming ``where``.

    Raises:
        UnsafeCheckpoint: A global outside the allowlist (the unpickler refused it).
        InvalidCheckpoint: Any other failure: the file is damaged.
    """
    try:
        with collector_paused():  # an object or more per opcode, each full collection walking them all
            return unpickler.load()
    except UnsafeCheckpoint as exc:
        raise UnsafeCheckpoint(f"{where} {exc}") from None
    except MemoryError:
        raise  # over the reader process's memory limit (``sandbox.py`` names it), not a damaged file
    except Exception as exc:  # noqa: BLE001 - any failure to unpickle means a damaged file
        raise InvalidCheckpoint(f"{where} is unreadable ({type(exc).__name__}: {exc})") from None


def check_metadata_stream(f: BinaryIO, name: str, files: Collection[str] | Mapping[str, int] | None = None,
                          chunks: bool = False) -> list | None:
    """``check_metadata_file`` of an open binary stream (a local file or an object-store object)
    called ``name`` in messages. ``files``: the step's manifest's file names; every file the
    metadata makes DCP read must be one of them (so every byte loaded is checksummed). With their
    sizes (a mapping), every tensor is also checked to be tiled by its chunks, each chunk's bytes
    inside its file (``chunks.layout_problem``). The check runs in the reader process
    (``sandbox.py``), under the OS's memory and time limits; a pass is remembered by content.
    With ``chunks``: the byte ranges ``[file, offset, length]`` of its tensor chunks (never remembered)."""
    data = read_bounded(f, name)
    key = _check_key(data, files)
    if not chunks and scancache.passed_before(key):
        _vouchable(data, key)
        return None
    result = sandbox.decode_in_sandbox("metadata", data, name, _check_args(files, chunks))
    _remember_check(key, data)
    return result


class MetadataChecks:
    """``check_metadata_stream`` of many ``.metadata`` files (``(data, name, files)`` each), sent
    to the reader process together: the caller works while it checks them (``ls`` of a root
    verifies the next steps' other files meanwhile), and no round trip separates two checks.
    Each check keeps its own limits; a pass is remembered by content as one checked alone."""

    def __init__(self, items: list[tuple[bytes, str, Mapping[str, int] | None]], chunks: bool = False) -> None:
        self._answers: list[Any] = [None] * len(items)
        self._data = [data for data, _, _ in items]
        self._names = [name for _, name, _ in items]
        self._todo: list[tuple[int, str]] = []
        self._same: list[tuple[int, int]] = []  # (file, an earlier file of the group with its key)
        first: dict[str, int] = {}
        jobs = []
        for i, (data, name, files) in enumerate(items):
            key = _check_key(data, files)
            if not chunks and scancache.passed_before(key):
                _vouchable(data, key)
                continue
            if key in first:  # the steps of one plan often hold the same bytes: checked once
                self._same.append((i, first[key]))
                continue
            first[key] = i
            self._todo.append((i, key))
            jobs.append((data, name, _check_args(files, chunks)))
        self._batch = sandbox.submit_decodes("metadata", jobs) if jobs else None

    def results(self) -> list[Any]:
        """Per file, in order: None (passed), its chunks' byte ranges (with ``chunks``), or the
        ``InvalidCheckpoint`` / ``UnsafeCheckpoint`` refusing it."""
        if self._batch is not None:
            passed = []
            answers = sandbox.collect_decodes(self._batch)
            if len(answers) != len(self._todo):  # never a pass for a file its reader did not answer
                answers = answers[:len(self._todo)] + [
                    InvalidCheckpoint(f"{self._names[i]}: not checked (no answer from the reader process); refused")
                    for i, _ in self._todo[len(answers):]]
            for (i, key), answer in zip(self._todo, answers):
                if not isinstance(answer, Exception):
                    passed += [key, _decode_key(self._data[i])]
                    _vouchable(self._data[i], key, passed[-1])
                self._answers[i] = answer
            scancache.remember_passes(passed)
            for i, j in self._same:
                self._answers[i] = self._answers[j]
            self._batch = None
        return self._answers


def _remember_check(key: str, data: bytes) -> None:
    """A passed check, and with it the decode loading asks for (``checked_pickle``): the check ran
    the same pre-scan and decode under the same limits, so a resume after ``ls`` or the
    registry's check does not decode the file in the reader process again."""
    decode = _decode_key(data)
    scancache.remember_passes([key, decode])
    _vouchable(data, key, decode)


def _decode_key(data: bytes) -> str:
    return scancache.digest(data, f"metadata decode {DEFAULT_BUDGET.scaled()!r}")


def _check_key(data: bytes, files: Collection[str] | Mapping[str, int] | None) -> str:
    return scancache.digest(data, f"metadata check {DEFAULT_BUDGET.scaled()!r} {_files_key(files)}")


def _check_args(files: Collection[str] | Mapping[str, int] | None, chunks: bool) -> dict[str, Any]:
    return {"files": files if isinstance(files, Mapping) or files is None else sorted(files), "chunks": chunks}


def metadata_verdict(data: bytes, name: str, files: Collection[str] | Mapping[str, int] | None,
                     passed: PassedScans, chunks: bool = False, decode_only: bool = False) -> list | None:
    """The torch-free check of the ``.metadata`` bytes ``data`` (what the reader process runs);
    with ``chunks``, the byte ranges of its tensor chunks; with ``decode_only``, only the decode
    (what loading then repeats, judging the objects it built itself). ``passed``: the pickles this
    process scanned before, which spare the pre-scan of one that differs only in atoms."""
    passed.scan(data, name)
    top = unpickle(_CheckingUnpickler(io.BytesIO(data)), name)
    if decode_only:
        return None
    if type(top).__name__ != "torch.distributed.checkpoint.metadata.Metadata":
        raise InvalidCheckpoint(f"{name} holds a {type(top).__name__}, not DCP Metadata")
    if vars(top).get("_called_with"):
        raise InvalidCheckpoint(f"{name} builds its Metadata by calling it with arguments, which DCP never writes "
                                "(its fields could not be checked)")
    check_data_files(vars(top).get("storage_data"), name, files)
    if isinstance(files, Mapping):
        problem = layout_problem(top, files)
        if problem is not None:
            raise InvalidCheckpoint(f"{name}: {problem}")
    return tensor_ranges(top) if chunks else None


def _files_key(files: Collection[str] | Mapping[str, int] | None) -> str:
    if files is None:
        return "any files"
    if isinstance(files, Mapping):
        return repr(sorted(files.items()))
    return repr(sorted(files))


def check_data_files(storage_data: Any, name: str, files: Collection[str] | None = None) -> None:
    """Every file DCP would read for the metadata ``storage_data`` (``_StorageInfo.relative_path``,
    joined to the step directory by DCP's readers) is a plain name inside the step and, when
    ``files`` is given, one of the manifest's files: a checkpoint reads only its own files.

    Raises:
        InvalidCheckpoint: Naming the first path that is not.
    """
    if storage_data is None:  # no data files at all: DCP reads nothing but the metadata
        return
    if not isinstance(storage_data, dict):
        raise InvalidCheckpoint(f"{name} has no map of its data files (storage_data is "
                                f"{type(storage_data).__name__})")
    for info in storage_data.values():
        if isinstance(info, _StandIn) and vars(info).get("_called_with"):
            raise InvalidCheckpoint(f"{name} builds a data entry by calling it with arguments, which DCP never "
                                    "writes (its file could not be checked)")
        path = getattr(info, "relative_path", None)
        if not isinstance(path, str):
            raise InvalidCheckpoint(f"{name} has a data entry without a file name")
        try:
            check_file_name(path)
        except ValueError as exc:
            raise InvalidCheckpoint(f"{name} points DCP at {path!r}: {exc} (a checkpoint reads only "
                                    "its own files)") from None
        if files is not None and path not in files:
            raise InvalidCheckpoint(f"{name} points DCP at {path!r}, which the manifest does not list "
                                    "(its bytes would be loaded unchecked)")
