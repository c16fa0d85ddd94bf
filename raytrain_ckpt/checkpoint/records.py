"""Records that cross a process boundary in the checkpoint machinery: frozen dataclasses only.

Everything one process hands another (a trainer to its node's writer, a writer to the
CheckpointActor, the driver to the trainers, the actor to the driver and the CLI) is one of
these types, never a dict or a positional tuple, so both sides name the same fields and a
remote method's signature says what it takes. Plain data: they import neither torch nor Ray.
"""

from __future__ import annotations

__all__: list[str] = []

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotation only: records import no other module of the package
    from raytrain_ckpt.checkpoint.policy.interval import IntervalDecision

__all__ += ["RankReport", "SaveTimings", "TrainingPoint"]


@dataclass(frozen=True)
class TrainingPoint:
    """What the trainers knew when they saved a step; recorded in its manifest."""

    samples_seen: int = 0
    tokens_seen: int = 0
    loss: float | None = None
    eval_loss: float | None = None
    certified_step: int | None = None
    """The newest step the training guard certified when this step was saved (None: none yet)."""
    skipped_samples: tuple[tuple[int, int, int], ...] = ()
    """The sample windows the job skips, ``(from step, lo, hi)`` (``data/skips.py``)."""
    replica_skips: tuple[tuple[int, int, int, int], ...] = ()
    """Every replica group's share a step trained without, up to this step, ``(step, group, lo,
    hi)``: step ``step`` did not train the global samples ``[lo, hi)`` (``replicas/membership.py``)."""


@dataclass(frozen=True)
class SaveTimings:
    """One rank's phases of one save, in seconds; the manifest's ``wall`` takes the slowest rank's."""

    stage_s: float = 0.0
    """The trainer's blocking part plus the writer's wait for the staging copy to finish."""
    persist_s: float = 0.0
    """From the writer taking the request to the rank's files being durable (or uploaded)."""
    write_s: float = 0.0
    """Of ``persist_s``, writing the files."""
    phases: tuple[tuple[str, float], ...] = ()
    """The writer's own breakdown of ``write_s`` (checksum, write calls, fsync...), name -> seconds."""


@dataclass(frozen=True)
class RankReport:
    """A writer's report to the CheckpointActor: rank ``rank``'s files of ``step`` are written."""

    step: int
    rank: int
    attempt: int
    plan_id: str
    results: Any
    """The rank's write results as numbers (``format.rankresults.RankResults``: each item's key, file,
    offset and length; what ``.metadata`` is written from); None: the same as this rank's last
    delivered report for the plan (``digest`` says which)."""
    files: dict[str, Any] = field(default_factory=dict)
    """File name -> ``format.manifest.FileEntry`` (size and CRC-32C) of each file the rank wrote."""
    point: TrainingPoint = TrainingPoint()
    timings: SaveTimings = SaveTimings()
    tensors: dict[str, Any] = field(default_factory=dict)
    """fqn -> ``format.fingerprints.ShardSums`` of each floating-point tensor the rank wrote,
    summed by its writer off the training path; merged into the manifest's ``tensors``."""
    digest: str = ""
    """``RankResults.digest`` of ``results`` ("": not computed; the coordinator computes it)."""


__all__ += ["STALLED"]

STALLED = ", its write of "
"""Joins a writer's name and one of its writes in the key of a stalled write's silence (the writers'
fleet builds the key, the controller's silence watch reads it)."""


__all__ += ["PersistRequest"]


@dataclass(frozen=True)
class PersistRequest:
    """One rank's staged step, handed from the trainer to its node's writer (``CheckpointWriter.accept``)."""

    step: int
    rank: int
    attempt: int
    plan_id: str
    buffer_path: str
    buffer_bytes: int
    slots: list[Any]
    """The ``datapath.staging.TensorSlot`` of every tensor in the buffer."""
    objects: bytes
    """Pickled non-tensor entries of the flat state dict (small: counters, scheduler, RNG)."""
    plan: Any
    """The rank's central DCP ``SavePlan``."""
    point: TrainingPoint = TrainingPoint()
    """What the trainers knew at the step: recorded in the manifest."""
    stage_s: float = 0.0
    """The trainer's blocking part of the save, up to the copy's start (the writer adds the copy's own time)."""
    token: int = 0
    """The save's name in the buffer's ``StageProgress``: the request was sent as the copy began,
    and the writer waits for each tensor's bytes to be staged before writing them (0: the copy was
    complete before the request was sent)."""
    tier: str = "durable"
    """"durable": written to storage and reported; "ram": a preemption's RAM tier, only recorded
    as the buffer's copy (no file, no report: ``roles/ramtier.py``)."""


