"""The first save's plan on numbers (``format/plannumbers.py``) is DCP's: each rank's plan expanded
from its numbers equals the plan it sent, and the global plan computed on the numbers (DCP's
load-balancing dedup, chunk indices, ``.metadata``'s entries in DCP's order, the merged planner
data) equals ``LinearCheckPlanner``'s (DCP's ``DefaultSavePlanner`` but for its chunk check), index
hints included, on real planner outputs of the debug model: FSDP2 over 1-48 ranks (shards of no
rows at 48), replicas holding equal shards (HSDP: every shard deduplicated), and two bases
(pipeline stages: their own tensors, shared byte items)."""

from __future__ import annotations

import dataclasses

import pytest
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from bench.scale_ranks import local_plan, template
from raytrain_ckpt.checkpoint.format.planchecks import global_plan
from raytrain_ckpt.checkpoint.format.plannumbers import PlanBook, central
from raytrain_ckpt.checkpoint.format.plannumbers_global import plan_on_numbers
from raytrain_ckpt.control.preflight import load_spec
from raytrain_ckpt.models.config import PRESETS


@pytest.fixture(scope="module")
def shape():
    return template(load_spec("jobs/llama_debug_fsdp.yaml", []), PRESETS["debug"])


def _renamed(plan: SavePlan, prefix: str) -> SavePlan:
    """A pipeline stage's plan: the same tensors under names of its own, the byte items shared."""
    items = []
    for item in plan.items:
        if item.type == WriteItemType.SHARD:
            item = dataclasses.replace(item, index=dataclasses.replace(item.index, fqn=prefix + item.index.fqn))
        items.append(item)
    shards = {i.index.fqn for i in plan.items if i.type == WriteItemType.SHARD}
    data = {(prefix + k if k in shards else k): v for k, v in plan.planner_data.items()}
    return dataclasses.replace(plan, items=items, planner_data=data)


def _assert_same_as_dcp(plans: list[SavePlan]) -> PlanBook:
    book = PlanBook()
    pns = [book.add(p) for p in plans]
    for plan, pn in zip(plans, pns):
        back = book.expand(pn)
        assert back == plan and back.planner_data == plan.planner_data
        assert [i.index.index for i in back.items] == [i.index.index for i in plan.items]
    want, metadata = global_plan(plans)
    got = plan_on_numbers(book, pns)
    assert got is not None
    centrals, ours = got
    for r, (pn, c) in enumerate(zip(pns, centrals)):
        mine = central(book, pn, c)
        assert mine.items == want[r].items, r
        assert [i.index.index for i in mine.items] == [i.index.index for i in want[r].items], r
        assert mine.planner_data == want[r].planner_data and mine.storage_data == want[r].storage_data
    assert list(ours.state_dict_metadata) == list(metadata.state_dict_metadata)  # .metadata's order
    assert ours == metadata
    assert list(ours.planner_data.items()) == list(metadata.planner_data.items())
    return book


@pytest.mark.parametrize("world", [1, 2, 5, 48])
def test_fsdp2_plans_on_numbers_equal_dcps_global_plan(shape, world: int) -> None:
    book = _assert_same_as_dcp([local_plan(shape, r, world) for r in range(world)])
    assert len(book.bases) == 1


def test_replicas_of_equal_shards_are_deduplicated_as_dcp_does(shape) -> None:
    # 6 ranks, 2 replicas of a 3-way shard: every shard and byte item is held twice or more.
    _assert_same_as_dcp([local_plan(shape, r % 3, 3) for r in range(6)])


def test_two_bases_with_tensors_of_their_own_and_byte_items_shared(shape) -> None:
    plans = [local_plan(shape, r, 2) for r in range(2)] + [_renamed(local_plan(shape, r, 2), "s1.") for r in range(2)]
    plans = [plans[0], plans[2], plans[1], plans[3]]  # stages interleaved by rank
    book = _assert_same_as_dcp(plans)
    assert len(book.bases) == 2


def test_a_tensor_sharded_at_two_places_is_left_to_dcps_planner(shape) -> None:
    one = local_plan(shape, 1, 2)
    book = PlanBook()
    pns = [book.add(local_plan(shape, 0, 2)), book.add(dataclasses.replace(one, items=one.items[:-1]))]
    assert len(book.bases) == 2  # a plan of another length: a base of its own, naming the same tensors
    assert plan_on_numbers(book, pns) is None
