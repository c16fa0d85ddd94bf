"""The ``checkpoint`` section (with ``final_export``, ``keep_best`` and ``replication``) and where
results go (``results_dir``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from raytrain_ckpt.common.locations import MANGLED_URI, STORE_SCHEMES, is_uri, mangled_uri
from raytrain_ckpt.spec.sections.base import (
    FieldProblems,
    MAX_SECONDS,
    MAX_STEP,
    MIN_MB_PER_S,
    MIN_SECONDS,
    RESUME_VALUES,
    _Section,
    _at_least,
    _exists,
    _known_home,
    is_ascii_digits,
)

__all__ = ["CheckpointSpec", "DEFAULT_RESULTS", "FinalExportSpec", "KeepBestSpec", "RESULTS_ENV", "ReplicationSpec", "results_dir"]


_STORES = STORE_SCHEMES
"""URI schemes a checkpoint or export may name (memory:// only where one process is all there is)."""
_ENV_VAR = re.compile(r"\$(\{[A-Za-z_][A-Za-z0-9_]*\}|[A-Za-z_][A-Za-z0-9_]*)")


def _path_or_uri(value: Path | str) -> Path | str:
    """A URI stays a string (Path would fold "s3://" to "s3:/"); anything else is a local path.
    A scheme no store here speaks, a URI missing a slash, and a ``$VARIABLE`` (a spec expands
    none) are refused rather than taken as a literal local directory.

    A JSON string may reach here as a Path (``model_validate_json`` on a worker picks the
    union's first member), its ``s3://`` already folded to ``s3:/``: a Path that reads as a
    folded URI is the URI; a string that does was typed that way, and is refused."""
    text = str(value)
    if "\0" in text:  # the OS refuses such a name, at the first mkdir of the run
        raise ValueError("contains a NUL byte, which no path or URI can hold; write the path out")
    if not text.strip():  # Path("") is the working directory: never meant
        raise ValueError("is empty; give a directory such as checkpoints, or an object-store URI")
    folded = MANGLED_URI.match(text) if isinstance(value, Path) else None
    if folded and folded.group(1).lower() == "file":
        text = text[len("file:"):]  # file:///x folds to file:/x: the local path /x
    elif folded:
        text = f"{folded.group(1)}://{text[folded.end():]}"
    if is_uri(text):
        scheme = text.split("://", 1)[0]
        if "@" in text.split("://", 1)[1].split("/", 1)[0]:
            raise ValueError("holds credentials (user:password@); a spec is printed and logged: give them in the "
                             "environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, a profile) or "
                             "checkpoint.storage_options instead")
        if scheme not in _STORES:
            raise ValueError(f"{scheme}:// is not a store checkpoints can live on; use a local or shared file "
                             "system path, s3://bucket/prefix or gs://bucket/prefix")
        return text
    mangled = mangled_uri(text)
    if mangled:
        raise ValueError(mangled)
    variable = _ENV_VAR.search(text)
    if variable:
        raise ValueError(f"{variable.group(0)} is not expanded (a spec reads paths as written); write the path out, "
                         "or start it with ~ for the home directory")
    return _known_home(Path(text.removeprefix("file://")))


class FinalExportSpec(_Section):
    format: Literal["hf", "torch"] = "hf"
    """hf: Hugging Face safetensors shards + index + config.json (built-in Llama only); torch: one torch.save file of the weights."""
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    """What the exported weights are cast to."""
    dir: Path | str | None = None
    """Output directory or object-store URI (must not exist or be empty); null: <checkpoint.dir>/<name>/export-step-<N>."""

    @field_validator("dir", mode="after")
    @classmethod
    def _dir_kind(cls, value: Path | str | None) -> Path | str | None:
        return value if value is None else _path_or_uri(value)


class KeepBestSpec(_Section):
    metric: Literal["eval_loss", "loss"] = "eval_loss"
    """The value a step's manifest records to rank by: eval_loss (needs the eval section; a save step records it when an eval falls on it) or loss (the training loss; a save step records it when it is a log step)."""
    mode: Literal["min", "max"] = "min"
    """min: lower is better (losses); max: higher is better."""
    k: int = Field(1, ge=1)
    """How many of the best steps to keep, besides keep_latest_k and keep_every_n_steps."""


class ReplicationSpec(_Section):
    mode: Literal["auto", "off"] = "off"
    """auto: after a step commits, each node's writer sends its ranks' committed copies to the next node's writer (a ring over the nodes hosting ranks); a rank on a node that was lost is restored from that replica, storage is the fallback. Off with one node (logged). off: no replicas."""
    max_mb_per_s: float | None = Field(200.0, gt=0)
    """Bandwidth limit of one writer's replica sends, in MB/s (1e6 bytes); null: unlimited. Sends run after the commit, off the training path."""

    @field_validator("max_mb_per_s")
    @classmethod
    def _rate_floor(cls, value: float | None) -> float | None:
        return _at_least(value, MIN_MB_PER_S, "MB/s")

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_words(cls, value: Any) -> Any:
        # YAML reads a bare off/on as a boolean
        return {False: "off", True: "auto"}.get(value, value) if isinstance(value, bool) else value


RESULTS_ENV = "RAYTRAIN_CKPT_RESULTS"
"""Environment variable naming the persistent results base (a directory or an object-store URI)."""
DEFAULT_RESULTS = "~/raytrain_results"
"""The persistent results base when RAYTRAIN_CKPT_RESULTS is unset, as Ray Train keeps ~/ray_results."""


def results_dir() -> Path | str:
    """Where a job's checkpoints go when its spec names no checkpoint.dir: $RAYTRAIN_CKPT_RESULTS,
    else ~/raytrain_results, made absolute here (the driver), so that every process of the job
    reads the same place from the resolved spec. Also the base of a relative checkpoint.dir under
    ``ray job submit`` (see ``raytrain_ckpt/control/preflight.py``)."""
    text = os.environ.get(RESULTS_ENV) or DEFAULT_RESULTS
    if is_uri(text):
        return text.rstrip("/")
    try:
        return Path(os.path.abspath(Path(text).expanduser()))
    except RuntimeError:  # no home directory to expand ~ to: preflight names the unusable path
        return Path(text)


class CheckpointSpec(_Section):
    enabled: bool = True
    """Save checkpoints (and resume from them): on unless a spec turns it off. false: no checkpoint is written or loaded, and a failure loses every step since the start."""
    dir: Path | str = Field(default_factory=results_dir)
    """Root directory or object-store URI (s3://bucket/prefix, gs://bucket/prefix; needs the [s3] / [gcs] extra); this job's steps go to <dir>/<name>/step-<N>/. Default: $RAYTRAIN_CKPT_RESULTS, else ~/raytrain_results. A relative path is resolved against the working directory; under `ray job submit` (whose working directory is a temporary copy of the code) against the default instead."""
    storage_options: dict[str, Any] = Field(default_factory=dict)
    """For a URI dir: options passed to its fsspec filesystem (e.g. {endpoint_url: http://minio:9000} or {anon: false}); credentials come from the usual environment and profiles (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ~/.aws)."""
    mode: Literal["async", "sync"] = "async"
    """async: stage into shared memory, write in the background, training goes on; sync: training waits for the commit."""
    interval_steps: int | Literal["auto"] | None = "auto"  # >= 1: _interval_hint
    """Save every this many steps; auto: choose the interval from the measured cost of a save and the failure rate (Young-Daly, see fault_tolerance.expected_mtbf_s); null saves only on interval_seconds / save_final."""
    interval_seconds: float | None = Field(None, gt=0, le=MAX_SECONDS)
    """Also save when this much time passed since the last save; null turns the time trigger off."""
    keep_latest_k: int | None = Field(3, ge=1)
    """Keep the newest k committed steps (plus keep_every_n_steps); null keeps every step."""
    keep_every_n_steps: int | None = Field(None, ge=1)
    """Also keep every step divisible by this (long-term snapshots); null: none."""
    keep_best: KeepBestSpec | None = None
    """Also keep the k committed steps with the best value of a metric their manifests record (Ray Train's checkpoint_score_attribute/order): metric (eval_loss, which needs the eval section, or loss, the training loss), mode (min or max), k (>= 1), e.g. {metric: eval_loss, mode: min, k: 1}; `export <root> best` exports the best step; null: none."""
    resume: str = "latest"
    """latest: the newest valid step under dir (a fresh start when there is none); none: start fresh; a step number; or a path to a step directory."""
    save_final: bool = True
    """Save (and wait for the commit of) the last step when training ends."""
    on_busy: Literal["wait", "skip"] = "wait"
    """A save due while the previous one is still writing: wait for it (training stalls), or skip this save (logged)."""
    verify_on_load: Literal["size", "checksum"] = "checksum"
    """Before loading: check every file's size and checksum against the manifest (reads every file, CRC-32C at several GB/s), or sizes only (a flipped bit is then loaded). A restart that loads from the in-memory copies checks their checksums instead and reads only sizes from storage."""
    commit_timeout_s: float = Field(600.0, gt=0, le=MAX_SECONDS)
    """How long a synchronous or final save waits for its commit before the job fails."""
    settle_timeout_s: float = Field(60.0, gt=0, le=MAX_SECONDS)
    """Before a restart (and when a failed job ends): how long to wait for steps that every rank handed to a writer to commit; a step still unfinished then is aborted. A step whose writer is known dead or restarted (it no longer holds a rank's hand-off, or its node is dead) is aborted at once: this bounds only a writer that is alive but stuck, or does not answer."""
    leftover_grace_s: float = Field(3600.0, gt=0, le=MAX_SECONDS)
    """An uncommitted step (shards without a manifest on an object store, a .tmp- directory on a file system) that no save of this job is writing and that stayed unchanged this long is removed while the job runs (at start, every leftover is removed at once)."""
    writer_threads: int = Field(1, ge=1, le=64)
    """I/O threads per rank in the node's checkpoint writer."""
    writer_nice: int = Field(2, ge=0, le=19)
    """Added to the checkpoint writer process's niceness (Ray starts workers at 15: the default puts it at 17, below the trainers). Higher makes saves durable later; the CPU a save takes from training stays about the same."""
    memory_copies: int = Field(2, ge=1, le=2)
    """Staging buffers per rank in its node's shared memory. 2: ranks stage into them in turn, so the newest committed step stays intact in memory until a newer one commits, and a restart at the same world size loads each rank's shard from there instead of storage (falling back to storage, logged, when a copy is missing or does not verify); costs a second staging buffer of host memory per rank (validate prints it). 1: one buffer; a restart always loads from storage."""
    replication: ReplicationSpec = Field(default_factory=ReplicationSpec)
    """Peer replicas of committed copies in RAM: mode (auto or off), max_mb_per_s (the send rate limit), e.g. {mode: auto, max_mb_per_s: 200}."""
    final_export: FinalExportSpec | None = None
    """After the last step commits, the driver exports it once: format (hf or torch), dtype (bf16, fp16, fp32), dir (null: <checkpoint.dir>/<name>/export-step-<N>); null: no export."""

    @field_validator("interval_seconds", "commit_timeout_s", "settle_timeout_s", "leftover_grace_s")
    @classmethod
    def _duration_floor(cls, value: float | None) -> float | None:
        return _at_least(value, MIN_SECONDS, "s")

    @field_validator("interval_steps", mode="before")
    @classmethod
    def _interval_hint(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError("must be >= 1; use checkpoint.enabled=false to turn saving off")
        whole = isinstance(value, int) and not isinstance(value, bool)
        if not whole and value is not None and value != "auto":
            raise ValueError(f"{value!r} is neither a whole number of steps nor auto; use e.g. 50, auto or null")
        return value

    @field_validator("dir", mode="before")
    @classmethod
    def _dir_not_empty(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip():  # Path("") is the working directory: never meant
            raise ValueError("is empty; give a directory such as checkpoints, or an object-store URI")
        return value

    @field_validator("dir", mode="after")
    @classmethod
    def _dir_kind(cls, value: Path | str) -> Path | str:
        return _path_or_uri(value)

    @field_validator("resume", mode="before")
    @classmethod
    def _resume_int(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and value < 0:
            raise ValueError("a step number is >= 0; use a committed step's number, latest or none")
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("resume")
    @classmethod
    def _resume_value(cls, value: str, info: ValidationInfo) -> str:
        if not value.strip() or "\0" in value:
            raise ValueError(RESUME_VALUES)
        if is_ascii_digits(value) and (len(value) > 19 or int(value) > MAX_STEP):
            raise ValueError(f"step {value[:30]} is beyond any step a job can reach ({MAX_STEP}); {RESUME_VALUES}")
        if value in ("latest", "none") or is_ascii_digits(value) or is_uri(value):
            return value.rstrip("/")
        path = _known_home(Path(value)).expanduser()
        base = (info.context or {}).get("base_dir")
        if base is None:  # a spec resolved where it entered, validated again (a worker): no disk to ask
            return str(path)
        if not path.is_absolute() and not _exists(path):
            path = Path(base) / path
        if not (_exists(path) and path.is_dir()):
            raise ValueError(f"{RESUME_VALUES} (resolved to {path}, which is not a directory)")
        return str(path.resolve())

    @model_validator(mode="after")
    def _replication_needs_copies(self) -> CheckpointSpec:
        if self.replication.mode == "auto" and self.memory_copies < 2:
            raise FieldProblems([("replication.mode", "auto needs memory_copies=2 (a replica is sent from the "
                                                      "committed copy kept in memory); set checkpoint.memory_copies=2 "
                                                      "or checkpoint.replication.mode=off")])
        return self
