"""The CheckpointActor across its own restarts and its threads, driven directly (no Ray) on real
files: the failed saves a restarted actor carries over (and a later run does not), a step skipped
on resume and committed again, and a retention pass racing a new timeline."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from raytrain_ckpt.checkpoint.records import GroupLayout
from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy
from tests.unit.test_checkpoint_actor import _save
from tests.unit.test_checkpoint_layout import _commit


def _one_rank(root: Path, k: int | None = None, run_id: str | None = "run-a") -> CheckpointActor:
    actor = CheckpointActor(str(root), RetentionPolicy(k))
    asyncio.run(actor.configure(GroupLayout(world_size=1, dp_size=1, spec_hash="h")))
    return actor


def _names(root: Path, part: str) -> list[str]:
    return sorted(p.name for p in root.iterdir() if part in p.name)


def test_a_step_skipped_on_resume_and_committed_again_is_not_set_aside_by_a_later_rollback(tmp_path: Path) -> None:
    """A restart skips damaged step 60 (resuming from 40); training saves step 60 again, and it
    commits, intact. A rollback to 40 later moves the new step 60 off the timeline as abandoned
    (kept, intact), not as invalid: it was never damaged, and the start must not fail."""
    layout = CheckpointLayout(tmp_path)
    for step in (20, 40, 60):
        _commit(layout, step)
    (layout.step_dir(60) / "__0_0.distcp").write_bytes(b"y" * 1000)   # same size: only the checksum sees it
    actor = _one_rank(tmp_path)

    async def scenario() -> None:
        point = await actor.acquire("attempt-1", "latest", "checksum")   # a restart: no new timeline
        assert point is not None and point.step == 40
        assert await _save(actor, 60, attempt=1) == "committed"
        await actor.start_timeline(40, str(layout.step_dir(40)), "rollback to step 40")

    asyncio.run(scenario())
    assert sorted(actor.committed) == [20, 40]
    abandoned = _names(tmp_path, ".abandoned-")
    assert [n[:13] for n in abandoned] == ["step-00000060"]
    again = CheckpointLayout(tmp_path / "again")       # the new save, intact: it verifies under its own name
    shutil.copytree(tmp_path / abandoned[0], again.step_dir(60))
    assert again.verify(again.step_dir(60), "checksum").step == 60
    # only the damaged save of step 60 (moved aside when the new one committed) is called invalid
    invalid = _names(tmp_path, "step-00000060.invalid-")
    assert len(invalid) == 1 and (tmp_path / invalid[0] / "__0_0.distcp").read_bytes() == b"y" * 1000


def test_a_retention_pass_racing_a_new_timeline_neither_fails_nor_counts_an_error(tmp_path: Path) -> None:
    """Retention runs on a thread after each commit; a new timeline moves steps aside on another.
    Both forget steps from the registry: neither may fail (a KeyError failed the start of the
    timeline, or counted a retention error) and every step moved aside leaves the registry."""
    root, made = tmp_path / "job", CheckpointLayout(tmp_path / "made")
    layout = CheckpointLayout(root)
    actor = _one_rank(root)
    stop, errors = threading.Event(), []

    def retention() -> None:
        while not stop.is_set():
            actor.retainer.purge()

    passes = threading.Thread(target=retention)
    passes.start()
    deadline = time.monotonic() + 3.0
    try:
        rounds = 0
        while time.monotonic() < deadline and not errors:
            for step in range(1, 25):   # committed elsewhere and moved in whole: the pass sees no temporary
                _commit(made, step).rename(layout.step_dir(step))
                actor.committed[step] = layout.verify(layout.step_dir(step))
            try:
                asyncio.run(actor.start_timeline(None, None, "none"))   # a fresh start: every step aside
            except Exception as exc:  # noqa: BLE001 - what the test looks for
                errors.append(exc)
            assert actor.committed == {} or errors
            rounds += 1
    finally:
        stop.set()
        passes.join()
    assert errors == [] and actor.purge_errors == 0, (errors, actor.purge_errors, rounds)
    assert not any(p.name.startswith("step-") and "." not in p.name for p in root.iterdir())
