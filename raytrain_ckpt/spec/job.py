"""``JobSpec``: the whole job, and the checks that span its sections."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from pydantic import Field, model_validator

from raytrain_ckpt.models import describe_model
from raytrain_ckpt.spec.sections import (
    CheckpointSpec,
    DataSpec,
    EvalSpec,
    FaultToleranceSpec,
    FieldProblems,
    LRSchedulerSpec,
    ModelSpec,
    OptimizerSpec,
    ParallelismSpec,
    ResourcesSpec,
    TrainingSpec,
    is_ascii_digits,
)
from raytrain_ckpt.spec.sections.base import _Section

__all__ = ["JobSpec"]


class JobSpec(_Section):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    """Job name (letters, digits, '_', '.', '-'); names the Ray actors and the checkpoint directory."""
    model: ModelSpec = Field(default_factory=ModelSpec)
    """What to train."""
    data: DataSpec = Field(default_factory=DataSpec)
    """Where the tokens come from."""
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    """How the model is split across workers."""
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    """Optimizer settings."""
    lr_scheduler: LRSchedulerSpec = Field(default_factory=LRSchedulerSpec)
    """Learning-rate schedule: linear warmup, then decay."""
    training: TrainingSpec = Field(default_factory=TrainingSpec)
    """Steps, batch sizes, sequence length, seed, precision."""
    eval: EvalSpec | None = None
    """Validation loss on held-out data (data.eval_path or data.eval_fraction; synthetic data has its own): every_steps, batches; null: no evaluation."""
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    """Workers and what each reserves."""
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    """Checkpointing."""
    fault_tolerance: FaultToleranceSpec = Field(default_factory=FaultToleranceSpec)
    """Restarts and timeouts."""

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self.resources.num_workers

    @property
    def dp_shard_size(self) -> int:
        """FSDP2 shard degree within one replica group, after resolving -1."""
        par = self.parallelism
        if par.dp_shard == -1:
            return self.world_size // (par.dp_replicate * par.pp)
        return par.dp_shard

    @property
    def dp_size(self) -> int:
        """Data-parallel degree: replica groups x shards, the ranks that split every global batch."""
        return self.parallelism.dp_replicate * self.dp_shard_size

    def with_workers(self, n: int) -> JobSpec:
        """The same job on ``n`` workers (a multiple of pp): the elastic layout after a shrink.

        Only the data-parallel degree shrinks; the pipeline keeps its stages, and the global
        batch stays, so each rank accumulates (or pipelines) more micro-batches.
        """
        return self.model_copy(update={
            "resources": self.resources.model_copy(update={"num_workers": n}),
            "parallelism": self.parallelism.model_copy(
                update={"dp_shard": n // self.parallelism.pp, "microbatches": None}),
        })

    def saving_group(self) -> JobSpec:
        """The layout that saves and resumes: the job itself, or with replica groups one group (its
        ranks are the job's first ``dp_shard x pp``), so that a checkpoint is the same as that of a
        job without replicas and loads into any ``dp_replicate``."""
        par = self.parallelism
        if par.dp_replicate == 1:
            return self
        return self.model_copy(update={
            "resources": self.resources.model_copy(update={"num_workers": self.world_size // par.dp_replicate}),
            "parallelism": par.model_copy(update={"dp_replicate": 1, "dp_shard": self.dp_shard_size}),
        })

    @property
    def local_microbatches(self) -> int:
        """Micro-batches per optimizer step on one data-parallel rank (the pipeline's microbatches)."""
        t = self.training
        return t.global_batch_size // (t.micro_batch_size * self.dp_size)

    def spec_hash(self) -> str:
        """Stable hash of the resolved spec, for telling runs apart."""
        text = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        problems = _layout_problems(self) + _batch_problems(self) + _model_data_problems(self)
        if not problems:
            problems = _pipeline_problems(self)
        problems += (_final_export_problems(self) + _eval_problems(self) + _keep_best_problems(self)
                     + _auto_interval_problems(self))
        if problems:
            raise FieldProblems(problems)
        return self


def _layout_problems(spec: JobSpec) -> list[tuple[str, str]]:
    par, n = spec.parallelism, spec.world_size
    out = _replica_problems(spec)
    r = par.dp_replicate
    if par.dp_shard == -1:
        if n % (r * par.pp):
            if r == 1:
                return out + [("resources.num_workers", f"{n} is not divisible by parallelism.pp={par.pp}; "
                               f"use a multiple of {par.pp} workers, or another pp")]
            return out + [("resources.num_workers", f"{n} is not divisible by parallelism.dp_replicate {r} x pp "
                           f"{par.pp} = {r * par.pp}; use a multiple of {r * par.pp} workers, or another dp_replicate")]
        return out
    if r * par.dp_shard * par.pp != n:
        if r == 1:
            return out + [("parallelism.dp_shard", f"dp_shard {par.dp_shard} x pp {par.pp} = {par.dp_shard * par.pp} "
                           f"does not match resources.num_workers={n}; make the product equal, or set dp_shard=-1")]
        return out + [("resources.num_workers", f"{n} does not equal dp_replicate {r} x dp_shard {par.dp_shard} x "
                       f"pp {par.pp} = {r * par.dp_shard * par.pp}; set num_workers to {r * par.dp_shard * par.pp}, "
                       "or parallelism.dp_shard=-1 to shard over the workers of each replica group")]
    return out


def _replica_problems(spec: JobSpec) -> list[tuple[str, str]]:
    """Replica fields that contradict each other, and what replica groups do not train with yet."""
    par, ft, r = spec.parallelism, spec.fault_tolerance, spec.parallelism.dp_replicate
    out: list[tuple[str, str]] = []
    if ft.min_replicas > r:
        out.append(("fault_tolerance.min_replicas", f"{ft.min_replicas} exceeds parallelism.dp_replicate={r}; set it "
                    f"to at most {r}"))
    if r == 1:
        return out
    if par.pp > 1:
        out.append(("parallelism.dp_replicate", f"{r} with parallelism.pp={par.pp}: replica groups with a pipeline "
                    "are not supported; use pp=1 with dp_replicate, or dp_replicate=1 with pp"))
    if spec.resources.min_workers is not None:
        out.append(("resources.min_workers", f"{spec.resources.min_workers} with parallelism.dp_replicate={r}: an "
                    "elastic shrink of a job with replica groups is not supported; remove min_workers"))
    return out




def _batch_problems(spec: JobSpec) -> list[tuple[str, str]]:
    t, dp, r = spec.training, spec.dp_size, spec.parallelism.dp_replicate
    out: list[tuple[str, str]] = []
    if dp >= 1 and t.global_batch_size % (t.micro_batch_size * dp):
        ranks = f"dp {dp}" if r == 1 else f"dp_replicate {r} x dp_shard {spec.dp_shard_size}"
        out.append(("training.global_batch_size",
                    f"{t.global_batch_size} is not divisible by micro_batch_size {t.micro_batch_size} x {ranks}; "
                    f"use a multiple of {t.micro_batch_size * dp}"))
    return out


def _model_data_problems(spec: JobSpec) -> list[tuple[str, str]]:
    cfg = describe_model(spec.model.name, spec.model.overrides) if ":" not in spec.model.name else None
    if cfg is None:
        return []
    out: list[tuple[str, str]] = []
    if spec.training.seq_len > cfg.max_seq_len:
        out.append(("training.seq_len", f"{spec.training.seq_len} exceeds the model context {cfg.max_seq_len} "
                    f"of '{spec.model.name}'; lower it or set model.overrides.max_seq_len"))
    bos = spec.data.bos_id
    if spec.data.source == "tokens" and bos is not None and bos >= cfg.vocab_size:
        out.append(("data.bos_id", f"{bos} is outside the model vocabulary (vocab_size {cfg.vocab_size}); use the "
                    "tokenizer's BOS id, below vocab_size, or raise model.overrides.vocab_size"))
    elif spec.data.source == "tokens":
        from raytrain_ckpt.data.tokens import CorpusWindows, TokenCorpus  # numpy and torch: only for token jobs

        # Opening the shards is cheap (a stat and a memory map each) and catches a wrong dtype,
        # a tokenizer larger than the model or a corpus shorter than one sample before any
        # worker starts.
        for name, path in (("data.path", spec.data.path), ("data.eval_path", spec.data.eval_path)):
            try:
                if path is not None:
                    CorpusWindows(TokenCorpus(path, spec.data.dtype, cfg.vocab_size), spec.training.seq_len, bos)
            except ValueError as exc:
                out.append((name, str(exc)))
    if spec.data.source == "text" and cfg.vocab_size < 256:
        out.append(("model.overrides.vocab_size", f"{cfg.vocab_size} is below 256, the byte-level vocabulary "
                    "of data.source=text; use vocab_size >= 256"))
    return out


# --- pipeline parallelism -------------------------------------------------------


def _pipeline_problems(spec: JobSpec) -> list[tuple[str, str]]:
    """Degrees, layers, micro-batches and batch sizes that a pipeline needs to fit."""
    par, t = spec.parallelism, spec.training
    out: list[tuple[str, str]] = []
    m = spec.local_microbatches
    if par.microbatches is not None and par.microbatches != m:
        out.append(("parallelism.microbatches", f"{par.microbatches} does not match global_batch_size "
                    f"{t.global_batch_size} / (micro_batch_size {t.micro_batch_size} x dp {spec.dp_size}) = {m}; "
                    f"set it to {m}, or null, or change training.micro_batch_size"))
    if par.pp == 1:
        return out
    stages = par.pp * par.virtual_stages
    cfg = describe_model(spec.model.name, spec.model.overrides) if ":" not in spec.model.name else None
    if cfg is not None and cfg.n_layers < stages:
        out.append(("parallelism.pp", f"{stages} stages (pp {par.pp} x virtual_stages {par.virtual_stages}) "
                    f"but '{spec.model.name}' has {cfg.n_layers} layers; each stage needs a layer: lower pp or "
                    f"virtual_stages, or raise model.overrides.n_layers"))
    if cfg is not None:
        out += _split_point_problems(par.pp_split_points, cfg.n_layers)
    if par.pp_schedule == "1f1b" and m < par.pp:
        out.append(("training.micro_batch_size", f"1f1b needs at least pp={par.pp} micro-batches per step, "
                    f"got {m} (global_batch_size {t.global_batch_size} / (micro_batch_size {t.micro_batch_size} "
                    f"x dp {spec.dp_size})); lower micro_batch_size or raise global_batch_size"))
    rounds = max(1, m // par.pp)
    if par.pp_schedule == "interleaved_1f1b" and m % rounds:
        out.append(("training.micro_batch_size", f"interleaved_1f1b needs the {m} micro-batches per step to be a "
                    f"multiple of {rounds} (rounds of pp={par.pp}); use a multiple of pp={par.pp} micro-batches"))
    return out


def _split_point_problems(points: list[str], n_layers: int) -> list[tuple[str, str]]:
    starts = []
    for point in points:
        prefix, _, key = point.partition(".")
        # (a layer index has at most 9 digits: int() of thousands of them raises, and is never a layer)
        if prefix != "layers" or not is_ascii_digits(key) or len(key) > 9 or not 0 < int(key) < n_layers:
            shown = point if len(point) <= 40 else f"{point[:20]}...({len(point)} characters)"
            return [("parallelism.pp_split_points", f"{shown!r} is not a layer a stage can start at; use "
                     f"'layers.<i>' with 1 <= i < n_layers={n_layers}")]
        starts.append(int(key))
    if starts != sorted(set(starts)):
        return [("parallelism.pp_split_points", f"{points} must be increasing and distinct")]
    return []


def _eval_problems(spec: JobSpec) -> list[tuple[str, str]]:
    d, out = spec.data, []
    if spec.eval is not None:
        if d.source == "text":
            out.append(("eval", "data.source=text has no held-out split; use data.source=tokens (see prepare-data) "
                        "or remove eval"))
        elif d.source != "synthetic" and d.eval_path is None and d.eval_fraction is None:
            out.append(("eval", "needs held-out data: set data.eval_path or data.eval_fraction"))
    return out


def _keep_best_problems(spec: JobSpec) -> list[tuple[str, str]]:
    cfg, best = spec.checkpoint, spec.checkpoint.keep_best
    if best is None:
        return []
    if best.metric == "eval_loss" and spec.eval is None:
        return [("checkpoint.keep_best.metric", "eval_loss is recorded only when the job evaluates; add an eval "
                 "section (eval: {every_steps: N}) or rank by metric: loss")]
    if cfg.interval_steps == "auto":  # the interval may come to any length, 1 included: some step can rank
        return []
    every = spec.eval.every_steps if best.metric == "eval_loss" and spec.eval else spec.training.log_every_steps
    last, interval = spec.training.steps, cfg.interval_steps
    # A save ranks when it falls on a recording step or is the last step. Saves fall on the
    # multiples of the interval up to the last step (and on the last with save_final); the first
    # multiple of both the interval and the recording period is their lcm (counted, not listed:
    # training.steps may be in the billions).
    rankable = cfg.save_final or (bool(interval) and (last % interval == 0 or math.lcm(interval, every) <= last))
    if cfg.interval_seconds is None and not rankable:
        knob = "eval.every_steps" if best.metric == "eval_loss" else "training.log_every_steps"
        return [("checkpoint.keep_best.metric", f"{best.metric} is recorded every {every} steps ({knob}) but no save "
                 f"step (checkpoint.interval_steps={cfg.interval_steps}) falls on one, so no step could rank; make "
                 "interval_steps a multiple of it")]
    return []


def _final_export_problems(spec: JobSpec) -> list[tuple[str, str]]:
    cfg = spec.checkpoint
    if cfg.final_export is None:
        return []
    if not cfg.enabled or not cfg.save_final:
        return [("checkpoint.final_export", "exports the final checkpoint; set checkpoint.enabled=true and "
                 "checkpoint.save_final=true, or remove final_export")]
    if cfg.final_export.format == "hf" and ":" in spec.model.name:
        return [("checkpoint.final_export.format", f"hf needs the built-in Llama; model.name={spec.model.name} is a "
                 "user factory with no Hugging Face names; use format torch")]
    return _export_overlap_problems(cfg.dir, cfg.final_export.dir, spec.name)


def _export_overlap_problems(base: Path | str, export: Path | str | None, name: str) -> list[tuple[str, str]]:
    """An export directory inside the job's checkpoint root (or holding it) is refused: the root's
    entries belong to retention and the start-up clean-up, and an export needs an empty directory,
    which one holding the root never is once the job has saved."""
    if export is None or isinstance(base, Path) != isinstance(export, Path):
        return []
    if isinstance(base, Path):
        try:
            root, out = (base.expanduser() / name).resolve(), export.expanduser().resolve()
        except (OSError, RuntimeError):  # (a ~user with no home, a link loop: the path checks say so)
            return []
        inside, holds = root == out or root in out.parents, out in root.parents
    else:
        root, out = f"{base.rstrip('/')}/{name}", export.rstrip("/")
        inside, holds = out == root or out.startswith(root + "/"), root.startswith(out + "/")
    if not (inside or holds):
        return []
    where = "is inside" if inside else "holds"
    return [(f"checkpoint.final_export.dir={export}", f"{where} the job's checkpoint root {root}, whose entries "
             "retention and the start-up clean-up own; use null (<checkpoint.dir>/<name>/export-step-<N>, which the "
             "root keeps) or a directory outside it")]


def _auto_interval_problems(spec: JobSpec) -> list[tuple[str, str]]:
    cfg, ft = spec.checkpoint, spec.fault_tolerance
    auto = cfg.interval_steps == "auto"
    if auto and not cfg.enabled and "interval_steps" in cfg.model_fields_set:  # (the default says nothing)
        return [("checkpoint.interval_steps", "auto chooses how often to save, but checkpoint.enabled=false; "
                 "set checkpoint.enabled=true, or remove interval_steps")]
    if ft.expected_mtbf_s is not None and not auto:
        return [("fault_tolerance.expected_mtbf_s", f"only used with checkpoint.interval_steps=auto (now "
                 f"{cfg.interval_steps}); set interval_steps=auto, or remove expected_mtbf_s")]
    return []
