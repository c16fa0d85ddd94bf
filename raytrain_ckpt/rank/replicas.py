"""A rank's side of replica groups: its ``ReplicaSync`` (``replicas/sync.py``) over the trainer, and
what a heal sends from a live group's rank to the same rank of a replacement group.

The heal's state is this rank's local shards, never the whole model: parameters, optimizer state
(marked where it is a DTensor, so the receiver wraps it over its own mesh), the learning rates and
LR schedules, ``TrainState`` (step, tokens seen, logged losses) and the membership rule's record.
It travels over torchft's checkpoint transport while the live group trains the same step; the
live group's parameters change only after the replacement has received it (torchft's vote).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from raytrain_ckpt.rank.trainer import Trainer

__all__ = ["heal_state", "load_heal_state", "replica_record", "replica_skips", "replica_sync"]


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def heal_state(trainer: Trainer, membership: Any) -> dict[str, Any]:
    """What a replacement of this rank needs to train on from this rank's step."""
    return {
        # the optimizers' parameters, the sharded ones: while the forward pass runs (this is called
        # then, from torchft's quorum thread) FSDP2 registers the unsharded ones on the modules
        "params": [_local(p).detach() for opt in trainer.optimizers for p in _params(opt)],
        "optim": [[{k: (hasattr(v, "to_local"), _local(v)) if torch.is_tensor(v) else (False, v)
                    for k, v in opt.state.get(p, {}).items()} for p in _params(opt)] for opt in trainer.optimizers],
        "lrs": [[g["lr"] for g in opt.param_groups] for opt in trainer.optimizers],
        "schedules": [s.state_dict() for s in trainer.schedulers],
        "train": dataclasses.asdict(trainer.state),
        "membership": membership.state(),
        # what a resume adopted from its manifest: the sample windows, the shares skipped before
        # this attempt, the certified step (a replacement loads no checkpoint: it gets them here)
        "skips": trainer.skips.as_lists(),
        "replica_skips_before": [list(r) for r in trainer.replica_skips_before],
        "certified": trainer.guard.last_certified if trainer.guard is not None else None,
    }


@torch.no_grad()
def load_heal_state(trainer: Trainer, state: dict[str, Any]) -> int:
    """Put a live rank's ``heal_state`` in place; returns the step it was at."""
    from torch.distributed.tensor import DTensor

    params = [p for opt in trainer.optimizers for p in _params(opt)]
    if len(params) != len(state["params"]):
        raise RuntimeError(f"heal: {len(state['params'])} parameter shards received, this rank holds {len(params)}")
    for p, t in zip(params, state["params"], strict=True):
        _local(p).copy_(t)
    for opt, states, lrs in zip(trainer.optimizers, state["optim"], state["lrs"], strict=True):
        for p, entries in zip(_params(opt), states, strict=True):
            opt.state[p] = {k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                            if wrapped else v for k, (wrapped, v) in entries.items()}
        for g, lr in zip(opt.param_groups, lrs, strict=True):
            g["lr"] = lr
    for sched, s in zip(trainer.schedulers, state["schedules"], strict=True):
        sched.load_state_dict(s)
    train = state["train"]
    trainer.state = type(trainer.state)(**train)
    trainer.skips = type(trainer.skips).from_lists(trainer.spec.training.global_batch_size, state["skips"])
    trainer.replica_skips_before = tuple(tuple(int(x) for x in r) for r in state["replica_skips_before"])
    if trainer.guard is not None and state["certified"] is not None:
        trainer.guard.last_certified = state["certified"]
    return int(train["step"])


def replica_sync(trainer: Trainer, *, replica: int, rank: int, ranks: int, lighthouse: str, roster: str,
                 store: tuple[str, int], replacement: bool, timeout_s: float, meet_timeout_s: float) -> Any:
    """This rank's ``ReplicaSync``: its group's torchft Manager meets at the group's rendezvous
    store; ``roster``: the Lighthouse actor's name; ``replacement``: this group replaces a failed
    one and is healed from a live group in its first quorum."""
    from raytrain_ckpt.replicas.membership import Membership
    from raytrain_ckpt.replicas.sync import ReplicaSync

    spec = trainer.spec
    membership = Membership(spec.parallelism.dp_replicate, spec.fault_tolerance.heal_steps)
    box: list[Any] = []

    def load(state: dict[str, Any]) -> None:
        step = load_heal_state(trainer, state)
        box[0].healed(state["membership"], step + 1)

    sync = ReplicaSync(replica=replica, rank=rank, ranks=ranks, lighthouse=lighthouse, store=store,
                       state=lambda: heal_state(trainer, membership), load=load, membership=membership,
                       roster=roster, replacement=replacement, timeout_s=timeout_s,
                       meet_timeout_s=meet_timeout_s)
    box.append(sync)
    return sync


def replica_record(trainer: Trainer) -> dict[str, Any]:
    """This rank's replicate-dimension record for its result (``WorkerResult.replicas``), with the
    samples each skipped share held: ``skipped_samples``, one (step, group, first, end) per skipped
    (step, group), the global sample indices ``first .. end - 1`` that were not trained."""
    from raytrain_ckpt.data.sampler import local_sample_range

    spec, record = trainer.spec, trainer.replicas.record()
    t, shard = spec.training, spec.dp_shard_size
    rows = []
    for step, group in record["skipped"]:
        first = local_sample_range(step=step - 1, global_batch_size=t.global_batch_size, dp_rank=group * shard,
                                   dp_size=spec.dp_size, start_index=trainer.skips.offset(step - 1)).start
        rows.append((step, group, first, first + t.global_batch_size // spec.parallelism.dp_replicate))
    return {**record, "skipped_samples": rows}


def replica_skips(trainer: Trainer, through: int) -> tuple[tuple[int, int, int, int], ...]:
    """Every share the job skipped up to step ``through`` (those before this attempt, from its
    resume's manifest, and this attempt's), (step, group, lo, hi): what a manifest records."""
    rows = set(trainer.replica_skips_before)
    if trainer.replicas is not None:
        rows.update(r for r in replica_record(trainer)["skipped_samples"] if r[0] <= through)
    return tuple(sorted(rows))
