"""The training loop of one rank, with no Ray in it.

A ``Trainer`` lives inside a process whose default process group is already
initialised (by a TrainWorker actor, or by torchrun in tests and GPU checks). It reads
top to bottom: build the model and shard it, then for each step take this rank's slice
of the global batch, accumulate gradients over micro batches (or run the pipeline schedule
over them, see ``parallel/pipeline.py``), clip, step.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from raytrain_ckpt.data import TokenSource, build_data, local_micro_batches
from raytrain_ckpt.data.skips import SampleSkips
from raytrain_ckpt.common.faults import take_nan
from raytrain_ckpt.models import build_model, resolve_factory
from raytrain_ckpt.parallel import PartBuilder, build_mesh, param_dtype_for, supports_deferred_init
from raytrain_ckpt.parallel.local_math import LocalAdamW, clip_grad_norm_
from raytrain_ckpt.parallel.pipeline import SPLIT_HOOK, Pipeline
from raytrain_ckpt.spec import JobSpec, LRSchedulerSpec, OptimizerSpec

logger = logging.getLogger(__name__)

__all__ = ["StepReport", "Trainer", "build_loss", "build_optimizer", "lr_lambda"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class StepReport:
    """What one finished step reports. ``loss`` is the global mean, or None off log steps."""

    step: int
    loss: float | None
    step_time_s: float
    tokens_per_s: float
    lr: float
    eval_loss: float | None = None
    """Validation loss after this step, on eval steps only."""


@dataclass
class TrainState:
    """Progress that a checkpoint must capture besides model and optimizer."""

    step: int = 0
    tokens_seen: int = 0
    losses: dict[int, float] = field(default_factory=dict)
    eval_losses: dict[int, float] = field(default_factory=dict)


def lr_lambda(sched: LRSchedulerSpec, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak LR at optimizer step ``i`` (0-based): warmup, then decay."""

    def factor(i: int) -> float:
        if i < sched.warmup_steps:
            return (i + 1) / sched.warmup_steps
        span = max(1, total_steps - sched.warmup_steps)
        progress = min(1.0, (i - sched.warmup_steps) / span)
        floor = sched.min_lr_ratio
        if sched.decay == "constant":
            return 1.0
        if sched.decay == "linear":
            return 1.0 - (1.0 - floor) * progress
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of ``[B, T, V]`` logits against ``[B, T]`` targets, in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_loss(name: str) -> LossFn:
    """``cross_entropy`` or the user function ``name`` ('package.module:fn'), checked on each call."""
    if name == "cross_entropy":
        return cross_entropy
    fn = resolve_factory(name, "loss function")

    def checked(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = fn(logits, targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            raise ValueError(f"training.loss={name!r} returned {type(loss).__name__}"
                             f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; "
                             "it must return a scalar floating-point tensor (reduce the loss, e.g. .mean())")
        return loss.reshape(())

    return checked


def build_optimizer(o: OptimizerSpec, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer named by the spec over ``params``."""
    if o.name == "adamw":
        # AdamW stepping on the local shards (``parallel/local_math.py``): the same arithmetic, without DTensor's dispatch
        return LocalAdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay)
    factory = resolve_factory(o.name, "optimizer factory")
    try:
        opt = factory(params, lr=o.lr, **o.kwargs)
    except TypeError as exc:
        raise ValueError(f"optimizer.name={o.name!r} rejected (params, lr={o.lr}, **{o.kwargs}): {exc}") from None
    if not isinstance(opt, torch.optim.Optimizer):
        raise ValueError(f"optimizer.name={o.name!r} returned {type(opt).__name__}, expected a torch.optim.Optimizer")
    return opt


class Trainer:
    """One rank's model, optimizer, data and step function."""

    def __init__(self, spec: JobSpec, device: torch.device, log_prefix: Callable[[], str] = lambda: "",
                 restoring: bool = False, replica: int = 0) -> None:
        """``restoring``: a checkpoint load follows and overwrites every parameter, so a model with
        ``init_buffers()`` skips drawing initial values (see ``parallel/materialise.py``).
        ``replica``: this rank's replica group (``parallelism.dp_replicate``); the default process
        group is that group's own, and ``replicas`` (set by the worker) averages across groups."""
        if not dist.is_initialized():
            raise RuntimeError("Trainer needs an initialised default process group")
        self.spec = spec
        self.device = device
        self.rank = replica * dist.get_world_size() + dist.get_rank()
        """The job-wide rank (with replica groups the process group is one group's: its rank is local)."""
        self._log_prefix = log_prefix
        t = spec.training
        # build model: on the meta device when it defines init_weights (each rank then
        # allocates and initialises only its shards), else whole on CPU under the seed. Either
        # way the initial parameters do not depend on the layout.
        par = spec.parallelism
        self.mesh = build_mesh(device.type, spec.dp_shard_size, par.pp)
        model, deferred = _build_model(spec)
        self.deferred_init = deferred
        """Whether the model was built on the meta device and only local shards initialised."""
        vocab_size = _vocab_size(model)
        self.loss_fn = build_loss(t.loss)
        build_part = PartBuilder(device, param_dtype_for(t.mixed_precision, spec.resources.use_gpu), t.seed,
                                 deferred, t.activation_checkpointing, t.compile, restoring)
        self.pipeline: Pipeline | None = None
        if par.pp == 1:
            self.model_parts = [build_part(model, self.mesh)]
        else:
            self.pipeline = Pipeline(spec, model, self.mesh, device, build_part, self.loss_fn)
            self.model_parts = self.pipeline.parts
        # build optimizer and schedule: one of each per model chunk (a pipeline rank may hold
        # several); they step together, so every chunk's schedule is at the same step.
        self.optimizers = [build_optimizer(spec.optimizer, list(part.parameters())) for part in self.model_parts]
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(spec.lr_scheduler, t.steps))
                           for opt in self.optimizers]
        # build data
        d = spec.data
        self.data = build_data(source=d.source, path=d.path, dtype=d.dtype, eval_path=d.eval_path,
                               eval_fraction=d.eval_fraction, bos_id=d.bos_id, kwargs=dict(d.kwargs),
                               seq_len=t.seq_len, seed=t.seed, vocab_size=vocab_size)
        self.source: TokenSource = self.data.train
        self.dp_rank = replica * spec.dp_shard_size + self.mesh.get_local_rank("dp_shard")
        """This rank's share of every global batch: replica groups in order, shards within each."""
        self.replicas: Any = None
        """A ``replicas.sync.ReplicaSync`` with dp_replicate > 1 (set by the worker): the step's
        quorum, the gradients averaged across replica groups and their commit vote."""
        self.state = TrainState()
        # Set by checkpointing: waits for an in-flight staging copy of the parameters.
        self.before_optimizer_step: Callable[[], None] = lambda: None
        self.skips = SampleSkips.from_lists(t.global_batch_size, d.skip_samples)
        """Sample windows this job skips (rollbacks, ``data/skips.py``): where each step's samples start."""
        self.replica_skips_before: tuple[tuple[int, int, int, int], ...] = ()
        """Replica shares skipped before this attempt, (step, group, lo, hi), from the resume's manifest."""
        self.attempt = 0
        """The attempt this trainer belongs to (set by the worker; fault injection reads it)."""
        self.guard: Any = None
        """A ``guard.LossGuard`` judging each step's loss before the optimizer step (set by the worker)."""
        self.state_reserve: Any = None
        """A spare's ``checkpoint.state.StateReserve``: the optimizer state of the load that follows
        is carved from it (taken once, by the first state created for a load)."""

    @property
    def model(self) -> nn.Module:
        """The model chunk of this rank (the first one when a pipeline rank holds several)."""
        return self.model_parts[0]

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        """The LR schedule of ``model`` (see ``schedulers`` for every chunk's)."""
        return self.schedulers[0]

    def _trained_samples(self) -> int:
        """The samples of the global batch the step just committed trained: with replica groups,
        those of the groups that took part (an absent group's share is skipped, and recorded)."""
        batch = self.spec.training.global_batch_size
        if self.replicas is None:
            return batch
        r = self.spec.parallelism.dp_replicate
        return batch - batch // r * self.replicas.last_skipped

    def train_step(self) -> StepReport | None:
        """Run one optimizer step on this rank's share of the global batch. None: with replica
        groups, the step was not applied (its quorum lost a group, or is not the rule's) and is redone."""
        t = self.spec.training
        start = time.monotonic()
        if self.replicas is not None:  # the quorum forms while forward and backward run
            self.replicas.begin(self.state.step + 1)
        batches = local_micro_batches(
            self.source, step=self.state.step, global_batch_size=t.global_batch_size,
            micro_batch_size=t.micro_batch_size, dp_rank=self.dp_rank, dp_size=self.spec.dp_size,
            start_index=self.skips.offset(self.state.step),
        )
        if self.pipeline is not None:
            local_loss = self.pipeline.forward_backward(batches)
        else:
            local_loss = self._forward_backward(batches)
        if take_nan(self.rank, self.state.step, self.attempt):  # fault injection: the loss and gradients
            self._poison(local_loss)
        if self.guard is not None:  # raises GuardTrip on every rank before any optimizer step
            self.guard.check(self.state.step, local_loss)
        if self.replicas is not None:  # each shard with the same shard of every other replica group
            # (the loss rides in the same buffer: the group's all-reduce of it is then the global mean)
            self.replicas.average([_local(p.grad) for part in self.model_parts for p in part.parameters()
                                   if p.grad is not None] + [local_loss])
        if t.grad_clip is not None:
            self._clip(t.grad_clip)
        lr = self.scheduler.get_last_lr()[0]
        self.before_optimizer_step()
        if self.replicas is not None and not self.replicas.commit(self.state.step + 1):
            for part in self.model_parts:  # a group failed in the step, or its quorum is not the rule's: redo it
                part.zero_grad(set_to_none=True)
            return None
        for opt, sched in zip(self.optimizers, self.schedulers, strict=True):
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
        if self.guard is not None:
            self.guard.healthy(self.state.step)
        self.state.step += 1
        tokens = self._trained_samples() * t.seq_len
        self.state.tokens_seen += tokens
        loss_value = self._global_loss(local_loss) if self._is_log_step() else None
        if loss_value is not None:
            self.state.losses[self.state.step] = loss_value
        elapsed = time.monotonic() - start
        eval_loss = self.evaluate() if self._is_eval_step() else None
        if eval_loss is not None:
            self.state.eval_losses[self.state.step] = eval_loss
        return StepReport(self.state.step, loss_value, elapsed, tokens / elapsed, lr, eval_loss)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the held-out samples ``[0, batches x global_batch_size)``: the same
        samples at every call and on every layout (each rank takes its slice of every batch)."""
        ev, t = self.spec.eval, self.spec.training
        assert ev is not None and self.data.eval is not None, "the spec requires held-out data with eval"
        total = torch.zeros((), device=self.device, dtype=torch.float32)
        for b in range(ev.batches):
            batches = local_micro_batches(
                self.data.eval, step=b, global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
                dp_rank=self.dp_rank, dp_size=self.spec.dp_size, start_index=self.data.eval_offset,
            )
            if self.pipeline is not None:
                total += self.pipeline.evaluate(batches)
                continue
            for inputs, targets in batches:
                logits = self.model(inputs.to(self.device))
                total += self.loss_fn(logits, targets.to(self.device)).detach().float() / len(batches)
        # As in _global_loss: with a pipeline only the last stage's ranks hold a loss, the others add 0.
        dist.all_reduce(total, op=dist.ReduceOp.SUM)  # (over this replica group's ranks: its share)
        return total.item() / (self.spec.dp_shard_size * ev.batches)

    def _forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Gradient accumulation over micro batches; returns this rank's mean loss."""
        local_loss = torch.zeros((), device=self.device, dtype=torch.float32)
        for inputs, targets in batches:
            logits = self.model(inputs.to(self.device))
            loss = self.loss_fn(logits, targets.to(self.device))
            (loss / len(batches)).backward()
            local_loss += loss.detach() / len(batches)
        return local_loss

    def _poison(self, local_loss: torch.Tensor) -> None:
        """Make this step's loss and gradients NaN, as a real overflow would (``nan@step`` faults)."""
        local_loss.fill_(math.nan)
        for part in self.model_parts:
            for p in part.parameters():
                if p.grad is not None:
                    _local(p.grad).fill_(math.nan)

    def _clip(self, max_norm: float) -> None:
        params = [p for part in self.model_parts for p in part.parameters()]
        clip_grad_norm_(params, max_norm, self.pipeline.group if self.pipeline is not None else None)

    def _is_eval_step(self) -> bool:
        ev, s = self.spec.eval, self.state.step
        return ev is not None and (s % ev.every_steps == 0 or s == self.spec.training.steps)

    def _is_log_step(self) -> bool:
        s = self.state.step
        return s % self.spec.training.log_every_steps == 0 or s == self.spec.training.steps

    def _global_loss(self, local_loss: torch.Tensor) -> float:
        # Reduce only on log steps: .item() syncs the device, which the other steps avoid.
        # With a pipeline only the last stage's ranks (one per dp shard) hold a loss; the
        # others add zero, so every rank gets the same mean and rank 0 can log it.
        # With replica groups the local losses were averaged across groups with the gradients.
        dist.all_reduce(local_loss, op=dist.ReduceOp.SUM)
        return local_loss.item() / self.spec.dp_shard_size

    def log(self, report: StepReport) -> None:
        """Rank 0 logs progress on log steps."""
        if self.rank != 0:
            return
        if report.eval_loss is not None:
            logger.info("%sstep %d/%d eval_loss %.4f", self._log_prefix(), report.step, self.spec.training.steps,
                        report.eval_loss)
        if report.loss is None:
            return
        logger.info(
            "%sstep %d/%d loss %.4f lr %.2e tokens/s %.0f step_time %.3fs", self._log_prefix(), report.step,
            self.spec.training.steps, report.loss, report.lr, report.tokens_per_s, report.step_time_s,
        )

    def fingerprint(self) -> str:
        """sha256 over this rank's local parameter and optimizer shards, for bit-exact comparisons."""
        h = hashlib.sha256()
        tensors: dict[str, torch.Tensor] = {}
        for part, opt in zip(self.model_parts, self.optimizers, strict=True):
            tensors.update(_local_tensors(part, opt))
        for name, tensor in sorted(tensors.items()):
            h.update(name.encode())
            h.update(tensor.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()


def _local_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for name, param in model.named_parameters():
        out[f"param/{name}"] = _local(param)
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optim/{names[id(param)]}/{key}"] = _local(value)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _build_model(spec: JobSpec) -> tuple[nn.Module, bool]:
    """The model on the meta device and True, or built whole on CPU under the seed and False."""
    name, overrides, seed = spec.model.name, dict(spec.model.overrides), spec.training.seed
    with torch.device("meta"):
        model = build_model(name, overrides)
    why = None
    if not supports_deferred_init(model):
        why = "it defines no init_weights()"
    elif spec.parallelism.pp > 1 and callable(getattr(model, SPLIT_HOOK, None)):
        why = f"its {SPLIT_HOOK}() stages may not carry init_weights()"
    if why is None:
        return model, True
    if dist.get_rank() == 0:
        logger.info("model %s is built whole on CPU on every rank, not on the meta device: %s "
                    "(see README, deferred initialisation)", name, why)
    torch.manual_seed(seed)
    return build_model(name, overrides), False


def _vocab_size(model: nn.Module) -> int:
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise ValueError("model has no nn.Embedding; a model must map token ids to logits")
    return emb.num_embeddings
