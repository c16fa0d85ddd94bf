"""What repeats between the saves of one layout: each rank's write results and the ``.metadata``
built from them.

Within an attempt every save of a layout writes the same items to the same files; a rank's
results (each item's file, offset and length: ``format/rankresults.py``) change only when a byte item's pickled
length changes (a counter that gains a digit, a longer RNG state), which moves every item
written after it. Rebuilding ``.metadata`` from every rank's results is O(ranks x tensors) per
save (4.5 s at 64 ranks of 70B), so both ends remember what they last exchanged:

- the writer sends a digest of a rank's results with each report, and leaves the results out
  when they equal those it last delivered for the same rank and plan (``SentResults``), or sends
  only the rows that differ (``ResultsDelta``: a save whose byte items grew moves a few rows);
- the coordinator keeps each rank's last results per plan (``ResultsCache``), fills a report
  sent without them from there, and when every rank's digest equals those of the step it
  last committed for the plan, copies that step's ``.metadata`` into the new step instead of
  building it: identical bytes, since ``.metadata`` holds nothing else that changes per step
  (its ``storage_meta`` is fixed per plan: see ``plan_storage_meta``).

The coordinator's cache holds one save's results of every rank between saves (what a save in
flight held before, so the peak memory is the same; the memory between saves is no longer freed),
for the newest plan only.

The commit protocol does not change: a step commits only when every rank's report is in; a
report sent by digest that the coordinator cannot resolve (it restarted since) is answered
``RESEND`` (so is a delta whose base it does not hold) and the writer sends the same report
again with its results, the step still in
flight; any changed digest makes ``.metadata`` again (``metadatafile.py``: spliced from the
last one when only byte items moved, else built in full).

A restarted coordinator has lost its plans too, while the ranks keep using theirs: a report of a
plan it does not know is resolved from the newest committed step of that plan
(``committed_plan``: each ``.metadata`` records its plan in ``storage_meta``, and every save of
a plan shares its tensor and byte entries' descriptions), so a save in flight through a
restart of the CheckpointActor (a drain of its node) still commits.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint
from raytrain_ckpt.checkpoint.format.manifest import Manifest
from raytrain_ckpt.checkpoint.format.metadata import load_metadata
from raytrain_ckpt.checkpoint.format.names import Location
from raytrain_ckpt.checkpoint.format.rankresults import RankResults, ResultsDelta
from raytrain_ckpt.checkpoint.format.verify import check_file
from raytrain_ckpt.checkpoint.records import RankReport
from raytrain_ckpt.common.locations import is_uri

logger = logging.getLogger(__name__)

__all__ = ["RESEND", "ResultsCache", "SentResults", "committed_plan", "copy_metadata", "plan_storage_meta"]

RESEND = "resend"
"""The coordinator's answer to a report sent by digest whose results it does not hold (it
restarted since the writer last delivered them): the writer sends the report again in full."""


def plan_storage_meta(plan_id: str) -> StorageMeta:
    """The ``storage_meta`` every ``.metadata`` of plan ``plan_id`` records. DCP's writer records
    the temporary directory it wrote to and a fresh uuid, which no reader uses (a loader sets
    its own ``load_id``) and which would make each save's ``.metadata`` differ; the plan id keeps
    the saves of one plan byte-identical where their results are."""
    return StorageMeta(checkpoint_id=None, save_id=f"plan-{plan_id}")


class SentResults:
    """Writer side: the results last delivered per rank, to send a digest alone when a rank's next
    results are the same, and the rows that differ when only where items lie changed."""

    def __init__(self) -> None:
        self._sent: dict[int, tuple[str, str, RankResults]] = {}
        """rank -> (plan id, digest, results) the coordinator last accepted from this writer."""
        self._slimmed: dict[int, tuple[str, str, RankResults]] = {}
        """rank -> the same of the report last slimmed (``delivered`` takes it over)."""

    def slim(self, report: RankReport) -> RankReport:
        """``report`` with its digest set, and its results as the coordinator can take them: none
        when it holds them, the rows that differ from the ones it holds (``ResultsDelta``), or all."""
        digest = report.results.digest()
        slim = replace(report, digest=digest)
        self._slimmed[report.rank] = (report.plan_id, digest, report.results)
        held = self._sent.get(report.rank)
        if held is None or held[0] != report.plan_id:
            return slim
        if held[1] == digest:
            return replace(slim, results=None)
        delta = report.results.delta_from(held[2], held[1])
        return slim if delta is None else replace(slim, results=delta)

    def delivered(self, report: RankReport) -> None:
        """The coordinator answered ``report`` (committed or pending): it holds its results."""
        slimmed = self._slimmed.get(report.rank)
        if slimmed is not None and slimmed[:2] == (report.plan_id, report.digest):
            self._sent[report.rank] = slimmed
        else:
            self._sent.pop(report.rank, None)

    def lost(self, rank: int) -> None:
        """A report of ``rank`` was not answered normally: send its results in full next time."""
        self._sent.pop(rank, None)

    def send(self, report: RankReport, call: Callable[[RankReport], Any]) -> Any:
        """``call(report)`` with the report slimmed (``slim``), remembering what the coordinator
        holds when it answers and forgetting it when it does not; sent again with its results
        when the coordinator answers ``RESEND``."""
        slim = self.slim(report)
        try:
            out = call(slim)
            if out == RESEND:  # only ever the answer to a report sent by digest
                logger.info("step %d rank %d: the checkpoint actor no longer holds this rank's results "
                            "(it restarted): sending them again", report.step, report.rank)
                slim = replace(slim, results=report.results)
                out = call(slim)
        except BaseException:
            self.lost(report.rank)
            raise
        self.delivered(slim)
        return out


@dataclass
class _Built:
    digests: dict[int, str]
    """rank -> digest of the results the ``.metadata`` was built from."""
    path: Location
    """Where that ``.metadata`` lies (the committed step's, once the step is committed)."""
    entry: dict[str, int]
    """Its manifest entry (size, CRC-32C)."""


@dataclass
class ResultsCache:
    """Coordinator side: per plan, every rank's last results and the last ``.metadata`` built."""

    results: dict[str, dict[int, tuple[str, RankResults]]] = field(default_factory=dict)
    built: dict[str, _Built] = field(default_factory=dict)
    reused: int = 0
    """How many commits copied an earlier ``.metadata`` (read by tests and the benchmark)."""
    rebuilt: int = 0

    def keep_only(self, plan_id: str) -> None:
        """A new plan replaced the others: forget theirs (O(ranks x tensors) of results)."""
        for table in (self.results, self.built):
            for old in [p for p in table if p != plan_id]:
                del table[old]

    def resolve(self, report: RankReport) -> RankReport | None:
        """Record ``report``'s results, or fill them in from the last ones its rank sent for the
        plan; None when a report sent by digest does not match them (the writer sends them again)."""
        ranks = self.results.setdefault(report.plan_id, {})
        if isinstance(report.results, ResultsDelta):
            held = ranks.get(report.rank)
            if held is None or held[0] != report.results.base:
                return None
            ranks[report.rank] = (report.digest, report.results.apply(held[1]))
            return replace(report, results=ranks[report.rank][1])
        if report.results is not None:
            results = report.results.interned()
            ranks[report.rank] = (report.digest or results.digest(), results)
            return replace(report, results=results, digest=ranks[report.rank][0])
        held = ranks.get(report.rank)
        if held is None or held[0] != report.digest:
            return None
        return replace(report, results=held[1])

    def reusable(self, plan_id: str, reports: list[RankReport]) -> _Built | None:
        """The ``.metadata`` built last for ``plan_id`` when every rank's results equal those it was built from."""
        built = self.built.get(plan_id)
        if built is None or len(built.digests) != len(reports):
            return None
        if any(built.digests.get(r.rank) != r.digest for r in reports):
            return None
        return built

    def record(self, plan_id: str, reports: list[RankReport], path: Location, entry: dict[str, int]) -> None:
        """The ``.metadata`` at ``path`` holds ``reports``' results: later saves may copy it."""
        self.built[plan_id] = _Built({r.rank: r.digest for r in reports}, path, entry)


def copy_metadata(storage: Any, src: Location, dst: Location) -> bool:
    """Put the bytes of ``src`` at ``dst``: a file copy, fsynced, on POSIX storage (at disk speed,
    no pickling; not a hard link, which would make one damaged file damage every step sharing
    it, the older steps a restart falls back to included), a server-side copy on an object store.
    False when that failed (``src`` was deleted or moved aside): build it instead."""
    try:
        storage.copy_file(src, dst)
        if not is_uri(str(dst)):
            with open(dst, "rb") as f:
                os.fsync(f.fileno())
        return True
    except Exception as exc:  # noqa: BLE001 - whatever failed, the caller builds the file in full instead
        logger.info("could not reuse %s for %s (%s): building it", src, dst, exc)
        return False


def committed_plan(storage: Any, step_dir: Callable[[int], Location], committed: dict[int, Manifest],
                   plan_id: str) -> Metadata | None:
    """The global plan ``plan_id`` (``f"{attempt}.{first step}"``) as its newest committed step's
    ``.metadata`` describes it (its tensors' and byte items' entries and the planner's data, no
    storage entries), read back after a restart of the coordinator; None when no committed step
    of the plan is intact. Only that one file is read: checked against its manifest entry (size
    and checksum), then unpickled by the safe reader, so this costs what a resume's read of it costs."""
    try:
        first = int(plan_id.split(".")[1])
    except (IndexError, ValueError):
        return None
    want = plan_storage_meta(plan_id).save_id
    for step in sorted((s for s in committed if s >= first), reverse=True):
        entry = committed[step].files.get(".metadata")
        path = storage.join(step_dir(step), ".metadata")
        if entry is None or check_file(storage, path, entry, checksum=True) is not None:
            continue
        try:
            with storage.open_read(path) as f:
                metadata = load_metadata(f, str(path))
        except (InvalidCheckpoint, OSError) as exc:
            logger.info("plan %s: step %d's .metadata is not readable (%s)", plan_id, step, exc)
            continue
        if metadata.storage_meta is not None and metadata.storage_meta.save_id == want:
            return Metadata(state_dict_metadata=metadata.state_dict_metadata, planner_data=metadata.planner_data)
    return None
