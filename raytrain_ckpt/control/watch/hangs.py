"""Hangs: how long a group may go without finishing a step, and which rank a hang is blamed on.

``HangClock`` is the hang timeout. ``fault_tolerance.hang_timeout_s: auto`` (the default) learns
it from the measured step times: ``MULTIPLE`` x the ``PERCENTILE``-th percentile of the latest
``WINDOW`` step times, at least ``FLOOR_S``. The phases that are legitimately long get their own
budget: the first step of an attempt (compile, warm-up) and every step before ``MIN_SAMPLES`` were
measured get ``FIRST_STEPS_S``; an eval step gets ``FIRST_STEPS_S`` until one was measured, then
``MULTIPLE`` x the longest eval step; a rank inside a save (its stall, or the final commit) gets
``checkpoint.commit_timeout_s``, the save's own bound. Joining, building and loading happen before
the group runs, under ``join_timeout_s`` and ``start_timeout_s``. A number means that fixed timeout
for every phase.

``blame`` decides the culprit of a hang from what every rank answered and its stacks (read from
outside the process, ``control/hang_evidence.py``): a rank that does not answer, else the ranks behind in
step, else the ranks whose training thread is not inside the collective the others wait in. When
none of these singles a rank out, the verdict says so.

Pure: no Ray, no torch (the controller imports it).
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raytrain_ckpt.common.events import Failure
from raytrain_ckpt.control.watch import Act, Verdict

if TYPE_CHECKING:
    from raytrain_ckpt.control.poll import GroupPoll, WorkerGroup

__all__ = ["Blame", "FAILURE_FILE", "FIRST_STEPS_S", "FLOOR_S", "HangClock", "HangWatch", "MULTIPLE", "auto_text", "blame",
           "dump_stacks", "in_collective", "keep_failures", "py_spy", "training_thread"]

logger = logging.getLogger(__name__)

FLOOR_S = 30.0
"""The least an auto timeout waits: a loaded machine's pauses (GC, a busy core, logging)."""
MULTIPLE = 10.0
PERCENTILE = 99.0
WINDOW = 200
"""Step times the percentile is taken over (the latest ones): a job that slows down is followed."""
MIN_SAMPLES = 5
FIRST_STEPS_S = 300.0
"""The budget before MIN_SAMPLES steps were measured, for each attempt's first step, and for an
eval step until one was measured."""


def auto_text(spec: Any) -> str:
    """What ``hang_timeout_s`` means for this spec, in one line (``validate``, the job's start)."""
    ft, ck = spec.fault_tolerance, spec.checkpoint
    if not isinstance(ft.hang_timeout_s, str):
        return f"hang timeout: fixed {ft.hang_timeout_s:g} s (fault_tolerance.hang_timeout_s)"
    save = f"; a save {ck.commit_timeout_s:g} s (checkpoint.commit_timeout_s)" if ck.enabled else ""
    ev = f"; an eval step {FIRST_STEPS_S:g} s until one was measured" if spec.eval is not None else ""
    return (f"hang timeout: auto, {MULTIPLE:g} x p{PERCENTILE:g} of the measured step times, at least {FLOOR_S:g} s; "
            f"{FIRST_STEPS_S:g} s for an attempt's first step and before {MIN_SAMPLES} steps were measured{ev}{save}")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


