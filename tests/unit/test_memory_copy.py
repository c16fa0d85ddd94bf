"""Restart from the node's memory, the decisions and the checks without Ray: which source each
rank loads from (a table), which buffer the next save stages into (a table), the copy's
checksum and step checks on a real shared-memory buffer, and the fault plan's copy kinds."""

from __future__ import annotations

import pickle

import pytest
import torch

from raytrain_ckpt.checkpoint.roles.client import next_buffer
from raytrain_ckpt.checkpoint.format.manifest import checksum_file
from raytrain_ckpt.checkpoint.records import CommittedCopy
from raytrain_ckpt.checkpoint.errors import CopyMismatch
from raytrain_ckpt.checkpoint.recovery.memcopy import choose_sources, CopyFacts, open_copy
from raytrain_ckpt.checkpoint.datapath.staging import allocate_buffer, layout_key, map_buffer, plan_slots, slot_views
from raytrain_ckpt.common.faults import ENV_VAR, parse_faults

FILES = {"__0_0.distcp": {"size": 100, "crc32c": 7}, "__1_0.distcp": {"size": 90, "crc32c": 8}}


def _copy(rank: int = 0, step: int = 10, files: dict | None = None) -> CommittedCopy:
    mine = {"__0_0.distcp": FILES["__0_0.distcp"]} if rank == 0 else {"__1_0.distcp": FILES["__1_0.distcp"]}
    return CommittedCopy(step, rank, "k", 64, [], b"", 0, f"/dev/shm/rtc-x-rank{rank}.buf",
                         mine if files is None else files)


@pytest.mark.parametrize(("copies", "saved_ws", "facts", "expect"), [
    (2, 2, [CopyFacts(0, _copy(0)), CopyFacts(1, _copy(1))], ["memory", "memory"]),
    (1, 2, [CopyFacts(0, _copy(0)), CopyFacts(1, _copy(1))], "checkpoint.memory_copies=1"),
    (2, 4, [CopyFacts(0, _copy(0)), CopyFacts(1, _copy(1))], "step 10 was saved at world size 4, this attempt runs 2"),
    (2, 2, [CopyFacts(0, _copy(0)), CopyFacts(1, None)], "rank 1: its node's writer holds no copy of step 10"),
    (2, 2, [CopyFacts(0, _copy(0)), CopyFacts(1, None, "GetTimeoutError: x")], "rank 1: its node's writer cannot"),
    (2, 2, [CopyFacts(0, _copy(0, step=5)), CopyFacts(1, _copy(1))], "rank 0: stale copy: it holds step 5"),
    (2, 2, [CopyFacts(0, _copy(1)), CopyFacts(1, _copy(1))], "rank 0: the copy is rank 1's"),
    (2, 2, [CopyFacts(0, _copy(0, files={"__0_0.distcp": {"size": 100, "crc32c": 9}})), CopyFacts(1, _copy(1))],
     "rank 0: the copy's file __0_0.distcp is not the one step 10's manifest lists"),
    (2, 2, [CopyFacts(0, _copy(0, files={})), CopyFacts(1, _copy(1))], "rank 0: the copy records no written files"),
])
def test_every_rank_loads_from_memory_or_every_rank_from_storage(copies, saved_ws, facts, expect):
    sources = choose_sources(10, 2, saved_ws, copies, facts, FILES)
    assert [s.rank for s in sources] == [0, 1]
    if isinstance(expect, list):
        assert [s.source for s in sources] == expect
        assert [s.copy for s in sources] == [f.copy for f in facts]
        return
    assert [s.source for s in sources] == ["storage", "storage"] and all(s.copy is None for s in sources)
    assert all(s.why.startswith(expect) for s in sources), sources[0].why


@pytest.mark.parametrize(("facts", "expect"), [
    ([CopyFacts(0, _copy(0, files={})), CopyFacts(1, _copy(1, files={}))], ["memory", "memory"]),
    ([CopyFacts(0, _copy(0, files={})), CopyFacts(1, None)], "rank 1: its node's writer holds no copy of step 10"),
    ([CopyFacts(0, _copy(0, files={})), CopyFacts(1, _copy(1, step=5))], "rank 1: stale copy: it holds step 5"),
])
def test_a_step_held_only_in_ram_needs_every_rank_s_copy_and_no_manifest(facts, expect):
    """A preemption's RAM-tier step: no files on storage to match (manifest None); the copies'
    own CRC-32C, checked on the ranks, is their proof. A missing copy sends every rank elsewhere."""
    sources = choose_sources(10, 2, 2, 2, facts, None)
    if isinstance(expect, list):
        assert [s.source for s in sources] == expect and "RAM-tier copy of step 10" in sources[0].why
        return
    assert [s.source for s in sources] == ["storage", "storage"] and sources[0].why.startswith(expect)


