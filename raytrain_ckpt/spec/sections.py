"""The sections of a job spec: one pydantic model each, a docstring under every field.

Checks that involve one section only live here (field and model validators); checks across
sections live with ``JobSpec`` in ``job.py``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from raytrain_ckpt.common.locations import home_problem, is_uri, mask_uri
from raytrain_ckpt.data.suffixes import TEXT_SUFFIXES, input_files
from raytrain_ckpt.models import PRESETS, describe_model, resolve_factory
from raytrain_ckpt.spec.loggers import LoggersSpec

__all__ = [
    "CheckpointSpec",
    "DataSpec",
    "EvalSpec",
    "FaultToleranceSpec",
    "FieldProblems",
    "FinalExportSpec",
    "GuardSpec",
    "KeepBestSpec",
    "LRSchedulerSpec",
    "ModelSpec",
    "OptimizerSpec",
    "ParallelismSpec",
    "ReplicationSpec",
    "ResourcesSpec",
    "SpecError",
    "TrainingSpec",
    ]


class SpecError(ValueError):
    """A user mistake in a job spec: one human-readable line per problem (a secret in a URI masked)."""

    def __init__(self, problems: list[str]) -> None:
        problems = [_printable(mask_uri(p)) for p in problems]
        super().__init__("\n".join(problems))
        self.problems = problems


def _printable(line: str) -> str:
    """``line`` with control and separator characters (a NUL, a newline, U+2028) escaped: one
    problem stays one line, and a NUL in a value is seen."""
    if line.isprintable():
        return line
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in line)


class FieldProblems(ValueError):
    """Cross-field problems raised inside a validator, each with its own field path."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{p}: {m}" for p, m in problems))
        self.problems = problems


class _Section(BaseModel):
    # strict: `steps: true` or `steps: 1.5` is a mistake, not 1; allow_inf_nan: `.inf` is never a setting.
    # Paths and the betas pair opt out of strictness per field (a str is a fine path, a list a fine pair).
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True, strict=True,
                              allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _within_64_bits(cls, value: Any) -> Any:
        # After each field's own bounds (which say more): any whole number beyond 64 bits validates
        # and then overflows in torch, Ray or a manifest at run time.
        if isinstance(value, int) and not isinstance(value, bool) and not -MAX_INT - 1 <= value <= MAX_INT:
            raise ValueError(f"a number of {len(str(abs(value)))} digits, beyond 64 bits; give at most {MAX_INT}")
        return value


class ModelSpec(_Section):
    name: str = "debug"
    """Built-in preset (debug, small, 1b, 8b) or a user factory 'package.module:function' that returns an nn.Module."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Preset fields to change (e.g. n_layers: 2), or keyword arguments passed to the factory."""

    @model_validator(mode="after")
    def _resolvable(self) -> ModelSpec:
        if ":" in self.name:
            try:
                resolve_factory(self.name)
            except ValueError as exc:
                raise FieldProblems([("name", str(exc))]) from None
            return self
        if self.name not in PRESETS:
            raise FieldProblems([("name", f"'{self.name}' is neither a preset ({', '.join(PRESETS)}) "
                                          "nor a factory path 'package.module:function'")])
        try:
            describe_model(self.name, self.overrides)
        except ValueError as exc:
            raise FieldProblems([("overrides", str(exc))]) from None
        return self


MAX_INT = 2**63 - 1
"""The largest whole number a spec field may hold (19 digits): torch, Ray and the manifests keep
counts and seeds in 64-bit integers, so a larger one would validate and then overflow at run time."""

RESUME_VALUES = "must be latest, none, a step number, or the path of an existing step directory"
"""What checkpoint.resume takes, as its errors say."""

MAX_SECONDS = 1e9
"""The longest duration a spec field may give (about 31 years): a timer longer than this is
never what is meant, and Python's waits and timedeltas refuse ones much longer."""

