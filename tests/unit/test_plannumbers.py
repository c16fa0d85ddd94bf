"""The first save's plan on numbers (``format/plannumbers.py``) is DCP's: each rank's plan expanded
from its numbers equals the plan it sent, and the global plan computed on the numbers (DCP's
load-balancing dedup, chunk indices, ``.metadata``'s entries in DCP's order, the merged planner
data) equals ``LinearCheckPlanner``'s (DCP's ``DefaultSavePlanner`` but for its chunk check), index
hints included, on real planner outputs of the debug model: FSDP2 over 1-48 ranks (shards of no
rows at 48), replicas holding equal shards (HSDP: every shard deduplicated), and two bases
(pipeline stages: their own tensors, shared byte items)."""

from __future__ import annotations

import dataclasses
import pickle

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
    arrays: dict = {}
    got = plan_on_numbers(book, pns, arrays)
    assert got is not None
    centrals, ours = got
    for fqn, (offsets, sizes) in arrays.items():  # the chunks .metadata can be written from: the same
        chunks = ours.state_dict_metadata[fqn].chunks
        assert offsets.tolist() == [list(c.offsets) for c in chunks] and sizes.tolist() == [list(c.sizes) for c in chunks]
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


@pytest.mark.parametrize("spread", [False, True])
def test_each_rank_makes_from_its_own_plan_the_central_plan_the_coordinator_made_before(shape, spread: bool) -> None:
    """What the coordinator sends back (``GatheredPlans``: the plans added in any order, the first
    to arrive a base) and the rank's own local plan give the central plan of DCP's planner with the
    planner data left out and the storage prefix DCP's writer (and, on an object store,
    ``spread_names``) gives it."""
    import random

    from torch.distributed.checkpoint import FileSystemWriter

    from raytrain_ckpt.checkpoint.format.plannumbers import own_central
    from raytrain_ckpt.checkpoint.roles.planning import GatheredPlans
    from raytrain_ckpt.checkpoint.storage.dcp import spread_names

    world = 6
    plans = [local_plan(shape, r, world) for r in range(world)]
    gathered = GatheredPlans()
    for r in random.Random(7).sample(range(world), world):
        gathered.add(r, plans[r])
    parts, metadata = gathered.build(world, spread)
    want, want_metadata = global_plan(plans)
    want = FileSystemWriter("/unused").prepare_global_plan([dataclasses.replace(p, planner_data=None) for p in want])
    want = spread_names(want) if spread else want
    assert metadata == want_metadata
    for r in range(world):
        mine = own_central(parts[r], plans[r])
        assert mine == want[r] and mine.storage_data == want[r].storage_data and mine.planner_data is None
        assert [i.index.index for i in mine.items] == [i.index.index for i in want[r].items]
        assert len(pickle.dumps(parts[r])) * 10 < len(pickle.dumps(want[r]))  # numbers, not the plan


def test_a_plan_dcps_check_refuses_is_refused_with_dcps_error(shape) -> None:
    from raytrain_ckpt.checkpoint.roles.planning import GatheredPlans

    plans = [local_plan(shape, r, 2) for r in range(2)]
    plans[1] = local_plan(shape, 0, 2)  # two ranks writing the same shards: rows 0.. twice, the rest never
    plans[1] = dataclasses.replace(plans[1], items=[i for i in plans[1].items if i.type == WriteItemType.SHARD])
    with pytest.raises(ValueError, match="Failed to validate global plan"):
        global_plan(plans)
    gathered = GatheredPlans()
    for r in range(2):
        gathered.add(r, plans[r])
    with pytest.raises(ValueError, match="Failed to validate global plan"):
        gathered.build(2, False)


@pytest.mark.parametrize("order", ["rank 0 first", "rank 0 last"])
def test_ranks_sending_their_differences_from_rank_0s_plan_get_dcps_plan(shape, order: str) -> None:
    """The wire form: rank 0 sends its plan, every other rank its difference from it
    (``difference_from``, rank 0's plan shared by a broadcast), or its whole plan where that is no
    smaller (a pipeline stage's); the coordinator's plan equals DCP's on the whole plans."""
    from torch.distributed.checkpoint import FileSystemWriter

    from raytrain_ckpt.checkpoint.format.plannumbers import SharedPlan, difference_from, own_central
    from raytrain_ckpt.checkpoint.roles.planning import GatheredPlans

    stage0 = [local_plan(shape, r, 2) for r in range(2)]
    stage1 = [_renamed(local_plan(shape, r, 2), "s1.") for r in range(2)]
    plans = [stage0[0], stage0[1], stage1[0], stage1[1]]
    sent = [SharedPlan(plans[0])] + [difference_from(plans[0], p, 0) or p for p in plans[1:]]
    assert [type(s).__name__ for s in sent] == ["SharedPlan", "PlanNumbers", "SavePlan", "SavePlan"]
    assert len(pickle.dumps(sent[1])) * 3 < len(pickle.dumps(plans[1]))
    gathered = GatheredPlans()
    arrival = list(range(4)) if order == "rank 0 first" else [3, 1, 2, 0]
    for r in arrival:
        gathered.add(r, pickle.loads(pickle.dumps(sent[r])))  # as the actor gets them: unpickled
    parts, metadata = gathered.build(4, False)
    want, want_metadata = global_plan(plans)
    want = FileSystemWriter("/unused").prepare_global_plan([dataclasses.replace(p, planner_data=None) for p in want])
    assert metadata == want_metadata and list(metadata.state_dict_metadata) == list(want_metadata.state_dict_metadata)
    for r in range(4):
        mine = own_central(parts[r], plans[r])
        assert mine == want[r] and [i.index.index for i in mine.items] == [i.index.index for i in want[r].items]