class HangClock:
    """The hang timeout of a running group: fixed, or learned from the step times it observes."""

    def __init__(self, spec: Any) -> None:
        ft = spec.fault_tolerance
        self.fixed: float | None = None if isinstance(ft.hang_timeout_s, str) else float(ft.hang_timeout_s)
        self._save_s = spec.checkpoint.commit_timeout_s if spec.checkpoint.enabled else None
        ev = spec.eval
        self._eval_every = ev.every_steps if ev is not None else None
        self._last_step = spec.training.steps
        self._steps: deque[float] = deque(maxlen=WINDOW)
        self._evals: list[float] = []
        self._first = True
        self._mark: tuple[int, float] | None = None
        """(step, time) of the last advance this attempt measured from; None: no step finished yet."""
        self.current_s: float = self.fixed if self.fixed is not None else FIRST_STEPS_S
        """The budget of the latest check (``status``)."""
        self.why = "fixed" if self.fixed is not None else "first steps"
        self.announced = False
        """Whether the learned step budget was logged once (the controller logs it)."""

    def attempt_started(self) -> None:
        """A new attempt runs: its first step (warm-up, a load's page faults) is not measured."""
        self._mark, self._first = None, True

    def observe(self, step: int, now: float, step_s: float | None = None) -> None:
        """The slowest rank finished ``step`` at about ``now`` (seen by a poll). ``step_s``: the
        longest duration of a latest step the ranks measured themselves (None: not measured, the
        attempt's first step). A measured duration is the pace whatever the polls' cadence: a
        loaded driver that polls seldom still learns its timeout within the first few steps."""
        mark = self._mark
        if mark is not None and step <= mark[0]:
            return
        self._mark = (step, now)
        covered = min(step - mark[0], WINDOW) if mark is not None else 1
        if step_s is not None:  # the ranks timed a step that was not the attempt's first
            self._first = False
            if self._is_eval(step):
                self._evals.append(step_s)
            else:
                self._steps.extend([step_s] * covered)
            return
        if mark is None:  # the attempt's starting step
            return
        if self._first:  # the attempt's first step: warm-up, not measured
            self._first = False
            return
        per_step = (now - mark[1]) / (step - mark[0])
        if self._is_eval(step) or any(self._is_eval(s) for s in range(mark[0] + 1, step)):
            self._evals.append(now - mark[1])
        else:
            # one sample per step the poll covers: steps faster than the poll interval (several
            # finished between two polls) count as measured, or a fast job would keep the
            # first-steps budget (300 s) long after it measured its pace
            self._steps.extend([per_step] * covered)

    def learned_s(self) -> float | None:
        """The step budget learned so far (None: too few steps measured)."""
        if len(self._steps) < MIN_SAMPLES:
            return None
        return max(FLOOR_S, MULTIPLE * _percentile(list(self._steps), PERCENTILE))

    def budget(self, next_step: int, phases: Mapping[int, str] | None = None) -> tuple[float, str]:
        """How long the group may take to finish ``next_step`` from its last advance, and why."""
        if self.fixed is not None:
            self.current_s, self.why = self.fixed, "fixed"
            return self.current_s, self.why
        if self._save_s is not None and phases and "saving" in phases.values():
            value, why = self._save_s, "a save (checkpoint.commit_timeout_s)"
        elif self._first:
            value, why = FIRST_STEPS_S, "the attempt's first step"
        elif self._is_eval(next_step):
            value = MULTIPLE * max(self._evals) if self._evals else FIRST_STEPS_S
            value, why = max(value, self.learned_s() or FIRST_STEPS_S, FLOOR_S), "an eval step"
        else:
            learned = self.learned_s()
            if learned is None:
                value, why = FIRST_STEPS_S, f"first steps (fewer than {MIN_SAMPLES} measured)"
            else:
                p = _percentile(list(self._steps), PERCENTILE)
                value, why = learned, f"{MULTIPLE:g} x p{PERCENTILE:g} step time {p:.3g} s, at least {FLOOR_S:g} s"
        self.current_s, self.why = value, why
        return value, why

    def _is_eval(self, step: int) -> bool:
        every = self._eval_every
        return every is not None and (step % every == 0 or step == self._last_step)


# -- the evidence and the culprit ---------------------------------------------------------------------------------

DUMP_TIMEOUT_S = 20.0


def py_spy() -> str | None:
    """The py-spy executable beside this interpreter (the project's virtualenv), else on PATH."""
    here = Path(sys.executable).with_name("py-spy")
    return str(here) if here.exists() else shutil.which("py-spy")


def dump_stacks(pid: int) -> str:
    """Every thread's Python stack of process ``pid`` (py-spy's text), or a line saying why not."""
    exe = py_spy()
    if exe is None:
        return "(no stacks: py-spy is not installed; pip install py-spy)"
    try:
        done = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=DUMP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return f"(no stacks: py-spy dump --pid {pid} did not finish in {DUMP_TIMEOUT_S:g}s)"
    if done.returncode != 0:
        return f"(no stacks: py-spy dump --pid {pid} failed: {(done.stderr or done.stdout).strip()})"
    return done.stdout


_THREAD = re.compile(r"^Thread (0x[0-9A-Fa-f]+|\d+)")
_RUN = re.compile(r"^(\w+\.)?_run \(.*worker\.py:\d+\)")
"""py-spy's line for ``TrainWorker._run`` (``TrainWorker._run (raytrain_ckpt/rank/worker.py:331)``)."""
_COLLECTIVE = ("torch/distributed/", "torch\\distributed\\", "torchft/", "torchft\\")
"""Where a rank waits on its peers: torch.distributed, and torchft (replica groups: a quorum, the
cross-group average, the commit vote)."""


