"""Each save's ``.metadata``: written from arrays (``format/metaemit.py``), and spliced from the last
one of the plan when only byte items moved.

A save whose every rank's results equal the last commit's copies that commit's file
(``repeats.py``). When some ranks' results differ, the coordinator compares those ranks' numbers
with the ones the last file was made from (``format/rankresults.py``): the same names, keys and
files, and every difference in a byte item's offset or length. Then only byte items moved (a pickled
counter or RNG state of a new length, written after its file's tensors), and the new file is the last
one with those items' two ints overwritten (``EmittedFile.moved``: every entry of the file has a
fixed width, so no byte moves). Anything else (a new shape, a moved tensor chunk, a byte item in
another file, a rank more or less) writes the file anew, which is a few numpy operations per rank
and the fill of its rows as they are written (``format/metarows.py``). A spliced file is byte for
byte the full build of the same results (``tests/unit/test_metadatafile.py``).

The comparison is O(items) numpy per changed rank (``RankResults.delta_from``; a rank of 70B: about
0.16 ms), so a save of 4096 ranks whose byte items all moved costs the coordinator about 0.7 s
before the write.

Held between saves, for the newest plan only: the last file (its tensor rows as the plan's and the
ranks' arrays; filled when written) and each rank's results it was made from.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import Metadata

from raytrain_ckpt.checkpoint.format.metaemit import EmittedFile
from raytrain_ckpt.checkpoint.format.metarows import PlanArrays, byte_rows, from_ranks
from raytrain_ckpt.checkpoint.format.rankresults import RankResults
from raytrain_ckpt.checkpoint.records import RankReport
from raytrain_ckpt.checkpoint.roles.repeats import plan_storage_meta

__all__ = ["MetadataFiles"]


@dataclass
class _Last:
    plan_id: str
    file: EmittedFile
    ranks: dict[int, tuple[str, RankResults]]
    """rank -> (digest, results) the file was made from."""


class MetadataFiles:
    """The ``.metadata`` of each save, and what the last one of the newest plan was made from."""

    def __init__(self) -> None:
        self._last: _Last | None = None
        self._plan: tuple[str, PlanArrays] | None = None
        self._chunks: tuple[str, dict] | None = None
        self.spliced = 0
        """Files spliced from the last one (read by tests and the benchmark)."""
        self.built = 0

    def make(self, plan_id: str, metadata: Metadata, reports: list[RankReport]) -> EmittedFile:
        """The ``.metadata`` of ``reports`` (every rank's, in rank order, results as numbers) under
        the plan ``plan_id`` whose global plan built ``metadata``."""
        ranks = {r.rank: (r.digest or r.results.digest(), r.results) for r in reports}
        file = self._spliced(plan_id, metadata, ranks)
        if file is not None:
            self.spliced += 1
        else:
            self.built += 1
            file = from_ranks(self._arrays(plan_id, metadata), [r.results for r in reports],
                              plan_storage_meta(plan_id), CURRENT_DCP_VERSION)
        self._last = _Last(plan_id, file, ranks)
        return file

    def planned(self, plan_id: str, chunks: dict) -> None:
        """The new plan's tensors' chunks as arrays (``plan_on_numbers``'s), which its first file is
        written from instead of the ``Metadata``'s chunk objects (O(chunks) at about 1 µs each)."""
        self._chunks = (plan_id, chunks)

    def _arrays(self, plan_id: str, metadata: Metadata) -> PlanArrays:
        if self._plan is None or self._plan[0] != plan_id:
            chunks = self._chunks[1] if self._chunks is not None and self._chunks[0] == plan_id else {}
            self._plan = (plan_id, PlanArrays.of(metadata, chunks))
            self._chunks = None
        return self._plan[1]

    def _spliced(self, plan_id: str, metadata: Metadata,
                 ranks: dict[int, tuple[str, RankResults]]) -> EmittedFile | None:
        last = self._last
        if last is None or last.plan_id != plan_id or set(last.ranks) != set(ranks):
            return None
        plan = self._arrays(plan_id, metadata)
        moves: dict = {}
        for rank, (digest, new) in ranks.items():
            old_digest, old = last.ranks[rank]
            if digest == old_digest:
                continue
            moved = _byte_moves(plan, old, new)
            if moved is None:
                return None
            moves.update(moved)
        return last.file.moved(moves)


def _byte_moves(plan: PlanArrays, old: RankResults, new: RankResults) -> dict | None:
    """Key -> (offset, length) of each of a rank's byte items that moved, or None when anything but
    byte items' offsets and lengths changed."""
    delta = new.delta_from(old, "")
    if delta is None:
        return None  # other names, keys or files
    differ = delta.rows
    if len(differ) and (not byte_rows(plan, new)[differ].all() or (new.where[differ, 0] != old.where[differ, 0]).any()):
        return None  # a tensor chunk moved, or a byte item went to another file
    return {new.key(i): tuple(new.where[i, 1:].tolist()) for i in differ.tolist()}
