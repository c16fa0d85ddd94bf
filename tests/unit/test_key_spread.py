"""A save's objects spread over the store's key ranges: on an object-store root the coordinator
names each rank's files after two hex digits of its own (``storage/dcp.py``), a local root keeps
DCP's names, and the step commits and verifies either way (real CheckpointActor, real DCP plans
of the debug model, an fsspec in-memory object store)."""

from __future__ import annotations

import asyncio
import io
from collections import Counter
from pathlib import Path

import crc32c
import pytest

from bench.scale_ranks import local_plan, template, write_results
from raytrain_ckpt.checkpoint.format.metadata import load_metadata
from raytrain_ckpt.checkpoint.format.unpickling import check_data_files
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy
from raytrain_ckpt.checkpoint.records import GroupLayout, RankReport
from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor
from raytrain_ckpt.checkpoint.storage.dcp import key_spread
from raytrain_ckpt.control.preflight import load_spec
from raytrain_ckpt.models.config import PRESETS

N = 4


@pytest.fixture(scope="module")
def plans() -> list:
    shape = template(load_spec("jobs/llama_debug_fsdp.yaml", []), PRESETS["debug"])
    return [local_plan(shape, r, N) for r in range(N)]


def _save(root: str, plans: list) -> CheckpointActor:
    """Plan and commit step 10 from every rank (each rank's file written at its reported size)."""
    actor = CheckpointActor(root, RetentionPolicy(None))
    asyncio.run(actor.configure(GroupLayout(N, N, "h", None)))

    async def scenario() -> None:
        centrals = await asyncio.gather(*(actor.plan(0, 10, r, plans[r], 30) for r in range(N)))
        tmp = await actor.open_step(10, 0)
        for r in range(N):
            await actor.accepted(10, r, 0, None)
        for r in range(N):
            results = write_results(centrals[r].plan, 10)
            name = results[0].storage_data.relative_path
            size = results[-1].storage_data.offset + results[-1].storage_data.length
            data = b"\0" * size
            actor.layout.storage.write_bytes(actor.layout.storage.join(tmp, name), data)
            out = await actor.report(RankReport(10, r, 0, centrals[r].plan_id, results,
                                                {name: {"size": size, "crc32c": crc32c.crc32c(data)}}))
        assert out == "committed"

    asyncio.run(scenario())
    return actor


def test_an_object_store_root_spreads_each_ranks_names_a_local_root_keeps_dcps(tmp_path: Path, plans: list) -> None:
    spread = _save(f"memory://{tmp_path.name}/job", plans)
    local = _save(str(tmp_path / "job"), plans)
    for actor, names in ((spread, [f"{key_spread(r)}__{r}_0.distcp" for r in range(N)]),
                         (local, [f"__{r}_0.distcp" for r in range(N)])):
        files = actor.committed[10].files
        storage = actor.layout.storage
        read = load_metadata(io.BytesIO(storage.read_bytes(storage.join(actor.layout.step_dir(10), ".metadata"))), "m")
        assert sorted(n for n in files if n.endswith(".distcp")) == sorted(names)
        assert sorted(actor.layout.valid_steps("size")) == [10]
        # plain names inside the step: what every reader (and an older version) accepts
        check_data_files(read.storage_data, "step", set(files))


def test_the_spread_is_even_over_the_first_hex_digit() -> None:
    counts = Counter(key_spread(r)[0] for r in range(4096))
    assert len(counts) == 16 and max(counts.values()) < 1.15 * 4096 / 16
    assert len({key_spread(r) for r in range(4096)}) == 256
