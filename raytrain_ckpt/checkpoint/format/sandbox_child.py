"""The reader process of ``sandbox.py``: decodes one untrusted file at a time under its limits.

Reads requests from stdin (``<IQ`` lengths, a JSON header, the file's bytes), answers on stdout
(``<I`` length, JSON). Imports the checkers before it limits itself and never imports torch: the
unpicklers here build inert stand-ins for every class. After a decode that ran out of memory it
exits, so the next one starts in a fresh process.
"""

from __future__ import annotations

import io
import json
import pickle
import struct
import sys
from collections.abc import Callable
from typing import Any

from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint, UnsafeCheckpoint
from raytrain_ckpt.checkpoint.format.sandbox import _limit_self, _unlimit_self
from raytrain_ckpt.checkpoint.format.scandiff import PassedScans
from raytrain_ckpt.checkpoint.format.unpickling import metadata_verdict, unpickle
from raytrain_ckpt.common.gcpause import collector_paused

__all__ = ["KINDS", "serve"]


class _Inert(dict):
    """Any class or function a weights-only pickle names: takes anything, runs nothing. A dict (an
    ``OrderedDict`` takes items; their keys are hashed as loading hashes them) that also takes
    appends and state."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()  # (arguments are not applied: only the cost of the structure is measured)

    def __setstate__(self, state: Any) -> None:
        pass  # (same)

    def append(self, item: Any) -> None:
        pass  # (same)

    def extend(self, items: Any) -> None:
        pass  # (same)

    def __hash__(self) -> int:  # a stand-in may be a key (a tensor is hashable by identity)
        return id(self)


class _DataUnpickler(pickle.Unpickler):
    """The structure of a ``torch.save`` pickle built with stand-ins: no global is imported."""

    def find_class(self, module: str, name: str) -> Any:
        return _Inert

    def persistent_load(self, pid: Any) -> Any:
        return None


PASSED = PassedScans()
"""The pickles this process's pre-scan passed last: an ``ls`` sends the same ``.metadata`` but for
a few values, step after step, and a pickle that differs from one of them only in its atoms is not
scanned again (``scandiff.py``); its decode and checks run in full."""


def _data_pickle(data: bytes, where: str, args: dict[str, Any]) -> None:
    PASSED.scan(data, where)
    unpickle(_DataUnpickler(io.BytesIO(data)), where)


def _metadata(data: bytes, where: str, args: dict[str, Any]) -> Any:
    return metadata_verdict(data, where, args.get("files"), PASSED, chunks=bool(args.get("chunks")),
                            decode_only=bool(args.get("decode_only")))


KINDS: dict[str, Callable[[bytes, str, dict[str, Any]], Any]] = {"metadata": _metadata, "pickle": _data_pickle}
"""What the reader process decodes: a DCP ``.metadata`` (the torch-free check; with ``chunks``, its
tensor chunks' byte ranges back), a ``torch.save`` pickle (``data.pkl``)."""


def _read(stream: Any, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise EOFError
    return data


def _serve_one(inp: Any) -> tuple[dict, bool]:
    head_len, data_len = struct.unpack("<IQ", _read(inp, 12))
    request = json.loads(_read(inp, head_len))
    data = _read(inp, data_len)
    where = str(request["where"])
    _limit_self(int(request["memory"]), float(request["cpu"]))
    try:
        # the collector paused: a decode allocates an object or more per opcode, none in a cycle (the
        # pre-scan refuses a structure that contains itself), and each full collection it would
        # trigger walks every one of them (a third of the time of a 1 MB .metadata's check)
        with collector_paused():
            return {"ok": True, "result": KINDS[request["kind"]](data, where, request["args"])}, True
    except MemoryError:
        return {"ok": False, "error": "memory"}, False
    except UnsafeCheckpoint as exc:
        return {"ok": False, "error": "unsafe", "message": str(exc)}, True
    except InvalidCheckpoint as exc:
        return {"ok": False, "error": "invalid", "message": str(exc)}, True
    except RecursionError:
        return {"ok": False, "error": "invalid", "message": f"{where} nests too deeply to decode"}, True
    finally:
        _unlimit_self()  # (no gc.collect here: a full collection costs more than most decodes)


def serve() -> None:
    """Answer requests until stdin closes (or a decode ran out of memory)."""
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            reply, keep = _serve_one(inp)
        except EOFError:
            return
        try:
            body = json.dumps(reply).encode()
        except (TypeError, ValueError):
            body = json.dumps({"ok": False, "error": "invalid", "message": "an answer that is not plain data"}).encode()
        out.write(struct.pack("<I", len(body)) + body)
        out.flush()
        if not keep:
            return
