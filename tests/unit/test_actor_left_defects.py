"""The CheckpointActor across its own restarts and its threads, driven directly (no Ray) on real
files: the failed saves a restarted actor carries over (and a later run does not), a step skipped
on resume and committed again, and a retention pass racing a new timeline."""

from __future__ import annotations

import asyncio
import json
import pathlib
import pickle
import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest

from raytrain_ckpt.checkpoint.records import GroupLayout
from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor
from raytrain_ckpt.checkpoint.roles.service import CheckpointService
from raytrain_ckpt.checkpoint.roles.steps import FAILED_FILE, MAX_FAILED_BYTES, FailedSavesFile
from raytrain_ckpt.checkpoint.roles.summary import failed_saves_text
from raytrain_ckpt.common.events import WorkerResult
from raytrain_ckpt.control.preflight import load_spec
from raytrain_ckpt.observe import metrics
from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy
from tests.unit.test_checkpoint_actor import _save
from tests.unit.test_checkpoint_layout import _commit


RUN_KEY = "9a" * 32
"""The runs' secret (a driver makes one per run: the same here, so two run ids are told apart by id)."""


def _one_rank(root: Path | str, k: int | None = None, run_id: str | None = "run-a") -> CheckpointActor:
    actor = CheckpointActor(str(root), RetentionPolicy(k), run_id=run_id, seal_key=RUN_KEY if run_id else None)
    asyncio.run(actor.configure(GroupLayout(world_size=1, dp_size=1, spec_hash="h")))
    return actor


def _names(root: Path, part: str) -> list[str]:
    return sorted(p.name for p in root.iterdir() if part in p.name)


async def _fail(actor: CheckpointActor, step: int, why: str) -> None:
    await actor.accepted(step, 0, 0)
    await actor.abort(step, why, attempt=0)


def _job_end(started_unix: float, status) -> str | None:
    """What the driver's end check says of a job of 60 steps that finished, with save_final off and
    no save due at its last step: only the failed saves and this run's commits can fail it."""
    service = object.__new__(CheckpointService)   # the check alone: no Ray, no actor of its own
    service.spec = load_spec("jobs/llama_debug_fsdp.yaml", ["checkpoint.save_final=false",
                                                            "checkpoint.interval_steps=7"])
    service.started_unix = started_unix
    return service.unsaved([WorkerResult(rank=0, steps=60, tokens_seen=0, losses={}, fingerprint="")], status)


def test_a_restarted_actor_still_reports_the_runs_failed_saves_and_the_job_does_not_succeed(tmp_path: Path,
                                                                                           monkeypatch) -> None:
    """Every save of the run failed; then the actor restarted (Ray restarted it, or the driver moved
    it off a draining node). The new actor reports the failed saves, the metric says how many in a
    row, and the job's end check fails the job: it did not end SUCCEEDED with nothing saved."""
    started = time.time()
    first = _one_rank(tmp_path)
    asyncio.run(_fail(first, 10, "rank 0: [Errno 28] No space left on device"))
    asyncio.run(_fail(first, 20, "rank 0: [Errno 28] No space left on device"))
    before = asyncio.run(first.status())
    recorded: list[tuple[str, float]] = []
    monkeypatch.setattr(metrics, "record", lambda name, value, tags: recorded.append((name, value)))
    restarted = _one_rank(tmp_path)                     # the same run: Ray passes the same arguments
    assert [v for n, v in recorded if n == "checkpoint_consecutive_failed_saves"] == [2]
    status = asyncio.run(restarted.status())
    assert status.failed == before.failed and sorted(status.failed) == [10, 20]
    assert status.failed_saves == before.failed_saves
    assert (status.failed_saves.total, status.failed_saves.consecutive, status.failed_saves.last_step) == (2, 2, 20)
    assert "2 save(s) failed in a row" in failed_saves_text(status.to_dict())
    assert "no checkpoint of this run committed, 2 save(s) failed" in _job_end(started, status)
    # the restarted actor's next failure counts on from there
    asyncio.run(_fail(restarted, 30, "rank 0: disk full"))
    again = asyncio.run(_one_rank(tmp_path).status())
    assert (again.failed_saves.total, again.failed_saves.consecutive, sorted(again.failed)) == (3, 3, [10, 20, 30])


