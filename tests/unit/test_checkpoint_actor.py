"""The CheckpointActor's bookkeeping, driven directly (no Ray): real saves through plan and
report, retention after a step was deleted by hand, the timeline a run starts, leases, rebuild
from storage, settling in-flight steps; and shared-memory staging round trips."""

from __future__ import annotations

import asyncio
import shutil
import threading
import zlib
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from raytrain_ckpt.checkpoint.format.rankresults import RankResults
from raytrain_ckpt.checkpoint.format.plannumbers import own_central
from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint
from raytrain_ckpt.checkpoint.records import GroupLayout, RankReport
from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor
from raytrain_ckpt.checkpoint.errors import StepAborted
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy
from raytrain_ckpt.checkpoint.datapath.staging import SharedMemoryStaging, allocate_buffer, map_buffer, plan_slots, slot_views
from tests.unit.test_checkpoint_layout import _commit


def _actor(root: Path, k: int | None = 1) -> CheckpointActor:
    actor = CheckpointActor(str(root), RetentionPolicy(k))
    asyncio.run(actor.configure(GroupLayout(world_size=2, dp_size=2, spec_hash="h")))
    return actor


async def _save(actor: CheckpointActor, step: int, attempt: int = 0) -> str:
    """One real save of a single-rank group: plan with the actor, write DCP files, report."""
    state = {"w": torch.arange(64.0) + step, "step": step}
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=True)
    local = planner.create_local_plan()
    central = await actor.plan(attempt, step, 0, local, timeout_s=5)
    plan_id, plan = central.plan_id, planner.finish_plan(own_central(central.plan, local))
    tmp = Path(await actor.accepted(step, 0, attempt))
    writer = FileSystemWriter(tmp, sync_files=False)
    writer.set_up_storage_writer(False, rank=0)
    results = writer.write_data(plan, planner).wait()
    files = {p.name: {"size": p.stat().st_size, "crc32": zlib.crc32(p.read_bytes())} for p in tmp.iterdir()}
    return await actor.report(RankReport(step, 0, attempt, plan_id, RankResults.of(results), files))


def test_a_group_whose_layout_cannot_be_recorded_still_starts(tmp_path: Path, caplog) -> None:
    """A full disk or a root moved away makes the group file unwritable (a real OSError here: a
    directory in its place); a restart's configure must not fail the driver, and no stale layout
    is left for an actor Ray restarts."""
    actor = _single_rank_actor(tmp_path, None)
    (tmp_path / ".group.json").unlink()
    (tmp_path / ".group.json").mkdir()
    (tmp_path / ".group.json" / "x").write_text("in the way")
    asyncio.run(actor.configure(GroupLayout(world_size=2, dp_size=2, spec_hash="h2")))
    assert (actor.world_size, actor.spec_hash) == (2, "h2")
    assert "could not record the group's layout" in caplog.text
    shutil.rmtree(tmp_path / ".group.json")
    moved = CheckpointActor(str(tmp_path / "gone" / "job"), RetentionPolicy(None))
    shutil.rmtree(tmp_path / "gone")  # the root moved away after the actor started
    asyncio.run(moved.configure(GroupLayout(world_size=1, dp_size=1, spec_hash="h")))
    assert moved.world_size == 1


def _single_rank_actor(root: Path, k: int | None) -> CheckpointActor:
    actor = CheckpointActor(str(root), RetentionPolicy(k))
    asyncio.run(actor.configure(GroupLayout(world_size=1, dp_size=1, spec_hash="h")))
    return actor


def test_a_step_removed_by_hand_is_dropped_and_retention_converges(tmp_path: Path, caplog) -> None:
    actor = _single_rank_actor(tmp_path, k=2)
    layout = CheckpointLayout(tmp_path)

    async def scenario() -> list[str]:
        outcomes = [await _save(actor, 1), await _save(actor, 2)]
        shutil.rmtree(layout.step_dir(1))                   # an operator frees space by hand
        for step in (3, 4, 5):
            outcomes.append(await _save(actor, step))
        return outcomes

    assert asyncio.run(scenario()) == ["committed"] * 5
    assert "step 1 vanished" in caplog.text
    status = asyncio.run(actor.status()).to_dict()
    assert status["committed"] == [4, 5] and status["failed"] == {} and status["purge_errors"] == 0
    assert sorted(layout.valid_steps("checksum")) == [4, 5]   # the disk follows the policy again