MIN_SECONDS = 0.001
"""The shortest duration a spec field may give: a timer below a millisecond expires before
anything it waits for could happen (and a collective's timeout of 0 fails at once)."""
MAX_STEP = MAX_INT
"""The largest step number (64 bits, as the manifests and torch record it)."""
RESOURCE_UNIT = 0.0001
"""Ray's granularity of a fractional resource: it refuses a quantity finer than this."""
MAX_RESOURCE_PER_WORKER = 1e6
"""The most CPUs or GPUs one worker may reserve (no node has more; Ray keeps quantities in fixed point)."""
MIN_MB_PER_S = 0.001
"""The slowest rate a bandwidth limit may set (1 KB/s): below it a send's wait overflows."""

_BUILTIN_SOURCES = ("synthetic", "text", "tokens")


def _resolve_existing(value: Path | None, info: ValidationInfo, what: str) -> Path | None:
    """Resolve a relative path against the spec file's directory; it must exist."""
    if value is None:
        return None
    base = (info.context or {}).get("base_dir")
    path = _known_home(value).expanduser()
    if not path.is_absolute() and base is not None:
        path = Path(base) / path
    if not _exists(path):
        raise ValueError(f"{value} does not exist (resolved to {path}); point it at {what}")
    return path.resolve()


def _exists(path: Path) -> bool:
    """``path.exists()``, with the lookup's own error (a name too long, a directory that cannot be
    searched) as the ValueError a user reads instead of an OSError."""
    try:
        return path.exists()
    except OSError as exc:
        raise ValueError(f"cannot be looked up ({exc.strerror or exc})") from None


def _builtin_or_import_path(value: str, builtins: tuple[str, ...], kind: str, not_a_path: str) -> str | None:
    """The problem with ``value`` as a built-in name or an import path ``package.module:name``
    (``not_a_path`` when it is neither), or None when it is fine."""
    if value in builtins:
        return None
    if ":" not in value:
        return not_a_path
    return _check_import_path(value, kind)


def _check_import_path(value: str, kind: str) -> str | None:
    """None when ``value`` names an importable callable, else why not."""
    try:
        resolve_factory(value, kind)
    except ValueError as exc:
        return str(exc)
    return None


