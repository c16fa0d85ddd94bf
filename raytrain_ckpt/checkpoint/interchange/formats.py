"""The file formats an export writes: size-bounded shard plans, a safetensors header computed
ahead of the data, and ``torch.save``'s zip layout written one storage record at a time. (The
names in them are the model's: ``models/hf.py``.)

Both writers put the tensor data last, after a header that needs only names, dtypes and shapes,
so an export can read each tensor just before writing it.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import pickle
import struct
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

__all__ = ["lazy_tensor", "plan_shards", "safetensors_header", "stream_torch_save"]

_ST_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
_STORAGE_TYPES: dict[torch.dtype, type] = {
    torch.float32: torch.FloatStorage, torch.bfloat16: torch.BFloat16Storage, torch.float16: torch.HalfStorage,
    torch.float64: torch.DoubleStorage, torch.int64: torch.LongStorage, torch.int32: torch.IntStorage,
}


def plan_shards(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Consecutive groups of entry indices, each at most ``max_bytes`` unless one tensor is larger."""
    shards: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        if shards[-1] and used + n > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += n
    return shards


def safetensors_header(items: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype) -> bytes:
    """The length-prefixed JSON header of a safetensors file whose tensors follow in ``items`` order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    for name, shape in items:
        n = itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class _Storage:
    """Stands for a storage in the pickle; its bytes are written after ``data.pkl``."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class _LazyTensor:
    """Pickles exactly as a contiguous CPU tensor of ``shape`` over ``storage`` would."""

    def __init__(self, storage: _Storage, shape: tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol: int) -> tuple:
        stride = torch.empty(self.shape, device="meta").stride()
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, torch.Size(self.shape), stride, False, collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> tuple | None:
        if isinstance(obj, _Storage):
            return ("storage", _STORAGE_TYPES[obj.dtype], obj.key, "cpu", obj.numel)
        return None


def lazy_tensor(record: str, dtype: torch.dtype, shape: tuple[int, ...]) -> Any:
    """A placeholder that pickles as a tensor whose storage is the zip record ``data/<record>``."""
    return _LazyTensor(_Storage(record, dtype, int(torch.Size(shape).numel())), tuple(shape))


def stream_torch_save(path: Path, obj: Any, records: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Write ``obj`` (holding ``lazy_tensor`` placeholders) in ``torch.save``'s zip format, then each
    (record, tensor) of ``records`` as it comes: the pickle goes first and refers to storages by
    record name, the layout ``torch.save`` produces, so ``torch.load`` (``weights_only``, ``mmap``)
    reads it. ``records`` may be a generator that reads each tensor just before it is written."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(obj)
    with open(path, "wb") as f:
        writer = torch._C.PyTorchFileWriter(f)  # a file object: we fsync it before the rename
        try:
            writer.write_record("data.pkl", buf.getvalue(), len(buf.getvalue()))
            writer.write_record("byteorder", sys.byteorder.encode(), len(sys.byteorder))
            for record, tensor in records:
                storage = tensor.contiguous().untyped_storage()
                writer.write_record(f"data/{record}", storage, storage.nbytes())
        except BaseException:
            # An unfinished writer finishes the zip in its C++ destructor. The traceback keeps it
            # alive until after `f` is closed, and that write to a closed file raises inside the
            # destructor, which aborts the process. Finish it now, while `f` is open; the caller
            # removes the partial file. After a failed write (a full disk) finishing fails too; the
            # write's own error is the one to report.
            with contextlib.suppress(RuntimeError, OSError):
                writer.write_end_of_file()
            raise
        writer.write_end_of_file()
        f.flush()
        os.fsync(f.fileno())
