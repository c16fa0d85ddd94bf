"""What a checkpoint holds, as one DCP state dict, and how a trainer gets it back.

Keys (a standard DCP checkpoint; plain ``dcp.load`` / ``dcp_to_torch_save`` read it)::

    model.<fqn>                       FSDP2 DTensor shards
    optim.state.<fqn>.<exp_avg|...>   optimizer state, flattened and FQN-keyed
    optim.param_groups.<fqn>.<lr|...>
    scheduler                         LR scheduler state_dict
    train                             {"step", "tokens_seen", "samples_seen", "world_size"}
    rng.rank<r>.cpu / .cuda / .python RNG states of every rank (restored at the same world size)

A checkpoint with ``model.*`` keys only (written by ``raytrain-ckpt import``) loads as
pretrained weights: the model is loaded, the optimizer, schedule and step start fresh.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

logger = logging.getLogger(__name__)

__all__ = ["app_state", "load_app_state"]

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _rng_state(rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {f"rng.rank{rank}.cpu": torch.get_rng_state(),
                           f"rng.rank{rank}.python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"rng.rank{rank}.cuda"] = torch.cuda.get_rng_state()
    return out


def app_state(trainer: Any) -> dict[str, Any]:
    """The full state of a ``Trainer`` as a DCP state dict (live tensors, no copies)."""
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer, options=_OPTIONS)
    t = trainer.state
    sd: dict[str, Any] = {
        "model": model_sd,
        "optim": optim_sd,
        "scheduler": trainer.scheduler.state_dict(),
        "train": {"step": t.step, "tokens_seen": t.tokens_seen,
                  "samples_seen": t.step * trainer.spec.training.global_batch_size,
                  "world_size": dist.get_world_size()},
    }
    sd.update(_rng_state(trainer.rank))
    return sd


def load_app_state(trainer: Any, path: str, same_world_size: bool) -> None:
    """Load a checkpoint into a freshly built ``Trainer`` (collective: every rank calls it).

    DCP reshards the model and optimizer to the current layout. RNG states are per rank, so
    they are restored only when the world size matches the one that saved them.
    """
    if _model_only(path):
        _load_model_only(trainer, path)
        return
    sd = app_state(trainer)
    if not same_world_size:
        sd = {k: v for k, v in sd.items() if not k.startswith("rng.")}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=sd["model"],
                   optim_state_dict=sd["optim"], options=_OPTIONS)
    trainer.scheduler.load_state_dict(sd["scheduler"])
    trainer.state.step = int(sd["train"]["step"])
    trainer.state.tokens_seen = int(sd["train"]["tokens_seen"])
    if same_world_size:
        r = trainer.rank
        torch.set_rng_state(sd[f"rng.rank{r}.cpu"])
        random.setstate(sd[f"rng.rank{r}.python"])
        if f"rng.rank{r}.cuda" in sd:
            torch.cuda.set_rng_state(sd[f"rng.rank{r}.cuda"])


def _model_only(path: str) -> bool:
    keys = FileSystemReader(path).read_metadata().state_dict_metadata
    return not any(k.startswith("train.") for k in keys)


def _load_model_only(trainer: Any, path: str) -> None:
    """Pretrained weights: the model only; optimizer, schedule, step and RNG stay as built (step 0)."""
    model_sd = get_model_state_dict(trainer.model)
    dcp.load({"model": model_sd}, checkpoint_id=path)
    set_model_state_dict(trainer.model, model_sd)
    logger.info("loaded model-only checkpoint %s: starting at step 0 with a fresh optimizer", path)
