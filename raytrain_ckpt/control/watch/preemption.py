"""Preemptions: act on Ray's drain notices before the node goes.

A node that is about to go away is announced: `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
--deadline-remaining-seconds N`, the autoscaler draining a node, a spot or preemptible VM's notice
raised by its node provider. Ray records the drain in the GCS (the node and its deadline) and stops
placing work there. ``PreemptionGuard`` (the driver's side) polls that record on every controller
poll; when a node hosting a rank drains, it tells every rank (``TrainWorker.preempt``). The ranks
agree at the next step boundary on the step in hand (one collective), save and commit it, and stop;
the controller records a ``preemption`` failure (its own budget, ``fault_tolerance.max_preemptions``,
never ``max_restarts``) and starts the next attempt, which Ray places off the draining node and
which resumes from that step (memory first, as any restart). A deadline shorter than the
measured durable save uses the RAM tier (``plan_save``): the step is held in RAM on nodes that are
not draining, never committed, and the next attempt resumes from it from memory
(``checkpoint/roles/ramtier.py``); storage's latest committed step stays the fallback.

A SIGTERM to one rank's process (a pod eviction, ``rank/eviction.py``) is acted on the same way, with
``fault_tolerance.stop_grace_s`` as its deadline. A draining node that hosts no rank loses its
checkpoint writer and the CheckpointActor at once; training goes on.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from raytrain_ckpt.common.events import Failure
from raytrain_ckpt.control.poll import GroupPoll, WorkerGroup
from raytrain_ckpt.control.watch import Act, Verdict

logger = logging.getLogger(__name__)

__all__ = ["DrainNotice", "PreemptionGuard", "PreemptionRecord", "SaveCosts", "SavePlan", "draining_nodes",
           "plan_save", "stop_signals"]

STOP_MARGIN_S = 1.0
"""A group still running this close to the deadline is stopped by the driver: the node goes at the deadline."""


def draining_nodes() -> dict[str, float | None]:
    """Every draining node of the connected Ray cluster: node id (hex) -> deadline (unix seconds;
    None: no deadline). The GCS's record, the one `ray drain-node` and the autoscaler write."""
    import ray

    raw: dict[str, int] = ray._private.state.state.get_draining_nodes() or {}
    return {node: (ms / 1000.0 if ms else None) for node, ms in raw.items()}


@dataclass(frozen=True)
class SavePlan:
    """How the step in hand is saved before a deadline."""

    tier: str
    """"durable": saved and committed to checkpoint.dir (in RAM on the writers' nodes on the way);
    "ram": staged into RAM and held on nodes that are not draining (pushed off the draining node),
    never committed to storage: storage keeps its latest committed step as the fallback."""
    fits: bool
    """Whether the measured save cost fits the time left (unknown cost or no deadline: True)."""
    why: str


PUSH_MB_PER_S = 200.0
"""The rate assumed for pushing a RAM-tier copy off the draining node (a Ray call between two
nodes' writers, in 8 MB chunks); the RAM tier's cost is the measured staging time plus the
step's bytes at this rate. Not measured per job yet."""


def plan_save(time_left_s: float | None, cost_s: float | None, ram_cost_s: float | None = None) -> SavePlan:
    """The save to take with ``time_left_s`` before the node goes (None: no deadline), given the
    measured cost of the latest committed save (``cost_s``; None: none measured yet) and the
    estimated cost of the RAM tier (``ram_cost_s``; None: no RAM tier, e.g. no node outside the
    drain or ``checkpoint.memory_copies: 1``).

    The durable commit when it fits, else the RAM tier when that fits. A deadline shorter than
    the fastest tier still saves, in the fastest tier: the committed steps are never touched by
    it, and it may complete before the node goes; the line says so.
    """
    if time_left_s is None:
        return SavePlan("durable", True, "no deadline")
    if cost_s is None:
        return SavePlan("durable", True, f"{time_left_s:.0f}s left, no save measured yet")
    if cost_s + STOP_MARGIN_S <= time_left_s:
        return SavePlan("durable", True, f"{time_left_s:.0f}s left, the last save took {cost_s:.1f}s")
    durable = f"the last durable save took {cost_s:.1f}s"
    if ram_cost_s is not None and ram_cost_s + STOP_MARGIN_S <= time_left_s:
        return SavePlan("ram", True, f"{time_left_s:.1f}s left, {durable}, RAM on a node not draining takes "
                                     f"~{ram_cost_s:.1f}s")
    if ram_cost_s is not None and ram_cost_s < cost_s:
        return SavePlan("ram", False, f"only {time_left_s:.1f}s left, {durable} and RAM ~{ram_cost_s:.1f}s: saving "
                                      "what fits in RAM; the latest committed step stays the fallback")
    return SavePlan("durable", False, f"only {time_left_s:.1f}s left and the last save took {cost_s:.1f}s: saving "
                                      "what fits; the latest committed step stays the fallback")