@pytest.mark.parametrize(("resume", "kept", "aside"), [
    ("40", [20, 40], [60, 80]),        # an older step of this root: the newer ones leave the timeline
    ("latest", [20, 40, 60, 80], []),
    ("none", [], [20, 40, 60, 80]),    # a fresh start is a new timeline too
    ("other", [], [20, 40, 60, 80]),   # another root's step: nothing of this root is on its timeline
])
def test_starting_a_timeline_moves_the_steps_off_it_aside(tmp_path: Path, caplog, resume, kept, aside) -> None:
    root, other = tmp_path / "job", tmp_path / "other"
    layout = CheckpointLayout(root)
    for step in (20, 40, 60, 80):
        _commit(layout, step)
    if resume == "other":
        resume = str(_commit(CheckpointLayout(other), 50))
    point = asyncio.run(_actor(root, k=1).begin("attempt-0", resume, "checksum"))
    # nothing moves before the ranks loaded the start (a start that fails leaves the timeline as it was)
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == \
        [f"step-{s:08d}" for s in (20, 40, 60, 80)]
    actor = _actor(root, k=1)   # the driver passes the start back: an actor restarted meanwhile does the same
    asyncio.run(actor.start_timeline(point.step if point else None, point.path if point else None, resume))
    assert sorted(actor.committed) == kept
    moved = sorted(p.name for p in root.iterdir() if ".abandoned-" in p.name)
    assert [int(n[5:13]) for n in moved] == aside
    assert all(layout.read_manifest(root / n).step == int(n[5:13]) for n in moved)   # kept intact
    assert all(n in caplog.text for n in moved)
    # a restarted actor rebuilds the same timeline from storage; the steps aside are never loaded
    assert sorted(_actor(root, k=1).committed) == kept


def test_restarted_actor_rebuilds_its_state_from_storage(tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path)
    _commit(layout, 5)
    _commit(layout, 10)
    (tmp_path / "step-00000012").mkdir()                    # torn: no manifest
    leftover = layout.new_tmp_dir(15)
    actor = _actor(tmp_path)
    status = asyncio.run(actor.status()).to_dict()
    assert status["committed"] == [5, 10] and status["latest"] == 10
    assert not leftover.exists()


def test_leased_step_survives_retention_until_released(tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path)
    _commit(layout, 1)
    _commit(layout, 2)
    actor = _actor(tmp_path, k=1)

    async def scenario() -> list[int]:
        point = await actor.acquire("loader", "1", "checksum")
        assert point is not None and point.step == 1
        actor.committed[3] = layout.verify(_commit(layout, 3))
        actor._purge()                                      # 2 goes; 1 is leased, 3 is newest
        assert sorted(actor.committed) == [1, 3]
        await actor.release("loader")
        actor._purge()
        return sorted(actor.committed)

    assert asyncio.run(scenario()) == [3]
    assert sorted(layout.step_dirs()) == [3]


def test_acquire_skips_a_corrupt_latest_and_names_it(tmp_path: Path, caplog) -> None:
    layout = CheckpointLayout(tmp_path)
    _commit(layout, 1)
    (_commit(layout, 2) / "__0_0.distcp").write_bytes(b"y" * 1000)   # same size, other bytes
    actor = _actor(tmp_path, k=None)
    point = asyncio.run(actor.acquire("a", "latest", "checksum"))
    assert point is not None and point.step == 1
    assert "step 2" in caplog.text and "CRC-32" in caplog.text
    with pytest.raises(InvalidCheckpoint, match="no committed step 7"):
        asyncio.run(actor.acquire("b", "7", "size"))
    assert asyncio.run(actor.acquire("c", "none", "size")) is None