__all__ += ["WriterUsage"]


@dataclass(frozen=True)
class WriterUsage:
    """What a node's writer process has used: for benchmarks and diagnosis."""

    user_s: float
    system_s: float
    last: dict[int, dict[str, float]] = field(default_factory=dict)
    """Rank -> the phases of its last write (seconds: serialize, checksum, write calls, fsync, report...)."""


# --- a step's phase ------------------------------------------------------------------------

__all__ += ["StepPhase"]


class StepPhase(str, Enum):
    """Where a step's save is: the one answer, kept by the CheckpointActor's step registry.

    A ``str`` so that the phase reads (and serialises) as its name: ``status --json``, the
    ``raytrain_ckpt_checkpoint_inflight_phase`` metric's ``phase`` tag.
    """

    PLANNING = "planning"
    """The ranks' local plans are being gathered."""
    STAGING = "staging"
    """Some ranks handed their staged data to a writer, not all yet."""
    WRITING = "writing"
    """Every rank handed off; writers are writing the files."""
    COMMITTING = "committing"
    """Every rank's files are written; the manifest is being committed."""
    COMMITTED = "committed"
    ABORTED = "aborted"

    @property
    def is_terminal(self) -> bool:
        return self in (StepPhase.COMMITTED, StepPhase.ABORTED)


IN_FLIGHT_PHASES: tuple[StepPhase, ...] = tuple(p for p in StepPhase if not p.is_terminal)
"""The phases of a step in flight, in order."""
__all__ += ["IN_FLIGHT_PHASES"]


# --- what the driver hands the trainers ----------------------------------------------------

__all__ += ["AttemptPlan", "GroupLayout", "RankCheckpointPlan", "ResumePoint", "SaveCosts", "WriterRef"]


@dataclass(frozen=True)
class GroupLayout:
    """The layout of the group an attempt starts (the driver's ``configure``), recorded in
    every manifest; kept in ``.group.json`` so that a restarted CheckpointActor has it."""

    world_size: int = 0
    dp_size: int = 0
    spec_hash: str = ""
    model: dict[str, Any] | None = None
    """The spec's model section (free-form, as the manifest records it)."""


@dataclass(frozen=True)
class ResumePoint:
    """A verified checkpoint to load, leased to ``holder`` until released."""

    step: int
    path: str
    world_size: int
    samples_seen: int
    metadata_key: str | None = None
    """The decode key of the step's ``.metadata`` whose check the plan saw pass
    (``unpickling.vouching``): a rank loading the step takes that decode as done
    (``unpickling.vouch_for``) rather than decode it in a reader process of its own."""


@dataclass(frozen=True)
class SaveCosts:
    """Rank 0's newest measured save cost and step time (``interval_steps: auto``)."""

    cost_s: float | None = None
    step_time_s: float | None = None


@dataclass(frozen=True)
class WriterRef:
    """The writer that took a rank's hand-off: its actor handle and its node's id."""

    handle: Any
    """A Ray actor handle (records import no Ray)."""
    node_id: str


__all__ += ["NodeAnswer", "NodeBatch"]


@dataclass(frozen=True)
class NodeBatch:
    """What a node's writer tells the CheckpointActor for its ranks in one call (``roles/courier.py``)."""

    writer: WriterRef | None = None
    accepted: tuple[tuple[int, int, int], ...] = ()
    """(step, rank, attempt) of each hand-off the writer took over."""
    reports: tuple[RankReport, ...] = ()
    stalls: tuple[tuple[int, int, float], ...] = ()
    """(step, rank, seconds): how long the save of step blocked that rank's training thread."""


@dataclass(frozen=True)
class NodeAnswer:
    """The actor's answer to a ``NodeBatch``, entry by entry: a value, or the error raised for it."""

    accepted: tuple[Any, ...] = ()
    """Per hand-off: the step's temporary directory, or an exception."""
    reports: tuple[Any, ...] = ()
    """Per report: ``"committed"`` or ``"pending"``, or an exception."""


