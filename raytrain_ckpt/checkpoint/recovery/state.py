"""What a checkpoint holds, as one DCP state dict, and how a trainer gets it back.

Keys (a standard DCP checkpoint; plain ``dcp.load`` / ``dcp_to_torch_save`` read it)::

    model.<fqn>                       FSDP2 DTensor shards
    optim.state.<fqn>.<exp_avg|...>   optimizer state, flattened and FQN-keyed
    optim.param_groups.<fqn>.<lr|...>
    scheduler                         LR scheduler state_dict (without pipeline parallelism)
    scheduler.stage<s>                one per pipeline stage (model chunk) s
    train                             {"step", "tokens_seen", "samples_seen", "world_size"}
    rng.rank<r>.cpu / .cuda / .python RNG states of every rank (restored at the same layout)

A pipeline stage keeps the full model's FQNs, so each rank saves only its stages' entries and
none collide; DCP's global plan puts them all into one checkpoint that any layout can load.

A checkpoint with ``model.*`` keys only (written by ``raytrain-ckpt import``) loads as
pretrained weights: the model is loaded, the optimizer, schedule and step start fresh.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.tensor import DTensor

from raytrain_ckpt.checkpoint.format.manifest import MANIFEST, Manifest
from raytrain_ckpt.checkpoint.format.metadata import SafeLoadPlanner, safe_reader
from raytrain_ckpt.checkpoint.storage.backends import open_storage
from raytrain_ckpt.parallel.local_math import LocalAdamW
from raytrain_ckpt.checkpoint.errors import CheckpointMismatch

logger = logging.getLogger(__name__)

__all__ = ["StateReserve", "app_state", "apply_own_state", "create_optimizer_state",
           "load_app_state", "optimizer_tensors", "own_state"]

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_SCHEDULER = "scheduler"


def _rng_state(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {f"rng.rank{rank}.cpu": torch.get_rng_state(),
                           f"rng.rank{rank}.python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"rng.rank{rank}.cuda"] = torch.cuda.get_rng_state()
    return out


def _scheduler_keys(trainer: Any) -> list[str]:
    """One key per model chunk: ``scheduler`` without a pipeline, ``scheduler.stage<s>`` with one."""
    pipeline = getattr(trainer, "pipeline", None)
    if pipeline is None:
        return [_SCHEDULER]
    return [f"{_SCHEDULER}.stage{s}" for s in pipeline.stage_ids]


class StateReserve:
    """Host memory touched ahead of time, handed out as the optimizer state of a load.

    A process that loads a rank's state after a crash writes it into memory it never touched:
    the kernel clears every page on first touch, on the restart's critical path (0.12 s of a
    0.16 s copy of 485 MiB here). So a spare touches, while idle, about what a rank's optimizer
    state takes (``nbytes``, carved into tensors), and a kept process hands its failed attempt's
    optimizer state to the next one (``recycled``: reused by shape and dtype) instead of freeing
    it (ARCHITECTURE, "A restarted rank loads into memory touched before"). Tensors that fit
    neither, or are not contiguous CPU tensors, are allocated as usual.
    """

    _ALIGN = 64

    def __init__(self, nbytes: int = 0, recycled: Iterable[torch.Tensor] = ()) -> None:
        self._buf = torch.zeros(nbytes, dtype=torch.uint8)  # zeroed: every page touched now
        self._offset = 0
        self._recycled: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        for t in recycled:
            if t.device.type == "cpu" and t.is_contiguous():
                self._recycled.setdefault((tuple(t.shape), t.dtype), []).append(t)

    @property
    def nbytes(self) -> int:
        return self._buf.numel()

    @property
    def used(self) -> int:
        """Bytes of the buffer handed out so far."""
        return self._offset

    def empty_like(self, t: torch.Tensor, memory_format: torch.memory_format = torch.preserve_format) -> torch.Tensor:
        """``torch.empty_like(t)`` from the reserve: a DTensor gets a local tensor from it."""
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.device.type != "cpu" or not local.is_contiguous():
            return torch.empty_like(t, memory_format=memory_format)
        view = self._take(tuple(local.shape), local.dtype, local.numel() * local.element_size())
        if view is None:
            return torch.empty_like(t, memory_format=memory_format)
        if isinstance(t, DTensor):
            return DTensor.from_local(view, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                      stride=t.stride())
        return view

    def _take(self, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor | None:
        same = self._recycled.get((shape, dtype))
        if same:
            return same.pop()
        start = -(-self._offset // self._ALIGN) * self._ALIGN
        if start + nbytes > self.nbytes:
            return None
        self._offset = start + nbytes
        return self._buf[start:start + nbytes].view(dtype).view(shape)


def optimizer_tensors(trainer: Any) -> list[torch.Tensor]:
    """The local tensors of every optimizer's state (Adam's step counts aside): what a kept
    process recycles into the next attempt's ``StateReserve``."""
    out = []
    for opt in trainer.optimizers:
        for state in opt.state.values():
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    out.append(value.to_local() if isinstance(value, DTensor) else value)
    return out


