"""The driver's metrics: after every controller step, the job's state, attempt, failures and
restarts by cause, preemptions, where the wall time went, the hang timeout and the stragglers.
Names and help texts: ``observe/metrics.py``'s ``METRICS``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from raytrain_ckpt.control.watch.hangs import HangWatch
from raytrain_ckpt.control.watch.stragglers import StragglerSwap
from raytrain_ckpt.observe import metrics as exported

if TYPE_CHECKING:
    from raytrain_ckpt.control.controller import Controller

__all__ = ["ControllerMetrics"]


class ControllerMetrics:
    """Called by the Controller after every ``step()`` (its observer): state, attempt, failures
    and restarts by kind; without checkpointing also the work at risk (with it, the
    CheckpointActor records that from the job notes the driver sends it)."""

    def __init__(self, job: str, checkpointing: bool = False) -> None:
        self.job = job
        self.checkpointing = checkpointing
        self._tags = {"job": job}
        self._failures = 0
        self._restarts: dict[str, int] = {}
        self._heals = 0
        self._preemptions = 0
        self._state = ""
        self._started = time.time()
        self._attempt = 0
        self._seconds: dict[str, float] = {}

    def _ledger(self, ctrl: Controller) -> None:
        """The goodput ledger's seconds by cause (as counters), its ratio, and the hang timeout."""
        for cause, total in ctrl.ledger.seconds.items():
            delta = total - self._seconds.get(cause, 0.0)
            if delta > 0:
                exported.record("job_wall_seconds_total", delta, {**self._tags, "cause": cause})
                self._seconds[cause] = total
        exported.record("job_goodput_ratio", ctrl.ledger.goodput, self._tags)
        hang, swap = ctrl.watch(HangWatch), ctrl.watch(StragglerSwap)
        if hang is not None:
            exported.record("job_hang_timeout_seconds", hang.hangs.current_s, self._tags)
        if swap is not None:
            exported.record("job_step_skew_seconds", swap.watch.skew_s, self._tags)
            exported.record("job_stragglers", len(swap.watch.reported), self._tags)

    def __call__(self, ctrl: Controller) -> None:
        state = ctrl.state.value
        if state != self._state:
            self._state = state
            for s in ("STARTING", "RUNNING", "RECOVERING", "SUCCEEDED", "FAILED", "STOPPED"):
                exported.record("job_state", int(s == state), {**self._tags, "state": s})
        exported.record("job_attempt", ctrl.attempt, self._tags)
        failures = ctrl.result.failures
        for failure in failures[self._failures:]:
            exported.record("job_failures_total", 1, {**self._tags, "cause": failure.kind})
        self._failures = len(failures)
        preemptions = ctrl.result.preemptions
        for p in preemptions[self._preemptions:]:
            exported.record("job_preemption_steps_lost_total", p["steps_lost"], self._tags)
            left = p["time_left_s"]
            exported.record("job_preemption_notice_seconds", -1 if left is None else left, self._tags)
        self._preemptions = len(preemptions)
        heals = ctrl.result.heals
        for heal in heals[self._heals:]:
            exported.record("job_replica_heals_total", 1, {**self._tags, "cause": heal["kind"]})
        self._heals = len(heals)
        for cause, n in ctrl.result.restarts.items():  # whole-group restarts only: a heal is not one
            if n > self._restarts.get(cause, 0):
                exported.record("job_restarts_total", n - self._restarts.get(cause, 0), {**self._tags, "cause": cause})
                self._restarts[cause] = n
        self._ledger(ctrl)
        poll = ctrl.last_poll
        if poll is not None and not self.checkpointing:  # everything this attempt trained is at risk
            if ctrl.attempt != self._attempt:
                self._attempt, self._started = ctrl.attempt, time.time()
            exported.record("work_at_risk_steps", poll.min_step, self._tags)  # the slowest rank: what all ranks trained
            exported.record("work_at_risk_seconds", time.time() - self._started, self._tags)