def training_thread(stacks: str) -> list[str]:
    """The frames (innermost first, as py-spy prints them) of the thread that runs the training
    loop (``TrainWorker._run``) in a py-spy dump, else of its main thread (py-spy lists it first);
    [] when there is none."""
    block: list[str] = []
    blocks: list[tuple[str, list[str]]] = []
    for line in stacks.splitlines():
        if _THREAD.match(line):
            block = []
            blocks.append((line, block))
        elif line.startswith(" ") and blocks:
            block.append(line.strip())
    for _, frames in blocks:
        if any(_RUN.match(f) for f in frames):
            return frames
    main = [frames for head, frames in blocks if '"MainThread"' in head] or [frames for _, frames in blocks[:1]]
    return main[0] if main else []


def in_collective(frames: list[str]) -> bool:
    """Whether a training thread's frames are inside torch.distributed (a collective or its wait)."""
    return any(any(c in f for c in _COLLECTIVE) for f in frames)


@dataclass(frozen=True)
class Blame:
    """Who a hang is blamed on, and what it rests on."""

    ranks: tuple[int, ...]
    """The culprit ranks, lowest first (): no rank could be blamed."""
    reason: str
    """One line: why these ranks (or why none)."""
    frames: dict[int, list[str]] = field(default_factory=dict)
    """Each culprit's training-thread frames, innermost first (from its stacks)."""
    folder: str | None = None
    """The attempt's diagnostics folder (every rank's stacks), if any."""

    @property
    def rank(self) -> int | None:
        return self.ranks[0] if self.ranks else None

    def where(self) -> str:
        """The innermost frame of the first culprit, e.g. ``maybe_inject (raytrain_ckpt/common/faults.py:150)``."""
        frames = self.frames.get(self.rank, []) if self.rank is not None else []
        return frames[0] if frames else ""


class HangWatch:
    """The controller's hang detector (a ``Watch``): the slowest rank's step must advance within
    the ``HangClock``'s budget; past it, every rank's stacks are read and the culprit named before
    anything is killed (a ``FAIL`` verdict)."""

    def __init__(self, spec: Any, clock: Callable[[], float]) -> None:
        self.hangs = HangClock(spec)
        self._clock = clock
        self._last_step = -1
        self.last_advance = clock()
        """When the slowest rank's step last advanced (or the budget started again)."""
        self.last_hang: str | None = None
        """The latest hang (or silent process replaced): its culprit and the diagnostics folder."""
        self._judged: tuple[GroupPoll, bool] | None = None
        """The latest poll ``hung`` judged, and its answer (the silence watch asks first)."""

    def new_attempt(self) -> None:
        self._last_step, self.last_advance = -1, self._clock()
        self.hangs.attempt_started()

    def status(self) -> dict[str, Any]:
        return {"hang_timeout_s": self.hangs.current_s, "hang_timeout_why": self.hangs.why, "last_hang": self.last_hang}

    def observe(self, poll: GroupPoll, group: WorkerGroup, attempt: int) -> Verdict | None:
        """A group past its step's budget: the hang, with its culprit, fails the attempt."""
        if not self.hung(poll):
            return None
        failure, folder = self.failure(poll, group, attempt)
        return Verdict(Act.FAIL, failure, diagnostics=(folder,) if folder is not None else ())

    def waited(self, why: str) -> None:
        """The ranks waited on another process (``why``: a silent writer, replaced): the step
        budget starts again; ``status`` names it as the latest hang."""
        self.last_advance = self._clock()
        self.last_hang = why

    def hung(self, poll: GroupPoll) -> bool:
        """Whether the slowest rank is past its step's budget (a poll that sees it advance teaches
        the clock); asked again about the same poll, the same answer."""
        if self._judged is not None and self._judged[0] is poll:
            return self._judged[1]
        hung = self._hung(poll)
        self._judged = (poll, hung)
        return hung

    def _hung(self, poll: GroupPoll) -> bool:
        now, hangs = self._clock(), self.hangs
        if poll.min_step != self._last_step:
            self._last_step, self.last_advance = poll.min_step, now
            hangs.observe(poll.min_step, now, poll.step_s)
            learned = hangs.learned_s()
            if learned is not None and not hangs.announced:
                hangs.announced = True
                hangs.budget(poll.min_step + 1)
                logger.info("hang timeout auto: %.0f s (%s)", learned, hangs.why)
            return False
        budget, _ = hangs.budget(poll.min_step + 1, poll.phases)
        return now - self.last_advance > budget

    def failure(self, poll: GroupPoll, group: WorkerGroup, attempt: int) -> tuple[Failure, str | None]:
        """The hang, with every rank's stacks read and the culprit named; and the diagnostics folder."""
        budget, why = self.hangs.current_s, self.hangs.why
        try:
            verdict = group.diagnose()
        except Exception as exc:  # noqa: BLE001 - the evidence is best effort: the hang is still handled
            verdict = Blame((), f"no single rank can be blamed: the evidence could not be read ({exc})")
        setting = "auto" if self.hangs.fixed is None else f"{budget:g}"
        timeout = (f"no step finished for {budget:.0f}s (fault_tolerance.hang_timeout_s={setting}: {why}); "
                   f"slowest rank at step {poll.min_step}")
        where = f"stuck in {verdict.where()}: " if verdict.where() else ""
        text = f"{where}{verdict.reason}; {timeout}"
        if verdict.folder is not None:
            text += f"; every rank's stacks in {verdict.folder}"
        frames = "".join(f"\n  rank {r}: " + "\n    ".join(f[:12]) for r, f in verdict.frames.items() if f)
        self.last_hang = f"rank {verdict.rank}: {text}" if verdict.rank is not None else text
        return (Failure(attempt, "hang", verdict.rank, text, text + (f"\nstacks:{frames}" if frames else "")),
                verdict.folder)


