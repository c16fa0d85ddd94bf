"""Fault injection at named points, for tests and drills.

A fault plan comes from the ``RAYTRAIN_CKPT_FAULTS`` environment variable of the driver,
which the worker group forwards to every worker. Grammar (``;`` separates faults)::

    KIND@POINT:rank=R,step=S[,attempt=A][,seconds=T]

KIND is ``raise`` (a Python exception), ``exit`` (the process dies with no cleanup, like
a segfault or the OOM killer), ``hang`` (the rank stops making progress) or ``slow``
(a 3 s delay, then it carries on: a slow disk or a straggler). POINT is
``step`` (in the trainer, before step ``S+1`` starts, i.e. after ``S`` steps), ``staging``
(on the trainer's staging thread, halfway through copying checkpoint ``S``), ``staged``
(in the trainer, right after checkpoint ``S`` was staged and handed to the writer) or
``persist`` (in the node's CheckpointWriter, while it writes rank ``R``'s files of step ``S``)
or ``uploaded`` (in the node's CheckpointWriter on an object store, after rank ``R``'s files of
step ``S`` are uploaded and before they are reported: the step's prefix holds shards and no
manifest) or ``commit`` (in the CheckpointActor, after ``.metadata`` and before the manifest of step
``S``; use ``rank=0``) or ``join`` (a rank of a starting attempt, before it joins the process
group; use ``step=0``) or ``setup`` (the same rank once joined, before it builds its trainer;
``step=0``) or ``restore`` (a restart loading step ``S`` from the in-memory copy of rank ``R``;
give the restart's ``attempt``). Two kinds damage that copy instead of the process, and only at
``restore``: ``corrupt`` flips one bit of the rank's staging buffer before the rank checksums it,
and ``stale`` hands the rank its writer's copy of the step before ``S`` (an older buffer).
One kind damages the numbers instead, at ``step`` only: ``nan@step:rank=R,step=S`` makes rank
``R``'s loss (and gradients) at step ``S`` (the step that starts after ``S`` steps) NaN, once per
job: the replay of step ``S`` after a rollback (``training.guard``) runs clean.
``attempt`` defaults to 0, so the restarted group runs clean unless the plan says otherwise.
``step=-1`` matches every step (``slow@step:rank=1,step=-1,seconds=0.5``: a straggler), and
``seconds`` sets a ``slow`` fault's delay (3 s by default).
Several faults at one point apply in plan order: ``slow@persist`` then ``exit@persist`` kills
the writer 3 s into the write, when its hand-off has long been acknowledged.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

__all__ = ["ENV_VAR", "Fault", "InjectedFault", "adopt_fault_env", "fault_env", "fault_plan_problem", "maybe_inject",
           "parse_faults", "planned", "take_nan"]

ENV_VAR = "RAYTRAIN_CKPT_FAULTS"
STAMP_VAR = "RAYTRAIN_CKPT_FAULT_STAMP"
"""If set, the first ``exit`` or ``hang`` fault of a run writes its wall-clock time to this file (benchmarks, tests)."""
KINDS = ("raise", "exit", "hang", "slow", "corrupt", "stale", "nan")
COPY_KINDS = ("corrupt", "stale")
"""Kinds that damage a rank's in-memory copy (point ``restore`` only); their caller acts on ``planned()``."""
VALUE_KINDS = ("nan",)
"""Kinds that damage the numbers of a step (point ``step`` only); the guard acts on ``take_nan()``."""
_TAKEN: set[Fault] = set()
"""The ``nan`` faults this process already applied: each fires once per job."""
SLOW_S = 3.0
POINTS = ("step", "staging", "staged", "persist", "uploaded", "commit", "join", "setup", "restore")


class InjectedFault(RuntimeError):
    """The exception that a ``raise`` fault throws."""


@dataclass(frozen=True)
class Fault:
    kind: str
    point: str
    rank: int
    step: int
    attempt: int = 0
    seconds: float = 3.0
    """A ``slow`` fault's delay."""