def create_optimizer_state(opt: torch.optim.Optimizer, fill: bool = True, reserve: StateReserve | None = None) -> bool:
    """Create an empty optimizer's state as its first step would (zeros, step 0), without a step.

    ``get_state_dict`` creates a missing optimizer state by taking a step with zero-filled
    gradients and lr 0: a gradient-sized allocation and the whole update's arithmetic over every
    parameter, which costs a restart more than reading the state it is about to overwrite
    (ARCHITECTURE, "A restart creates the optimizer's state without a step"). For the built-in
    optimizers whose lazy state is known (``Adam``/``AdamW`` without ``capturable``/``fused``,
    ``SGD`` with momentum) the same entries, dtypes and devices are made directly; any other
    optimizer, or one that has state or gradients already, is left to DCP's way. Returns whether
    it created the state.

    ``fill=False``, for a state about to be loaded (every entry is then overwritten, or the load
    fails): the tensors are allocated but not zeroed, which saves a pass over the optimizer's
    memory on the restart's critical path (the copy of the loaded bytes touches it anyway).
    ``reserve`` (with ``fill=False``): the tensors are carved from memory touched ahead of time.
    """
    if opt.state or any(p.grad is not None for g in opt.param_groups for p in g["params"]):
        return False
    kind = type(opt)
    groups = opt.param_groups
    if kind in (torch.optim.Adam, torch.optim.AdamW, LocalAdamW):  # LocalAdamW: AdamW's state, its own step
        if any(g.get("capturable") or g.get("fused") or g.get("differentiable") for g in groups):
            return False
        make = _adam_state
    elif kind is torch.optim.SGD and all(g["momentum"] != 0 for g in groups):
        make = _sgd_state
    else:
        return False
    new = torch.zeros_like if fill else reserve.empty_like if reserve is not None else torch.empty_like
    with torch.no_grad():
        for group in groups:
            for param in group["params"]:
                if param.requires_grad:
                    opt.state[param] = make(param, group, new)
    return True


