"""The arrays ``metaemit.emit`` writes ``.metadata`` from: a plan's tensors as chunk arrays
(``PlanArrays``, made once per plan) and every rank's results (``rankresults.RankResults``) merged
into storage runs, a few numpy operations per rank.

The storage dict DCP's ``finish`` builds is every rank's results in rank order, a later entry for
a key replacing an earlier one. The file keeps that: its storage entries are the tensor items of
every rank in rank order (grouped by their number of dims), then the byte items in rank order, and
an unpickler's ``SETITEMS`` of a key seen before replaces it as the dict did. (DCP's deduplicated
global plan gives each key to one rank, so no key repeats in a save of ours.)

An item is a tensor chunk when its name is a tensor of the plan and its key has an offset and a
chunk index; anything else (a byte item, an item of a name the plan does not know) is written as
its own entry with its key pickled whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from raytrain_ckpt.checkpoint.format.metaemit import ByteItem, EmittedFile, StorageRun, TensorChunks, emit
from raytrain_ckpt.checkpoint.format.rankresults import RankResults

__all__ = ["PlanArrays", "byte_rows", "from_ranks"]


@dataclass
class PlanArrays:
    """A global plan's ``state_dict_metadata`` as ``emit`` takes it."""

    tensors: list[TensorChunks]
    byte_fqns: list[str]
    fqns: list[str]
    """The tensors' names, numbered in order (a storage run's ``fqn`` column)."""
    fqn_id: dict[str, int]
    planner_data: Any
    known: dict[tuple[str, ...], np.ndarray] = field(default_factory=dict)
    """A rank's names tuple -> ``ids`` of it (the ranks of a layout share a few tuples)."""

    @staticmethod
    def of(metadata: Metadata, chunks: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> PlanArrays:
        """Once per plan: each tensor's chunks from ``chunks`` (name -> (offsets, sizes), the
        planner's arrays: ``plan_on_numbers``) where it has them, else from the ``Metadata``'s
        chunk objects (O(chunks), about 1.4 µs a chunk)."""
        chunks = chunks or {}
        tensors, byte_fqns, fqns = [], [], []
        for name, md in metadata.state_dict_metadata.items():
            if isinstance(md, BytesStorageMetadata):
                byte_fqns.append(name)
                continue
            fqns.append(name)
            nd, k = len(md.size), len(md.chunks)
            given = chunks.get(name)
            if given is not None and given[0].shape == (k, nd) == given[1].shape:
                offsets, sizes = given
            else:
                offsets = np.array([c.offsets for c in md.chunks], dtype=np.int64).reshape(k, nd)
                sizes = np.array([c.sizes for c in md.chunks], dtype=np.int64).reshape(k, nd)
            tensors.append(TensorChunks(name, md.properties, tuple(md.size), offsets, sizes))
        return PlanArrays(tensors, byte_fqns, fqns, {n: i for i, n in enumerate(fqns)}, metadata.planner_data)

    def ids(self, results: RankResults) -> np.ndarray:
        """Each of a rank's names' number in ``fqns`` (-1: not a tensor of the plan); the chunks'
        names, which the ranks of a layout share, looked up once."""
        shared = self.known.get(results.fqns)
        if shared is None:
            if len(self.known) > 4_096:
                self.known.clear()
            shared = self.known[results.fqns] = self._lookup(results.fqns)
        return np.concatenate([shared, self._lookup(results.own)]) if results.own else shared

    def _lookup(self, names: tuple[str, ...]) -> np.ndarray:
        return np.array([self.fqn_id.get(n, -1) for n in names], dtype=np.int64)


def byte_rows(plan: PlanArrays, results: RankResults, gid: np.ndarray | None = None) -> np.ndarray:
    """A mask of ``results``' items written as their own entries (not a chunk of a plan's tensor);
    ``gid``: their names' numbers in the plan, when already looked up."""
    keys = results.keys
    if gid is None:
        gid = plan.ids(results)[keys[:, 0]]
    return (gid < 0) | (keys[:, 1] < 0) | (keys[:, 2] < 0)


def from_ranks(plan: PlanArrays, ranks: list[RankResults], storage_meta: Any, version: str | None) -> EmittedFile:
    """``.metadata`` of ``plan`` finished with every rank's results (in rank order)."""
    files: list[str] = []
    file_id: dict[str, int] = {}
    by_nd: dict[int, list[tuple[np.ndarray, ...]]] = {}
    byte_items: list[ByteItem] = []
    for r in ranks:
        keys, where = r.keys, r.where
        fmap = np.empty(len(r.files), dtype=np.int64)
        for j, name in enumerate(r.files):
            if name not in file_id:
                file_id[name] = len(files)
                files.append(name)
            fmap[j] = file_id[name]
        gid = plan.ids(r)[keys[:, 0]]
        own = byte_rows(plan, r, gid)
        for i in np.flatnonzero(own).tolist():
            f, at, length = where[i].tolist()
            byte_items.append(ByteItem(r.key(i), r.files[f], at, length))
        if own.all():
            continue
        chunk = ~own
        nds = keys[:, 2]
        for nd in np.unique(nds[chunk]).tolist():
            sel = chunk & (nds == nd)
            w = where[sel]
            by_nd.setdefault(nd, []).append((gid[sel], keys[sel, 3:3 + nd], keys[sel, 1], fmap[w[:, 0]], w[:, 1], w[:, 2]))
    runs = [StorageRun(*(np.concatenate(col) for col in zip(*parts))) for _, parts in sorted(by_nd.items())]
    return emit(plan.tensors, plan.byte_fqns, plan.fqns, files, runs, byte_items, plan.planner_data, storage_meta,
                version)
