"""The coordinator's global-plan check gives DCP's verdict, layout for layout, without its pairwise sweep."""

from __future__ import annotations

import random
import time

import pytest
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner, _validate_global_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan

from bench.scale_ranks import local_plan, template
from raytrain_ckpt.checkpoint.format.planchecks import LinearCheckPlanner, plan_problems
from raytrain_ckpt.models.factory import describe_model
from raytrain_ckpt.control.preflight import load_spec


def _metadata(size: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> Metadata:
    chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in boxes]
    return Metadata({"t": TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size), chunks)})


def _verdicts(size, boxes, ranks: int = 2) -> tuple[bool, bool]:
    """(ours, DCP's): True where the layout is valid."""
    md, plans = _metadata(size, boxes), [SavePlan([]) for _ in range(ranks)]
    return not plan_problems(plans, md), not _validate_global_plan(plans, md)


def _rows(size: tuple[int, ...], n: int) -> list:
    """FSDP2's Shard(0) over ``n`` ranks: torch.chunk's sizes, empty shards at the end of dim 0."""
    step = -(-size[0] // n)
    out = []
    for r in range(n):
        start = min(r * step, size[0])
        rows = max(0, min(step, size[0] - start))
        out.append(((start, *[0] * (len(size) - 1)), (rows, *size[1:])))
    return out


def _grid(size: tuple[int, int], a: int, b: int) -> list:
    rows, cols = _rows(size, a), _rows((size[1], size[0]), b)
    return [((r[0][0], c[0][0]), (r[1][0], c[1][0])) for r in rows for c in cols]


CASES = {
    "fsdp2 rows, wide": ((64, 4096), _rows((64, 4096), 8)),
    "fsdp2 rows, uneven last": ((255, 96), _rows((255, 96), 2)),
    "fsdp2 rows, 0-size shards at the end": ((5, 16), _rows((5, 16), 8)),
    "1-d, 0-size shards": ((3,), _rows((3,), 4)),
    "one chunk": ((4, 4), [((0, 0), (4, 4))]),
    "2-d grid": ((30, 40), _grid((30, 40), 3, 4)),
    "overlap by a row": ((8, 4), [((0, 0), (5, 4)), ((4, 0), (4, 4))]),
    "overlap, same volume": ((8, 4), [((0, 0), (4, 4)), ((3, 0), (4, 4)), ((7, 0), (1, 4))]),
    "duplicate chunk": ((8, 4), [((0, 0), (4, 4)), ((0, 0), (4, 4))]),
    "gap": ((8, 4), [((0, 0), (3, 4)), ((4, 0), (4, 4))]),
    "out of bounds": ((8, 4), [((0, 0), (4, 4)), ((4, 0), (5, 4))]),
    "negative offset": ((8, 4), [((-1, 0), (4, 4)), ((3, 0), (5, 4))]),
    "negative size": ((8, 4), [((0, 0), (8, 4)), ((2, 0), (-1, 4))]),
    "0-size chunk strictly inside another": ((8, 4), [((0, 0), (8, 4)), ((3, 0), (0, 4))]),
    "0-size chunk on an edge": ((8, 4), [((0, 0), (4, 4)), ((4, 0), (4, 4)), ((4, 0), (0, 4))]),
    "two 0-size chunks crossing": ((8, 8), [((0, 0), (8, 8)), ((4, 0), (0, 8)), ((0, 4), (8, 0))]),
    "no grid: staggered columns": ((4, 6), [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 2)), ((2, 2), (2, 4))]),
    "no grid, overlapping": ((4, 6), [((0, 0), (2, 3)), ((0, 3), (2, 3)), ((1, 0), (2, 2)), ((2, 2), (2, 4))]),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("ranks", [1, 2])
def test_each_layout_gets_dcps_verdict(name: str, ranks: int) -> None:
    size, boxes = CASES[name]
    ours, dcp = _verdicts(size, boxes, ranks)
    assert ours == dcp, (name, ours, dcp)


def test_the_cases_cover_both_verdicts() -> None:
    verdicts = {name: _verdicts(*CASES[name])[1] for name in CASES}
    assert verdicts["fsdp2 rows, wide"] and verdicts["fsdp2 rows, 0-size shards at the end"]
    assert verdicts["2-d grid"] and verdicts["no grid: staggered columns"]
    for bad in ("overlap by a row", "overlap, same volume", "gap", "out of bounds", "negative size",
                "0-size chunk strictly inside another", "no grid, overlapping"):
        assert not verdicts[bad], bad