def _adam_state(param: torch.Tensor, group: dict[str, Any],
                new: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # Adam's step dtype
    state = {"step": torch.tensor(0.0, dtype=scalar),
             "exp_avg": new(param, memory_format=torch.preserve_format),
             "exp_avg_sq": new(param, memory_format=torch.preserve_format)}
    if group["amsgrad"]:
        state["max_exp_avg_sq"] = new(param, memory_format=torch.preserve_format)
    return state


def _sgd_state(param: torch.Tensor, group: dict[str, Any],
               new: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"momentum_buffer": new(param, memory_format=torch.preserve_format)}


def _parts_state(trainer: Any,
                 fill: bool = True) -> tuple[dict[str, Any], dict[str, Any], list[tuple[set[str], set[str]]]]:
    """Model and optimizer state of every chunk, merged (FQNs are disjoint), and each chunk's keys.
    ``fill=False``: a missing optimizer state is created unzeroed, for a load to overwrite."""
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    keys = []
    reserve = None if fill else _take_reserve(trainer)
    for part, opt in zip(trainer.model_parts, trainer.optimizers, strict=True):
        create_optimizer_state(opt, fill, reserve)
        m, o = get_state_dict(part, opt, options=_OPTIONS)
        keys.append((set(m), set(o)))
        model_sd.update(m)
        optim_sd.update(o)
    return model_sd, optim_sd, keys


def _take_reserve(trainer: Any) -> StateReserve | None:
    """The trainer's ``state_reserve``, used once: by the first state created for a load."""
    reserve = getattr(trainer, "state_reserve", None)
    if reserve is not None:
        trainer.state_reserve = None
    return reserve


def app_state(trainer: Any) -> dict[str, Any]:
    """The full state of a ``Trainer`` as a DCP state dict (live tensors, no copies)."""
    return own_state(trainer)[0]


def own_state(trainer: Any, fill: bool = True) -> tuple[dict[str, Any], list[tuple[set[str], set[str]]]]:
    """``app_state`` and each model chunk's (model keys, optimizer keys), for ``apply_own_state``.
    ``fill=False``: for a load that overwrites every tensor (see ``create_optimizer_state``)."""
    model_sd, optim_sd, keys = _parts_state(trainer, fill)
    t = trainer.state
    sd: dict[str, Any] = {
        "model": model_sd,
        "optim": optim_sd,
        "train": {"step": t.step, "tokens_seen": t.tokens_seen,
                  "samples_seen": t.step * trainer.spec.training.global_batch_size,
                  "world_size": dist.get_world_size()},
    }
    for key, sched in zip(_scheduler_keys(trainer), trainer.schedulers, strict=True):
        sd[key] = sched.state_dict()
    sd.update(_rng_state(trainer.rank))
    return sd, keys


def apply_own_state(trainer: Any, sd: dict[str, Any], keys: list[tuple[set[str], set[str]]]) -> None:
    """Make ``sd`` (an ``own_state`` dict whose values were replaced by a saved state of the same
    layout, RNG included) the trainer's state."""
    _apply(trainer, sd, keys, _scheduler_keys(trainer), rng=True)


def load_app_state(trainer: Any, path: str, same_world_size: bool) -> float:
    """Load a checkpoint into a freshly built ``Trainer`` (collective: every rank calls it).

    DCP reshards the model and optimizer to the current layout by FQN, across dp and pp
    degrees. Entries this rank needs that the checkpoint lacks, or holds with another shape,
    and model entries no rank of this model has (a deeper model's layers) raise
    ``CheckpointMismatch`` before anything is loaded. RNG states are per rank, so they
    are restored only at the layout that saved them (same world size and pipeline degree).
    Returns the seconds spent reading the checkpoint into the state dict (``dcp.load``).
    """
    saved = safe_reader(path, _options(trainer)).read_metadata().state_dict_metadata
    if not any(k.startswith("train.") for k in saved):
        t0 = time.monotonic()
        _load_model_only(trainer, path, saved)
        return time.monotonic() - t0
    model_sd, optim_sd, keys = _parts_state(trainer, fill=False)
    _check_no_extras(path, saved, _model_keys_of_every_rank(model_sd))
    _check_fits(path, saved, model_sd, optim_sd)
    sd: dict[str, Any] = {"model": model_sd, "optim": optim_sd,
                          "train": {"step": 0, "tokens_seen": 0, "samples_seen": 0, "world_size": 0}}
    sources = [_scheduler_source(key, saved, path) for key in _scheduler_keys(trainer)]
    for source, sched in zip(sources, trainer.schedulers, strict=True):
        sd[source] = sched.state_dict()
    same_layout = same_world_size and _saved_pp(path, _options(trainer)) in (None, trainer.spec.parallelism.pp)
    if same_layout:
        sd.update(_rng_state(trainer.rank))
    t0 = time.monotonic()
    dcp.load(sd, storage_reader=safe_reader(path, _options(trainer)), planner=SafeLoadPlanner())
    read_s = time.monotonic() - t0
    _apply(trainer, sd, keys, sources, same_layout)
    return read_s


def _apply(trainer: Any, sd: dict[str, Any], keys: list[tuple[set[str], set[str]]], sources: list[str],
           rng: bool) -> None:
    for part, opt, (mkeys, okeys) in zip(trainer.model_parts, trainer.optimizers, keys, strict=True):
        set_state_dict(part, opt, model_state_dict={k: sd["model"][k] for k in mkeys},
                       optim_state_dict={k: sd["optim"][k] for k in okeys}, options=_OPTIONS)
    for source, sched in zip(sources, trainer.schedulers, strict=True):
        sched.load_state_dict(sd[source])
    trainer.state.step = int(sd["train"]["step"])
    trainer.state.tokens_seen = int(sd["train"]["tokens_seen"])
    if rng:
        r = trainer.rank
        torch.set_rng_state(sd[f"rng.rank{r}.cpu"])
        random.setstate(sd[f"rng.rank{r}.python"])
        if f"rng.rank{r}.cuda" in sd:
            torch.cuda.set_rng_state(sd[f"rng.rank{r}.cuda"])


def _scheduler_source(key: str, saved: dict[str, Any], path: str) -> str:
    """The saved scheduler state a chunk loads: its own, else the checkpoint's first one.

    Every chunk's schedule steps once per optimizer step, so all saved schedule states are
    equal and any of them continues a chunk of another layout correctly.
    """
    for candidate in (key, _SCHEDULER, f"{_SCHEDULER}.stage0"):
        if f"{candidate}.last_epoch" in saved:
            return candidate
    raise CheckpointMismatch(f"checkpoint {path} has no LR scheduler state ({key}); it was not written by "
                             "raytrain_ckpt. Resume from another step or set checkpoint.resume=none")


def _check_fits(path: str, saved: dict[str, Any], model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
    """Refuse a checkpoint that lacks this rank's entries or holds them with other shapes."""
    wanted = {f"model.{k}": v for k, v in model_sd.items()} | {f"optim.{k}": v for k, v in optim_sd.items()}
    missing = sorted(k for k in wanted if k not in saved)
    if missing:
        raise CheckpointMismatch(
            f"checkpoint {path} cannot be loaded into this model: {len(missing)} entries this rank needs are not "
            f"in it (e.g. {missing[0]}); it was saved from a model with other parameter names (another model, or a "
            "pipeline split hook that renames parameters). Resume with the model that saved it, or set "
            "checkpoint.resume=none")
    for key, value in wanted.items():
        meta = saved[key]
        if isinstance(value, torch.Tensor) and isinstance(meta, TensorStorageMetadata):
            if tuple(meta.size) != tuple(value.shape):
                raise CheckpointMismatch(
                    f"checkpoint {path}: {key} has shape {tuple(meta.size)} there and {tuple(value.shape)} in this "
                    "model; the model's shape changed (model.name / model.overrides). Resume with the same model "
                    "shape, or set checkpoint.resume=none")


def _model_keys_of_every_rank(local: Iterable[str]) -> set[str]:
    """The model FQNs of the whole group (collective): a pipeline rank holds only its stages'."""
    keys = set(local)
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(keys))
        keys = keys.union(*gathered)
    return keys


def _check_no_extras(path: str, saved: dict[str, Any], model_keys: set[str]) -> None:
    """Refuse a checkpoint holding model entries this model lacks: DCP loads only what is asked
    for, so a deeper model's checkpoint would otherwise load its first layers and drop the rest."""
    extra = sorted(k for k in saved if k.startswith("model.") and k[len("model."):] not in model_keys)
    if extra:
        raise CheckpointMismatch(
            f"checkpoint {path} cannot be loaded into this model: it holds {len(extra)} model entries this model "
            f"does not have (e.g. {extra[0]}); it was saved from another model (model.name / model.overrides, "
            "e.g. more layers). Resume with the model that saved it, or set checkpoint.resume=none")


def _options(trainer: Any) -> dict[str, Any]:
    return dict(trainer.spec.checkpoint.storage_options)


def _saved_pp(path: str, options: dict[str, Any]) -> int | None:
    """The pipeline degree that saved ``path`` (1 for manifests older than pipelining), None without a manifest."""
    storage = open_storage(path, options)
    mpath = storage.join(path, MANIFEST)
    if not storage.is_file(mpath):
        return None
    return Manifest.from_json(storage.read_bytes(mpath).decode("utf-8")).pp_size


def _load_model_only(trainer: Any, path: str, saved: dict[str, Any]) -> None:
    """Pretrained weights: the model only; optimizer, schedule, step and RNG stay as built (step 0)."""
    ours = [key for part in trainer.model_parts for key in get_model_state_dict(part)]
    _check_no_extras(path, saved, _model_keys_of_every_rank(ours))
    for part in trainer.model_parts:
        model_sd = get_model_state_dict(part)
        _check_fits(path, saved, model_sd, {})
        dcp.load({"model": model_sd}, storage_reader=safe_reader(path, _options(trainer)), planner=SafeLoadPlanner())
        set_model_state_dict(part, model_sd)
    logger.info("loaded model-only checkpoint %s: starting at step 0 with a fresh optimizer", path)