def test_a_commit_after_the_failures_ends_the_row_for_a_restarted_actor_and_saves_write_no_record(
        tmp_path: Path) -> None:
    """A commit after the failed saves: a restarted actor still counts them in all, none in a row,
    and the job ends well. A successful save writes no record of failures (nothing on its path)."""
    clean = tmp_path / "clean"
    assert asyncio.run(_save(_one_rank(clean), 5)) == "committed"
    assert not (clean / FAILED_FILE).exists()
    started = time.time()
    actor = _one_rank(tmp_path)
    asyncio.run(_fail(actor, 10, "rank 0: disk full"))
    assert (tmp_path / FAILED_FILE).is_file()
    recorded = (tmp_path / FAILED_FILE).read_bytes()
    assert asyncio.run(_save(actor, 20)) == "committed"
    assert (tmp_path / FAILED_FILE).read_bytes() == recorded       # the commit wrote nothing
    status = asyncio.run(_one_rank(tmp_path).status())
    assert (status.failed_saves.total, status.failed_saves.consecutive, status.failed) == \
        (1, 0, {10: "rank 0: disk full"})
    assert failed_saves_text(status.to_dict()) is None and _job_end(started, status) is None


def test_a_later_run_in_the_same_directory_does_not_inherit_the_failed_saves(tmp_path: Path) -> None:
    asyncio.run(_fail(_one_rank(tmp_path, run_id="run-a"), 10, "rank 0: disk full"))
    status = asyncio.run(_one_rank(tmp_path, run_id="run-b").status())
    assert status.failed == {} and status.failed_saves.total == 0
    # without a run id (an actor made outside a driver) nothing is read or written
    bare = _one_rank(tmp_path / "bare", run_id=None)
    asyncio.run(_fail(bare, 10, "rank 0: disk full"))
    assert not (tmp_path / "bare" / FAILED_FILE).exists()


def _record(**fields) -> bytes:
    value = {"version": 1, "run": "run-a", "total": 1, "consecutive": 1, "last_step": 10, "last_error": "x",
             "failed": {"10": "x"}, "newest_commit_unix": None}
    return json.dumps({**value, **fields}).encode()


@pytest.mark.parametrize("content", [
    pytest.param(b" " * MAX_FAILED_BYTES + _record(), id="too-large"),
    pytest.param(b"{\"version\": 1, \"run\": \"run-a\", \"tot", id="torn"),
    pytest.param(b"[" * 100_000 + b"]" * 100_000, id="deeply-nested"),
    pytest.param(b"\xff\xfe not utf-8", id="not-utf8"),
    pytest.param(_record(total=True), id="a-bool-count"),
    pytest.param(_record(total=-1), id="a-negative-count"),
    pytest.param(_record(consecutive=10**30), id="a-huge-count"),
    pytest.param(_record(failed={"-1": "x"}), id="a-negative-step"),
    pytest.param(_record(failed={"\u0661\u0662": "x"}), id="a-non-ascii-digit-step"),
    pytest.param(_record(failed={str(s): "x" for s in range(1000)}), id="too-many-steps"),
    pytest.param(_record(failed=["10"]), id="steps-not-a-map"),
    pytest.param(_record(last_error=5), id="a-reason-not-text"),
    pytest.param(_record().replace(b'"newest_commit_unix": null', b'"newest_commit_unix": NaN'), id="nan"),
    pytest.param(_record(version=2), id="another-version"),
    pytest.param(b"null", id="not-a-record"),
])
def test_a_damaged_or_hostile_record_of_failed_saves_is_logged_and_ignored(tmp_path: Path, caplog, content) -> None:
    # sealed with the run's key, as only an actor of the run could: what its parse refuses
    (tmp_path / FAILED_FILE).write_bytes(_sealed(tmp_path, content))
    status = asyncio.run(_one_rank(tmp_path).status())
    assert status.failed == {} and status.failed_saves.total == 0
    assert f"ignoring {tmp_path / FAILED_FILE}" in caplog.text


def _sealed(root: Path, body: bytes) -> bytes:
    return body + b"\n" + FailedSavesFile(CheckpointLayout(root), "run-a", bytes.fromhex(RUN_KEY))._mac(body).encode() + b"\n"


def test_a_record_of_the_run_that_its_actors_did_not_seal_is_not_taken(tmp_path: Path, caplog) -> None:
    """The run id is in the file, not a secret: a record with it, written by anyone without the
    run's key (a forged count, reasons with terminal escapes), is ignored; the same record sealed
    is taken, its reasons shown as one visible line."""
    forged = _record(total=7, consecutive=7, last_step=40, last_error="\x1b]0;pwned\x07\x1b[2Jfake",
                     failed={"40": "\x1b[31mforged"})
    (tmp_path / FAILED_FILE).write_bytes(forged + b"\n" + b"0" * 64 + b"\n")
    status = asyncio.run(_one_rank(tmp_path).status())
    assert status.failed == {} and status.failed_saves.total == 0
    assert "its seal does not hold" in caplog.text
    (tmp_path / FAILED_FILE).write_bytes(_sealed(tmp_path, forged))
    status = asyncio.run(_one_rank(tmp_path).status())
    assert status.failed_saves.total == 7 and "\x1b" not in status.failed[40] and "\x1b" not in (
        status.failed_saves.last_error or "")
    assert "\x1b" not in (failed_saves_text(status.to_dict()) or "x\x1b")