class DataSpec(_Section):
    source: str = "synthetic"
    """synthetic: a seeded, learnable token stream; text: byte-level tokens (vocab 256) from text files; tokens: pre-tokenized shards (.bin flat arrays of data.dtype, or .npy), memory-mapped; or a factory 'package.module:function' returning a map-style dataset of token-id sequences."""
    path: Path | None = Field(None, strict=False)
    """File or directory of text (source=text) or of token shards (source=tokens); a relative path is resolved against the spec file's directory."""
    dtype: Literal["uint16", "uint32"] = "uint16"
    """Token type of .bin shards (source=tokens); .npy shards carry their own."""
    bos_id: int | None = Field(None, ge=0)
    """Token id put before every sample (its window is then seq_len tokens of the data); null: none."""
    eval_path: Path | None = Field(None, strict=False)
    """Held-out token shards for evaluation (source=tokens), read like path; null: see eval_fraction."""
    eval_fraction: float | None = Field(None, gt=0, lt=1)
    """Carve this fraction of the samples (the last windows of the corpus, or the last dataset items) off as the held-out split; training never sees them."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of a data.source factory."""
    skip_samples: list[list[int]] = Field(default_factory=list)
    """Windows of global sample indices never read, each [from_step, lo, hi]: from that step on the samples [lo, hi) are skipped (what a guard rollback records in the manifest's skipped_samples; a resume adds the manifest's windows)."""

    @field_validator("skip_samples")
    @classmethod
    def _windows(cls, value: list[list[int]]) -> list[list[int]]:
        for row in value:
            if len(row) != 3 or min(row) < 0 or row[2] <= row[1]:
                raise ValueError(f"window {row} is not [from_step, lo, hi] with 0 <= lo < hi and from_step >= 0")
        return value

    @field_validator("source")
    @classmethod
    def _known_source(cls, value: str) -> str:
        why = _builtin_or_import_path(value, _BUILTIN_SOURCES, "data.source factory",
                                      f"must be {', '.join(_BUILTIN_SOURCES)} or a dataset factory "
                                      "'package.module:function'")
        if why:
            raise ValueError(why)
        return value

    @field_validator("path")
    @classmethod
    def _resolve_path(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        path = _resolve_existing(value, info, "a text file, a token shard or a directory of them")
        problem = _text_path_problem(path) if path is not None and info.data.get("source") == "text" else None
        if problem:
            raise ValueError(f"{problem}; point it at a text file or a directory of them")
        return path

    @field_validator("eval_path")
    @classmethod
    def _resolve_eval_path(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        return _resolve_existing(value, info, "a token shard or a directory of shards")

    @model_validator(mode="after")
    def _path_matches_source(self) -> DataSpec:
        problems = _data_problems(self)
        if problems:
            raise FieldProblems(problems)
        return self

    @property
    def is_factory(self) -> bool:
        """source names a user dataset factory."""
        return self.source not in _BUILTIN_SOURCES


def _data_problems(d: DataSpec) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    if d.is_factory:
        if d.path is not None or d.eval_path is not None:
            out.append(("path", "a data.source factory reads its own data; remove path/eval_path"))
        return out
    if d.source in ("text", "tokens") and d.path is None:
        out.append(("path", f"required when source={d.source}; set it to a file or directory"))
    if d.source == "synthetic" and d.path is not None:
        out.append(("path", "only used with source=text or tokens; remove it or set data.source"))
    if d.eval_path is not None and d.source != "tokens":
        out.append(("eval_path", "only used with source=tokens; use eval_fraction to hold out part of the data"))
    if d.eval_path is not None and d.eval_fraction is not None:
        out.append(("eval_fraction", "set either eval_path or eval_fraction, not both"))
    if d.source in ("synthetic", "text") and d.eval_fraction is not None:
        out.append(("eval_fraction", f"not supported with source={d.source}; use source=tokens or a factory"))
    if d.kwargs:
        out.append(("kwargs", "only used with a data.source factory; remove it"))
    if d.bos_id is not None and d.source != "tokens":
        out.append(("bos_id", f"not used with source={d.source}; use source=tokens or a factory, or remove it"))
    return out


class EvalSpec(_Section):
    every_steps: int = Field(..., ge=1)
    """Compute the validation loss after every this many steps (and after the last one)."""
    batches: int = Field(4, ge=1)
    """Held-out global batches (training.global_batch_size samples each) per evaluation: the same samples every time, on every layout."""


class ParallelismSpec(_Section):
    dp_shard: int = -1
    """FSDP2 data-parallel shard degree; -1 means every worker not used by other dimensions."""
    pp: int = Field(1, ge=1)
    """Pipeline-parallel degree: the model is split into pp stages (x virtual_stages) across workers; world = pp x dp_shard."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    """Pipeline schedule (pp > 1): gpipe (all forwards, then all backwards), 1f1b, or interleaved_1f1b (virtual_stages chunks per rank)."""
    virtual_stages: int = Field(1, ge=1)
    """Model chunks per pipeline rank; >= 2 only with pp_schedule=interleaved_1f1b (pp x virtual_stages stages in all)."""
    microbatches: int | None = Field(None, ge=1)
    """Pipeline micro-batches per optimizer step on each data-parallel rank; null: global_batch_size / (micro_batch_size x dp). When set it must equal that."""
    pp_split_points: list[str] = Field(default_factory=list)
    """Layer FQNs where a new stage starts, e.g. [layers.2] (pp x virtual_stages - 1 of them); empty: balance layers by parameter count."""

    @field_validator("dp_shard")
    @classmethod
    def _dp_shard_value(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("must be >= 1, or -1 for 'all remaining workers'")
        return value

    @model_validator(mode="after")
    def _pipeline_fields(self) -> ParallelismSpec:
        return _check_pipeline_fields(self)


class OptimizerSpec(_Section):
    name: str = "adamw"
    """adamw (torch.optim.AdamW), sgd (torch.optim.SGD), or a factory 'package.module:function' called as f(params, lr=lr, **kwargs) that returns a torch.optim.Optimizer."""
    lr: float = Field(3e-4, gt=0)
    """Peak learning rate, reached at the end of warmup."""
    betas: tuple[float, float] = Field((0.9, 0.95), strict=False)
    """AdamW (beta1, beta2), each in [0, 1)."""
    eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    weight_decay: float = Field(0.1, ge=0)
    """Decoupled weight decay (adamw), L2 penalty (sgd)."""
    momentum: float = Field(0.9, ge=0, lt=1)
    """SGD momentum (sgd only)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of an optimizer factory (besides lr)."""

    @model_validator(mode="after")
    def _known_optimizer(self) -> OptimizerSpec:
        if self.name in ("adamw", "sgd"):
            if self.kwargs:
                raise FieldProblems([("kwargs", "only used with an optimizer factory; remove it")])
            return self
        why = _builtin_or_import_path(self.name, (), "optimizer factory",
                                      f"'{self.name}' is neither adamw, sgd nor a factory path 'package.module:function'")
        if why:
            raise FieldProblems([("name", why)])
        return self

    @field_validator("betas")
    @classmethod
    def _betas_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in value):
            raise ValueError(f"each beta must be in [0, 1), got {list(value)}")
        return value


class LRSchedulerSpec(_Section):
    warmup_steps: int = Field(10, ge=0)
    """Linear warmup from 0 to optimizer.lr over this many steps (a run shorter than this never reaches the peak)."""
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    """Shape of the decay from the peak to min_lr_ratio * lr at training.steps."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """Final learning rate as a fraction of the peak."""


class GuardSpec(_Section):
    nonfinite: bool = True
    """Trip when any rank's loss at a step is NaN or infinite: no optimizer step is applied and the job rolls back to the newest certified step (see README, the guard)."""
    spike: bool = False
    """Also trip on a loss spike: a rank's loss whose robust z-score over the last spike_window losses exceeds spike_threshold."""
    spike_window: int = Field(50, ge=5)
    """How many previous healthy losses of the rank the spike test compares with (it starts once the window is full)."""
    spike_threshold: float = Field(6.0, gt=0)
    """Robust z-score, (loss - median) / (1.4826 x MAD), above which a loss is a spike."""
    certify_after_steps: int = Field(10, ge=1)
    """A committed step becomes certified, a step a rollback may return to, once this many healthy steps followed it."""
    max_rollbacks: int = Field(3, ge=0)
    """Rollbacks per job (they never spend fault_tolerance.max_restarts); one more trip fails the job with one report."""


class TrainingSpec(_Section):
    steps: int = Field(100, ge=1)
    """Optimizer steps to run."""
    global_batch_size: int = Field(8, ge=1)
    """Samples per optimizer step across all data-parallel ranks."""
    micro_batch_size: int = Field(2, ge=1)
    """Samples per forward/backward on one rank; gradient accumulation makes up the rest."""
    seq_len: int = Field(128, ge=2)
    """Tokens per sample."""
    seed: int = Field(0, ge=0, lt=2**63)
    """Seed for model init, data order and dropout-free training; same seed and world size give bit-identical runs on CPU."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this value; null turns clipping off."""
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    """FSDP2 parameter dtype for compute: auto = bf16 on GPU, fp32 on CPU. Gradients are reduced in fp32."""
    log_every_steps: int = Field(10, ge=1)
    """Rank 0 logs step, loss, tokens/s and step time every this many steps (and the last step)."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute block activations in backward to save memory: none, full (every block) or selective (every other block: about half the memory saving for half the recompute). Checkpoints load with any value."""
    compile: bool = False
    """torch.compile each transformer block (in place, so checkpoints keep their names and load with compile on or off); needs a C++ compiler on CPU."""
    deterministic: bool = False
    """GPU: run only deterministic CUDA kernels (torch.use_deterministic_algorithms and cuBLAS's fixed workspace), so a restart replays the lost steps bit-identically on the same GPUs and world size; slower. CPU training is deterministic without it."""
    loss: str = "cross_entropy"
    """cross_entropy (next-token, fp32), or a function 'package.module:fn' called as fn(logits [B, T, V], targets [B, T]) that returns a scalar tensor."""
    tensorboard_dir: str | None = None
    """Write TensorBoard scalars under <tensorboard_dir>/<job name>/: train (rank 0: loss, lr, tokens/s, eval loss) and driver (checkpoint commits, stall, persist, attempts, failures); steps replayed after a restart replace the earlier points. Needs the tensorboard extra; a directory every node can write (as checkpoint.dir). null: none."""
    loggers: LoggersSpec = Field(default_factory=LoggersSpec)
    """Scalar loggers: TensorBoard, W&B, MLflow or the user's own, one run per job (spec/loggers.py)."""
    guard: GuardSpec = Field(default_factory=GuardSpec)
    """The NaN/Inf and loss-spike guard: a trip rolls back to the newest certified step and skips the data window."""

    @model_validator(mode="after")
    def _tensorboard_named_with_its_dir(self) -> TrainingSpec:
        if "tensorboard" in self.loggers.backends and self.tensorboard_dir is None:
            raise ValueError("loggers.backends names tensorboard but training.tensorboard_dir is null; set "
                             "training.tensorboard_dir=<directory>")
        return self

    @field_validator("loss")
    @classmethod
    def _loss_importable(cls, value: str) -> str:
        why = _builtin_or_import_path(value, ("cross_entropy",), "loss function",
                                      f"'{value}' is neither cross_entropy nor a function path 'package.module:fn'")
        if why:
            raise ValueError(why)
        return value

    @field_validator("tensorboard_dir")
    @classmethod
    def _tensorboard_dir_absolute(cls, value: str | None) -> str | None:
        # as checkpoint.dir: relative to the driver's working directory, which the workers do not share
        if value is None:
            return None
        if not value.strip() or "\0" in value or "://" in value:
            raise ValueError("must be a local or mounted directory path (not a URI), or null for no TensorBoard output")
        return str(_known_home(Path(value)).expanduser().absolute())


class ResourcesSpec(_Section):
    num_workers: int = Field(2, ge=1)
    """Training processes (ranks), one Ray actor each."""
    min_workers: int | None = Field(None, ge=1)
    """Elastic floor: when num_workers cannot be placed within fault_tolerance.placement_timeout_s, train on the largest data-parallel size >= this that keeps the global batch (null: never shrink)."""
    use_gpu: bool = False
    """Train on CUDA with NCCL; false trains on CPU with gloo."""
    cpus_per_worker: float = Field(1.0, gt=0)
    """CPUs reserved per worker; also sets the worker's torch thread count."""
    gpus_per_worker: float | None = Field(None, ge=0)
    """GPUs reserved per worker; default 1 with use_gpu, else 0."""
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Ray placement group strategy for the worker bundles."""

    @property
    def gpus(self) -> float:
        """GPUs per worker after defaults."""
        if self.gpus_per_worker is not None:
            return self.gpus_per_worker
        return 1.0 if self.use_gpu else 0.0

    @model_validator(mode="after")
    def _gpu_consistent(self) -> ResourcesSpec:
        if self.min_workers is not None and self.min_workers > self.num_workers:
            raise FieldProblems([("min_workers", f"{self.min_workers} exceeds num_workers={self.num_workers}; "
                                                 "set it to at most num_workers, or null to never shrink")])
        problems = _resource_problems("cpus_per_worker", self.cpus_per_worker)
        if self.gpus_per_worker is not None:
            problems += _resource_problems("gpus_per_worker", self.gpus_per_worker)
        if problems:
            raise FieldProblems(problems)
        g = self.gpus_per_worker
        if g is not None and g > 0 and not self.use_gpu:
            raise FieldProblems([("gpus_per_worker", f"{g} GPUs requested but use_gpu is false; set resources.use_gpu=true or gpus_per_worker=0")])
        if g == 0 and self.use_gpu:
            raise FieldProblems([("gpus_per_worker", "0 with use_gpu=true; each worker needs a GPU share > 0")])
        return self


def _resource_problems(name: str, value: float) -> list[tuple[str, str]]:
    """What Ray would refuse when it places a worker reserving ``value`` of a resource."""
    if value > MAX_RESOURCE_PER_WORKER:
        return [(name, f"{value:g} is more than any node has; give at most {MAX_RESOURCE_PER_WORKER:g}")]
    units = value / RESOURCE_UNIT
    if value and (units < 1 or abs(units - round(units)) > 1e-6 * units):
        return [(name, f"{value!r} is finer than Ray's resource granularity {RESOURCE_UNIT}; round it to a "
                       f"multiple of {RESOURCE_UNIT} (e.g. {max(RESOURCE_UNIT, round(units) * RESOURCE_UNIT):.4f})")]
    if name == "gpus_per_worker" and value > 1 and not value.is_integer():
        return [(name, f"{value:g}: Ray gives a worker more than one GPU only in whole GPUs; use a whole number, "
                       "or a fraction below 1")]
    return []


_STORES = ("s3", "s3a", "gs", "gcs", "memory")
"""URI schemes a checkpoint or export may name (memory:// only where one process is all there is)."""
_MANGLED_URI = re.compile(r"^(s3a?|gs|gcs|file):/?(?!/)", re.IGNORECASE)
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
    folded = _MANGLED_URI.match(text) if isinstance(value, Path) else None
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
    mangled = _MANGLED_URI.match(text)
    if mangled:
        scheme = mangled.group(1)
        raise ValueError(f"looks like a {scheme}:// URI missing a slash; write {scheme}://{text[mangled.end():]}")
    variable = _ENV_VAR.search(text)
    if variable:
        raise ValueError(f"{variable.group(0)} is not expanded (a spec reads paths as written); write the path out, "
                         "or start it with ~ for the home directory")
    return _known_home(Path(text.removeprefix("file://")))


def _known_home(path: Path) -> Path:
    """``path``, whose leading ``~`` or ``~user`` (if any) can be expanded."""
    problem = home_problem(path)
    if problem:
        raise ValueError(problem)
    return path


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


DEFAULT_JOIN_S = 60.0
"""fault_tolerance.join_timeout_s when it is null (and start_timeout_s is at least twice as long)."""
DEFAULT_MTBF_S = 86400.0
"""The prior of fault_tolerance.expected_mtbf_s when it is null: one failure a day."""


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


def _at_least(value: float | None, floor: float, unit: str) -> float | None:
    """``value`` when it is null or at least ``floor`` (a duration or rate below it cannot work)."""
    if value is not None and value < floor:
        raise ValueError(f"{value!r} {unit} is below {floor:g} {unit}, the least this setting can work with; "
                         f"give {floor:g} or more")
    return value


def is_ascii_digits(text: str) -> bool:
    """``"40"`` but not ``"\u00b2"``: str.isdigit alone accepts Unicode digits that int() rejects."""
    return text.isascii() and text.isdigit()


def _text_path_problem(path: Path) -> str | None:
    """Why ``path`` cannot be the text corpus (a device, a FIFO, a directory without text files), or None."""
    if path.is_file():
        return None
    if not path.is_dir():
        return f"{path} is not a regular file or a directory (a device, FIFO or socket)"
    try:
        found = input_files(path, TEXT_SUFFIXES)
    except ValueError as exc:  # a FIFO among them, which the run would block on
        return str(exc)
    if not found:
        return f"directory {path} has no text files (suffixes {', '.join(sorted(TEXT_SUFFIXES))})"
    return None


def _check_pipeline_fields(par: ParallelismSpec) -> ParallelismSpec:
    problems: list[tuple[str, str]] = []
    interleaved = par.pp_schedule == "interleaved_1f1b"
    if par.virtual_stages > 1 and not interleaved:
        problems.append(("virtual_stages", f"{par.virtual_stages} needs pp_schedule=interleaved_1f1b "
                         f"(now {par.pp_schedule}); set virtual_stages=1 or pp_schedule=interleaved_1f1b"))
    if interleaved and par.virtual_stages < 2:
        problems.append(("virtual_stages", "interleaved_1f1b needs virtual_stages >= 2 (chunks per rank); "
                         "set it, or use pp_schedule=1f1b for one stage per rank"))
    if par.pp == 1 and (par.virtual_stages > 1 or par.pp_split_points):
        field = "virtual_stages" if par.virtual_stages > 1 else "pp_split_points"
        problems.append((field, "only used with pipeline parallelism; set parallelism.pp >= 2 or remove it"))
    stages = par.pp * par.virtual_stages
    if par.pp_split_points and len(par.pp_split_points) != stages - 1:
        problems.append(("pp_split_points", f"{len(par.pp_split_points)} points for {stages} stages "
                         f"(pp {par.pp} x virtual_stages {par.virtual_stages}); give {stages - 1}, or none to balance"))
    if problems:
        raise FieldProblems(problems)
    return par
