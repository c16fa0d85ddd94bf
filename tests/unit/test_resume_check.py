"""A committed step is checked as a restart's resume plan checks it, right after the commit
(``roles/resumecheck.py``): real saves through the CheckpointActor, real DCP files, the real reader
process. The resume plan that follows decodes nothing, and a step the check refuses is said at the
commit, with the reason the resume plan then gives for skipping it.

The scan cache's disk part is off and its memory emptied in each test, so the only verdict a resume
plan can find is one this process made.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import zlib
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from raytrain_ckpt.checkpoint.format.rankresults import RankResults
from raytrain_ckpt.checkpoint.format.plannumbers import own_central
from raytrain_ckpt.checkpoint.format import sandbox, scancache
from raytrain_ckpt.checkpoint.format.manifest import describe_file
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy
from raytrain_ckpt.checkpoint.records import GroupLayout, RankReport
from raytrain_ckpt.checkpoint.roles import resumecheck
from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor


@pytest.fixture
def decodes(monkeypatch) -> list[str]:
    """The names of the files the reader process is asked to decode from now on (the real
    decode still runs); no verdict of an earlier test or command is found."""
    monkeypatch.setenv(scancache.CACHE_ENV, "0")
    scancache.forget()
    asked: list[str] = []
    real = sandbox.decode_in_sandbox

    def counted(kind, data, where, *args, **kwargs):
        asked.append(where)
        return real(kind, data, where, *args, **kwargs)

    monkeypatch.setattr(sandbox, "decode_in_sandbox", counted)
    return asked


def _actor(root: Path) -> CheckpointActor:
    actor = CheckpointActor(str(root), RetentionPolicy(None))
    asyncio.run(actor.configure(GroupLayout(world_size=1, dp_size=1, spec_hash="h")))
    return actor


def _save(actor: CheckpointActor, step: int, cut: int = 0, plans: dict | None = None) -> str:
    """One real save of a single-rank group; ``cut`` bytes are lost from the end of its data file
    before the writer reports it (the manifest then records the shorter file: every file is
    intact by its checksum, but the tensor chunks run past the end). With ``plans``, the plan made
    for an earlier save is kept there and saved with again, as a trainer does."""

    async def save() -> str:
        state = {"w": torch.arange(4096.0) + step, "step": step}
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, is_coordinator=True)
        local = planner.create_local_plan()
        central = (plans or {}).get("central") or await actor.plan(0, step, 0, local, timeout_s=5)
        if plans is not None:
            plans["central"] = central
        plan = planner.finish_plan(own_central(central.plan, local))
        tmp = Path(await actor.accepted(step, 0, 0))
        writer = FileSystemWriter(tmp, sync_files=False)
        writer.set_up_storage_writer(False, rank=0)
        results = writer.write_data(plan, planner).wait()
        for p in tmp.glob("*.distcp"):
            os.truncate(p, p.stat().st_size - cut)
        files = {p.name: {"size": p.stat().st_size, "crc32": zlib.crc32(p.read_bytes())} for p in tmp.iterdir()}
        return await actor.report(RankReport(step, 0, 0, central.plan_id, RankResults.of(results), files))

    return asyncio.run(save())


def test_the_resume_plan_after_a_commit_decodes_nothing(tmp_path: Path, decodes: list[str]) -> None:
    actor = _actor(tmp_path)
    assert _save(actor, 5) == "committed"
    assert actor.resume_check.wait(60)
    assert actor.resume_check.passed == [5] and not actor.resume_check.refused
    assert decodes == [str(actor.layout.step_dir(5) / ".metadata")]  # the check, once
    point = asyncio.run(actor.acquire("attempt-1", "latest", "size"))
    assert point is not None and point.step == 5
    assert len(decodes) == 1  # the resume plan found the check's verdict
    # What the verdict saved: the same resume plan where no check ran (a new process) decodes.
    scancache.forget()
    assert asyncio.run(actor.acquire("attempt-2", "latest", "size")).step == 5
    assert len(decodes) == 2


def test_a_step_a_restart_would_not_resume_from_is_said_at_its_commit(tmp_path: Path, decodes: list[str],
                                                                      caplog) -> None:
    actor = _actor(tmp_path)
    assert _save(actor, 5) == "committed"
    assert actor.resume_check.wait(60)
    with caplog.at_level(logging.WARNING):
        assert _save(actor, 6, cut=100) == "committed"
        assert actor.resume_check.wait(60)
    reason = actor.resume_check.refused[6]
    assert "past the end of __0_0.distcp" in reason, reason
    assert "step 6 is committed" in caplog.text and "would not resume from it" in caplog.text
    assert reason in caplog.text
    assert 6 in actor.committed  # said, not deleted: retention alone removes committed steps
    # The resume plan agrees: it skips step 6 for the same reason and resumes from step 5.
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        point = asyncio.run(actor.acquire("attempt-1", "latest", "size"))
    assert point is not None and point.step == 5
    assert "not resuming from step 6" in caplog.text and reason in caplog.text


def test_a_save_with_the_last_steps_metadata_is_not_decoded_again(tmp_path: Path, decodes: list[str]) -> None:
    actor, plans = _actor(tmp_path), {}
    assert _save(actor, 5, plans=plans) == "committed"
    assert actor.resume_check.wait(60)
    # Step 6 holds the same results (the same byte items: a one-digit step), so the coordinator
    # copies step 5's .metadata; it is checked by its manifest entry, not decoded again.
    assert _save(actor, 6, plans=plans) == "committed"
    assert actor.resume_check.wait(60)
    assert actor.coordinator.repeats.reused == 1
    assert actor.resume_check.passed == [5, 6] and len(decodes) == 1
    assert asyncio.run(actor.acquire("attempt-1", "latest", "size")).step == 6
    assert len(decodes) == 1


def test_a_thread_that_cannot_start_leaves_the_check_ready_for_the_next_commit(tmp_path: Path, decodes: list[str],
                                                                                 monkeypatch, caplog) -> None:
    actor = _actor(tmp_path)
    with monkeypatch.context() as m:
        # The commit's own work runs on the event loop's executor threads: only the check's start fails.
        def refuse(self):
            raise RuntimeError("can't start new thread")

        m.setattr(resumecheck.threading.Thread, "start", refuse)
        with caplog.at_level(logging.WARNING):
            actor.resume_check.committed(5)
    assert "step 5 is not checked ahead of a restart" in caplog.text
    assert actor.resume_check.wait(0)  # idle again: a restart does not wait for a check that never ran
    assert _save(actor, 6) == "committed"
    assert actor.resume_check.wait(60) and actor.resume_check.passed == [6]


def test_a_step_retention_takes_away_while_it_is_checked_is_not_called_unresumable(tmp_path: Path,
                                                                                    decodes: list[str],
                                                                                    caplog) -> None:
    actor = _actor(tmp_path)
    assert _save(actor, 5) == "committed"
    assert actor.resume_check.wait(60)
    # Retention renames a step out of its place first and forgets it after: the check reads in between.
    step = actor.layout.step_dir(5)
    os.rename(step, tmp_path / ".tmp-deleting")
    with caplog.at_level(logging.WARNING):
        actor.resume_check._last_pass = None
        actor.resume_check._check(5)
    assert 5 not in actor.resume_check.refused and "would not resume" not in caplog.text
    # The same read of a step still in its place is a refusal (the check is not simply silenced).
    os.rename(tmp_path / ".tmp-deleting", step)
    (step / ".metadata").unlink()
    with caplog.at_level(logging.WARNING):
        actor.resume_check._check(5)
    assert "unreadable" in actor.resume_check.refused[5] and "step 5 is committed" in caplog.text


def test_a_step_a_restart_would_not_resume_from_is_in_the_status_and_its_texts(tmp_path: Path,
                                                                              decodes: list[str]) -> None:
    """The refusal is not only a log line: ``status`` (the actor's ``ActorStatus`` and its JSON view,
    ``JobResult.checkpoints``) names the step and why, and so do the job's end warning and
    ``status --job``; a step retention removed since is no longer named."""
    from raytrain_ckpt.checkpoint.roles.summary import resume_refused_text

    actor = _actor(tmp_path)
    assert _save(actor, 5) == "committed"
    assert actor.resume_check.wait(60)
    assert asyncio.run(actor.status()).resume_refused == {}
    assert resume_refused_text(asyncio.run(actor.status()).to_dict()) is None
    assert _save(actor, 6, cut=100) == "committed"
    assert actor.resume_check.wait(60)
    status = asyncio.run(actor.status())
    assert list(status.resume_refused) == [6] and "past the end of __0_0.distcp" in status.resume_refused[6]
    as_json = status.to_dict()
    assert as_json["resume_refused"] == {6: status.resume_refused[6]}
    text = resume_refused_text(as_json)
    assert text is not None and text.startswith("a restart would not resume from step 6: ")
    assert resume_refused_text({"resume_refused": {str(k): v for k, v in as_json["resume_refused"].items()}}) == text
    del actor.committed[6]  # (gone from the registry, as retention leaves it)
    assert asyncio.run(actor.status()).resume_refused == {}


def _sealed_actor(root: Path, key: str) -> CheckpointActor:
    actor = CheckpointActor(str(root), RetentionPolicy(None), seal_key=key)
    asyncio.run(actor.configure(GroupLayout(world_size=1, dp_size=1, spec_hash="h")))
    return actor


def test_an_actor_of_the_same_run_started_elsewhere_takes_the_sealed_check_and_no_one_else_does(
        tmp_path: Path, decodes: list[str]) -> None:
    """Ray restarts a crashed actor on any node (a process that has checked nothing, no user cache
    there): with the run's seal key it takes the check its predecessor sealed and the resume plan
    decodes nothing; an actor with another key (another run), a forged or altered line, and a
    ``.metadata`` changed since the check all mean the check runs, as before."""
    from raytrain_ckpt.checkpoint.format import sandbox

    real = sandbox.submit_decodes  # (an actor's start checks its steps in a batch: counted too)
    sandbox.submit_decodes = lambda kind, jobs, *a, **k: (decodes.extend(w for _, w, _ in jobs),
                                                          real(kind, jobs, *a, **k))[1]
    try:
        _sealed_checks_taken_by_the_run_only(tmp_path, decodes)
    finally:
        sandbox.submit_decodes = real


def _sealed_checks_taken_by_the_run_only(tmp_path: Path, decodes: list[str]) -> None:
    from raytrain_ckpt.checkpoint.roles.seals import SEALS_FILE

    run, other = "ab" * 32, "cd" * 32
    first = _sealed_actor(tmp_path, run)
    assert _save(first, 5) == "committed"
    assert first.resume_check.wait(60) and first.resume_check.passed == [5]
    assert len(decodes) == 1
    sealed = (tmp_path / SEALS_FILE).read_text()
    assert len(sealed.splitlines()) == 2  # the check's key and the decode's
    scancache.forget()  # a new process on another node
    again = _sealed_actor(tmp_path, run)
    assert asyncio.run(again.acquire("attempt-1", "latest", "size")).step == 5
    assert len(decodes) == 1  # taken from the seal: not decoded
    scancache.forget()
    stranger = _sealed_actor(tmp_path, other)
    assert asyncio.run(stranger.acquire("attempt-2", "latest", "size")).step == 5
    assert len(decodes) == 2  # another run's key: checked itself
    scancache.forget()  # a line written by someone without the key: ignored
    lines = sealed.splitlines()
    forged = [f"{line.split()[0]} {'0' * 64}" for line in lines]
    (tmp_path / SEALS_FILE).write_text("\n".join(forged) + "\n")
    assert asyncio.run(_sealed_actor(tmp_path, run).acquire("attempt-3", "latest", "size")).step == 5
    assert len(decodes) == 3
    # the bytes changed after the seal (same size, intact by the manifest's sizes): another key
    (tmp_path / SEALS_FILE).write_text(sealed)
    scancache.forget()
    step = first.layout.step_dir(5)
    data = bytearray((step / ".metadata").read_bytes())
    at = data.index(b"step")  # a key of the saved state: the same length, another name
    data[at:at + 4] = b"stEp"
    (step / ".metadata").write_bytes(bytes(data))
    manifest = json.loads((step / "manifest.json").read_text())  # and its manifest entry made to agree
    manifest["files"][".metadata"] = describe_file(step / ".metadata")
    (step / "manifest.json").write_text(json.dumps(manifest))
    assert asyncio.run(_sealed_actor(tmp_path, run).acquire("attempt-4", "latest", "size")).step == 5
    assert len(decodes) == 4  # other bytes: checked, not taken from the seal


def test_a_seal_whose_write_failed_is_written_when_the_same_check_passes_again(tmp_path: Path) -> None:
    from raytrain_ckpt.checkpoint.roles.seals import SEALS_FILE, SealedChecks
    from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout

    layout = CheckpointLayout(tmp_path)
    seals, keys = SealedChecks(layout, b"k" * 32), ["a" * 64, "b" * 64]
    (tmp_path / SEALS_FILE).mkdir()  # a real failure of the write
    seals.add(keys)
    (tmp_path / SEALS_FILE).rmdir()
    seals.add(keys)
    assert [line.split()[0] for line in (tmp_path / SEALS_FILE).read_text().splitlines()] == keys
    scancache.forget()
    assert SealedChecks(layout, b"k" * 32).load() == 2 and all(scancache.passed_before(k) for k in keys)
    assert SealedChecks(layout, b"x" * 32).load() == 0
