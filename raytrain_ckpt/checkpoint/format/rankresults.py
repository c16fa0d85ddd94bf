"""A rank's write results as numbers: what a writer reports to the CheckpointActor in place of DCP's
``WriteResult`` objects, and what ``.metadata``'s storage entries are written from
(``metaemit.emit``).

A ``WriteResult`` is four objects (the result, its ``MetadataIndex`` with a ``torch.Size``, its
``_StorageInfo``), about 140 bytes pickled and 6 µs to unpickle each; a rank of 70B at 4096 ranks
writes 2,170 of them, so the results of a first commit were 8.9 M objects for the coordinator to
unpickle (about two minutes) and pickle again into ``.metadata``. Here a rank's results are two
int64 arrays and two tuples of names:

- ``keys`` (items, 3 + dims): each item's ``MetadataIndex``: its name (a number into ``fqns``
  then ``own``), its chunk index (-1: None), the number of its offset's dims (-1: no offset) and
  the offsets, zero-padded to the widest;
- ``where`` (items, 3): where its bytes lie: its file (a number into ``files``), offset, length.

The names are split so that they are shared: ``fqns`` holds the names of the sharded tensors (a
chunk smaller than its tensor: ``sharded_names``), the same on every rank of a layout under FSDP2
(one shard of every parameter and moment a rank), and ``own`` the rest: byte items, whole tensors
such as a rank's own RNG state, and the optimizer's step counters, which DCP's dedup gives to one
rank each. Each process keeps one tuple of each
distinct ``fqns`` (``RankResults.of`` and ``interned``), so that a node's batch of reports pickles
it once and the coordinator holds it once. A rank of 70B's arrays are 140 KB (its names 150 KB,
once a batch).

Only what the project's writers write is carried: a result whose storage has transform
descriptors (DCP's compression extensions) raises, since a file written that way is not one this
project's reader takes either.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

__all__ = ["RankResults", "ResultsDelta", "sharded_names"]


def sharded_names(plan: Any) -> frozenset[str]:
    """The names of ``plan``'s items that are a part of their tensor (a DTensor's shard)."""
    return frozenset(item.index.fqn for item in plan.items
                     if item.tensor_data is not None and tuple(item.tensor_data.chunk.sizes) != tuple(item.tensor_data.size))


_NAMES: dict[tuple[str, ...], tuple[str, ...]] = {}
"""The names tuples the coordinator holds, one object per distinct tuple (``interned``)."""


@dataclass(frozen=True, eq=False)
class RankResults:
    """One rank's write results, in the order it wrote them (see the module's note)."""

    fqns: tuple[str, ...]
    """Names of the sharded tensors' chunks (``keys[:, 0]`` below ``len(fqns)``): shared by the ranks of a layout."""
    own: tuple[str, ...]
    """Names of the other items (``keys[:, 0] - len(fqns)``)."""
    files: tuple[str, ...]
    keys: np.ndarray
    where: np.ndarray

    def __len__(self) -> int:
        return len(self.where)

    @staticmethod
    def of(results: list[Any], sharded: frozenset[str] | None = None) -> RankResults:
        """The numbers of a rank's ``WriteResult``s. ``sharded``: the names whose items go to
        ``fqns`` (``sharded_names`` of the rank's plan); default: every tensor of a dimension or more."""
        names: dict[str, int] = {}
        own: dict[str, int] = {}
        files: dict[str, int] = {}
        width = max((len(wr.index.offset) for wr in results if wr.index.offset is not None), default=0)
        keys = np.zeros((len(results), 3 + width), dtype=np.int64)
        where = np.zeros((len(results), 3), dtype=np.int64)
        for i, wr in enumerate(results):
            info, index = wr.storage_data, wr.index
            if not isinstance(info, _StorageInfo) or info.transform_descriptors:
                raise ValueError(f"write result of {index.fqn!r} has storage {info!r}: only a file, offset "
                                 "and length are reported (no transform descriptors)")
            row = keys[i]
            row[1] = -1 if index.index is None else index.index
            if not index.offset if sharded is None else index.fqn not in sharded:
                row[0] = -1 - own.setdefault(index.fqn, len(own))  # numbered after the chunks' names below
            else:
                row[0] = names.setdefault(index.fqn, len(names))
            if index.offset is None:
                row[2] = -1
            else:
                row[2] = len(index.offset)
                row[3:3 + len(index.offset)] = index.offset
            where[i] = (files.setdefault(info.relative_path, len(files)), info.offset, info.length)
        mine = keys[:, 0] < 0
        keys[mine, 0] = len(names) - 1 - keys[mine, 0]
        return RankResults(tuple(names), tuple(own), tuple(files), keys, where).interned()

    def digest(self) -> str:
        """Equal digests, equal results (every key and every storage)."""
        h = hashlib.blake2b(digest_size=16)
        for names in (self.fqns, self.own, self.files):
            h.update(f"{len(names)}:".encode())
            h.update("\0".join(names).encode("utf-8", "surrogatepass"))
        for a in (self.keys, self.where):
            h.update(str(a.shape).encode())
            h.update(np.ascontiguousarray(a).tobytes())
        return h.hexdigest()

    def interned(self) -> RankResults:
        """The same results holding this process's one tuple of their chunks' names."""
        if len(_NAMES) > 4_096:  # names of long-gone layouts: start over
            _NAMES.clear()
        fqns = _NAMES.setdefault(self.fqns, self.fqns)
        return self if fqns is self.fqns else RankResults(fqns, self.own, self.files, self.keys, self.where)

    def name(self, j: int) -> str:
        """Name number ``j`` (``keys[:, 0]``)."""
        return self.fqns[j] if j < len(self.fqns) else self.own[j - len(self.fqns)]

    def key(self, i: int) -> MetadataIndex:
        """Item ``i``'s ``MetadataIndex``, as its ``WriteResult`` had it."""
        row = self.keys[i].tolist()
        offset = None if row[2] < 0 else torch.Size(row[3:3 + row[2]])
        return MetadataIndex(self.name(row[0]), offset, None if row[1] < 0 else row[1])

    def storage(self, i: int) -> _StorageInfo:
        """Item ``i``'s storage, as its ``WriteResult`` had it."""
        file, at, length = self.where[i].tolist()
        return _StorageInfo(self.files[file], at, length)

    def delta_from(self, old: RankResults, base: str) -> ResultsDelta | None:
        """These results as the rows that differ from ``old`` (whose digest is ``base``); None when
        more than where items lie changed (other names, keys or files)."""
        if (self.fqns != old.fqns or self.own != old.own or self.files != old.files
                or self.keys.shape != old.keys.shape or self.where.shape != old.where.shape
                or not np.array_equal(self.keys, old.keys)):
            return None
        rows = np.flatnonzero((self.where != old.where).any(axis=1))
        return ResultsDelta(base, rows, self.where[rows])

    def storage_dict(self) -> dict[MetadataIndex, _StorageInfo]:
        """Key -> storage of every item (O(items): tests and small tools)."""
        return {self.key(i): self.storage(i) for i in range(len(self))}


@dataclass(frozen=True, eq=False)
class ResultsDelta:
    """A rank's results sent as the rows that differ from the results it last delivered for the
    plan (a save whose byte items grew: a few rows of the ``where`` array), which the coordinator
    applies to the ones it holds when their digest is ``base``."""

    base: str
    rows: np.ndarray
    where: np.ndarray

    def apply(self, old: RankResults) -> RankResults:
        where = old.where.copy()
        where[self.rows] = self.where
        return RankResults(old.fqns, old.own, old.files, old.keys, where)
