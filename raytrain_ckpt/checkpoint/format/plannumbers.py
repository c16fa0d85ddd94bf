"""The first save's plan on numbers: each rank's local plan as its difference from a base plan,
and DCP's global plan computed from those differences.

A rank of the 70B model under FSDP2 sends 11,581 local-plan items; at 4096 ranks the coordinator
held 47.4 M of them as objects (39.5 GB unpickled) and DCP's ``create_default_global_save_plan``
made a new item for each. The items of two ranks of one layout differ only in their shards'
offsets and sizes and in the few items and planner keys that name the rank (its RNG states), so a
plan is kept as ``PlanNumbers``: a mark per item (equal to the base's item at its place, a shard
of the same tensor whose offsets and sizes are numbers, or an item of its own), the numbers in one
array, its own items, and the planner keys that differ from the base's. A plan that matches no
base closely becomes a base (a pipeline stage's first rank, say).

``plannumbers_global.plan_on_numbers`` is DCP's ``dedup_save_plans`` (the load-balancing rule: a duplicated item goes
to the holder that has planned the fewest bytes so far, the lowest rank among equals, in the order
DCP meets the items) and ``create_default_global_save_plan`` (chunk indices, ``.metadata``'s
entries in DCP's order, the merged planner data) computed on the numbers: per rank, which items it
keeps and its chunks' indices, no item object per rank and item. ``central`` expands one rank's
central plan from them. ``tests/unit/test_plannumbers.py`` asserts the expanded plans and the
``Metadata`` equal DCP's, index hints included, on real planner outputs (FSDP2, replicated and
rank-specific state, several bases) and generated layouts. A layout outside what the numbers
model (a fqn sharded at two places, a key twice in one plan) answers None: plan with DCP's own.
"""

from __future__ import annotations

import dataclasses
from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

__all__ = ["Central", "PlanBook", "PlanNumbers", "central", "planner_of"]

SAME, NUMBERS, OWN = 1, 2, 0
"""Marks: the base's item; the base's shard with offsets and sizes of its own; an item of its own."""

MAX_BASES = 64
"""Plans kept whole as bases (one per pipeline stage, say); beyond, a plan's items are its own."""


@dataclass
class _Base:
    plan: SavePlan
    keys: list[Any]
    shard_at: list[int]
    """Positions of the base's shard items, in order; the numbers of a rank hold 2 x ndim per position."""
    width: list[int]
    """Per shard position, where its numbers start (the last entry: the row's width)."""


@dataclass
class PlanNumbers:
    """One rank's local plan as its difference from ``base`` (see the module docstring)."""

    base: int
    marks: bytes
    numbers: array
    """Per shard position of the base: the offsets, then the sizes (the base's where the item is its own)."""
    own: dict[int, WriteItem]
    planner: dict[int, tuple[Any, Any]] | None
    """Planner keys that differ from the base's at their place: position -> (key, value); None: ``planner_full``."""
    planner_full: Any = None
    storage_data: Any = None
    usable: bool = True


class PlanBook:
    """The base plans of one gather and each rank's ``PlanNumbers``."""

    def __init__(self) -> None:
        self.bases: list[_Base] = []

    def add(self, plan: SavePlan) -> PlanNumbers:
        """``plan`` as numbers against the first base it matches closely, else as a new base."""
        for i, base in enumerate(self.bases):
            if len(base.plan.items) == len(plan.items):
                got = _difference(i, base, plan)
                if len(got.own) * 8 <= len(plan.items):
                    return got
        if len(self.bases) >= MAX_BASES and self.bases:
            return _difference(0, self.bases[0], plan)
        shard_at = [p for p, item in enumerate(plan.items) if item.type == WriteItemType.SHARD]
        width = [0]
        for p in shard_at:
            width.append(width[-1] + 2 * len(plan.items[p].tensor_data.size))
        keys = list(plan.planner_data) if isinstance(plan.planner_data, dict) else []
        self.bases.append(_Base(plan, keys, shard_at, width))
        return _difference(len(self.bases) - 1, self.bases[-1], plan)

    def expand(self, pn: PlanNumbers) -> SavePlan:
        """The local plan ``pn`` stands for, equal to the one added."""
        base = self.bases[pn.base]
        items = [_item(base, pn, p) for p in range(len(pn.marks))]
        return SavePlan(items, pn.storage_data, planner_of(base, pn), pn.usable)


