"""The first save's plan: what a rank sends of its local plan, the coordinator's gather of them
kept as numbers, and the global plan made from them.

A rank sends its difference from its process group's first rank's plan, shared by one broadcast
(``plan_to_send``); the group's first rank sends its plan whole (``SharedPlan``).

Each rank's plan is added to a ``PlanBook`` as it arrives (``format/plannumbers.py``: about 80 KB a
rank of 70B instead of the 9.6 MB its unpickled objects held) and the plan objects are let go.
Once every rank is in, ``plan_on_numbers`` computes DCP's global plan on the numbers and each
rank gets back ``CentralNumbers`` (which of its items it writes, their chunk indices, its storage
prefix), from which it makes its central plan out of its own local plan (``apply_central``). A
layout the numbers do not model is planned by DCP's planner as before (``planchecks.global_plan``
over the plans expanded again), and its ranks get their central plans whole.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from raytrain_ckpt.checkpoint.format.planchecks import check_global_plan, global_plan
from raytrain_ckpt.checkpoint.format.plannumbers import SHARED, PlanBook, PlanNumbers, SharedPlan, difference_from, wire_central
from raytrain_ckpt.checkpoint.format.plannumbers_global import plan_on_numbers
from raytrain_ckpt.checkpoint.storage.dcp import rank_prefix
from raytrain_ckpt.common.gcpause import collector_paused

__all__ = ["GatheredPlans", "plan_to_send"]

logger = logging.getLogger(__name__)


def plan_to_send(make: Callable[[], SavePlan], rank: int, device: torch.device) -> tuple[SavePlan, Any]:
    """Rank ``rank``'s local plan (``make``) and what it sends the coordinator of it. A rank whose
    ``make`` raises takes its part in the broadcast below first, then raises."""
    try:
        local, failed = make(), None
    except Exception as exc:  # noqa: BLE001 - raised below, after this rank took its part in the broadcast
        local, failed = None, exc
    sent = _part(local, rank, device)
    if failed is not None:
        raise failed
    return local, sent


def _part(local: SavePlan | None, rank: int, device: torch.device) -> SavePlan | SharedPlan | PlanNumbers | None:
    """What rank ``rank`` sends of its local plan (None: it could not make one).
    Its process group's first rank sends its plan, which every rank of the group gets by one
    broadcast (a collective: the group's ranks plan again together); each other rank sends its
    difference from it (its shards' offsets and sizes and its own few items: 80 KB a rank of 70B
    against 2 MB), or its whole plan where that is no smaller (``plannumbers.difference_from``)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    box = [local if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, device=device)
    if dist.get_rank() == 0:
        return None if local is None else SharedPlan(local)
    if box[0] is None or local is None:  # the group's first rank could not plan: its save fails there
        return local
    try:
        return difference_from(box[0], local, against=rank - dist.get_rank()) or local
    except Exception:  # noqa: BLE001 - the whole plan says the same, at its size
        logger.exception("rank %d: its plan as a difference failed; sending it whole", rank)
        return local


class GatheredPlans:
    """See the module docstring."""

    def __init__(self) -> None:
        self._book = PlanBook()
        self._numbers: dict[int, PlanNumbers] = {}
        self._shared: dict[int, SavePlan] = {}
        """The plans the ranks' differences are from (``SharedPlan``), by rank."""

    def __len__(self) -> int:
        return len(self._numbers)

    def add(self, rank: int, plan: SavePlan | SharedPlan | PlanNumbers) -> None:
        """Rank ``rank``'s local plan, or its difference from a plan its process group shares
        (``difference_from``); a call sent again replaces its earlier one."""
        if isinstance(plan, PlanNumbers):
            if plan.base != SHARED:
                raise ValueError(f"rank {rank} sent a plan difference from base {plan.base}, not a shared plan")
            self._numbers[rank] = plan
            return
        if isinstance(plan, SharedPlan):
            plan = self._shared[rank] = plan.plan
        self._numbers[rank] = self._book.add(plan)

    def _rebased(self, pn: PlanNumbers) -> PlanNumbers:
        """A rank's difference from a shared plan, as numbers against that plan's base here."""
        shared = self._shared.get(pn.against)
        if shared is None:
            raise ValueError(f"plan differences from rank {pn.against}'s plan, which that rank did not send")
        base = self._numbers[pn.against].base
        if self._book.bases[base].plan is shared:  # the shared plan is a base itself (it came first of its kind)
            return self._book.resolve(pn, base)
        alone = PlanBook()  # else it is numbers against another base: the rank's plan back, added as any
        alone.add_base(shared)
        return self._book.add(alone.expand(alone.resolve(pn, 0)))

    def pop(self, rank: int) -> None:
        self._numbers.pop(rank, None)

    def clear(self) -> None:
        self._numbers.clear()
        self._book = PlanBook()
        self._shared.clear()

    def build(self, world: int, spread: bool, chunk_arrays: dict | None = None) -> tuple[list[Any], Metadata]:
        """Per rank what it gets back (``CentralNumbers``, or its central ``SavePlan`` when DCP's
        planner made the plan) and the global ``Metadata``; raises DCP's error for a plan its
        check refuses. ``spread``: an object store's file names (``storage/dcp.py``'s ``spread_names``).
        ``chunk_arrays``: filled with the chunks of each base-sharded tensor as arrays (``plan_on_numbers``)."""
        pns = [self._numbers[r] for r in range(world)]
        if any(pn.base == SHARED for pn in pns):
            pns = [self._rebased(pn) if pn.base == SHARED else pn for pn in pns]
        with collector_paused():
            got = plan_on_numbers(self._book, pns, chunk_arrays)
            if got is None:
                central, metadata = global_plan([self._book.expand(pn) for pn in pns])
                return [dataclasses.replace(p, planner_data=None, storage_data=rank_prefix(r, p.storage_data, spread))
                        for r, p in enumerate(central)], metadata
            centrals, metadata = got
            check_global_plan(pns, metadata)
            return [wire_central(self._book, pn, c, rank_prefix(r, pn.storage_data, spread))
                    for r, (pn, c) in enumerate(zip(pns, centrals))], metadata
