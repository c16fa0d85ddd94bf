"""Simulated ranks for ``bench/scale.py``: each rank's DCP local save plan and write results,
computed from a model's shape, with no process group and no tensor bytes.

A real rank's plan comes from ``DefaultSavePlanner.create_local_plan`` over ``app_state``: the
FSDP2 shards of the model and of AdamW's state (``DTensor``, ``Shard(0)`` over the dp mesh), the
optimizer's step counters and param groups, the schedule, the step counters and the rank's RNG
states. Here the same planner runs over the same state dict, built on the meta device (the
real model, optimizer and schedule, so every key and its order are the trainer's), with each
sharded tensor replaced by a stand-in that answers DCP's ``__create_write_items__`` the way a
``DTensor`` does: DTensor's own shard arithmetic (``_compute_local_shape_and_global_offset``)
for rank ``r`` of a ``(dp,)`` mesh. ``tests/distributed/test_scale_ranks.py`` checks that the plan
equals the one two real gloo ranks produce for the same model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from raytrain_ckpt.checkpoint.recovery.state import create_optimizer_state
from raytrain_ckpt.models.config import PRESETS, LlamaConfig
from raytrain_ckpt.models.llama import Llama
from raytrain_ckpt.spec import JobSpec
from raytrain_ckpt.rank.trainer import build_optimizer, lr_lambda

__all__ = ["MODELS", "RankTemplate", "local_plan", "template", "write_results"]

MODELS: dict[str, LlamaConfig] = {
    "8b": PRESETS["8b"],
    # Llama 3 70B's shape (not a preset: no CPU job trains it; its plan is what scales).
    "70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, ffn_dim=28672,
                       max_seq_len=8192, rope_theta=500000.0),
    # The CPU demo's model: a plan small enough to drive thousands of ranks' calls through a real Ray
    # actor on this box (``scale.py --calls-only --ray``), where the calls, not the plan, are measured.
    "debug": PRESETS["debug"],
}
_PLACEMENTS = (Shard(0),)


@dataclass
class _Shard:
    """A stand-in for one rank's ``DTensor`` shard of a tensor: what DCP's planner asks of it."""

    shape: torch.Size
    local: torch.Tensor
    """A meta tensor of the local shard's shape and dtype (``TensorProperties`` reads it)."""
    offsets: torch.Size

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        # DCP's _create_write_items_for_dtensor, item for item.
        return [WriteItem(index=MetadataIndex(fqn, self.offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=self.offsets,
                                                                                 sizes=self.local.shape),
                                                      properties=TensorProperties.create_from_tensor(self.local),
                                                      size=self.shape))]


@dataclass(frozen=True)
class RankTemplate:
    """The state dict of a rank built on the meta device: which entries are FSDP2 shards."""

    state: dict[str, Any]
    sharded: dict[str, set[str]]
    """Section ("model", "optim") -> its keys whose value is sharded like a parameter."""


def template(spec: JobSpec, config: LlamaConfig) -> RankTemplate:
    """The trainer's state dict (``recovery.state.app_state``'s keys, in order) for ``config``,
    on the meta device: the real model, optimizer (its state created as a first step would) and
    schedule, unsharded."""
    with torch.device("meta"):
        model = Llama(config)
    opt = build_optimizer(spec.optimizer, list(model.parameters()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(spec.lr_scheduler, spec.training.steps))
    create_optimizer_state(opt)
    model_sd, optim_sd = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    params = {n for n, p in model.named_parameters()}
    sharded_optim = {k for k, v in optim_sd.items() if isinstance(v, torch.Tensor) and v.dim() > 0
                     and k.startswith("state.") and k.rsplit(".", 1)[0][len("state."):] in params}
    state = {"model": model_sd, "optim": optim_sd,
             "train": {"step": 0, "tokens_seen": 0, "samples_seen": 0, "world_size": 0},
             "scheduler": sched.state_dict()}
    return RankTemplate(state, {"model": set(model_sd), "optim": sharded_optim})


def _rank_state(t: RankTemplate, rank: int, world: int) -> dict[str, Any]:
    coordinate = lambda dim: rank  # noqa: E731 - a 1-D (dp_shard,) mesh: the coordinate is the rank
    out: dict[str, Any] = {}
    for section in ("model", "optim"):
        entries = {}
        for key, value in t.state[section].items():
            if key in t.sharded[section]:
                sizes, offsets = _compute_local_shape_and_global_offset(value.shape, (world,), coordinate,
                                                                        _PLACEMENTS)
                value = _Shard(value.shape, torch.empty(sizes, dtype=value.dtype, device="meta"),
                               torch.Size(offsets))
            entries[key] = value
        out[section] = entries
    out["train"] = {**t.state["train"], "world_size": world}
    out["scheduler"] = t.state["scheduler"]
    out[f"rng.rank{rank}.cpu"] = torch.get_rng_state()
    out[f"rng.rank{rank}.python"] = random.getstate()
    return out


def local_plan(t: RankTemplate, rank: int, world: int) -> SavePlan:
    """Rank ``rank`` of ``world``'s local save plan, by the planner a real rank runs."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(_rank_state(t, rank, world), is_coordinator=rank == 0)
    return planner.create_local_plan()


def write_results(central: SavePlan, step: int = 0, bytes_last: bool = False) -> list[WriteResult]:
    """What a writer reports for a rank's central plan: one ``WriteResult`` per item, laid out
    one after another in one file in the plan's order (sizes from the shapes; ``step`` sets the
    byte items' lengths as a pickled counter would: one byte longer for each digit, so the results
    of steps 10 and 20 are equal and those of step 100 differ). ``bytes_last``: the byte items after
    every tensor, so that a byte item of a new length moves no tensor."""
    name = f"{central.storage_data.prefix}0.distcp"
    out, offset = [], 0
    items = central.items
    if bytes_last:
        items = sorted(items, key=lambda i: i.type == WriteItemType.BYTE_IO)
    for item in items:
        if item.type == WriteItemType.BYTE_IO:
            length = 64 + len(str(step))
        else:
            chunk = item.tensor_data.chunk.sizes
            length = 1024 + item.tensor_data.properties.dtype.itemsize * int(torch.Size(chunk).numel())
        out.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length)))
        offset += length
    return out