@dataclass(frozen=True)
class RankCheckpointPlan:
    """What one rank of an attempt needs to checkpoint: the CheckpointActor, its node's writer,
    and what it resumes from and where it loads it from."""

    actor: Any
    """The CheckpointActor's handle."""
    writer: Any
    """The handle of the CheckpointWriter on the rank's node."""
    resume: ResumePoint | None = None
    """None: a fresh start."""
    source: Any = None
    """``recovery.memcopy.RankSource``: memory or storage (None: nothing to load)."""
    interval: Any = None
    """``policy.interval.IntervalHistory`` (None: a fixed interval); the same on every rank."""
    plan_s: float = 0.0
    """Seconds the driver took verifying the resume step and choosing each rank's source."""


@dataclass(frozen=True)
class AttemptPlan:
    """The checkpoint plan of an attempt: one ``RankCheckpointPlan`` per rank, by rank."""

    ranks: tuple[RankCheckpointPlan, ...]


# --- the CheckpointActor's status ----------------------------------------------------------

__all__ += ["ActorStatus", "CentralPlan", "CommittedStep", "FailedSaves", "FileSum", "InFlight", "IntervalChoice",
            "JobNote", "ProbesSeen", "WorkAtRisk"]


@dataclass(frozen=True)
class CentralPlan:
    """A rank's part of the global save plan, and the plan's id (its cached metadata)."""

    plan: Any
    """``CentralNumbers`` (``format/plannumbers.py``), or DCP's central ``SavePlan`` itself where
    DCP's planner made the plan: ``plannumbers.own_central`` gives the rank its ``SavePlan``."""
    plan_id: str


@dataclass(frozen=True)
class FileSum:
    """A committed file's size and CRC-32C, as its step's manifest lists them."""

    size: int
    crc32c: int


@dataclass(frozen=True)
class ProbesSeen:
    """The CheckpointActor's node and which of the writers' probe files it sees under the root."""

    node_id: str
    seen: list[str]


@dataclass(frozen=True)
class JobNote:
    """The driver's view of the job after each controller step (``Controller.summary``)."""

    state: str
    attempt: int
    restarts: int
    failures: dict[str, int]
    """Failures by kind."""
    train_step: int | None
    preemption: str | None = None
    """The latest preemption: the node drained, the notice, the step saved and the steps lost."""
    hang_timeout_s: float | None = None
    """The hang timeout the controller applies now (``fault_tolerance.hang_timeout_s``, learned when auto)."""
    hang_timeout_why: str | None = None
    last_hang: str | None = None
    """The latest hang: its culprit and the diagnostics folder with every rank's stacks."""
    goodput: float | None = None
    """Training time / wall time so far (``control/watch/goodput.py``)."""
    stragglers: list[int] | None = None
    """Ranks reported as stragglers (``control/watch/stragglers.py``)."""
    stuck: str | None = None
    """A checkpoint writer or the actor not answering now, with the step (``control/watch/silence.py``)."""
    replica_heals: int | None = None
    """Replica groups replaced while the others trained on (``control/watch/replicas.py``; None: no replica groups)."""
    replicas_healing: list[int] | None = None
    """The replica groups being replaced or healed now (not yet back in the quorum)."""


@dataclass(frozen=True)
class FailedSaves:
    """Failed saves, counted per step: a job whose saves keep failing must say so."""

    total: int = 0
    consecutive: int = 0
    """Failed saves since the last commit."""
    last_step: int | None = None
    last_error: str | None = None


@dataclass(frozen=True)
class CommittedStep:
    """A committed step as ``status`` shows it."""

    bytes: int
    wall: dict[str, float]
    """The manifest's phase times, with the slowest rank's stall (``stall_s``) when known."""
    created_unix: float


@dataclass(frozen=True)
class InFlight:
    """The newest step in flight, its phase, and each rank's progress (1 handed off, 2 written)."""

    step: int | None = None
    """None: nothing in flight."""
    phase: StepPhase | None = None
    """None: idle."""
    ranks: dict[int, int] = field(default_factory=dict)

    @property
    def phase_name(self) -> str:
        """The phase as ``status`` and the metrics name it (``idle`` when nothing is in flight)."""
        return self.phase.value if self.phase is not None else "idle"


