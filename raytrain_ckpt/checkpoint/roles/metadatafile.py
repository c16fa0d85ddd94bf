"""Each save's ``.metadata``: spliced from the last one built for the plan when only byte items
moved, else built in full (``format/metapickle.py`` writes both, the same bytes for the same results).

A save whose every rank's results equal the last commit's copies that commit's file
(``repeats.py``). When some ranks' results differ, the coordinator looks at those ranks alone:
each still wrote as many items, its byte items lie at the same positions among them (recorded
at the last full build), the first tensor item after each run of byte items has the same storage,
and a digest of all its tensor items' results equals the one recorded then. If so, only byte items
moved (a pickled counter or RNG state of a new length, in a file whose tensors it does not
precede), and the new file is the last one with those items' offsets and lengths re-encoded
(``metapickle.splice``). Anything else (a new shape, a moved tensor chunk, a byte item in
another file, a rank more or less) builds in full.

The digest of a rank's tensor results is made by its writer, which pickles the results anyway
for the digest of the whole report (``repeats.SentResults``), and sent with the positions of the
byte items; the coordinator takes it when those positions are the ones it recorded, and computes
it itself only for a report without them. So a spliced save costs the coordinator O(changed byte
items) (their re-encoding, found by a walk of each value's few opcodes) and the write of the file,
not O(changed ranks x their items).

Held between saves, for the newest plan only: the last file's bytes (the size of ``.metadata``)
and, per rank, its item count, byte positions and tensor digest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from raytrain_ckpt.checkpoint.format.metapickle import MetadataPickle, build, splice
from raytrain_ckpt.checkpoint.records import RankReport
from raytrain_ckpt.checkpoint.roles.repeats import plan_storage_meta, tensor_digest

__all__ = ["MetadataFiles"]


@dataclass(frozen=True)
class _RankShape:
    count: int
    """How many results the rank wrote."""
    byte_at: tuple[int, ...]
    """Positions of its byte items among them."""
    after: tuple[tuple[int, Any], ...]
    """(position, storage) of the tensor item right after each run of byte items: a cheap first test."""
    tensors: str
    """Digest of every other item's result (``repeats.tensor_digest``)."""


def _shape(report: RankReport, byte_keys: dict[MetadataIndex, Any]) -> _RankShape:
    results = report.results
    byte_at = tuple(i for i, wr in enumerate(results) if wr.index in byte_keys)
    after = tuple((i + 1, results[i + 1].storage_data) for i in byte_at
                  if i + 1 < len(results) and i + 1 not in byte_at)
    return _RankShape(len(results), byte_at, after, _tensors(report, byte_at))


def _tensors(report: RankReport, byte_at: tuple[int, ...]) -> str:
    """The digest of the report's tensor results: the writer's, when it names the same byte items
    (O(1) here), else computed (O(the rank's items))."""
    if report.tensor_digest and report.byte_at == byte_at:
        return report.tensor_digest
    return tensor_digest(report.results, byte_at)


@dataclass
class _Last:
    plan_id: str
    file: MetadataPickle
    digests: dict[int, str]
    """rank -> digest of the results the file was made from."""
    shapes: dict[int, _RankShape]


class MetadataFiles:
    """The ``.metadata`` of each save, and what the last one of the newest plan was made from."""

    def __init__(self) -> None:
        self._last: _Last | None = None
        self.spliced = 0
        """Files spliced from the last one (read by tests and the benchmark)."""
        self.built = 0

    def make(self, plan_id: str, metadata: Metadata, reports: list[RankReport]) -> bytes:
        """The ``.metadata`` bytes of ``reports`` (every rank's, in rank order) under the plan
        ``plan_id`` whose global plan built ``metadata``: spliced when only byte items moved (a
        full build pauses the cyclic collector: ``metapickle.build``)."""
        file = self._spliced(plan_id, reports)
        if file is not None:
            self.spliced += 1
            self._last = _Last(plan_id, file, {r.rank: r.digest for r in reports}, self._last.shapes)
            return file.data
        self.built += 1
        results = [r.results for r in reports]
        file = build(metadata, results, CURRENT_DCP_VERSION, plan_storage_meta(plan_id))
        self._last = _Last(plan_id, file, {r.rank: r.digest for r in reports}, self._shapes(file, reports))
        return file.data

    @staticmethod
    def _shapes(file: MetadataPickle, reports: list[RankReport]) -> dict[int, _RankShape]:
        if file.count != sum(len(r.results) for r in reports):
            return {}  # a key written by two ranks (DCP's dedup makes none): the last one wins, build in full
        return {r.rank: _shape(r, file.entries) for r in reports}

    def _spliced(self, plan_id: str, reports: list[RankReport]) -> MetadataPickle | None:
        last = self._last
        if last is None or last.plan_id != plan_id or set(last.shapes) != {r.rank for r in reports}:
            return None
        changed: dict[MetadataIndex, Any] = {}
        for r in reports:
            if r.digest == last.digests.get(r.rank):
                continue
            moved = _byte_moves(last.shapes[r.rank], r, last.file)
            if moved is None:
                return None
            changed.update(moved)
        return splice(last.file, changed)


def _byte_moves(shape: _RankShape, report: RankReport, file: MetadataPickle) -> dict[MetadataIndex, Any] | None:
    """The byte items of one rank whose storage differs from ``file``'s, or None when anything
    but byte items changed."""
    results = report.results
    if results is None or len(results) != shape.count:
        return None
    if report.byte_at is not None and report.byte_at != shape.byte_at:
        return None  # the writer's byte items lie elsewhere among its results
    if any(results[i].storage_data != info for i, info in shape.after):
        return None  # a tensor moved (the usual case: a byte item written before it changed length)
    moved = {}
    for i in shape.byte_at:
        wr = results[i]
        entry = file.entries.get(wr.index)
        if entry is None:
            return None
        if wr.storage_data != entry.info:
            moved[wr.index] = wr.storage_data
    if _tensors(report, shape.byte_at) != shape.tensors:
        return None
    return moved
