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

``plannumbers_global.plan_on_numbers`` is DCP's ``dedup_save_plans`` (the load-balancing rule: a
duplicated item goes to the holder that has planned the fewest bytes so far, among equals the
first in the order DCP's set of holders iterates, in the order DCP meets the items) and ``create_default_global_save_plan`` (chunk indices, ``.metadata``'s
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

__all__ = ["Central", "CentralNumbers", "PlanBook", "PlanNumbers", "SHARED", "SharedPlan", "apply_central", "central", "difference_from", "own_central", "planner_of", "wire_central"]

SAME, NUMBERS, OWN = 1, 2, 0
"""Marks: the base's item; the base's shard with offsets and sizes of its own; an item of its own."""

SHARED = -1
"""``PlanNumbers.base`` of a rank's difference from its process group's shared plan (``against``)."""

MAX_BASES = 64
"""How many bases of its length a plan is compared with before it becomes a base of its own
(bounds the comparisons per plan where plans of many shapes arrive)."""


@dataclass
class _Base:
    plan: SavePlan
    keys: list[Any]
    shard_at: list[int]
    """Positions of the base's shard items, in order; the numbers of a rank hold 2 x ndim per position."""
    width: list[int]
    """Per shard position, where its numbers start (the last entry: the row's width)."""

    @property
    def shard_mask(self) -> np.ndarray:
        """Per item: whether it is one of the base's shard items."""
        mask = np.zeros(len(self.plan.items), dtype=bool)
        mask[self.shard_at] = True
        return mask


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
    against: int = -1
    """For a difference a rank sent (base ``SHARED``): the rank whose plan it is from."""


@dataclass(frozen=True)
class SharedPlan:
    """A rank's local plan that the other ranks of its process group got by a broadcast and sent
    their differences from (``difference_from``): the coordinator keeps it whole."""

    plan: SavePlan


