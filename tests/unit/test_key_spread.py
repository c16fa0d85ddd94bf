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
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from bench.scale_ranks import local_plan, template, write_results
from raytrain_ckpt.checkpoint.format.rankresults import RankResults
from raytrain_ckpt.checkpoint.format.plannumbers import own_central
from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint
from raytrain_ckpt.checkpoint.format.manifest import Manifest
from raytrain_ckpt.checkpoint.format.metadata import SafeLoadPlanner, load_metadata, safe_reader
from raytrain_ckpt.checkpoint.format.verify import verify_step
from raytrain_ckpt.checkpoint.format.unpickling import check_data_files
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy
from raytrain_ckpt.checkpoint.recovery.memcopy import CopyFacts, choose_sources
from raytrain_ckpt.checkpoint.records import CommittedCopy, GroupLayout, RankReport
from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor
from raytrain_ckpt.checkpoint.storage.dcp import key_spread, spread_names
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.cli.main import main
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
            results = write_results(own_central(centrals[r].plan, plans[r]), 10)
            name = results[0].storage_data.relative_path
            size = results[-1].storage_data.offset + results[-1].storage_data.length
            data = b"\0" * size
            actor.layout.storage.write_bytes(actor.layout.storage.join(tmp, name), data)
            out = await actor.report(RankReport(10, r, 0, centrals[r].plan_id, RankResults.of(results),
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
    assert [key_spread(r) for r in (0, 1, 17)] == ["b6", "35", "07"]  # the names README and ARCHITECTURE show



class _SpreadWriter(FsspecWriter):
    """DCP's object-store writer naming each rank's files as the coordinator does on an object store."""

    def prepare_global_plan(self, plans: list) -> list:
        return spread_names(super().prepare_global_plan(plans))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_spread_names_verify_list_and_match_in_memory_copies(tmp_path: Path, capsys) -> None:
    """What reads a step's files by name takes the spread names as DCP's (a real DCP save of a
    small state, committed manifest last): ``verify`` and ``ls --checksum`` check every file and
    name a flipped byte in the spread one, the state loads back, and a rank's in-memory copy
    matches the manifest's entry of its spread file."""
    layout = CheckpointLayout(f"memory://{tmp_path.name}/job")
    storage, step = layout.storage, layout.new_tmp_dir(10)
    state = {"w": torch.arange(8, dtype=torch.float32), "train": {"step": 10}}
    dcp.save(state, storage_writer=_SpreadWriter(str(step)), no_dist=True)
    name = f"{key_spread(0)}__0_0.distcp"
    files = {n: {"size": len(b := storage.read_bytes(storage.join(step, n))), "crc32c": crc32c.crc32c(b)}
             for n in storage.listdir(step)}
    assert sorted(files) == sorted([".metadata", name])
    layout.commit(step, Manifest(step=10, world_size=1, dp_size=1, spec_hash="h", files=files))
    assert verify_step(step, "checksum", storage).files.keys() == files.keys()
    assert sorted(layout.valid_steps("checksum")) == [10]
    capsys.readouterr()
    assert main(["ls", "--checksum", str(layout.root)]) == 0
    assert "valid" in capsys.readouterr().out
    loaded = {"w": torch.zeros(8), "train": {"step": 0}}
    dcp.load(loaded, storage_reader=safe_reader(str(step)), planner=SafeLoadPlanner(), no_dist=True)
    assert torch.equal(loaded["w"], state["w"]) and loaded["train"] == {"step": 10}
    copy = CommittedCopy(10, 0, "k", 64, [], b"", 0, "/dev/shm/rtc-x-rank0.buf", {name: files[name]})
    assert [s.source for s in choose_sources(10, 1, 1, 2, [CopyFacts(0, copy)], files)] == ["memory"]
    shard = storage.join(step, name)
    data = bytearray(storage.read_bytes(shard))
    data[len(data) // 2] ^= 0xFF
    storage.write_bytes(shard, bytes(data))
    with pytest.raises(InvalidCheckpoint, match=name):
        verify_step(step, "checksum", storage)
    assert sorted(layout.valid_steps("checksum")) == []