@pytest.mark.parametrize("by", ["number", "path"])
def test_a_corrupt_step_named_by_resume_is_refused_not_replaced_by_a_fresh_start(tmp_path: Path, by: str) -> None:
    layout = CheckpointLayout(tmp_path)
    for step in (2, 4, 6):
        _commit(layout, step)
    (layout.step_dir(6) / "__0_0.distcp").write_bytes(b"y" * 1000)   # same size, other bytes
    actor = _actor(tmp_path, k=None)
    resume = "6" if by == "number" else str(layout.step_dir(6))
    with pytest.raises(InvalidCheckpoint, match=rf"checkpoint.resume={resume}: .*does not verify .*CRC-32C.*"
                                                r"use latest for the newest valid one"):
        asyncio.run(actor.begin("attempt-0", resume, "checksum"))
    # nothing was moved aside: the older valid steps stay on their timeline
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == \
        ["step-00000002", "step-00000004", "step-00000006"]
    assert sorted(layout.valid_steps("checksum")) == [2, 4]
    assert actor.leases == {}


def test_a_damaged_step_skipped_on_resume_leaves_the_timeline_and_is_never_purged(tmp_path: Path) -> None:
    layout = CheckpointLayout(tmp_path)
    for step in (2, 4, 6):
        _commit(layout, step)
    (layout.step_dir(6) / "__0_0.distcp").write_bytes(b"y" * 1000)   # same size: only the checksum sees it
    actor = _actor(tmp_path, k=1)
    point = asyncio.run(actor.begin("attempt-0", "latest", "checksum"))
    assert point is not None and point.step == 4
    asyncio.run(actor.start_timeline(point.step, point.path, "latest"))
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("step-00000006.invalid-")]
    assert len(aside) == 1 and not layout.step_dir(6).exists()
    # a rebuilt actor (sizes only) no longer counts it, so retention of the new timeline cannot delete it
    rebuilt = _actor(tmp_path, k=1)
    assert sorted(rebuilt.committed) == [2, 4]
    _commit(layout, 8)
    rebuilt.steps.committed = layout.valid_steps("size")
    rebuilt._purge()
    assert sorted(layout.valid_steps("size")) == [8] and aside[0].is_dir()


def test_settle_aborts_a_step_that_a_rank_never_handed_off(tmp_path: Path) -> None:
    actor = _actor(tmp_path)

    async def scenario() -> dict:
        tmp = await actor.accepted(7, rank=0, attempt=0)     # rank 1 died before its hand-off
        assert Path(tmp).is_dir()
        await actor.settle(timeout_s=5)
        with pytest.raises(StepAborted):
            await actor.wait_committed(7, timeout_s=1)
        assert not Path(tmp).exists()
        return (await actor.status()).to_dict()

    status = asyncio.run(scenario())
    assert status["in_flight"] == [] and "never handed it off" in status["failed"][7]


@pytest.mark.parametrize("opened_first", [True, False])
def test_a_hand_off_after_the_save_was_aborted_is_refused(tmp_path: Path, opened_first: bool) -> None:
    """Rank 0's write of step 10 fails and it aborts the save; rank 1 hands its part off later.
    The save stays aborted (rank 1's final save must not wait for a rank that gave up); the
    next attempt saves step 10 again."""
    actor = _actor(tmp_path)

    async def scenario() -> None:
        if opened_first:
            await actor.accepted(10, rank=0, attempt=0)
        await actor.abort(10, "rank 0: disk full", attempt=0)
        with pytest.raises(StepAborted, match="step 10 was aborted: rank 0: disk full"):
            await actor.accepted(10, rank=1, attempt=0)
        with pytest.raises(StepAborted):
            await actor.wait_committed(10, timeout_s=1)
        assert (await actor.status()).to_dict()["in_flight"] == []
        assert Path(await actor.accepted(10, rank=0, attempt=1)).is_dir()

    asyncio.run(scenario())