class PlanBook:
    """The base plans of one gather and each rank's ``PlanNumbers``."""

    def __init__(self) -> None:
        self.bases: list[_Base] = []

    def add(self, plan: SavePlan) -> PlanNumbers:
        """``plan`` as numbers against the first base of its length it matches closely (of the
        first ``MAX_BASES`` such), else as a new base."""
        tried = 0
        for i, base in enumerate(self.bases):
            if len(base.plan.items) == len(plan.items) and tried < MAX_BASES:
                tried += 1
                got = _difference(i, base, plan, len(plan.items) // 8)
                if got is not None:
                    return got
        return self.add_base(plan)

    def add_base(self, plan: SavePlan) -> PlanNumbers:
        """``plan`` as a base of its own (rank 0's, which the other ranks' differences name)."""
        shard_at = [p for p, item in enumerate(plan.items) if item.type == WriteItemType.SHARD]
        width = [0]
        for p in shard_at:
            width.append(width[-1] + 2 * len(plan.items[p].tensor_data.size))
        keys = list(plan.planner_data) if isinstance(plan.planner_data, dict) else []
        self.bases.append(_Base(plan, keys, shard_at, width))
        got = _difference(len(self.bases) - 1, self.bases[-1], plan, None)
        assert got is not None
        return got

    def resolve(self, pn: PlanNumbers, base: int) -> PlanNumbers:
        """A rank's difference from a shared plan (``difference_from``), that plan being base
        ``base`` here; ValueError if it does not fit that base."""
        b = self.bases[base]
        if (not isinstance(pn.marks, bytes) or not isinstance(pn.numbers, array) or pn.numbers.typecode != "q"
                or not isinstance(pn.own, dict) or not all(isinstance(p, int) and isinstance(i, WriteItem)
                                                           for p, i in pn.own.items())
                or not (pn.planner is None or isinstance(pn.planner, dict) and all(
                    isinstance(p, int) and isinstance(v, tuple) and len(v) == 2 for p, v in pn.planner.items()))):
            raise ValueError(f"a rank's plan, sent as its difference from rank {pn.against}'s, is not one")
        marks = np.frombuffer(pn.marks, dtype=np.uint8)
        if (len(marks) != len(b.plan.items) or len(pn.numbers) != b.width[-1] or (len(marks) and marks.max() > NUMBERS)
                or int((marks == OWN).sum()) != len(pn.own) or any(not 0 <= p < len(marks) or marks[p] != OWN for p in pn.own)
                or bool(((marks == NUMBERS) & ~b.shard_mask).any())
                or (pn.planner is not None and any(not 0 <= p < len(b.keys) for p in pn.planner))):
            raise ValueError(f"a rank's plan, sent as its difference from rank {pn.against}'s, does not fit that plan")
        return dataclasses.replace(pn, base=base)

    def expand(self, pn: PlanNumbers) -> SavePlan:
        """The local plan ``pn`` stands for, equal to the one added."""
        base = self.bases[pn.base]
        items = [_item(base, pn, p) for p in range(len(pn.marks))]
        return SavePlan(items, pn.storage_data, planner_of(base, pn), pn.usable)


def _difference(b: int, base: _Base, plan: SavePlan, limit: int | None) -> PlanNumbers | None:
    """``plan`` against ``base``; None once more than ``limit`` of its items are its own."""
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
            if limit is not None and len(own) > limit:
                return None
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



@dataclass(frozen=True)
class CentralNumbers:
    """What a rank needs of the global plan to make its central plan from its own local plan:
    which of its items it writes, the chunk index of each tensor item it writes (in order), and
    its storage prefix. About 30 KB a rank of 70B, against 9 MB for the central plan itself."""

    keep: bytes
    indices: array
    storage_data: Any


def wire_central(book: PlanBook, pn: PlanNumbers, c: Central, storage_data: Any) -> CentralNumbers:
    """Rank's ``CentralNumbers`` from its ``Central`` (see ``apply_central``)."""
    base = book.bases[pn.base]
    keep = np.frombuffer(c.keep, dtype=np.uint8).astype(bool)
    marks = np.frombuffer(pn.marks, dtype=np.uint8)
    at = np.asarray(base.shard_at, dtype=np.int64)
    mine = keep[at] & (marks[at] != OWN) if len(at) else np.zeros(0, dtype=bool)
    pos = np.concatenate([at[mine], np.asarray([p for p in c.index if keep[p]], dtype=np.int64)])
    val = np.concatenate([np.asarray(c.shard_index, dtype=np.int64)[mine],
                          np.asarray([c.index[p] for p in c.index if keep[p]], dtype=np.int64)])
    indices = array("q", val[np.argsort(pos, kind="stable")].tobytes())
    return CentralNumbers(c.keep, indices, storage_data)


def apply_central(local: SavePlan, cn: CentralNumbers) -> SavePlan:
    """The rank's central plan, as the coordinator's global plan has it (planner data left out,
    ``storage_data`` the prefix it was given), from its own local plan."""
    if len(cn.keep) != len(local.items):
        raise ValueError(f"a central plan of {len(cn.keep)} items for a local plan of {len(local.items)}")
    items, it = [], iter(cn.indices)
    for item, keep in zip(local.items, cn.keep):
        if not keep:
            continue
        if item.type != WriteItemType.BYTE_IO:
            item = dataclasses.replace(item, index=dataclasses.replace(item.index, index=next(it)))
        items.append(item)
    if next(it, None) is not None:
        raise ValueError("a central plan with more chunk indices than the local plan has tensor items")
    return dataclasses.replace(local, items=items, storage_data=cn.storage_data, planner_data=None)


def own_central(part: Any, local: SavePlan) -> SavePlan:
    """A rank's central ``SavePlan`` from what the coordinator sent back (``CentralNumbers``, or
    the plan itself where DCP's planner made it) and the local plan the rank sent."""
    return apply_central(local, part) if isinstance(part, CentralNumbers) else part


def difference_from(shared: SavePlan, plan: SavePlan, against: int) -> PlanNumbers | None:
    """What a rank sends in place of its local plan: its difference from ``shared``, rank
    ``against``'s plan, which the ranks of its process group got by one broadcast; None when that
    is no smaller (another length, more than an eighth of its items its own: another pipeline
    stage's plan, say)."""
    if len(shared.items) != len(plan.items):
        return None
    book = PlanBook()
    book.add_base(shared)
    got = _difference(0, book.bases[0], plan, len(plan.items) // 8)
    return None if got is None else dataclasses.replace(got, base=SHARED, against=against)
