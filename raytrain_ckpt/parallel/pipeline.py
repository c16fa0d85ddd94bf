"""Pipeline parallelism: split a model into stages and run a ``torch.distributed.pipelining`` schedule.

Every rank builds the full model (on the meta device when it defines ``init_weights``, see
``parallel/materialise.py``) and keeps only what its stages own; initial parameters do not
depend on the layout. Stages keep the full model's FQNs
(``layers.3.attention.wq.weight``), so per-stage checkpoints never collide and DCP reshards
them to any other layout by name.

Splitting, in order of preference:

1. the model defines ``split_for_pipeline(stage_index, num_stages) -> nn.Module`` (a hook the
   factory provides): its result is the stage module;
2. the model has a ``layers`` ``nn.ModuleDict``: stage ``s`` keeps a contiguous range of its
   entries, the first stage also keeps every child registered before ``layers`` (embeddings),
   the last stage every child registered after it (norm, head); the others are set to None and
   ``forward`` must skip None parts. The ranges come from ``parallelism.pp_split_points`` or
   are balanced by parameter count.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from raytrain_ckpt.spec import JobSpec

if TYPE_CHECKING:  # imported where a pipeline is built: 0.4 s of CPU that an FSDP-only rank need not pay
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

logger = logging.getLogger(__name__)

__all__ = ["Pipeline", "balance", "build_schedule", "layer_bounds", "split_model", "stage_indices"]

SPLIT_HOOK = "split_for_pipeline"


def stage_indices(pp_rank: int, pp: int, virtual_stages: int) -> list[int]:
    """Stages held by ``pp_rank``: one per virtual stage, round robin (rank r: r, r + pp, ...)."""
    return [pp_rank + k * pp for k in range(virtual_stages)]


def balance(costs: Sequence[int], num_stages: int) -> list[int]:
    """Start index of each stage: contiguous ranges of ``costs`` minimising the largest stage sum.

    Every stage gets at least one entry. Ties go to the split with the earliest boundaries,
    so the answer is the same on every rank.
    """
    n = len(costs)
    if num_stages > n:
        raise ValueError(f"cannot split {n} layers into {num_stages} stages; each stage needs a layer")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the smallest max-stage-sum for the first i entries in s stages; cut[s][i]: last start.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    starts, i = [], n
    for s in range(num_stages, 0, -1):
        i = cut[s][i]
        starts.append(i)
    return starts[::-1]


def layer_bounds(model: nn.Module, num_stages: int, split_points: Sequence[str]) -> list[tuple[int, int]]:
    """``[start, end)`` layer positions of each stage, from split points or balanced by parameter count."""
    keys = list(_layers(model).keys())
    if split_points:
        starts = [0] + [_split_position(point, keys) for point in split_points]
        if len(starts) != num_stages or starts != sorted(set(starts)) or starts[1] == 0:
            raise ValueError(f"parallelism.pp_split_points {list(split_points)}: need {num_stages - 1} distinct "
                             f"increasing points after the first layer (layers.1 .. layers.{keys[-1]})")
    else:
        costs = [_numel(m) for m in _layers(model).values()]
        before, after = _outside_layers(model)
        # The embedding weighs on the first stage and the head on the last: balance with them.
        costs[0] += sum(_numel(m) for _, m in before)
        costs[-1] += sum(_numel(m) for _, m in after)
        starts = balance(costs, num_stages)
    ends = starts[1:] + [len(keys)]
    return list(zip(starts, ends, strict=True))


def split_model(model: nn.Module, stage: int, num_stages: int, bounds: Sequence[tuple[int, int]]) -> nn.Module:
    """A copy of ``model`` holding only what ``stage`` owns (see the module docstring)."""
    hook = getattr(model, SPLIT_HOOK, None)
    if callable(hook):
        part = hook(stage, num_stages)
        if not isinstance(part, nn.Module):
            raise ValueError(f"{type(model).__name__}.{SPLIT_HOOK} returned {type(part).__name__}, "
                             "expected the stage's nn.Module")
        return part
    part = copy.deepcopy(model)
    layers = _layers(part)
    start, end = bounds[stage]
    for i, key in enumerate(list(layers.keys())):
        if not start <= i < end:
            del layers[key]
    before, after = _outside_layers(part)
    for name, _ in before if stage > 0 else []:
        setattr(part, name, None)
    for name, _ in after if stage < num_stages - 1 else []:
        setattr(part, name, None)
    return part


def _layers(model: nn.Module) -> nn.ModuleDict:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise ValueError(
            f"model {type(model).__name__} cannot be split into pipeline stages: it needs a 'layers' nn.ModuleDict "
            f"(keyed '0', '1', ...; forward must skip parts set to None) or a method "
            f"{SPLIT_HOOK}(stage_index, num_stages) returning the stage's module; or set parallelism.pp=1")
    return layers


def _outside_layers(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """Top-level children registered before and after ``layers``."""
    names = [name for name, _ in model.named_children()]
    at = names.index("layers")
    children = dict(model.named_children())
    return [(n, children[n]) for n in names[:at]], [(n, children[n]) for n in names[at + 1:]]


def _split_position(point: str, keys: list[str]) -> int:
    prefix, _, key = point.partition(".")
    if prefix != "layers" or key not in keys:
        raise ValueError(f"parallelism.pp_split_points: {point!r} is not a layer of this model; "
                         f"use 'layers.<key>' with a key among {keys[0]} .. {keys[-1]}")
    return keys.index(key)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def build_schedule(
    name: str, stages: list[PipelineStage], microbatches: int, loss_fn: LossFn
) -> ScheduleGPipe | Schedule1F1B | ScheduleInterleaved1F1B:
    """The schedule for ``parallelism.pp_schedule``.

    ``loss_fn`` returns a micro-batch's mean loss and the schedule divides the gradients by
    ``microbatches`` (``scale_grads``), which is what gradient accumulation without pipelining does.
    """
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if name == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn, scale_grads=True)
    cls = ScheduleGPipe if name == "gpipe" else Schedule1F1B
    return cls(stages[0], microbatches, loss_fn=loss_fn, scale_grads=True)


class Pipeline:
    """This rank's pipeline stages (FSDP2 inside each) and the schedule that runs them."""

    def __init__(self, spec: JobSpec, model: nn.Module, mesh: DeviceMesh, device: torch.device,
                 build_part: Callable[[nn.Module, DeviceMesh], nn.Module], loss_fn: LossFn) -> None:
        from torch.distributed.pipelining import PipelineStage

        par = spec.parallelism
        self.group = mesh.get_group("pp")
        pp_rank = mesh.get_local_rank("pp")
        num_stages = par.pp * par.virtual_stages
        bounds = layer_bounds(model, num_stages, par.pp_split_points) if not _has_hook(model) else []
        self.stage_ids = stage_indices(pp_rank, par.pp, par.virtual_stages)
        self.parts: list[nn.Module] = []
        stages: list[PipelineStage] = []
        for stage in self.stage_ids:
            # build_part shards the stage and materialises it (deferred init) or moves it to device.
            part = build_part(split_model(model, stage, num_stages, bounds), mesh["dp_shard"])
            self.parts.append(part)
            stages.append(PipelineStage(part, stage, num_stages, device, group=self.group))
        self.has_first = any(s.is_first for s in stages)
        self.has_last = any(s.is_last for s in stages)
        self.schedule = build_schedule(par.pp_schedule, stages, spec.local_microbatches, loss_fn)
        self.device = device
        if bounds and dist.get_rank() == 0:
            logger.info("pipeline: %d stages over pp=%d (%s), layers per stage %s", num_stages, par.pp,
                        par.pp_schedule, [end - start for start, end in bounds])

    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Run the schedule over this dp rank's micro-batches; returns their mean loss (0 off the last stage).

        The schedule splits the concatenated batch back into the same micro-batches (equal
        contiguous chunks), so the pipeline sees exactly what gradient accumulation would.
        """
        return self._run(batches, self.schedule.step, return_outputs=False)

    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward only over this dp rank's micro-batches; their mean loss (0 off the last stage)."""
        return self._run(batches, self.schedule.eval)

    def _run(self, batches: list[tuple[torch.Tensor, torch.Tensor]], run: Callable[..., Any],
             **kwargs: Any) -> torch.Tensor:
        inputs = torch.cat([x for x, _ in batches]).to(self.device)
        targets = torch.cat([y for _, y in batches]).to(self.device)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        run(*args, target=targets if self.has_last else None, losses=losses if self.has_last else None, **kwargs)
        if not self.has_last:
            return torch.zeros((), device=self.device, dtype=torch.float32)
        return torch.stack([loss.detach().float() for loss in losses]).mean()


def _has_hook(model: nn.Module) -> bool:
    return callable(getattr(model, SPLIT_HOOK, None))
