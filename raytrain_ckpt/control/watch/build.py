"""The controller's watches for a job, built from its spec, in the order the controller asks them
(their priority: the first verdict that ends a poll wins).

1. the goodput ledger: each poll's progress (never a verdict);
2. rollbacks: the training guard's, recorded as failures recovered from;
3. stragglers: reported, and one asked to stop at a committed step (``replace_stragglers``);
4. the preemption guard: a drain, an eviction, a stop signal or a grow settled (restart, stop);
5. rank failures: a crash or an exception fails the attempt (with replica groups the controller
   asks ``ReplicaHeals`` first, of every failure: one group's is healed, the others train on);
6. the straggler stop: the group stopped for a replacement restarts without that rank;
7. the finish: every rank done;
8. silence: a silent checkpoint writer or actor replaced, training on;
9. hangs: the slowest rank past its budget fails the attempt.

A new detector is one module under ``control/watch/`` implementing ``Watch`` and one line here.
Pure: no Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from raytrain_ckpt.control.watch import Watch
from raytrain_ckpt.control.watch.goodput import GoodputLedger
from raytrain_ckpt.control.watch.hangs import HangWatch
from raytrain_ckpt.control.watch.outcomes import Finished, RankFailures
from raytrain_ckpt.control.watch.replicas import ReplicaHeals
from raytrain_ckpt.control.watch.rollbacks import RollbackWatch
from raytrain_ckpt.control.watch.silence import SilenceWatch
from raytrain_ckpt.control.watch.stragglers import StragglerStop, StragglerSwap, StragglerWatch

if TYPE_CHECKING:
    from raytrain_ckpt.control.watch.preemption import PreemptionGuard

__all__ = ["watches_for"]


def _mover(heals: ReplicaHeals, hang: HangWatch) -> Callable[..., bool]:
    """The guard's ``move_replicas``: ``ReplicaHeals.move_off``; a move restarts the hang watch's
    step budget (the healthy groups may wait for the moved group's quorum meanwhile)."""
    def move(group: Any, node: str, ranks: tuple[int, ...], step: int, kind: str = "drain") -> bool:
        moved = heals.move_off(group, node, ranks, getattr(group, "attempt", 0), step, kind)
        if moved:
            hang.waited(f"replica group(s) of rank(s) {', '.join(map(str, ranks))} moved off node {node} ({kind})")
        return moved
    return move


def watches_for(spec: Any, clock: Callable[[], float], ledger: GoodputLedger,
                preemption: PreemptionGuard | None = None) -> list[Watch]:
    """Every watch of a job of ``spec``, in priority order. ``ledger``: the controller's goodput
    ledger (it also marks the attempts' starts and ends on it); ``preemption``: the driver's guard
    over drains and stop signals (None: nothing is checkpointed, none is acted on)."""
    ft = spec.fault_tolerance
    swap = StragglerSwap(spec, StragglerWatch(ft.straggler_margin),
                         preemption.latest_committed if preemption is not None else None)
    hang = HangWatch(spec, clock)
    heals = ReplicaHeals(spec) if spec.parallelism.dp_replicate > 1 else None
    if preemption is not None:
        preemption.limit = ft.max_preemptions
        if heals is not None:  # a drained node's replica groups move off it while the others train on
            preemption.move_replicas = _mover(heals, hang)
    watches: list[Watch | None] = [
        ledger,
        RollbackWatch(),
        swap,
        preemption,
        heals,
        RankFailures(),
        StragglerStop(swap),
        Finished(),
        SilenceWatch(spec, hang),
        hang,
    ]
    return [w for w in watches if w is not None]