def test_a_difference_that_does_not_fit_rank_0s_plan_is_refused(shape) -> None:
    from raytrain_ckpt.checkpoint.format.plannumbers import OWN, SharedPlan, difference_from
    from raytrain_ckpt.checkpoint.roles.planning import GatheredPlans

    plans = [local_plan(shape, r, 2) for r in range(2)]
    diff = difference_from(plans[0], plans[1], 0)
    bad = [dataclasses.replace(diff, marks=diff.marks[:-1]),  # another length
           dataclasses.replace(diff, marks=bytes([OWN]) + diff.marks[1:]),  # an own item it does not carry
           dataclasses.replace(diff, marks=bytes([9]) + diff.marks[1:])]  # no such mark
    for d in bad:
        gathered = GatheredPlans()
        gathered.add(0, SharedPlan(plans[0]))
        gathered.add(1, d)
        with pytest.raises(ValueError, match="does not fit that plan"):
            gathered.build(2, False)
    for d in (dataclasses.replace(diff, marks=list(diff.marks)), dataclasses.replace(diff, numbers=list(diff.numbers)),
              dataclasses.replace(diff, own={0: "not an item"}), dataclasses.replace(diff, planner={0: "not a pair"})):
        gathered = GatheredPlans()
        gathered.add(0, SharedPlan(plans[0]))
        gathered.add(1, d)
        with pytest.raises(ValueError, match="is not one"):
            gathered.build(2, False)
    gathered = GatheredPlans()  # rank 0 sent its plan, but not as the plan its group shares
    gathered.add(0, plans[0])
    gathered.add(1, diff)
    with pytest.raises(ValueError, match="which that rank did not send"):
        gathered.build(2, False)


# --- small layouts made by hand: where DCP's rules are subtle ---------------------------------


def _byte(fqn: str):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem

    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


def _tensor(fqn: str, dtype=None):
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem

    return WriteItem(index=MetadataIndex(fqn, (0,)), type=WriteItemType.TENSOR,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size([0]), torch.Size([4])),
                                                 properties=TensorProperties(dtype=dtype or torch.float32),
                                                 size=torch.Size([4])))


def _plan(items: list, planner: dict | None = None) -> SavePlan:
    return SavePlan(items, planner_data=planner if planner is not None else {i.index.fqn: (i.index.fqn,) for i in items})


def _assert_plans_as_dcp(plans: list[SavePlan]) -> None:
    from raytrain_ckpt.checkpoint.format.plannumbers import own_central
    from raytrain_ckpt.checkpoint.roles.planning import GatheredPlans
    from torch.distributed.checkpoint import FileSystemWriter

    gathered = GatheredPlans()
    for r, p in enumerate(plans):
        gathered.add(r, p)
    parts, metadata = gathered.build(len(plans), False)
    want, want_metadata = global_plan(plans)
    want = FileSystemWriter("/unused").prepare_global_plan([dataclasses.replace(p, planner_data=None) for p in want])
    for r, p in enumerate(plans):
        mine = own_central(parts[r], p)
        assert mine == want[r] and [i.index.index for i in mine.items] == [i.index.index for i in want[r].items], r
    assert metadata == want_metadata and list(metadata.state_dict_metadata) == list(want_metadata.state_dict_metadata)
    assert list(metadata.planner_data.items()) == list(want_metadata.planner_data.items())


def test_a_tie_goes_where_dcps_set_of_holders_puts_it_first() -> None:
    # DCP's min() over a set of plan indices: {1, 8} iterates 8 first, so x goes to rank 8, not rank 1.
    plans = [_plan([_byte("a")]) for _ in range(9)]
    plans[1] = plans[8] = _plan([_byte("x"), _byte("y")])
    _assert_plans_as_dcp(plans)
    # Many holders, as a group's: the set of 100 ranks iterates in another order than its ranks'.
    plans = [_plan([_byte("a")] + ([_byte(f"r{r}")] if r % 7 == 0 else []) + [_byte("b"), _byte("c")])
             for r in range(100)]
    _assert_plans_as_dcp(plans)


def test_more_bases_than_are_compared_and_plans_of_every_length() -> None:
    _assert_plans_as_dcp([_plan([_byte(f"r{r}.{k}") for k in range(r + 1)]) for r in range(70)])
    _assert_plans_as_dcp([_plan([_byte(f"r{r}")]) for r in range(69)] + [_plan([_byte("x"), _byte("y")])])


def test_a_key_is_sized_by_the_last_rank_holding_it_and_planner_values_come_from_the_first() -> None:
    import torch

    plans = [_plan([_tensor("rr0"), _tensor("g0.r0", torch.float16), _tensor("r0")]),
             _plan([_tensor("g0.r0"), _tensor("r0", torch.float16)])]
    _assert_plans_as_dcp(plans)  # "r0" differs between the ranks: DCP sizes it by rank 1's item
    plans = [_plan([_byte("a")], {"a": ("x",)}), _plan([_byte("a"), _byte("b")], {"a": ("y",), "b": ("b",)}),
             _plan([_byte("a")], {"a": ("x",)})]
    _assert_plans_as_dcp(plans)


def test_planner_data_not_of_its_bases_shape_is_left_to_dcps_planner() -> None:
    from raytrain_ckpt.checkpoint.format.plannumbers_global import plan_on_numbers

    book = PlanBook()
    pns = [book.add(_plan([_byte("a")], {"a": ("a",)})), book.add(SavePlan([_byte("a")], planner_data=None))]
    assert plan_on_numbers(book, pns) is None