@pytest.mark.parametrize(("steps", "expect"), [
    ([None], 0),
    ([5], 0),              # one buffer: always that one
    ([None, None], 0),
    ([5, None], 1),        # the empty one, never the one holding the newest step
    ([5, 10], 0),          # the older step
    ([15, 10], 1),
    ([None, 10], 0),       # a save that failed is forgotten: its buffer is reused
])
def test_the_next_save_never_stages_over_the_newest_step(steps, expect):
    assert next_buffer(steps) == expect


def _real_copy(tmp_path, step: int = 10) -> CommittedCopy:
    tensors = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.float64)}
    slots, nbytes = plan_slots(tensors)
    path = tmp_path / "rtc-test-rank0.buf"
    allocate_buffer(path, nbytes)  # owned for the test's life (the handle keeps the lock)
    buf = map_buffer(path, nbytes)
    for fqn, view in slot_views(buf, slots).items():
        view.copy_(tensors[fqn])
    objects = {"train.step": step}
    return CommittedCopy(step, 0, layout_key(slots, list(objects)), nbytes, slots, pickle.dumps(objects),
                         checksum_file(path), str(path), {})


def test_a_verified_copy_maps_its_tensors_and_a_flipped_bit_or_other_step_is_refused(tmp_path, monkeypatch):
    copy = _real_copy(tmp_path)
    opened = open_copy(copy, 10, 0)
    assert torch.equal(opened.views["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    with pytest.raises(CopyMismatch, match="not rank 0's step 15"):
        open_copy(copy, 15, 0)
    with pytest.raises(CopyMismatch, match="not rank 1's step 10"):
        open_copy(copy, 10, 1)
    monkeypatch.setenv(ENV_VAR, "corrupt@restore:rank=0,step=10,attempt=1")
    open_copy(copy, 10, 0, attempt=0)  # the fault is planned for the restart's attempt only
    with pytest.raises(CopyMismatch, match="CRC-32C .* recorded"):
        open_copy(copy, 10, 0, attempt=1)
    monkeypatch.delenv(ENV_VAR)
    with pytest.raises(CopyMismatch, match="CRC-32C"):  # the flip stays: a corrupted buffer is never loaded
        open_copy(copy, 10, 0)


def test_a_missing_buffer_is_refused_not_raised(tmp_path):
    copy = _real_copy(tmp_path)
    (tmp_path / "rtc-test-rank0.buf").unlink()
    with pytest.raises(CopyMismatch, match="cannot be read"):
        open_copy(copy, 10, 0)


def test_copy_fault_kinds_apply_at_restore_only():
    assert parse_faults("corrupt@restore:rank=0,step=10,attempt=1")[0].kind == "corrupt"
    with pytest.raises(ValueError, match="stale applies at restore only"):
        parse_faults("stale@step:rank=0,step=10")


def test_the_copy_into_the_state_is_exact_in_pieces_on_several_threads(monkeypatch):
    import raytrain_ckpt.checkpoint.recovery.memcopy as memcopy

    monkeypatch.setattr(memcopy, "_PIECE_BYTES", 4096)  # many pieces, and a tensor's last piece short
    gen = torch.Generator().manual_seed(0)
    sources = [torch.randn(3001, generator=gen), torch.randn(64, 33, generator=gen).to(torch.bfloat16),
               torch.randint(0, 1 << 30, (5000,), generator=gen), torch.randn(0), torch.randn(7, generator=gen)]
    targets = [torch.empty_like(s) for s in sources]
    strided = torch.empty(40, 50)[:, ::2]  # not contiguous: copied whole
    sources.append(torch.randn(40, 25, generator=gen))
    targets.append(strided)
    memcopy.copy_in(list(zip(targets, sources)))
    for dst, src in zip(targets, sources):
        assert torch.equal(dst, src)
