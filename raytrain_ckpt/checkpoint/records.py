"""Records that cross a process boundary in the checkpoint machinery: frozen dataclasses only.

Everything one process hands another (a trainer to its node's writer, a writer to the
CheckpointActor, the driver to the trainers, the actor to the driver and the CLI) is one of
these types, never a dict or a positional tuple, so both sides name the same fields and a
remote method's signature says what it takes. Plain data: they import neither torch nor Ray.
"""

from __future__ import annotations

__all__: list[str] = []

from dataclasses import dataclass, field
from typing import Any

__all__ += ["RankReport", "SaveTimings", "TrainingPoint"]


@dataclass(frozen=True)
class TrainingPoint:
    """What the trainers knew when they saved a step; recorded in its manifest."""

    samples_seen: int = 0
    tokens_seen: int = 0
    loss: float | None = None
    eval_loss: float | None = None


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
    results: list[Any]
    """DCP's ``WriteResult`` of every item the rank wrote (what ``.metadata`` is finished from)."""
    files: dict[str, Any] = field(default_factory=dict)
    """File name -> ``format.manifest.FileEntry`` (size and CRC-32C) of each file the rank wrote."""
    point: TrainingPoint = TrainingPoint()
    timings: SaveTimings = SaveTimings()


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


__all__ += ["WriterUsage"]


@dataclass(frozen=True)
class WriterUsage:
    """What a node's writer process has used: for benchmarks and diagnosis."""

    user_s: float
    system_s: float
    last: dict[int, dict[str, float]] = field(default_factory=dict)
    """Rank -> the phases of its last write (seconds: serialize, checksum, write calls, fsync, report...)."""