@dataclass(frozen=True)
class SaveCosts:
    """What a save measured, for ``plan_save``: the latest committed step's."""

    durable_s: float | None = None
    """Staging, writing and committing it (None: nothing committed yet)."""
    stage_s: float | None = None
    """Staging it into RAM (the RAM tier's first part)."""
    nbytes: int = 0
    """Its size (the RAM tier's push, at ``PUSH_MB_PER_S``)."""

    def ram_s(self) -> float | None:
        if self.stage_s is None:
            return None
        return self.stage_s + self.nbytes / (PUSH_MB_PER_S * 1e6)


@dataclass(frozen=True)
class DrainNotice:
    """A drain of a node the group uses, as the driver saw it."""

    node: str
    deadline_unix: float | None
    ranks: tuple[int, ...]
    """The ranks on the draining node."""
    seen_unix: float
    step: int
    """The slowest rank's step when the notice was seen."""
    plan: SavePlan
    cause: str = "drain"
    """"drain": Ray's drain record for the node; "sigterm": SIGTERM to the ranks' processes (``rank/eviction.py``)."""

    def time_left(self, now: float) -> float | None:
        return None if self.deadline_unix is None else self.deadline_unix - now


@dataclass(frozen=True)
class PreemptionRecord:
    """One preemption, as ``JobResult.preemptions`` and ``status`` report it."""

    attempt: int
    node: str
    deadline_unix: float | None
    time_left_s: float | None
    """Seconds between the notice and the deadline (None: no deadline)."""
    tier: str
    saved_step: int | None
    """The step the ranks saved at the notice (None: they did not finish the save)."""
    steps_lost: int
    """Steps trained that no committed step holds: the next attempt trains them again."""
    cause: str = "drain"
    """"drain": the node drained; "sigterm": a rank's process got SIGTERM (a pod eviction)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class PreemptionGuard:
    """The driver's watch over drain notices and stop signals, one per job (see the module
    docstring); a ``Watch``: its verdicts restart (a preemption, a grow), stop or give up."""

    def __init__(self, total_steps: int, latest_committed: Callable[[], int | None],
                 save_cost: Callable[[], float | None] = lambda: None,
                 draining: Callable[[], dict[str, float | None]] = draining_nodes,
                 clock: Callable[[], float] = time.time,
                 service_node: Callable[[], str | None] = lambda: None,
                 move_service: Callable[[], None] = lambda: None,
                 full_size: int = 0, grow_check_s: float | None = None,
                 room: Callable[[set[str]], int] = lambda draining: 0,
                 ram_cost: Callable[[set[str]], float | None] = lambda draining: None,
                 keep_in_ram: Callable[[str, int, float | None], str | None] = lambda node, step, by: "no RAM tier",
                 retire_writer: Callable[[str], bool] = lambda node: False, saving_ranks: int | None = None) -> None:
        """``ram_cost``: the RAM tier's estimated cost with these nodes draining (None: no RAM
        tier); ``keep_in_ram(node, step, deadline)``: after a RAM-tier save, push the copies of
        ``step`` held on draining ``node`` to nodes that are not draining and hold the step as the
        next attempt's resume point; returns None, or why it could not.
        ``service_node``: the node of the CheckpointActor (None: unknown); ``move_service``:
        restart it, which Ray does off the draining node (committed steps are on storage).
        ``full_size``: the world size asked for; a group running below it looks every
        ``grow_check_s`` (None: never) for ``room`` (how many more ranks fit on nodes that are not
        draining) and grows back at the next step boundary when the missing ranks fit.
        ``retire_writer``: stop the checkpoint writer of a draining node that hosts no rank (False:
        none there), so that no later restart or close waits on it once the node is gone.
        ``saving_ranks``: with replica groups, the saving group's ranks (the first ones; None: all).
        The step saved is theirs; a step another group trained past it is lost, not the save."""
        self.total_steps, self.latest_committed, self._cost = total_steps, latest_committed, save_cost
        self._draining, self._clock = draining, clock
        self._service_node, self._ram_cost, self._keep_in_ram = service_node, ram_cost, keep_in_ram
        self._move_service, self._move_after_stop, self._retire_writer = move_service, False, retire_writer
        self._full_size, self._grow_check_s, self._room, self._grow_checked = full_size, grow_check_s, room, clock()
        self.outcome = "preemption"
        """What the stop of the group was for: "preemption", "stop" (a signal) or "grow"."""
        self.notice: DrainNotice | None = None
        """The notice the running attempt is acting on (None: none)."""
        self.records: list[PreemptionRecord] = []
        self.preemptions = 0
        """Preemptions acted on (a grow or a stop is none)."""
        self.limit: int | None = None
        """``fault_tolerance.max_preemptions`` (None: no bound); ``watches_for`` sets it from the spec."""
        # with replica groups (set by ``watches_for``): move a draining node's groups off it; False: they cannot be
        self.move_replicas: Callable[..., bool] = lambda group, node, ranks, step, kind="drain": False
        self._ignored, self._reached, self._saving_ranks = set[str](), 0, saving_ranks
        self.stop_request: tuple[str, float] | None = None
        """(signal name, deadline unix) once the driver was told to stop (``request_stop``)."""

    def request_stop(self, why: str, grace_s: float) -> None:
        """Told to stop (`ray job stop`, Ctrl-C): the step in hand is committed within ``grace_s``, the job ends."""
        self.stop_request = (why, self._clock() + grace_s)

    def status(self) -> dict[str, Any]:
        return {}  # the summary's "preemption" is the latest preemption failure of the job's result

    def new_attempt(self) -> None:
        self.notice, self._reached = None, 0
        self.outcome = "preemption"
        self._grow_checked = self._clock()

    def settle(self, failure: Failure, attempt: int) -> Verdict:
        """What the stop of the group was for, as the controller's verdict: capacity came back
        (restart at full size); the driver was told to stop (the job ends, no failure: the step
        that is safe); a preemption, spent on ``limit`` (``fault_tolerance.max_preemptions``), never
        on max_restarts."""
        if self.outcome == "grow":  # capacity came back: the step is saved, restart at full size
            return Verdict(Act.RESTART, failure, events=(f"attempt {attempt} grow",), reason=failure.headline)
        if self.outcome == "stop":  # the driver was told to stop: the step is saved, stop
            assert self.stop_request is not None
            by = self.stop_request[0]
            return Verdict(Act.STOP, failure, events=(f"attempt {attempt} stopped by {by}",), stopped_by=by,
                           reason=failure.headline)
        self.preemptions += 1
        noted = {"recorded": (failure,), "preemptions": (self.records[-1].to_dict(),),
                 "events": (f"attempt {attempt} preemption detected",)}
        limit = self.limit
        if limit is not None and self.preemptions > limit:
            return Verdict(Act.GIVE_UP, failure, error=failure.detail, **noted,
                           reason=(f"preemption; {self.preemptions - 1}/{limit} preemptions survived "
                                   "(fault_tolerance.max_preemptions)"))
        return Verdict(Act.RESTART, failure, cause="preemption", **noted,
                       reason=(f"preemption {self.preemptions}" + (f"/{limit}" if limit is not None else "")
                               + "; restarts not spent"))

    def observe(self, poll: GroupPoll, group: WorkerGroup, attempt: int) -> Verdict | None:
        """The group stopped for a drain, a stop signal or a grow (or must stop: the deadline is
        near): what that settles (``settle``); else None."""
        failure = self.watch(group, poll, attempt)
        return self.settle(failure, attempt) if failure is not None else None

    def watch(self, group: WorkerGroup, poll: GroupPoll, attempt: int) -> Failure | None:
        """Look for a drain of the group's nodes; returns the preemption once the group stopped
        (or must be stopped: the deadline is near), else None."""
        self._reached = max(self._reached, poll.min_step, *(r.steps for r in poll.results))
        if self.notice is None and self.stop_request is not None:
            why, deadline = self.stop_request
            self.notice = DrainNotice(why, deadline, tuple(range(len(group.rank_nodes()))), self._clock(),
                                      poll.min_step, plan_save(deadline - self._clock(), self._cost()))
            logger.warning("%s: saving and committing the step in hand within %.0fs, then stopping (send it again to "
                           "stop at once)", why, deadline - self._clock())
            group.preempt(deadline)
            self.outcome = "stop"
        if self.notice is None:
            self._look(group, poll)
        if self.notice is None and poll.evictions:
            self._evicted(group, poll)
        if self.notice is None:
            self._maybe_grow(group, poll)
            return None
        if poll.finished and not poll.failures and poll.results and min(r.steps for r in poll.results) >= self.total_steps:
            return None  # the notice came with the last step: the job is done, nothing to restart
        stopped = poll.failures or poll.finished
        left = self.notice.time_left(self._clock())
        if not stopped and (left is None or left > STOP_MARGIN_S):
            return None
        return self._failure(poll, attempt, stopped=bool(stopped))

    def _look(self, group: WorkerGroup, poll: GroupPoll) -> None:
        drains = self._draining()
        if not drains:
            return
        nodes = group.rank_nodes()
        service = self._service_node()
        for node, deadline in drains.items():
            ranks = tuple(r for r, n in enumerate(nodes) if n == node)
            if not ranks:
                if node not in self._ignored:
                    self._ignored.add(node)
                    self._leave(node, hosts_actor=node == service)
                continue
            if node not in self._ignored and self.move_replicas(group, node, ranks, poll.min_step):
                self._ignored.add(node)  # its replica groups moved off it: training goes on
                continue
            if node == service and node not in self._ignored:
                self._ignored.add(node)
                self._move_after_stop = True
            now = self._clock()
            left = None if deadline is None else deadline - now
            plan = plan_save(left, self._cost(), self._ram_cost(set(drains)) if left is not None else None)
            self.notice = DrainNotice(node, deadline, ranks, now, poll.min_step, plan)
            logger.warning("preemption: node %s (rank %s) is draining, %s; saving the step in hand (%s tier: %s) "
                           "and restarting off that node", node, ", ".join(map(str, ranks)),
                           "no deadline" if left is None else f"deadline in {left:.1f}s", plan.tier, plan.why)
            if not plan.fits:
                logger.warning("preemption: %s", plan.why)
            group.preempt(deadline, plan.tier)
            return

    def _leave(self, node: str, hosts_actor: bool) -> None:
        """A draining node that hosts no rank: the CheckpointActor and the checkpoint writer there
        leave it now (committed steps are on storage; a writer there serves no rank of this attempt,
        so nothing of the step in hand is on it); training goes on."""
        if hosts_actor:
            logger.warning("preemption: node %s hosting the CheckpointActor is draining; restarting the actor "
                           "off that node (committed steps are on storage); training continues", node)
            self._move_service()
        if self._retire_writer(node):
            logger.warning("preemption: node %s, which hosts no rank, is draining; its checkpoint writer is stopped "
                           "(committed steps are on storage); training continues", node)
        elif not hosts_actor:
            logger.debug("node %s is draining; no rank of this job is there: ignored", node)

    def _evicted(self, group: WorkerGroup, poll: GroupPoll) -> None:
        """Ranks whose process got SIGTERM: a drain notice of their node with their deadline (the
        ranks agreed on the step already; ``preempt`` reaches any that did not yet see it)."""
        healing = getattr(group, "healing", set())  # a replica group moved already: its old processes' signal
        ranks = tuple(sorted(r for r in poll.evictions if r not in healing))
        nodes = group.rank_nodes()
        node = nodes[ranks[0]] if ranks and ranks[0] < len(nodes) else "unknown"
        if not ranks or self.move_replicas(group, node, ranks, poll.min_step, "eviction"):
            return  # replica groups: the evicted ranks' groups are replaced elsewhere while the others train on
        deadline = min(poll.evictions[r] for r in ranks)
        now = self._clock()
        plan = plan_save(deadline - now, self._cost())
        self.notice = DrainNotice(node, deadline, ranks, now, poll.min_step, plan, cause="sigterm")
        logger.warning("preemption: the process of rank %s on node %s got SIGTERM (an eviction), %.1fs left "
                       "(fault_tolerance.stop_grace_s); saving the step in hand (%s tier: %s) and restarting",
                       ", ".join(map(str, ranks)), node, deadline - now, plan.tier, plan.why)
        group.preempt(deadline)

    def _maybe_grow(self, group: WorkerGroup, poll: GroupPoll) -> None:
        size = len(group.rank_nodes())
        now = self._clock()
        if (self._grow_check_s is None or not 0 < size < self._full_size
                or now - self._grow_checked < self._grow_check_s):
            return
        self._grow_checked = now
        room = self._room(set(self._draining()))
        if room < self._full_size - size:
            logger.debug("running %d of %d workers; room for %d more (nodes not draining)", size, self._full_size, room)
            return
        logger.warning("capacity is back: %d more rank(s) fit on nodes that are not draining; saving the step in hand "
                       "and growing back from %d to %d workers", room, size, self._full_size)
        self.notice = DrainNotice("grow", None, (), now, poll.min_step, SavePlan("durable", True, "growing back"))
        self.outcome = "grow"
        group.preempt(None)

    def _failure(self, poll: GroupPoll, attempt: int, stopped: bool) -> Failure:
        notice = self.notice
        assert notice is not None
        latest = self.latest_committed() or 0
        saved = max((r.steps for r in poll.results if self._saving_ranks is None or r.rank < self._saving_ranks),
                    default=None) if poll.finished and not poll.failures else None
        how, lost, kept = self._outcome(notice, saved, latest)  # a RAM-tier copy leaves the node first: the deadline
        if self._move_after_stop:  # the group stopped: the CheckpointActor leaves the node with it
            self._move_after_stop = False
            logger.warning("preemption: restarting the CheckpointActor off draining node %s", notice.node)
            self._move_service()
        tier = notice.plan.tier
        record = PreemptionRecord(attempt, notice.node, notice.deadline_unix, notice.time_left(notice.seen_unix),
                                  tier, kept, lost, notice.cause)  # kept: None when the save did not complete
        self.records.append(record)
        if not stopped:
            how = f"the group did not stop before the deadline; {how}"
        left = record.time_left_s
        if self.outcome == "grow":
            text = f"grow back to {self._full_size} workers: {how}"
            return Failure(attempt, "preemption", None, text, text)
        if self.stop_request is not None:
            text = f"{notice.node}: " + (f"step {latest} is committed and safe" + (f" ({lost} steps after it lost)" if lost else "")
                                         if saved is not None and saved == latest else how)
            logger.warning("stopped: %s", text)
            return Failure(attempt, "preemption", None, text, text)
        ranks = ", ".join(map(str, notice.ranks))
        notice_s = "no deadline" if left is None else f"{left:.1f}s notice"
        text = (f"node {notice.node} drained (rank {ranks}, {notice_s}, tier {tier}): {how}" if notice.cause == "drain" else
                f"the process of rank {ranks} got SIGTERM on node {notice.node} ({notice_s}, tier {tier}): {how}")
        logger.warning("preemption: %s", text)
        return Failure(attempt, "preemption", notice.ranks[0], text, text)

    def _outcome(self, notice: DrainNotice, saved: int | None, latest: int) -> tuple[str, int, int | None]:
        """What became of the save (``saved``: the step the ranks stopped at, None: they did not
        finish), the steps lost, and the step saved (None when the save did not complete)."""
        if notice.plan.tier == "ram":
            return self._kept_in_ram(notice, saved, latest)
        lost, ok = max(0, self._reached - latest), saved is not None and saved == latest
        return (f"step {saved} saved, {lost} steps lost" if ok else
                f"the save did not complete: resuming at committed step {latest}, {lost} steps lost"), lost, saved if ok else None

    def _kept_in_ram(self, notice: DrainNotice, saved: int | None, latest: int) -> tuple[str, int, int | None]:
        """After a RAM-tier save: hold ``saved`` off the draining node; what happened and the steps lost."""
        why = "the save did not complete" if saved is None else self._keep_in_ram(notice.node, saved,
                                                                                  notice.deadline_unix)
        if why is None:
            assert saved is not None
            lost = max(0, self._reached - saved)
            return (f"step {saved} held in RAM on nodes not draining (not committed to storage; its latest "
                    f"committed step {latest} is untouched), {lost} steps lost"), lost, saved
        lost = max(0, self._reached - latest)
        return f"the RAM copy was not kept ({why}): resuming at committed step {latest}, {lost} steps lost", lost, None


@contextlib.contextmanager
def stop_signals(guard: PreemptionGuard | None, grace_s: float) -> Iterator[None]:
    """While the job runs: the first SIGTERM or SIGINT to the driver asks ``guard`` to save the
    step in hand and stop (``request_stop``). A second one means "stop now": it is logged and
    raised as ``KeyboardInterrupt``, the driver's Ctrl-C path (what is committed stays, the step in
    flight is not waited for, Ray is shut down and the staging buffers freed); the handlers before
    these come back then. Outside the main thread (a driver run from a thread, as in tests) or
    without a guard: nothing is installed."""
    if guard is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = (signal.SIGTERM, signal.SIGINT)
    before = {s: signal.getsignal(s) for s in signals}

    def restore() -> None:
        for s, handler in before.items():
            signal.signal(s, handler)

    def again(signum: int, _frame: Any) -> None:
        restore()
        logger.warning("%s again: stopping now; the committed step stays, the save in flight is not waited for",
                       signal.Signals(signum).name)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    def on_signal(signum: int, _frame: Any) -> None:
        for s in signals:
            signal.signal(s, again)
        guard.request_stop(signal.Signals(signum).name, grace_s)

    for s in signals:
        signal.signal(s, on_signal)
    try:
        yield
    finally:
        restore()