def test_a_late_abort_of_a_committed_step_keeps_it_and_counts_no_failed_save(tmp_path: Path) -> None:
    """A rank whose writer stopped right after the commit (its answer to the rank lost) aborts the
    step when the writer is replaced: the step stays committed and on disk, and no failed save is
    reported for it; an abort of a step still in flight is recorded as before."""
    actor = _single_rank_actor(tmp_path, k=None)
    layout = CheckpointLayout(tmp_path)

    async def scenario() -> None:
        await _save(actor, 5)
        await actor.abort(5, "rank 0: The actor is temporarily unavailable: the actor was restarted", attempt=0)
        status = (await actor.status()).to_dict()
        assert status["committed"] == [5] and layout.step_dir(5).is_dir()
        assert status["failed"] == {} and status["failed_saves"]["total"] == 0, status
        await actor.accepted(10, 0, 0)
        await actor.abort(10, "rank 0: disk full", attempt=0)
        status = (await actor.status()).to_dict()
        assert status["failed_saves"]["total"] == 1 and status["failed_saves"]["last_step"] == 10, status

    asyncio.run(scenario())


def test_an_abort_while_the_commit_runs_waits_for_it_and_keeps_the_committed_step(tmp_path: Path,
                                                                                monkeypatch) -> None:
    """A rank's writer dies while the actor commits the step that writer's report completed (the
    rank then gives up on it): the abort must not remove the directory being committed nor count
    the step failed; the commit decides. The directory is renamed, then the commit is held while
    the abort arrives."""
    actor = _single_rank_actor(tmp_path, k=None)
    layout = CheckpointLayout(tmp_path)
    renamed, release = threading.Event(), threading.Event()
    real = CheckpointLayout.commit

    def held_commit(self, tmp, manifest):
        final = real(self, tmp, manifest)
        renamed.set()
        release.wait(30)
        return final

    monkeypatch.setattr(CheckpointLayout, "commit", held_commit)

    async def scenario() -> tuple[str, dict]:
        save = asyncio.create_task(_save(actor, 5))
        while not renamed.is_set():
            await asyncio.sleep(0.01)
        abort = asyncio.create_task(actor.abort(5, "rank 0: The actor died unexpectedly", attempt=0))
        await asyncio.sleep(0.2)
        assert not abort.done()                             # it waits for the commit's outcome
        release.set()
        outcome = await save
        await abort
        return outcome, (await actor.status()).to_dict()

    outcome, status = asyncio.run(scenario())
    assert outcome == "committed"
    assert status["committed"] == [5] and status["failed"] == {} and status["failed_saves"]["total"] == 0, status
    assert sorted(p.name for p in layout.step_dir(5).iterdir()) == [".metadata", "__0_0.distcp", "manifest.json"]
    assert sorted(layout.valid_steps("checksum")) == [5]


def test_a_leftover_unchanged_for_the_grace_period_is_removed_after_a_commit(tmp_path: Path) -> None:
    from raytrain_ckpt.checkpoint.storage.layout import LeftoverWatch

    actor = _single_rank_actor(tmp_path, k=None)
    clock = [0.0]
    actor.retainer.leftovers = LeftoverWatch(60.0, lambda: clock[0])
    # an aborted step's directory that a slow writer wrote into after the abort removed it
    leftover = tmp_path / "step-00000002.tmp-0a1b2c3d4e5f"
    leftover.mkdir()
    (leftover / "__0_0.distcp").write_bytes(b"late shard")

    async def scenario() -> None:
        await _save(actor, 1)                               # first sight
        clock[0] = 59.0
        await _save(actor, 3)                               # within the grace period: kept
        assert leftover.is_dir()
        clock[0] = 61.0
        await _save(actor, 4)                               # unchanged for 61s of the actor's clock

    asyncio.run(scenario())
    assert not leftover.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == \
        ["step-00000001", "step-00000003", "step-00000004"]


def test_shared_memory_staging_round_trip_through_a_second_mapping(tmp_path: Path) -> None:
    tensors = {"w": torch.randn(33, 7), "b": torch.arange(5, dtype=torch.int64), "h": torch.randn(4).half(),
               "empty": torch.zeros(0)}
    slots, nbytes = plan_slots(tensors)
    assert all(s.offset % 64 == 0 for s in slots)
    path = tmp_path / "buf"
    allocate_buffer(path, nbytes)
    staging = SharedMemoryStaging(map_buffer(path, nbytes), slots)
    done: list[bool] = []
    staging.start(tensors, lambda: done.append(True))
    staging.wait()
    staging.finish()                                          # the hand-off too
    assert done == [True]
    other = slot_views(map_buffer(path, nbytes), slots)      # what the writer process sees
    for k, v in tensors.items():
        assert torch.equal(other[k], v) and other[k].dtype == v.dtype
    tensors["w"].add_(1.0)                                    # the staged copy does not follow the live tensor
    assert not torch.equal(other["w"], tensors["w"])