def _difference(b: int, base: _Base, plan: SavePlan) -> PlanNumbers:
    marks, own = bytearray(len(plan.items)), {}
    numbers = array("q", bytes(8 * base.width[-1]))
    s = 0
    for p, (item, ref) in enumerate(zip(plan.items, base.plan.items)):
        shard = s < len(base.shard_at) and base.shard_at[s] == p
        if shard:
            at = base.width[s]
            s += 1
        if item == ref and item.index.index == ref.index.index:
            marks[p] = SAME
            if shard:
                _put(numbers, at, ref)
        elif shard and _same_tensor(item, ref):
            marks[p] = NUMBERS
            _put(numbers, at, item)
        else:
            own[p] = item
            if shard:
                _put(numbers, at, ref)
    planner, full = _planner_difference(base, plan.planner_data)
    return PlanNumbers(b, bytes(marks), numbers, own, planner, full, plan.storage_data, plan.usable)


def _same_tensor(item: WriteItem, ref: WriteItem) -> bool:
    """A shard of ``ref``'s tensor whose index names its chunk's offsets (DCP's DTensor items)."""
    if item.type != WriteItemType.SHARD or item.index.fqn != ref.index.fqn or item.bytes_io_data is not None:
        return False
    data, r = item.tensor_data, ref.tensor_data
    if data is None or data.chunk is None or data.size != r.size or data.properties != r.properties:
        return False
    if item.index.index != ref.index.index or len(data.chunk.offsets) != len(r.size) or len(data.chunk.sizes) != len(r.size):
        return False
    return item.index.offset == data.chunk.offsets


def _put(numbers: array, at: int, item: WriteItem) -> None:
    chunk = item.tensor_data.chunk
    n = len(chunk.offsets)
    numbers[at:at + n] = array("q", chunk.offsets)
    numbers[at + n:at + 2 * n] = array("q", chunk.sizes)


def _planner_difference(base: _Base, data: Any) -> tuple[dict | None, Any]:
    ref = base.plan.planner_data
    if not isinstance(data, dict) or not isinstance(ref, dict) or len(data) != len(ref):
        return None, data
    out = {}
    for p, ((key, value), known) in enumerate(zip(data.items(), base.keys)):
        if key != known or value != ref[known]:
            out[p] = (key, value)
    return out, None


def planner_of(base: _Base, pn: PlanNumbers) -> Any:
    if pn.planner is None:
        return pn.planner_full
    ref = base.plan.planner_data
    if not pn.planner:
        return dict(ref)
    return dict(pn.planner[p] if p in pn.planner else (k, ref[k]) for p, k in enumerate(base.keys))


def _item(base: _Base, pn: PlanNumbers, p: int, s: int | None = None) -> WriteItem:
    mark = pn.marks[p]
    if mark == OWN:
        return pn.own[p]
    ref = base.plan.items[p]
    if mark == SAME:
        return ref
    if s is None:
        s = base.shard_at.index(p)
    at, n = base.width[s], len(ref.tensor_data.size)
    offsets = torch.Size(pn.numbers[at:at + n])
    chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(pn.numbers[at + n:at + 2 * n]))
    return WriteItem(index=MetadataIndex(ref.index.fqn, offsets, ref.index.index), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=chunk, properties=ref.tensor_data.properties,
                                                 size=ref.tensor_data.size))


@dataclass
class Central:
    """A rank's central plan as numbers: which of its items it writes, and each tensor item's chunk index."""

    keep: bytes
    shard_index: Any
    """Per shard position of the base: the chunk's index (where kept)."""
    index: dict[int, int] = field(default_factory=dict)
    """Position -> chunk index, for the other tensor items it keeps."""


def central(book: PlanBook, pn: PlanNumbers, c: Central) -> SavePlan:
    """Rank's central plan, as DCP's global plan has it (index hints rewritten)."""
    base = book.bases[pn.base]
    shard_pos = {p: s for s, p in enumerate(base.shard_at)}
    items = []
    for p, keep in enumerate(c.keep):
        if not keep:
            continue
        s = shard_pos.get(p)
        item = _item(base, pn, p, s)
        if item.type != WriteItemType.BYTE_IO:
            i = int(c.shard_index[s]) if s is not None and pn.marks[p] != OWN else c.index[p]
            item = dataclasses.replace(item, index=dataclasses.replace(item.index, index=i))
        items.append(item)
    return SavePlan(items, pn.storage_data, planner_of(base, pn), pn.usable)

