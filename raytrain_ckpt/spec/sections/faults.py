"""The ``fault_tolerance`` section.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from raytrain_ckpt.spec.sections.base import FieldProblems, MAX_SECONDS, MIN_SECONDS, _Section, _at_least

__all__ = ["DEFAULT_HEAL_STEPS", "DEFAULT_JOIN_S", "DEFAULT_MTBF_S", "FaultToleranceSpec"]


DEFAULT_JOIN_S = 60.0
"""fault_tolerance.join_timeout_s when it is null (and start_timeout_s is at least twice as long)."""
DEFAULT_MTBF_S = 86400.0
"""The prior of fault_tolerance.expected_mtbf_s when it is null: one failure a day."""
DEFAULT_HEAL_STEPS = 20
"""fault_tolerance.heal_steps by default. A replica's heal from a live peer measured 3-6 s, within
10 s (``bench/replica_heal.py``, docs/ARCHITECTURE.md "Replicas heal from a live peer"): 20 steps
cover it at a step of 0.5 s or longer. Too many steps idle only the healed replica (1/R of the
job) and skip its samples; too few make every healthy replica wait, so the default errs long."""


class FaultToleranceSpec(_Section):
    max_restarts: int = Field(3, ge=0)
    """Times the whole worker group is rebuilt after a worker failure or hang before the job fails (within failure_window_s, if set); 0: never restart, any failure ends the job."""
    failure_window_s: float | None = Field(3600.0, gt=0, le=MAX_SECONDS)
    """Count only failures within this many seconds against max_restarts; null counts every failure of the job."""
    retry_on: list[Literal["crash", "exception", "hang", "start"]] = Field(
        default_factory=lambda: ["crash", "exception", "hang", "start"])
    """Failures that restart the group: crash (a rank's process or node died), exception (a rank raised), hang, start (the group could not be placed or formed). Others fail the job at once."""
    restart_backoff_s: float = Field(0.0, ge=0, le=MAX_SECONDS)
    """Wait this long after tearing a failed group down before building the next one."""
    hang_timeout_s: float | Literal["auto"] = Field("auto")
    """A running group that completes no step for this long is treated as hung: every rank's stacks are saved, the culprit named, the group torn down. auto: learned from the measured step times (10 x the 99th percentile of the latest 200, at least 30 s; 300 s before 5 steps were measured and for the first step of each attempt; an eval step gets 300 s until one was measured, a rank in a save gets checkpoint.commit_timeout_s); a number: that fixed timeout, also the timeout of every collective (at least join_timeout_s; with auto, 600 s)."""
    start_timeout_s: float = Field(300.0, gt=0, le=MAX_SECONDS)
    """Time allowed for resources to be placed and the process group to form."""
    join_timeout_s: float | None = Field(None, gt=0, le=MAX_SECONDS)
    """How long a rank waits at the rendezvous for the others: a rank that never joins is named after this (below start_timeout_s). Also the floor of every collective's timeout, which leaves a loaded machine room when hang_timeout_s is short. null: 60 s, or half of start_timeout_s if that is less."""
    placement_timeout_s: float = Field(60.0, gt=0, le=MAX_SECONDS)
    """With resources.min_workers: how long to wait for the full group before shrinking it."""
    poll_interval_s: float = Field(1.0, gt=0, le=MAX_SECONDS)
    """How often the driver polls worker progress (the hang check). A crash or an exception is seen at once, not at the next poll."""
    reuse_workers: bool = True
    """After a crash or exception on a node that is still alive: keep the placement group and the surviving ranks' processes for the restart and replace only the dead ranks (false: rebuild every process)."""
    spare_workers: int = Field(1, ge=0, le=64)
    """Idle worker processes (torch already imported, no Ray resources held) kept ready to replace a crashed rank on their node; CPU jobs with max_restarts > 0 and reuse_workers only. With checkpointing and a built-in model, each spare also holds about one rank's optimizer state of host memory, touched ahead so that a takeover's load does not wait for fresh pages. 0: start replacements on demand."""
    drain_timeout_s: float = Field(5.0, gt=0, le=MAX_SECONDS)
    """With reuse_workers: how long surviving ranks get to leave the failed step and release their process group before they are killed and replaced instead."""
    expected_mtbf_s: float | None = Field(None, gt=0, le=MAX_SECONDS)
    """With checkpoint.interval_steps=auto: the prior mean time between failures in seconds, counted as one failure observed and blended with the failures the job sees; null: 86400 (one day)."""
    watch_drains: bool = True
    """Watch Ray's drain notices (`ray drain-node`, the autoscaler, a spot or preemptible VM's notice) for every node hosting a rank: on a notice every rank stops at the next step boundary, the step in hand is saved and committed, and the job restarts from it off the draining node. Needs checkpoint.enabled. false: a drained node's loss is a crash."""
    max_preemptions: int | None = Field(None, ge=0)
    """Preemptions (drain notices acted on) the job survives before it fails; they never spend max_restarts. null: no limit."""
    stop_grace_s: float = Field(30.0, gt=0, le=MAX_SECONDS)
    """On SIGTERM or SIGINT to the driver (`ray job stop`, a pod eviction, Ctrl-C): the time the ranks get to save and commit the step in hand before the job stops (state STOPPED, exit 143 for SIGTERM, 130 for SIGINT, with the step that is safe); a second signal stops at once. SIGTERM to one rank's process (a pod eviction) gets the same time, as a drain notice of that rank: the job saves, restarts and resumes. Needs checkpoint.enabled. A local Ray the driver starts runs in sessions of its own, so a signal to the driver's whole process group (`timeout`, a shell's job control) reaches the driver and not the Ray it stops with. A second signal means "stop now": logged as `SIGTERM again: stopping now`, and handled as Ctrl-C (what is committed stays, Ray shuts down, staging buffers are freed; exit 130)."""
    grow_check_s: float | None = Field(60.0, gt=0, le=MAX_SECONDS)
    """With resources.min_workers: how often a group running below num_workers looks for room for the missing ranks on nodes that are not draining; when they fit, the step in hand is saved and the group restarts at num_workers from it. Needs checkpoint.enabled. null: grow only at the next restart."""
    quarantine_s: float | None = Field(1800.0, gt=0, le=MAX_SECONDS)
    """A node whose ranks crashed or hung twice within failure_window_s gets no rank for this long while the cluster has room elsewhere (the group is placed around it; without room it is used, logged); null: never."""
    straggler_margin: float | None = Field(0.25, gt=0, le=100)
    """A rank that begins its steps later than the first rank by more than this fraction of the step time (median over its last 8 steps) is reported as a straggler (log, status, JobResult.stragglers; the skew is the job_step_skew_seconds metric); null: not watched."""
    heal_steps: int = Field(DEFAULT_HEAL_STEPS, ge=1, le=10**6)
    """With parallelism.dp_replicate > 1, the heal rule: a replica group that fails alone is out of the step it failed in (s, the first committed without it) and the heal_steps after; its replacement is healed from a live group at step s+heal_steps (its share of that step still skipped) and trains its share again from the next one. Skipped shares are recorded (JobResult, each rank's result) and tokens_seen counts trained samples only. A replacement ready early waits for that step; one not ready by then makes the others wait there. Fixed by the fault, not the clock, so a replay skips the same samples and ends bit-identical. 20 covers the measured heal (under 10 s) at steps of 0.5 s or longer."""
    min_replicas: int = Field(1, ge=1)
    """With parallelism.dp_replicate > 1: the fewest healthy replica groups the job steps on with while a failed one heals; a failure that would leave fewer, a failure in the first group (it saves the checkpoints) or in two groups at once restarts the whole job from its last checkpoint (logged with the reason). At most dp_replicate."""
    replace_stragglers: bool = False
    """Replace a rank reported as a straggler (straggler_margin): every rank saves and commits the step in hand and stops, and the job restarts from it with a spare or a new process for that rank, the others kept (reuse_workers). Each rank once per job; counted in JobResult.failures as kind straggler, never against max_restarts. Needs checkpoint.enabled and straggler_margin."""

    @field_validator("hang_timeout_s", mode="before")
    @classmethod
    def _hang_number_or_auto(cls, value: Any) -> Any:
        if isinstance(value, str) and value != "auto":
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"{value!r} is neither a number of seconds nor auto; use e.g. 120 or auto") from None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not value > 0:
            raise ValueError("must be > 0; use e.g. 120 or auto")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > MAX_SECONDS:
            raise ValueError(f"must be <= {MAX_SECONDS:.0f}")
        return value

    @field_validator("failure_window_s", "hang_timeout_s", "start_timeout_s", "join_timeout_s", "placement_timeout_s",
                     "poll_interval_s", "drain_timeout_s", "expected_mtbf_s", "stop_grace_s", "grow_check_s",
                     "quarantine_s")
    @classmethod
    def _duration_floor(cls, value: float | str | None) -> float | str | None:
        return value if isinstance(value, str) else _at_least(value, MIN_SECONDS, "s")

    @model_validator(mode="after")
    def _join_before_start(self) -> FaultToleranceSpec:
        if self.join_timeout_s is not None and self.join_timeout_s >= self.start_timeout_s:
            raise FieldProblems([("join_timeout_s", f"{self.join_timeout_s:g} is not below start_timeout_s="
                                  f"{self.start_timeout_s:g}: the start would give up before a rank that never "
                                  "joins is named; lower join_timeout_s or raise start_timeout_s")])
        if self.replace_stragglers and self.straggler_margin is None:
            raise FieldProblems([("replace_stragglers", "true needs stragglers to be watched, but straggler_margin "
                                  "is null; set straggler_margin (e.g. 0.25) or replace_stragglers=false")])
        return self

    @property
    def join_s(self) -> float:
        """join_timeout_s after its default."""
        return self.join_timeout_s if self.join_timeout_s is not None else min(DEFAULT_JOIN_S, self.start_timeout_s / 2)

    @property
    def prior_mtbf_s(self) -> float:
        """expected_mtbf_s after its default."""
        return self.expected_mtbf_s if self.expected_mtbf_s is not None else DEFAULT_MTBF_S