def test_staging_error_reaches_the_training_thread(tmp_path: Path) -> None:
    tensors = {"w": torch.randn(4, 4)}
    slots, nbytes = plan_slots(tensors)
    allocate_buffer(tmp_path / "buf", nbytes)
    staging = SharedMemoryStaging(map_buffer(tmp_path / "buf", nbytes), slots)
    release = threading.Event()

    def boom() -> None:
        release.wait(10)
        raise RuntimeError("hand-off failed")

    staging.start(tensors, boom)
    staging.wait()  # the copy is done: the optimizer step does not wait for the hand-off
    assert staging._thread is not None and staging._thread.is_alive()
    release.set()
    with pytest.raises(RuntimeError, match="hand-off failed"):
        staging.finish()  # what the next save (or the end of the attempt) calls first

    def bad_copy(sources, midway) -> None:
        raise RuntimeError("copy failed")

    staging._copy = bad_copy
    staging.start(tensors, lambda: None)
    with pytest.raises(RuntimeError, match="copy failed"):
        staging.wait()
    assert staging._thread is None


def test_a_new_timeline_that_would_move_an_exported_step_aside_is_refused_and_moves_nothing(tmp_path: Path) -> None:
    from raytrain_ckpt.checkpoint.storage.leases import FileLease

    layout = CheckpointLayout(tmp_path)
    for step in (20, 40, 60):
        _commit(layout, step)
    actor = _actor(tmp_path, k=1)
    with FileLease(layout.root, 60):                     # an export reads step 60
        with pytest.raises(InvalidCheckpoint, match=r"checkpoint.resume=20: step\(s\) \[60\] are being exported"):
            asyncio.run(actor.begin("attempt-0", "20", "checksum"))
    point = asyncio.run(actor.begin("attempt-0", "40", "checksum"))
    with FileLease(layout.root, 60):                     # an export that started while the ranks loaded
        with pytest.raises(InvalidCheckpoint, match=r"step\(s\) \[60\] are being exported"):
            asyncio.run(actor.start_timeline(point.step, point.path, "40"))
        assert sorted(layout.step_dirs()) == [20, 40, 60]
    asyncio.run(actor.start_timeline(point.step, point.path, "40"))     # the export ended: 60 leaves the timeline
    assert sorted(layout.step_dirs()) == [20, 40]


def test_a_newer_certified_step_frees_the_one_kept_beside_keep_latest_k_at_once(tmp_path: Path) -> None:
    """keep_latest_k=1 plus the newest certified step: once a newer step is certified, the older
    certified step is deleted then, not after the next commit (which a full disk may never allow)."""
    actor = _single_rank_actor(tmp_path, k=1)
    layout = CheckpointLayout(tmp_path)

    async def scenario() -> None:
        await _save(actor, 2)
        await actor.certify(2)
        await _save(actor, 4)
        await _save(actor, 6)
        assert sorted(actor.steps.committed) == [2, 6]   # 2 kept for the guard, 4 gone by keep_latest_k
        await actor.certify(6)                           # no commit follows
        assert sorted(actor.steps.committed) == [6]
        assert not layout.step_dir(2).exists()

    asyncio.run(scenario())


def test_a_step_certified_that_never_committed_leaves_the_certified_step_before_it_kept(tmp_path: Path) -> None:
    """The guard certifies each step it saved once healthy steps followed; a save lost after it
    began (its write failed) never commits. Told that step, retention must still keep the newest
    certified step that did commit: it is what a rollback loads."""
    actor = _single_rank_actor(tmp_path, k=1)

    async def scenario() -> None:
        await _save(actor, 10)
        await actor.certify(10)
        await actor.accepted(20, 0, 0)
        await actor.abort(20, "rank 0: step 20 not written: [Errno 5] Input/output error")
        await actor.certify(20)                          # the guard's view: it does not know 20 was lost
        await _save(actor, 30)
        assert sorted(actor.steps.committed) == [10, 30], actor.steps.committed

    asyncio.run(scenario())


