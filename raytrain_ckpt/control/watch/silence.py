"""Silence: a checkpoint writer or the CheckpointActor that stops answering while the job trains.

The driver pings each of them (Ray's ``__ray_ready__``, one ping in flight per process) at every
poll; a ping answers in milliseconds, even while the process writes (its calls run on a thread
pool), so one left unanswered means the process is stopped or every thread of it is held (a hung
filesystem). A silence longer than ``NOTICE_S`` is named in ``status`` (the step and the
process); one longer than ``silence_budget_s`` is a failure of that process, kind
``writer_hang``: it is killed and Ray restarts it, the save in flight is aborted (its ranks'
calls to it fail), and training goes on, without a restart of the group and without spending
``max_restarts``. At most ``MAX_REPLACEMENTS`` per job: past that it is handled as a hang of the
ranks would be (the group restarts, on ``max_restarts``).

A writer's ping is its ``write_stalls()``: besides answering, it says how long each write in
progress has moved no bytes. A write stuck in the file system while its writer answers (one
thread held, the others free) is a silence of its own, keyed ``"<writer>STALLED<rank R step S>"``:
named in ``status`` past ``NOTICE_S`` ("moved no bytes of its write of rank R step S for Ns"),
and past the budget its writer is replaced as a silent one is (the save aborted, training on).

Pure: no Ray, no torch (the controller imports it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from raytrain_ckpt.checkpoint.records import STALLED
from raytrain_ckpt.common.events import Failure, headline
from raytrain_ckpt.control.watch import Act, Verdict
from raytrain_ckpt.control.watch.hangs import FLOOR_S

if TYPE_CHECKING:
    from raytrain_ckpt.control.poll import GroupPoll, WorkerGroup
    from raytrain_ckpt.control.watch.hangs import HangClock, HangWatch

logger = logging.getLogger(__name__)

__all__ = ["MAX_REPLACEMENTS", "NOTICE_S", "STALLED", "SilenceWatch", "overdue", "silence_budget_s", "stuck_line"]

NOTICE_S = 10.0
"""Silence after which ``status`` names the process (the bound a restart's ping waits)."""
MAX_REPLACEMENTS = 3
"""Processes replaced while training, per job, before a silence restarts the group instead."""


def silence_budget_s(fixed_s: float | None, learned_s: float | None, floor_s: float,
                     save_s: float | None) -> float:
    """How long a writer or the actor may leave a ping unanswered: the hang timeout of a step
    (``fixed_s``, else the learned one ``learned_s``, else ``floor_s``: a ping does not wait on a
    step, so the first steps' long budget does not apply), never more than a save's own bound
    ``save_s`` (``checkpoint.commit_timeout_s``), so the process is named before its ranks' save
    runs out of time and the ranks are blamed."""
    step = fixed_s if fixed_s is not None else learned_s if learned_s is not None else floor_s
    return min(step, save_s) if save_s is not None else step


def overdue(silences: Mapping[str, float], budget_s: float) -> list[str]:
    """The processes (by name) silent for longer than ``budget_s``, in name order."""
    return sorted(what for what, s in silences.items() if s > budget_s)


def stuck_line(step: int, saving: bool, silences: Mapping[str, float], notice_s: float = NOTICE_S,
               in_flight: int | None = None) -> str | None:
    """The ``status`` line for processes silent longer than ``notice_s`` (None: none is).

    ``step``: the slowest rank's step; ``saving``: some rank is inside the save of the next step;
    ``in_flight``: the oldest step the CheckpointActor has in flight (None: unknown or none), the
    save the silent process holds up.
    """
    late = sorted(((s, what) for what, s in silences.items() if s > notice_s), reverse=True)
    if not late:
        return None
    where = (f"step {in_flight} (its save)" if in_flight is not None
             else f"step {step + 1} (its save)" if saving else f"step {step}")
    return f"stuck: {where}, " + "; ".join(_silent(what, s) for s, what in late)


def _silent(what: str, seconds: float) -> str:
    writer, _, write = what.partition(STALLED)
    if write:
        return f"{writer} moved no bytes of its write of {write} for {seconds:.0f}s"
    return f"{what} has not answered for {seconds:.0f}s"


class SilenceWatch:
    """The controller's watch over the checkpoint writers and the actor (a ``Watch``): a process
    silent past its budget is replaced while the group trains on (a ``PROCEED`` verdict, a
    ``writer_hang`` recovered from), at most ``MAX_REPLACEMENTS`` per job; the silence is in
    ``status`` meanwhile. ``hang``: the job's hang watch, whose budget bounds a silence's and
    whose step budget starts again once the process its ranks waited on was replaced."""

    def __init__(self, spec: Any, hang: HangWatch) -> None:
        self._hang = hang
        ck = spec.checkpoint
        self._save_s = ck.commit_timeout_s if ck.enabled else None
        self.stuck: str | None = None
        """A checkpoint writer or the actor silent now, with the step (``stuck_line``)."""
        self.replaced = 0

    def new_attempt(self) -> None:
        pass  # silences are the checkpoint processes', which outlive attempts

    def status(self) -> dict[str, Any]:
        return {"stuck": self.stuck}

    def observe(self, poll: GroupPoll, group: WorkerGroup, attempt: int) -> Verdict | None:
        """A process silent past its budget, replaced: the ``writer_hang`` recorded, training on."""
        found = self.replace_silent(group, poll, self._hang.hung(poll), self._hang.hangs, attempt)
        if found is None:
            return None
        text, replaced = found
        logger.error("attempt %d writer_hang (%d/%d, max_restarts not spent): %s", attempt, self.replaced,
                     MAX_REPLACEMENTS, text)
        self._hang.waited(text)  # its ranks waited on it: the step budget starts again
        return Verdict(Act.PROCEED, recorded=(Failure(attempt, "writer_hang", None, headline(text),
                                                      "\n".join([text, *replaced])),),
                       events=(f"attempt {attempt} writer_hang detected",
                               *(f"attempt {attempt}: {note}" for note in replaced)))

    def replace_silent(self, group: WorkerGroup, poll: GroupPoll, hung: bool, hangs: HangClock,
                       attempt: int) -> tuple[str, list[str]] | None:
        """The text of a silence past its budget and one line per process replaced for it; None:
        none replaced. ``hung``: the ranks are past their hang timeout; one silent past
        ``NOTICE_S`` is then what they wait on (a save), replaced instead of blaming them."""
        silences = group.checkpointing_silences()
        saving = "saving" in poll.phases.values()
        in_flight = None
        if any(v > NOTICE_S for v in silences.values()):
            in_flight = group.save_in_flight()
        self.stuck = stuck_line(poll.min_step, saving, silences, in_flight=in_flight)
        budget = silence_budget_s(hangs.fixed, hangs.learned_s(), FLOOR_S, self._save_s)
        budget = min(budget, NOTICE_S) if hung else budget
        late = overdue(silences, budget)
        if not late or self.replaced >= MAX_REPLACEMENTS:
            return None
        why = "its ranks are past their hang timeout" if hung else "the hang timeout of a step"
        text = (f"{stuck_line(poll.min_step, saving, {w: silences[w] for w in late}, budget, in_flight)}: "
                f"silent for longer than "
                f"{budget:.0f}s ({why}); replaced, training continues")
        stalled = {w: budget for w in late if STALLED in w}
        replaced = group.replace_silent_checkpointing(stalled)
        if not replaced:  # it answered the confirming ping: a pause, not a hang
            logger.warning("attempt %d: %s answered again; not replaced", attempt, ", ".join(late))
            return None
        self.replaced += 1
        self.stuck = None
        return text, replaced
