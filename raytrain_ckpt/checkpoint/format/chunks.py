"""Every tensor of a DCP checkpoint is tiled exactly by its chunks, and each chunk's bytes exist.

DCP's ``.metadata`` declares each tensor's size and the chunks (offsets, sizes) it was saved in,
and where each chunk's bytes are (``storage_data``: file, offset, length). Loading allocates the
declared size and fills it chunk by chunk: a tensor declared larger than its chunks would keep
the uninitialised memory in between (an export would write it as weights), two chunks covering
the same elements would load whichever came last. ``layout_problem`` refuses, before anything
is allocated:

- a chunk outside its tensor, of another rank than the tensor, or of a negative size;
- chunks whose volumes do not add up to the tensor's (a gap), or that overlap;
- a chunk without a ``storage_data`` entry, a byte range past the end of its file (the
  manifest's size), or shorter than the chunk's elements.

It reads attributes only, so it judges the objects loading builds and the torch-free check's
stand-ins alike (a dtype is then known by name).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["MAX_CHUNKS_PER_TENSOR", "layout_problem"]

MAX_CHUNKS_PER_TENSOR = 1 << 20
"""Chunks one tensor may be saved in (one per rank and sharded dimension: far above any job)."""

_ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
             "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "int16": 2, "short": 2, "uint16": 2, "float16": 2,
             "half": 2, "bfloat16": 2, "int32": 4, "int": 4, "uint32": 4, "float32": 4, "float": 4,
             "complex32": 4, "chalf": 4, "int64": 8, "long": 8, "uint64": 8, "float64": 8, "double": 8,
             "complex64": 8, "cfloat": 8, "complex128": 16, "cdouble": 16}
"""Bytes per element of a dtype known by its name (the torch-free check's stand-ins)."""


def _dims(value: Any) -> tuple[int, ...] | None:
    try:
        dims = tuple(value)
    except TypeError:
        return None
    if len(dims) > 64 or not all(type(d) is int and 0 <= d < 1 << 62 for d in dims):
        return None
    return dims


def _itemsize(properties: Any) -> int | None:
    dtype = getattr(properties, "dtype", None)
    if dtype is None:  # a stand-in holds TensorProperties' state as a tuple, dtype first
        state = vars(properties).get("_state") if hasattr(properties, "__dict__") else None
        dtype = state[0] if isinstance(state, tuple) and state else None
    size = getattr(dtype, "itemsize", None)
    if type(size) is int and size > 0:
        return size
    name = getattr(dtype, "__name__", "") if isinstance(dtype, type) else ""
    return _ITEMSIZE.get(name.removeprefix("torch."))


def _index(storage_data: Any) -> dict[tuple[str, tuple[int, ...]], Any]:
    out: dict[tuple[str, tuple[int, ...]], Any] = {}
    if isinstance(storage_data, dict):
        for key, info in storage_data.items():
            fqn, offset = getattr(key, "fqn", None), _dims(getattr(key, "offset", None) or ())
            if isinstance(fqn, str) and offset is not None:
                out[(fqn, offset)] = info
    return out


def layout_problem(metadata: Any, file_sizes: Mapping[str, int] | None = None) -> str | None:
    """The first tensor of ``metadata`` whose chunks do not tile it exactly, or whose bytes are
    not where ``storage_data`` says (``file_sizes``: each file's size, from the manifest; None:
    byte ranges are checked against the chunks only); None when every tensor is whole."""
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        return "it declares no state dict"
    storage = _index(getattr(metadata, "storage_data", None))
    for fqn, md in entries.items():
        chunks = getattr(md, "chunks", None)
        if chunks is None:  # a non-tensor entry
            continue
        problem = _tensor_problem(fqn, md, chunks, storage, file_sizes)
        if problem is not None:
            return f"tensor {str(fqn)[:200]!r} {problem}"
    return None


def _tensor_problem(fqn: str, md: Any, chunks: Any, storage: dict, file_sizes: Mapping[str, int] | None) -> str | None:
    size = _dims(getattr(md, "size", None))
    if size is None:
        return "has no valid size"
    if not isinstance(chunks, list) or len(chunks) > MAX_CHUNKS_PER_TENSOR:
        return f"has no list of chunks (or over {MAX_CHUNKS_PER_TENSOR})"
    itemsize = _itemsize(getattr(md, "properties", None))
    volume = math.prod(size)
    covered = 0
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for chunk in chunks:
        offsets, sizes = _dims(getattr(chunk, "offsets", None)), _dims(getattr(chunk, "sizes", None))
        if offsets is None or sizes is None or len(offsets) != len(size) or len(sizes) != len(size):
            return f"has a chunk without offsets and sizes of its {len(size)} dimensions"
        if any(o + s > d for o, s, d in zip(offsets, sizes, size)):
            return f"has a chunk at {list(offsets)} of {list(sizes)} outside its size {list(size)}"
        n = math.prod(sizes)
        covered += n
        if n:
            boxes.append((offsets, sizes))
        problem = _bytes_problem(storage.get((fqn, offsets)), n * itemsize if itemsize else 0, file_sizes)
        if problem is not None:
            return f"chunk at {list(offsets)}: {problem}"
    if covered != volume:
        return (f"declares {volume} elements, its chunks hold {covered} (a gap or an overlap: loading would "
                "leave memory uninitialised or read elements twice)")
    overlap = _overlap(boxes)
    if overlap is not None:
        return f"has chunks at {list(overlap[0])} and {list(overlap[1])} that overlap"
    return None


def _bytes_problem(info: Any, need: int, file_sizes: Mapping[str, int] | None) -> str | None:
    if info is None:
        return "no data entry says where its bytes are"
    path, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
    if not isinstance(path, str) or type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        return "its data entry has no valid file, offset and length"
    if length < need:
        return f"its {length} bytes in {path} cannot hold its {need} bytes of elements"
    if file_sizes is not None:
        have = file_sizes.get(path)
        if have is not None and offset + length > have:
            return f"its bytes {offset}..{offset + length} are past the end of {path} ({have} bytes)"
    return None


def _overlap(boxes: Iterable[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[tuple[int, ...], ...] | None:
    """Two boxes that share an element, found by a sweep along the first dimension (chunks of a
    tensor sharded along one dimension never overlap in it, so the sweep keeps one box active)."""
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for off, sz in sorted(boxes):
        start = off[0] if off else 0
        active = [b for b in active if (b[0][0] + b[1][0] if b[0] else 1) > start]
        for other in active:
            if all(o1 < o2 + s2 and o2 < o1 + s1 for o1, s1, o2, s2 in zip(off, sz, other[0], other[1])):
                return other[0], off
        active.append((off, sz))
    return None