def test_a_late_failure_or_report_of_an_earlier_attempts_save_does_not_touch_the_next_attempts(tmp_path: Path) -> None:
    """Attempt 1's save of step 20 was aborted (settle) while its writer still wrote; attempt 2
    saves step 20 again. Attempt 1's late abort leaves attempt 2's save alone, and its late report
    is refused: a step committed from it would hold attempt 1's checksums over attempt 2's files."""
    actor = _single_rank_actor(tmp_path, k=None)

    async def scenario() -> None:
        await actor.accepted(20, 0, 1)
        await actor.abort(20, "the writer holding ranks [0] died or failed before they reported", attempt=1)
        await actor.accepted(20, 0, 2)
        await actor.abort(20, "rank 0: the trainer went away (attempt 1)", attempt=1)
        assert actor.steps.pending[20].attempt == 2 and actor.steps.pending[20].error is None
        with pytest.raises(StepAborted, match="attempt 1's save"):
            await actor.report(RankReport(20, 0, 1, "1.20", RankResults.of([]), {}))
        assert 20 in actor.steps.pending and 20 not in actor.steps.committed

    asyncio.run(scenario())


def test_a_new_timeline_forgets_what_was_certified_after_its_head(tmp_path: Path) -> None:
    """The guard certified 20; a rollback goes to 10 and the steps after it leave the timeline. The
    new timeline's own step 20 is not certified: retention keeps 10, the head, not the new 20."""
    actor = _single_rank_actor(tmp_path, k=2)

    async def scenario() -> None:
        for step in (10, 20):
            await _save(actor, step)
        await actor.certify(10)
        await actor.certify(20)
        point = await actor.acquire("rollback", "10", "size")
        await actor.start_timeline(point.step, point.path, "10")
        await actor.release("rollback")                   # loaded: only its certification keeps 10 now
        for step in (20, 30, 40):
            await _save(actor, step)
        assert sorted(actor.steps.committed) == [10, 30, 40], sorted(actor.steps.committed)

    asyncio.run(scenario())


def test_a_read_that_fails_once_does_not_drop_the_newest_step_from_the_resume_plan(tmp_path: Path, monkeypatch) -> None:
    """The resume plan's read of the newest step's ``.metadata`` fails once (an NFS ``EIO``): it is
    read again, and the run resumes from that step rather than skipping it (and the steps since)."""
    from raytrain_ckpt.checkpoint.roles import timeline

    actor = _single_rank_actor(tmp_path, k=None)
    for step in (10, 20):
        asyncio.run(_save(actor, step))
    fresh = CheckpointActor(str(tmp_path), RetentionPolicy(None))   # a restart: nothing checked yet
    asyncio.run(fresh.configure(GroupLayout(world_size=1, dp_size=1, spec_hash="h")))
    storage, failed = fresh.layout.storage, []
    real = storage.open_read

    def flaky(path):
        if str(path).endswith("step-00000020/.metadata") and not failed:
            failed.append(path)
            raise OSError(5, "Input/output error")
        return real(path)

    monkeypatch.setattr(storage, "open_read", flaky)
    monkeypatch.setattr(timeline, "UNREADABLE_RETRY_S", 0.01, raising=False)
    point = asyncio.run(fresh.acquire("restart", "latest", "checksum"))
    assert failed and point is not None and point.step == 20


def test_a_save_out_of_space_runs_retention_again(tmp_path: Path) -> None:
    actor = _single_rank_actor(tmp_path, k=1)
    layout = CheckpointLayout(tmp_path)

    async def scenario() -> None:
        await _save(actor, 2)
        await actor.certify(2)
        await _save(actor, 6)
        actor.retainer.told_certified.append(6)  # certified without a pass of retention since (a failed pass, say)
        await actor.abort(8, "rank 0: step 8 not written: write failed: [Errno 5] Input/output error")
        assert layout.step_dir(2).exists()               # another failure: nothing to free
        await actor.abort(8, "rank 0: step 8 not written: [Errno 28] No space left on device")
        assert sorted(actor.steps.committed) == [6] and not layout.step_dir(2).exists()

    asyncio.run(scenario())
