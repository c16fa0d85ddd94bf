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

import itertools
import math
from array import array
from collections.abc import Mapping
from typing import Any

__all__ = ["MAX_CHUNKS_PER_TENSOR", "layout_problem", "tensor_ranges"]

MAX_CHUNKS_PER_TENSOR = 1 << 20
"""Chunks one tensor may be saved in (one per rank and sharded dimension: far above any job)."""

_ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
             "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "int16": 2, "short": 2, "uint16": 2, "float16": 2,
             "half": 2, "bfloat16": 2, "int32": 4, "int": 4, "uint32": 4, "float32": 4, "float": 4,
             "complex32": 4, "chalf": 4, "int64": 8, "long": 8, "uint64": 8, "float64": 8, "double": 8,
             "complex64": 8, "cfloat": 8, "complex128": 16, "cdouble": 16}
"""Bytes per element of a dtype known by its name (the torch-free check's stand-ins)."""


def _dims(value: Any) -> tuple[int, ...] | None:
    # (loops, not all() over a generator: this runs for every chunk of every .metadata read)
    if type(value) is tuple:
        dims = value
    else:
        try:
            dims = tuple(value)
        except TypeError:
            return None
    if len(dims) > 64:
        return None
    for d in dims:
        if type(d) is not int or d < 0 or d >= _DIM_LIMIT:
            return None
    return dims


_DIM_LIMIT = 1 << 62


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
        for o, s, d in zip(offsets, sizes, size):
            if o + s > d:
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
    if isinstance(overlap, str):
        return overlap
    if overlap is not None:
        return f"has chunks at {list(overlap[0])} and {list(overlap[1])} that overlap"
    return None


def _bytes_problem(info: Any, need: int, file_sizes: Mapping[str, int] | None) -> str | None:
    if info is None:
        return "no data entry says where its bytes are"
    path, offset = getattr(info, "relative_path", None), getattr(info, "offset", None)
    length = getattr(info, "length", None)
    if not isinstance(path, str) or type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        return "its data entry has no valid file, offset and length"
    if length < need:
        return f"its {length} bytes in {path} cannot hold its {need} bytes of elements"
    if file_sizes is not None:
        have = file_sizes.get(path)
        if have is not None and offset + length > have:
            return f"its bytes {offset}..{offset + length} are past the end of {path} ({have} bytes)"
    return None


_CELLS_PER_CHUNK = 4
"""Grid cells per chunk up to which overlaps are found by marking cells (``_overlap_on_grid``)."""
_SWEEP_PAIRS = 20_000_000
"""Pairs of chunks compared at most for a layout that is no grid (``_overlap_by_sweep``)."""


def _overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[tuple[int, ...], ...] | str | None:
    """Two boxes that share an element (their offsets), a reason the layout cannot be judged, or None.

    DCP's chunks form a grid (each dimension cut at the same points for every chunk), so the cut
    points of every dimension split the tensor into cells, each chunk covers whole cells, and two
    chunks overlap exactly when they mark one cell twice: O(n log n) however the chunks split
    the tensor. A layout that is no grid (more cells than a few per chunk) is swept instead."""
    if len(boxes) < 2:
        return None
    ndim = len(boxes[0][0])
    cuts = [sorted({off[i] for off, _ in boxes} | {off[i] + sz[i] for off, sz in boxes}) for i in range(ndim)]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells <= _CELLS_PER_CHUNK * len(boxes) + 64:
        return _overlap_on_grid(boxes, cuts, cells)
    return _overlap_by_sweep(boxes)


def _overlap_on_grid(boxes: list, cuts: list[list[int]], cells: int) -> tuple[tuple[int, ...], ...] | None:
    # Each mark fills a fresh cell or finds the overlap, so at most ``cells + 1`` marks are made.
    index = [{c: k for k, c in enumerate(cs)} for cs in cuts]
    strides = [1] * len(cuts)
    for i in range(len(cuts) - 2, -1, -1):
        strides[i] = strides[i + 1] * (len(cuts[i + 1]) - 1)
    owner = array("i", [-1]) * max(cells, 1)
    for n, (off, sz) in enumerate(boxes):
        spans = [range(index[i][o] * st, index[i][o + s] * st, st)
                 for i, (o, s, st) in enumerate(zip(off, sz, strides))]
        for cell in itertools.product(*spans):
            at = sum(cell)
            if owner[at] >= 0:
                return boxes[owner[at]][0], off
            owner[at] = n
    return None


def _overlap_by_sweep(boxes: list, max_pairs: int | None = _SWEEP_PAIRS) -> tuple[tuple[int, ...], ...] | str | None:
    """A sweep along the dimension with the most distinct starts, keeping the boxes it is inside
    (``max_pairs``: pairs compared at most, None: no limit). Two boxes overlap when each starts
    before the other ends in every dimension, so a box of size 0 overlaps one it lies strictly
    inside, as DCP's plan check counts it."""
    dim = max(range(len(boxes[0][0])), key=lambda i: len({off[i] for off, _ in boxes}))
    active: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    pairs = 0
    for off, sz in sorted(boxes, key=lambda b: b[0][dim]):
        active = [b for b in active if b[0][dim] + b[1][dim] > off[dim]]
        pairs += len(active)
        if max_pairs is not None and pairs > max_pairs:
            return (f"cuts its dimensions at different points in different chunks, too irregularly to check "
                    f"for overlaps (over {_SWEEP_PAIRS} pairs of chunks to compare); DCP never writes that")
        for other in active:
            if all(o1 < o2 + s2 and o2 < o1 + s1 for o1, s1, o2, s2 in zip(off, sz, other[0], other[1])):
                return other[0], off
        active.append((off, sz))
    return None


def tensor_ranges(metadata: Any) -> list[list]:
    """``[file, offset, length]`` of every tensor chunk of ``metadata`` (each a ``torch.save`` blob)."""
    storage = _index(getattr(metadata, "storage_data", None))
    out: list[list] = []
    entries = getattr(metadata, "state_dict_metadata", None)
    for fqn, md in (entries.items() if isinstance(entries, dict) else ()):
        for chunk in getattr(md, "chunks", None) or ():
            info = storage.get((fqn, _dims(getattr(chunk, "offsets", None)) or ()))
            path, offset, length = (getattr(info, k, None) for k in ("relative_path", "offset", "length"))
            if isinstance(path, str) and type(offset) is int and type(length) is int:
                out.append([path, offset, length])
    return out
