"""The node's calls into the CheckpointActor: one call carries what several ranks have to say.

A save used to make four small calls per rank into the one CheckpointActor (the rank's
``open_step`` and ``record_stall``, the writer's ``accepted`` and ``report``): 16,384 at 4096
ranks, all into one async actor. The rank's ``open_step`` stays its own (the actor then knows
the step is in flight even when the node's writer stops answering). The node's writer takes
every rank's hand-off, so it speaks for them: ``NodeCourier`` queues each rank's hand-off,
report and stall and sends what is queued as one ``NodeBatch`` (``CheckpointActor.node_accepted``
for hand-offs and stalls, retried across a restart of the actor; ``node_report`` for reports,
never made twice) once every rank of the node the writer knows of has sent the same kind for the
step, or once the oldest entry has waited its window: 4096 + 1024 calls a save at 4096 ranks of
8 a node. Each caller blocks until the answer for its own entry comes (an entry's error is raised
to its caller alone); a stall is not waited for and rides with the next batch. The actor counts ranks, not
calls: a step commits when every rank of the group reported, whichever calls brought them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from raytrain_ckpt.checkpoint.records import NodeAnswer, NodeBatch, RankReport, WriterRef

logger = logging.getLogger(__name__)

__all__ = ["HAND_OFF_WINDOW_S", "NodeCourier", "REPORT_WINDOW_S", "STALL_WINDOW_S"]

HAND_OFF_WINDOW_S = 0.05
"""How long a hand-off waits for the node's other ranks' (their copies begin together, after a collective)."""
REPORT_WINDOW_S = 0.25
"""How long a report waits for the node's other ranks' (their writes end within about this of each other)."""
STALL_WINDOW_S = 5.0
"""How long a stall waits for a batch to ride with (the node's reports of the step follow it); one
of a step this node already reported (a save that waited for its commit) goes at once."""

_WINDOW = {"accepted": HAND_OFF_WINDOW_S, "report": REPORT_WINDOW_S, "stall": STALL_WINDOW_S}


@dataclass
class _Entry:
    kind: str
    step: int
    rank: int
    attempt: int
    payload: Any
    since: float = field(default_factory=time.monotonic)
    answer: Future = field(default_factory=Future)


class NodeCourier:
    """Batches one node's calls into the CheckpointActor; see the module docstring.

    ``send(batch)`` makes the call (a blocking Ray call in the writer); ``writer()`` is the
    writer's ``WriterRef``. The ranks of the node, per attempt, are what ``expect`` was told (the
    writer tells it each rank whose staging buffer it allocates).
    """

    def __init__(self, send: Callable[[NodeBatch], NodeAnswer], writer: Callable[[], WriterRef | None],
                 windows: dict[str, float] | None = None) -> None:
        self._send, self._writer = send, writer
        self._windows = {**_WINDOW, **(windows or {})}
        self._cond = threading.Condition()
        self._queue: list[_Entry] = []
        self._ranks: dict[int, set[int]] = {}
        self._reported: list[int] = []
        """The steps whose reports this node sent lately."""
        self._thread: threading.Thread | None = None
        self.calls = 0
        """Batches sent (what the benchmarks and tests count)."""

    def expect(self, attempt: int, rank: int) -> None:
        """Rank ``rank`` of ``attempt`` saves through this node's writer."""
        with self._cond:
            for old in [a for a in self._ranks if a < attempt]:
                del self._ranks[old]
            self._ranks.setdefault(attempt, set()).add(rank)
            self._cond.notify_all()

    def accepted(self, step: int, rank: int, attempt: int) -> str:
        """Tell the actor this writer holds rank ``rank``'s hand-off of ``step``; its temporary directory."""
        return self._put("accepted", step, rank, attempt, None).result()

    def report(self, report: RankReport) -> str:
        """Report rank ``report.rank``'s files of its step: ``"committed"`` or ``"pending"``."""
        return self._put("report", report.step, report.rank, report.attempt, report).result()

    def stall(self, step: int, rank: int, seconds: float) -> None:
        """Rank ``rank``'s training thread was blocked ``seconds`` by the save of ``step`` (not waited for)."""
        self._put("stall", step, rank, -1, seconds)

    def _put(self, kind: str, step: int, rank: int, attempt: int, payload: Any) -> Future:
        entry = _Entry(kind, step, rank, attempt, payload)
        with self._cond:
            self._queue.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="rtc-courier", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return entry.answer

    def _ready(self) -> bool:
        """Whether the queue goes now: some kind of some step has every rank of the node, or the
        oldest entry's window is over."""
        now = time.monotonic()
        if any(now >= e.since + self._windows[e.kind] or (e.kind == "stall" and e.step in self._reported)
               for e in self._queue):
            return True
        groups: dict[tuple[str, int, int], set[int]] = {}
        for e in self._queue:
            if e.kind != "stall":
                groups.setdefault((e.kind, e.step, e.attempt), set()).add(e.rank)
        return any(ranks >= self._ranks.get(attempt, {-1}) for (_, _, attempt), ranks in groups.items())

    def _wait_s(self) -> float:
        return max(0.0, min(e.since + self._windows[e.kind] for e in self._queue) - time.monotonic())

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue or not self._ready():
                    self._cond.wait(self._wait_s() if self._queue else None)
                batch, self._queue = self._queue, []
            self._deliver(batch)

    def _deliver(self, queued: list[_Entry]) -> None:
        """Sends what was queued: in two calls when it holds both hand-offs and reports (the
        hand-offs' call outlives a restart of the actor, a report's is not made twice)."""
        if any(e.kind == "accepted" for e in queued) and any(e.kind == "report" for e in queued):
            self._send_one([e for e in queued if e.kind != "report"])
            self._send_one([e for e in queued if e.kind == "report"])
        else:
            self._send_one(queued)

    def _send_one(self, entries: list[_Entry]) -> None:
        accepted = [e for e in entries if e.kind == "accepted"]
        reports = [e for e in entries if e.kind == "report"]
        batch = NodeBatch(self._writer() if accepted else None,
                          tuple((e.step, e.rank, e.attempt) for e in accepted),
                          tuple(e.payload for e in reports),
                          tuple((e.step, e.rank, e.payload) for e in entries if e.kind == "stall"))
        with self._cond:
            self._reported = sorted({*self._reported, *(e.step for e in reports)})[-8:]
        try:
            self.calls += 1
            answer = self._send(batch)
        except BaseException as exc:  # the actor restarting or gone: every caller sees why
            for e in entries:
                if e.kind == "stall":
                    logger.debug("stall of rank %d step %d not recorded: %s", e.rank, e.step, exc)
                else:
                    e.answer.set_exception(exc)
            return
        for e, out in [*zip(accepted, answer.accepted), *zip(reports, answer.reports)]:
            if isinstance(out, BaseException):
                e.answer.set_exception(out)
            else:
                e.answer.set_result(out)
        for e in entries:
            if e.kind == "stall":
                e.answer.set_result(None)
