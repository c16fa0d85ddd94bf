"""The CheckpointActor across its own restarts and its threads, driven directly (no Ray) on real
files: a retention pass racing a new timeline."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from raytrain_ckpt.checkpoint.records import GroupLayout
from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy
from tests.unit.test_checkpoint_layout import _commit


def _one_rank(root: Path, k: int | None = None, run_id: str | None = "run-a") -> CheckpointActor:
    actor = CheckpointActor(str(root), RetentionPolicy(k))
    asyncio.run(actor.configure(GroupLayout(world_size=1, dp_size=1, spec_hash="h")))
    return actor


def _names(root: Path, part: str) -> list[str]:
    return sorted(p.name for p in root.iterdir() if part in p.name)


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