def test_a_pickle_in_place_of_the_record_is_never_unpickled_and_an_unwritable_record_is_not_fatal(
        tmp_path: Path, caplog) -> None:
    marker = tmp_path / "unpickled"
    (tmp_path / FAILED_FILE).write_bytes(pickle.dumps(_Touch(marker)))
    assert asyncio.run(_one_rank(tmp_path).status()).failed == {}
    assert not marker.exists() and f"ignoring {tmp_path / FAILED_FILE}" in caplog.text
    (tmp_path / FAILED_FILE).unlink()
    (tmp_path / FAILED_FILE).mkdir()                   # a real OSError when it is written
    actor = _one_rank(tmp_path)
    asyncio.run(_fail(actor, 10, "rank 0: disk full"))  # the failure is still counted, and the job goes on
    assert asyncio.run(actor.status()).failed_saves.total == 1
    assert "could not record the failed saves" in caplog.text


class _Touch:
    """Unpickled, it would create ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


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
    deadline = time.monotonic() + 2.0
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


def test_the_failed_saves_outlive_the_actor_on_an_object_store() -> None:
    """The record goes through the root's storage (one PUT on an object store), not a local file."""
    root = f"memory://ckpt-{uuid.uuid4().hex[:8]}/runs/job"
    asyncio.run(_fail(_one_rank(root), 10, "rank 0: SlowDown: please reduce your request rate"))
    layout = CheckpointLayout(root)
    assert layout.storage.is_file(f"{root}/{FAILED_FILE}")
    status = asyncio.run(_one_rank(root).status())
    assert status.failed == {10: "rank 0: SlowDown: please reduce your request rate"}
    assert status.failed_saves.consecutive == 1
    layout.storage.write_bytes(f"{root}/{FAILED_FILE}", b"{" * (MAX_FAILED_BYTES + 1))   # over the limit
    assert asyncio.run(_one_rank(root).status()).failed == {}


def test_a_fifo_planted_at_the_actors_own_files_neither_blocks_its_start_nor_is_read(tmp_path: Path) -> None:
    """``.group.json``, ``.failed-saves.json`` and ``.checked-sealed`` are opened without following a
    link and without blocking: a FIFO at each name (no writer: a blocking open never returns) is
    refused as not a file of ours, and the actor starts at once."""
    import os

    from raytrain_ckpt.checkpoint.roles.actor import GROUP_FILE
    from raytrain_ckpt.checkpoint.roles.seals import SEALS_FILE

    for name in (GROUP_FILE, FAILED_FILE, SEALS_FILE):
        os.mkfifo(tmp_path / name)
    started: list[CheckpointActor] = []
    t = threading.Thread(target=lambda: started.append(_one_rank(tmp_path)), daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the actor's start blocked on a FIFO"
    assert started and asyncio.run(started[0].status()).failed == {}
    # a FIFO renamed over the name between its check and its open: the open itself refuses it
    from raytrain_ckpt.checkpoint.errors import NotOwnFile
    from raytrain_ckpt.checkpoint.storage.posix import read_small_file

    layout = CheckpointLayout(tmp_path)
    for name in (GROUP_FILE, FAILED_FILE, SEALS_FILE):
        (tmp_path / name).unlink()  # (configure() put a file of its own at .group.json)
        os.mkfifo(tmp_path / name)
        with pytest.raises(NotOwnFile, match="not a regular file"):
            read_small_file(layout.storage, tmp_path / name, 1024)


def test_a_small_root_file_over_its_limit_is_refused_by_the_read_itself(tmp_path):
    """``read_small_file`` refuses a file longer than its limit (on POSIX and from an object
    store), so no caller can take a truncated prefix for the file."""
    from raytrain_ckpt.checkpoint.storage.backends import open_storage
    from raytrain_ckpt.checkpoint.storage.posix import read_small_file

    for root in (str(tmp_path), "memory://rtc-small-file-test"):
        storage = open_storage(root)
        storage.makedirs(root)
        path = storage.join(root, "f.json")
        storage.write_bytes(path, b"x" * 64)
        assert read_small_file(storage, path, 64) == b"x" * 64
        with pytest.raises(ValueError, match="over the 63 bytes"):
            read_small_file(storage, path, 63)
