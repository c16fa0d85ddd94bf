"""Review findings on this round's changes: each test fails on the code before its fix."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy
from raytrain_ckpt.checkpoint.records import GroupLayout
from raytrain_ckpt.checkpoint.roles.actor import GROUP_FILE, CheckpointActor
from raytrain_ckpt.checkpoint.roles.steps import MAX_FAILED_BYTES, FailedSavesFile, SaveFailures
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout

RUN_KEY = "9a" * 32


@pytest.mark.parametrize("content", [
    '{"world_size": Infinity, "dp_size": 1, "spec_hash": "h"}',   # int(inf): OverflowError
    '{"world_size": 1e999, "dp_size": 1, "spec_hash": "h"}',      # the same, spelled as a number
    "[" * 100_000,                                                # RecursionError in the JSON decoder
])
def test_a_hostile_group_file_does_not_stop_the_actor_from_starting(tmp_path: Path, content: str) -> None:
    """``.group.json`` lies in the shared root and is not sealed: anything planted there must be
    ignored (logged), as ``GroupFile.read`` intends ("unreadable: the next configure() rewrites it"),
    not raise out of the constructor (Ray restarts the actor forever, the job never starts)."""
    (tmp_path / GROUP_FILE).write_text(content)
    actor = CheckpointActor(str(tmp_path), RetentionPolicy(None))
    assert actor.group == GroupLayout()


@pytest.mark.parametrize("reason", [
    "OSError: [Errno 28] デバイスに空き領域がありません: '/ckpt/" + "ジョブ" * 300 + "'",  # non-ASCII: 6 bytes a char
])
def test_the_runs_own_record_of_32_failed_saves_is_read_back(tmp_path: Path, reason: str) -> None:
    """The record an actor writes must fit the bound its restarted successor reads it under: with
    32 failed saves whose reasons JSON escapes (ensure_ascii), the body outgrows MAX_FAILED_BYTES
    and the restarted actor drops every failure of the run (the job's end check then passes)."""
    record = FailedSavesFile(CheckpointLayout(tmp_path), "run-a", bytes.fromhex(RUN_KEY))
    saves, failed = SaveFailures(), {}
    for step in range(40):
        saves.failed(step, reason)
        failed[step] = reason
    data = record.record(saves, failed, None)
    (tmp_path / ".failed-saves.json").write_bytes(data)
    back = record.read({})
    assert back is not None, f"record of {len(data)} bytes not read back (limit {MAX_FAILED_BYTES})"
    carried, steps = back
    assert carried.total == 40 and carried.consecutive == 40 and carried.last_step == 39
    assert steps and max(steps) == 39


def test_a_fifo_or_a_link_in_the_lease_directory_neither_hangs_retention_nor_is_read(tmp_path: Path) -> None:
    """``<root>/leases/*.json`` is read by every retention pass (after each commit, holding the
    retainer's one_pass lock and the root's lease lock; ``report`` awaits it) with a plain
    ``read_bytes``: a FIFO planted there blocks the open forever (the committing rank's report
    never returns, the new timeline waits on the lock), and a link to /dev/zero reads without bound.
    Lease files are written by replace (a regular file of one name): read them like the actor's
    other root files (``read_small_file``)."""
    import os
    import threading

    from raytrain_ckpt.checkpoint.storage.leases import LEASE_DIR

    actor = CheckpointActor(str(tmp_path), RetentionPolicy(1))
    (tmp_path / LEASE_DIR).mkdir(exist_ok=True)
    os.mkfifo(tmp_path / LEASE_DIR / "export-planted.json")
    done: list[bool] = []
    t = threading.Thread(target=lambda: (actor.retainer.purge(), done.append(True)), daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():  # unblock the test process's thread (a writer opens the FIFO; it reads EOF)
        fd = os.open(tmp_path / LEASE_DIR / "export-planted.json", os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(10)
        pytest.fail("a retention pass blocked on a FIFO planted in the lease directory")
    assert done and actor.purge_errors == 0
    # a link to a file outside the root (here: a large file) is not followed either
    big = tmp_path.parent / f"{tmp_path.name}-big"
    big.write_bytes(b'{"step": 5, "beat": 0}' + b" " * (8 << 20))
    (tmp_path / LEASE_DIR / "export-planted.json").unlink()
    (tmp_path / LEASE_DIR / "export-link.json").symlink_to(big)
    assert actor.retainer.file_leased_steps() == set()


@pytest.mark.parametrize("content", ['{"step": Infinity, "beat": 0}', "[" * 4000])
def test_a_garbage_lease_file_is_skipped_not_a_retention_error(tmp_path: Path, content: str) -> None:
    """A lease file whose step is Infinity (int(): OverflowError) or that nests past the JSON
    decoder's depth (RecursionError) fails every retention pass (counted, nothing deleted, the disk
    fills) instead of being skipped as the garbage it is."""
    from raytrain_ckpt.checkpoint.storage.leases import LEASE_DIR

    actor = CheckpointActor(str(tmp_path), RetentionPolicy(1))
    (tmp_path / LEASE_DIR).mkdir(exist_ok=True)
    (tmp_path / LEASE_DIR / "export-planted.json").write_text(content)
    actor.retainer.purge()
    assert actor.purge_errors == 0


def test_a_restarted_actor_does_not_take_a_group_layout_its_run_never_configured(tmp_path: Path) -> None:
    """``.group.json`` is the only root file a restarted actor trusts without a seal (the failed
    saves and the sealed checks carry the run's HMAC). A layout planted there (world_size 1 where
    the run configured 2) makes the restarted actor commit a save of the 2-rank group on one rank's
    report: a step whose .metadata names files it does not hold counts as a commit, ends the row of
    failed saves and lets retention delete intact steps."""
    import json

    from raytrain_ckpt.checkpoint.errors import StepAborted
    from tests.unit.test_checkpoint_actor import _save

    run = CheckpointActor(str(tmp_path), RetentionPolicy(None), run_id="run-a", seal_key=RUN_KEY)
    asyncio.run(run.configure(GroupLayout(world_size=2, dp_size=2, spec_hash="h")))
    # a restart of the run's actor reads back the layout the run configured
    assert CheckpointActor(str(tmp_path), RetentionPolicy(None), run_id="run-a", seal_key=RUN_KEY).world_size == 2
    (tmp_path / GROUP_FILE).write_text(json.dumps({"world_size": 1, "dp_size": 1, "spec_hash": "h"}))
    restarted = CheckpointActor(str(tmp_path), RetentionPolicy(None), run_id="run-a", seal_key=RUN_KEY)
    try:
        out = asyncio.run(_save(restarted, 5))  # rank 0 of the 2-rank group saves alone
    except (StepAborted, asyncio.TimeoutError):
        out = "aborted"
    assert out != "committed" and 5 not in restarted.committed


def test_a_job_record_planted_in_the_root_prints_as_one_visible_line_and_a_link_there_is_not_read(tmp_path: Path) -> None:
    """``status DIR`` reads ``.job.json`` from the root, which anyone who can write the root could
    have made: its fields' escape sequences print escaped, and a link planted at its name (to a file
    the user can read, but the root's writer cannot) is not followed."""
    from raytrain_ckpt.report import jobrecord
    from raytrain_ckpt.report.inventory import ending_line

    record = jobrecord.started("j\x1b]0;pwned\x07", str(tmp_path))
    record |= {"error": "boom\x1b[2J\nfake line", "job_info": {"state": "FAILED\x1b[31m"}}
    (tmp_path / jobrecord.RECORD).write_text(json.dumps(record))
    line = ending_line(jobrecord.read_root(str(tmp_path)))
    assert line.isprintable() and "\\x1b]0;pwned" in line and "\\nfake line" in line, line
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps(jobrecord.started("private", "/elsewhere")))
    (tmp_path / jobrecord.RECORD).unlink()
    (tmp_path / jobrecord.RECORD).symlink_to(secret)
    assert jobrecord.read_root(str(tmp_path)) is None