def _perturbed(rng: random.Random) -> tuple[tuple[int, ...], list]:
    dims = rng.choice([1, 2, 3])
    size = tuple(rng.randint(1, 9) for _ in range(dims))
    boxes = _rows(size, rng.randint(1, 12))
    if dims >= 2 and rng.random() < 0.3:
        boxes = [b for b in _grid(size[:2], rng.randint(1, 4), rng.randint(1, 4))]
        size = size[:2]
    for _ in range(rng.randint(0, 2)):
        i, d = rng.randrange(len(boxes)), rng.randrange(len(size))
        off, sz = list(boxes[i][0]), list(boxes[i][1])
        if rng.random() < 0.5:
            off[d] += rng.choice([-2, -1, 1, 2])
        else:
            sz[d] += rng.choice([-2, -1, 1, 2])
        boxes[i] = (tuple(off), tuple(sz))
    if rng.random() < 0.2:
        boxes.append(rng.choice(boxes))
    if rng.random() < 0.2:  # a chunk of size 0 somewhere inside the tensor
        off = tuple(rng.randrange(d + 1) for d in size)
        boxes.append((off, tuple(0 if k == 0 else size[k] - off[k] for k in range(len(size)))))
    return size, boxes


def test_generated_layouts_get_dcps_verdict() -> None:
    rng = random.Random(50)
    seen = {True: 0, False: 0}
    for _ in range(3000):
        size, boxes = _perturbed(rng)
        ours, dcp = _verdicts(size, boxes, rng.choice([1, 2]))
        assert ours == dcp, (size, boxes, ours, dcp)
        seen[dcp] += 1
    assert min(seen.values()) > 300, seen


def test_a_wide_tensor_over_many_ranks_is_checked_in_linear_time() -> None:
    # FSDP2 rows of a tensor wider than tall: DCP's sweep runs along the unsharded dimension and
    # compares every pair (8M pairs at 4096 ranks); the grid check marks each chunk's cells once.
    size = (8192, 65536)
    md, plans = _metadata(size, _rows(size, 4096)), [SavePlan([]), SavePlan([])]
    t0 = time.perf_counter()
    assert plan_problems(plans, md) == []
    assert time.perf_counter() - t0 < 2.0


def test_the_planner_builds_dcps_global_plan_and_metadata() -> None:
    spec = load_spec("jobs/llama_debug_fsdp.yaml", ["model.overrides.dim=96", "model.overrides.n_heads=2",
                                                    "model.overrides.n_kv_heads=1", "model.overrides.ffn_dim=200",
                                                    "model.overrides.vocab_size=255"])
    shape = template(spec, describe_model(spec.model.name, spec.model.overrides))
    plans = [local_plan(shape, r, 3) for r in range(3)]
    ours, dcp = LinearCheckPlanner().create_global_plan(plans), DefaultSavePlanner().create_global_plan(plans)
    assert ours[0] == dcp[0]
    assert ours[1] == dcp[1]


def test_the_planner_refuses_what_dcp_refuses() -> None:
    spec = load_spec("jobs/llama_debug_fsdp.yaml", [])
    shape = template(spec, describe_model(spec.model.name, spec.model.overrides))
    plans = [local_plan(shape, r, 2) for r in range(2)]
    plans[1] = plans[0]  # both ranks claim rank 0's shards: a gap and duplicate chunks
    with pytest.raises(ValueError, match="Failed to validate global plan"):
        DefaultSavePlanner().create_global_plan(plans)
    with pytest.raises(ValueError, match="Failed to validate global plan"):
        LinearCheckPlanner().create_global_plan(plans)


def test_row_shards_take_the_sort_and_other_layouts_the_grid() -> None:
    from raytrain_ckpt.checkpoint.format import planchecks

    def chunks(boxes):
        return _metadata((1,), boxes).state_dict_metadata["t"].chunks

    assert planchecks._rows((64, 4096), chunks(_rows((64, 4096), 8)), True) == ""
    assert planchecks._rows((8, 4), chunks(CASES["overlap by a row"][1]), True)
    assert planchecks._rows((8, 4), chunks(CASES["0-size chunk strictly inside another"][1]), True)
    assert planchecks._rows((30, 40), chunks(CASES["2-d grid"][1]), True) is None


def test_the_coordinators_plan_pauses_the_collector_and_restores_it() -> None:
    import gc

    from raytrain_ckpt.checkpoint.format.planchecks import global_plan

    spec = load_spec("jobs/llama_debug_fsdp.yaml", [])
    shape = template(spec, describe_model(spec.model.name, spec.model.overrides))
    plans = [local_plan(shape, r, 2) for r in range(2)]
    assert gc.isenabled()
    assert global_plan(plans) == DefaultSavePlanner().create_global_plan(plans)
    assert gc.isenabled()
    gc.disable()
    try:
        global_plan(plans)
        assert not gc.isenabled()
    finally:
        gc.enable()
    plans[1] = plans[0]
    with pytest.raises(ValueError):
        global_plan(plans)
    assert gc.isenabled()