def blame(world: int, steps: Mapping[int, int], stacks: Mapping[int, str]) -> Blame:
    """The culprit of a hang among ranks ``0..world-1``.

    ``steps``: each rank's last finished step, for the ranks that answered; ``stacks``: each rank's
    py-spy dump, for the ranks whose stacks could be read.
    """
    ranks = range(world)
    frames = {r: training_thread(stacks[r]) for r in ranks if r in stacks}
    silent = tuple(r for r in ranks if r not in steps)
    if silent and len(silent) < world:
        return Blame(silent, f"rank {_names(silent)} did not answer (its process is stuck or gone)",
                       {r: frames.get(r, []) for r in silent})
    if not steps:
        return Blame((), "no rank answered: the whole group (or its node) is stuck; no single rank can be blamed")
    low, high = min(steps.values()), max(steps.values())
    if low < high:
        behind = tuple(r for r in ranks if steps.get(r) == low)
        return Blame(behind, f"rank {_names(behind)} behind at step {low} while others reached step {high}",
                       {r: frames.get(r, []) for r in behind})
    waiting = tuple(r for r in ranks if r in frames and frames[r] and in_collective(frames[r]))
    outside = tuple(r for r in ranks if r in frames and frames[r] and not in_collective(frames[r]))
    if waiting and outside:
        return Blame(outside, f"rank {_names(outside)} not in the collective that rank {_names(waiting)} "
                                f"wait in (all at step {low})", {r: frames[r] for r in outside})
    if len(frames) < world:
        why = f"stacks of rank {_names(tuple(r for r in ranks if r not in frames))} could not be read"
    elif waiting:
        why = "every rank waits in a collective"
    else:
        why = "no rank is in a collective"
    return Blame((), f"no single rank can be blamed: every rank at step {low}, {why}")


def _names(ranks: tuple[int, ...]) -> str:
    return ", ".join(str(r) for r in ranks)


FAILURE_FILE = "failure.txt"
"""Every failed rank's full text of an attempt, beside its hang evidence (if any)."""


def keep_failures(base: Path, attempt: int, failures: list[Any]) -> str | None:
    """Append each of ``failures`` (a headline line, then its full text) to
    ``<base>/attempt-<attempt>/failure.txt``; the path, or None where it cannot be written."""
    path = base / f"attempt-{attempt}" / FAILURE_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.writelines(f"{failure}\n{failure.detail}\n\n" for failure in failures)
    except OSError as exc:  # best effort: the failure is still handled, its text is in JobResult.error
        logger.warning("could not keep the failures' text in %s: %s", path, exc)
        return None
    return str(path)
