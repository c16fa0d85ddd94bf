"""The ``parallelism``, ``optimizer``, ``lr_scheduler``, ``training`` (with its ``guard``) and
``resources`` sections.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from raytrain_ckpt.spec.loggers import LoggersSpec
from raytrain_ckpt.spec.sections.base import (
    FieldProblems,
    MAX_RESOURCE_PER_WORKER,
    RESOURCE_UNIT,
    _Section,
    _builtin_or_import_path,
    _known_home,
)

__all__ = ["GuardSpec", "LRSchedulerSpec", "OptimizerSpec", "ParallelismSpec", "ResourcesSpec", "TrainingSpec"]


class ParallelismSpec(_Section):
    dp_replicate: int = Field(1, ge=1, le=1024)
    """Replica groups (HSDP's replicate dimension): each group of dp_shard x pp workers is a process group of its own holding a whole copy of the model (FSDP2 over its shards) and trains its share of every global batch; the groups average gradients through torchft and step on its commit vote. world = dp_replicate x dp_shard x pp. The first group saves checkpoints, laid out as those of the same job without replicas (they load into any dp_replicate). A failure local to a group other than the first replaces that group only, healed from a live group while the others train on (fault_tolerance.heal_steps, min_replicas). Needs torchft; pp = 1 and no min_workers for now (README, Replicas)."""
    dp_shard: int = -1
    """FSDP2 data-parallel shard degree within a replica group; -1 means every worker not used by other dimensions."""
    pp: int = Field(1, ge=1)
    """Pipeline-parallel degree: the model is split into pp stages (x virtual_stages) across workers; world = dp_replicate x pp x dp_shard."""
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