def parse_faults(text: str) -> list[Fault]:
    """Parse a fault plan; raises ValueError naming the bad entry."""
    faults = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        try:
            head, _, args = entry.partition(":")
            kind, _, point = head.partition("@")
            kv = dict(pair.split("=", 1) for pair in args.split(","))
            fault = Fault(kind, point, int(kv.pop("rank")), int(kv.pop("step")), int(kv.pop("attempt", 0)),
                          float(kv.pop("seconds", SLOW_S)))
        except (ValueError, KeyError) as exc:
            raise ValueError(f"{ENV_VAR}: cannot parse {entry!r} ({exc}); expected KIND@step:rank=R,step=S") from None
        if fault.kind not in KINDS or fault.point not in POINTS or kv:
            raise ValueError(f"{ENV_VAR}: bad fault {entry!r}; KIND is one of {KINDS}, POINT one of {POINTS}")
        if fault.kind in COPY_KINDS and fault.point != "restore":
            raise ValueError(f"{ENV_VAR}: bad fault {entry!r}; {fault.kind} applies at restore only")
        if fault.kind in VALUE_KINDS and fault.point != "step":
            raise ValueError(f"{ENV_VAR}: bad fault {entry!r}; {fault.kind} applies at step only")
        faults.append(fault)
    return faults


def fault_plan_problem(environ: dict[str, str] | None = None) -> str | None:
    """Why this process's ``RAYTRAIN_CKPT_FAULTS`` is not a fault plan (an unknown kind or point, a
    malformed entry), or None. Checked before Ray starts: otherwise each rank would raise the
    same error at its first fault point, and the job would restart into it until it failed."""
    text = (os.environ if environ is None else environ).get(ENV_VAR)
    if not text:
        return None
    try:
        parse_faults(text)
    except ValueError as exc:
        return str(exc)
    return None


def fault_env() -> dict[str, str]:
    """The fault settings of this process, to forward to the actors it creates."""
    return {k: os.environ[k] for k in (ENV_VAR, STAMP_VAR) if os.environ.get(k)}


def adopt_fault_env(env: dict[str, str] | None) -> None:
    """Make ``env`` (the driver's ``fault_env()``) this actor process's fault settings: a setting the
    driver did not pass is removed, so a cluster whose processes were started with one (a
    ``ray start`` in a shell that had it) injects nothing into a run that asked for nothing."""
    for key in (ENV_VAR, STAMP_VAR):
        value = (env or {}).get(key)
        if value:
            os.environ[key] = value
        else:
            os.environ.pop(key, None)


def _stamp() -> None:
    """When the run's first fault struck, kept once: a later fault (a crash in the next attempt)
    must not move the time a test measures the first one's detection from."""
    path = os.environ.get(STAMP_VAR)
    if path:
        try:
            with open(path, "x") as f:
                f.write(repr(time.time()))
        except FileExistsError:
            pass


def planned(kind: str, point: str, rank: int, step: int, attempt: int) -> bool:
    """Whether the plan has a ``kind`` fault here (the ``COPY_KINDS``, which their callers carry out)."""
    text = os.environ.get(ENV_VAR)
    if not text:
        return False
    hit = Fault(kind, point, rank, step, attempt) in parse_faults(text)
    if hit:
        logger.warning("injecting fault %s at %s rank %d step %d attempt %d", kind, point, rank, step, attempt)
    return hit


def take_nan(rank: int, step: int, attempt: int) -> bool:
    """Whether the plan makes this rank's loss at ``step`` NaN now: true once per job (a replay of the
    step after a rollback runs clean)."""
    text = os.environ.get(ENV_VAR)
    if not text:
        return False
    fault = Fault("nan", "step", rank, step, attempt)
    if fault in _TAKEN or fault not in parse_faults(text):
        return False
    _TAKEN.add(fault)
    logger.warning("injecting fault nan at step rank %d step %d attempt %d", rank, step, attempt)
    return True


def maybe_inject(point: str, rank: int, step: int, attempt: int) -> None:
    """Trigger the planned fault for this point, rank, step and attempt, if any."""
    text = os.environ.get(ENV_VAR)
    if not text:
        return
    for f in parse_faults(text):
        if (f.point, f.rank, f.attempt) != (point, rank, attempt) or f.step not in (step, -1) or f.kind in COPY_KINDS + VALUE_KINDS:
            continue
        logger.warning("injecting fault %s at %s rank %d step %d attempt %d", f.kind, point, rank, step, attempt)
        if f.kind == "raise":
            raise InjectedFault(f"injected fault at {point} rank {rank} step {step}")
        if f.kind == "exit":
            _stamp()
            os._exit(17)
        if f.kind == "slow":  # a slow disk or a straggler: delay, then carry on (with the next fault here)
            time.sleep(f.seconds)
            continue
        _stamp()
        while True:  # hang: stop making progress until the controller kills us
            time.sleep(3600)