@dataclass(frozen=True)
class WorkAtRisk:
    """What a failure now would lose: seconds and training steps since the newest commit."""

    seconds: float
    steps: int


@dataclass(frozen=True)
class IntervalChoice:
    """The newest ``interval_steps: auto`` decision and the step it was taken at."""

    step: int
    decision: IntervalDecision


@dataclass(frozen=True)
class ActorStatus:
    """The CheckpointActor's state: committed, in-flight and failed steps, leases, the job's
    last note and the work at risk. ``to_dict`` is its JSON view (``status --json``, a job's result)."""

    root: str
    job: str
    world_size: int
    committed: list[int]
    in_flight: list[int]
    failed: dict[int, str]
    """Step -> why its save failed (the first reason, not the echoes)."""
    purge_errors: int
    failed_saves: FailedSaves
    leases: dict[int, int]
    """Step -> how many holders lease it."""
    steps: dict[int, CommittedStep]
    inflight: InFlight
    job_info: JobNote | None
    at_risk: WorkAtRisk
    interval: IntervalChoice | None
    resume_refused: dict[int, str] = field(default_factory=dict)
    """Committed steps a restart would not resume from, and why (``ResumeCheck``: checked as the
    resume plan checks, right after each commit): intact files, a ``.metadata`` the reader refuses."""

    @property
    def latest(self) -> int | None:
        return max(self.committed) if self.committed else None

    def to_dict(self) -> dict[str, Any]:
        """The JSON view, with the keys and order ``status`` has always printed."""
        inflight = self.inflight
        return {"root": self.root, "committed": list(self.committed), "in_flight": list(self.in_flight),
                "failed": dict(self.failed), "purge_errors": self.purge_errors,
                "failed_saves": asdict(self.failed_saves), "leases": dict(self.leases), "latest": self.latest,
                "job": self.job, "world_size": self.world_size,
                "steps": {s: {"bytes": c.bytes, "wall": dict(c.wall), "created_unix": c.created_unix}
                          for s, c in self.steps.items()},
                "inflight": {"step": inflight.step, "phase": inflight.phase_name, "ranks": dict(inflight.ranks)},
                "job_info": asdict(self.job_info) if self.job_info is not None else {},
                "at_risk": {"seconds": self.at_risk.seconds, "steps": self.at_risk.steps},
                "interval": ({"step": self.interval.step, **asdict(self.interval.decision)}
                             if self.interval is not None else None),
                "resume_refused": dict(self.resume_refused)}


__all__ += ["CommittedCopy"]


@dataclass(frozen=True)
class CommittedCopy:
    """Where one rank's copy of a written step lives on its node, and what it must hash to."""

    step: int
    rank: int
    layout: str
    """``staging.layout_key`` of the state it holds: the same key means the same slots and objects."""
    nbytes: int
    slots: list[Any]
    """The ``datapath.staging.TensorSlot`` of every tensor in the buffer."""
    objects: bytes
    """The pickled non-tensor entries of the rank's flat state dict (as handed to the writer)."""
    crc32c: int
    """CRC-32C of the buffer's first ``nbytes`` (its whole file), taken when the step was written."""
    path: str
    """The staging buffer file (``/dev/shm``) that holds the bytes on this node."""
    files: dict[str, dict[str, int]] = field(default_factory=dict)
    """The rank's files of the step as written: name -> {"size", "crc32c"}; the manifest must list the same."""
    node_id: str = ""


__all__ += ["Replica"]


@dataclass(frozen=True)
class Replica:
    """A verified replica held by a node's writer."""

    source_node: str
    """The node whose writer sent it (where the rank's own copy was)."""
    step: int
    rank: int
    nbytes: int
    crc32c: int
    copy: CommittedCopy
    """The source's committed-copy descriptor, its ``path`` replaced by this node's file."""

    @property
    def path(self) -> str:
        return self.copy.path


__all__ += ["NodeProbe"]


@dataclass(frozen=True)
class NodeProbe:
    """What one node wrote: its Ray node id, its address (for the message) and the probe's file name."""

    node_id: str
    address: str
    name: str
