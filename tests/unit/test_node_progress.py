"""Progress read one node at a time (``rank/progress.py``): a rank's file says what its
``progress()`` says, and whatever a file cannot say is left for the rank itself to answer."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from raytrain_ckpt.rank import progress as nodeprogress
from raytrain_ckpt.common.events import Progress
from raytrain_ckpt.rank.progress import ProgressFile, PublishedProgress, node_batches, read_node


@pytest.fixture(autouse=True)
def _own_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nodeprogress, "_dir", lambda: tmp_path / "progress")


class _Rank(PublishedProgress):
    """What TrainWorker does with its progress: assigns ``_progress`` and ``_rollbacks``."""

    def __init__(self, run: str, attempt: int, rank: int) -> None:
        self._progress_file = ProgressFile(run, attempt, rank)
        self._progress = Progress(rank, 0, None, time.time(), "setup")
        self._rollbacks = ()


RUN_A, RUN_B = "a" * 32, "b" * 32
"""Two runs' identities (the driver mints one per run: ``uuid4().hex``)."""


def test_every_change_of_a_ranks_progress_is_what_its_node_reads() -> None:
    ranks = [_Rank(RUN_A, 3, r) for r in range(4)]
    ranks[2]._progress = Progress(2, 17, 1.25, 123.0, "saving", stall_s=0.5, eval_s=0.25, step_started_at=120.0,
                                 step_s=2.5)
    answer = read_node(RUN_A, 3, [0, 1, 2, 3])
    assert answer.ask == []
    assert answer.progress == {r._progress.rank: r._progress for r in ranks}
    assert answer.progress[2] == Progress(2, 17, 1.25, 123.0, "saving", stall_s=0.5, eval_s=0.25, step_started_at=120.0,
                                        step_s=2.5)


def test_what_a_file_cannot_say_is_asked_of_the_rank(tmp_path: Path) -> None:
    _Rank(RUN_A, 1, 0)
    _Rank(RUN_A, 0, 1)  # an earlier attempt's file
    with_rollbacks = _Rank(RUN_A, 1, 2)
    with_rollbacks._rollbacks = ("a rollback record",)  # the records stay with the rank
    gone = _Rank(RUN_A, 1, 3)
    path = gone._progress_file.path
    path.write_text(path.read_text().replace(f'"pid": {os.getpid()}', '"pid": 999999999'))  # an exited process
    (tmp_path / "progress" / f"{RUN_A}.rank5.json").write_text('{"attempt": 1, "rank": 5}')  # another shape
    (tmp_path / "progress" / f"{RUN_A}.rank6.json").write_text('[1, 2]')
    answer = read_node(RUN_A, 1, [0, 1, 2, 3, 4, 5, 6])  # rank 4 never wrote one
    assert sorted(answer.progress) == [0]
    assert answer.ask == [1, 2, 3, 4, 5, 6]


def test_an_evicted_ranks_deadline_reaches_its_nodes_file() -> None:
    class _Evicted(_Rank):
        evicted_until: float | None = None

        def _shown(self) -> Progress:
            from dataclasses import replace
            return replace(self._progress, evicted_until=self.evicted_until)

    rank = _Evicted(RUN_A, 0, 0)
    rank.evicted_until = 1234.5           # SIGTERM: the training thread's next change writes it
    rank._progress = Progress(0, 8, None, time.time(), "saving")
    assert read_node(RUN_A, 0, [0]).progress[0].evicted_until == 1234.5


@pytest.mark.parametrize("end", ["done", "preempted"])
def test_a_run_that_ended_leaves_no_file_and_is_asked_of_the_rank(tmp_path: Path, end: str) -> None:
    """"preempted": the rank stopped on a drain notice or a SIGTERM (`ray job stop`), its step saved."""
    done, failed = _Rank(RUN_A, 0, 0), _Rank(RUN_A, 0, 1)
    done._progress = Progress(0, 20, 1.0, time.time(), end)
    assert read_node(RUN_A, 0, [0, 1]).ask == [0]
    failed._progress = Progress(1, 7, None, time.time(), "failed")
    assert read_node(RUN_A, 0, [0, 1]).ask == [0, 1]
    assert not (tmp_path / "progress").exists()  # nothing of the job left in shared memory
    _Rank(RUN_A, 1, 0)                            # a kept process's next attempt writes again
    assert sorted(read_node(RUN_A, 1, [0]).progress) == [0]


def test_ranks_are_asked_per_node_or_one_by_one_when_nodes_are_unknown() -> None:
    assert node_batches([0, 1, 2, 3, 5], ["a", "b", "a", "b", "a", "c"]) == [[0, 2], [1, 3], [5]]
    assert node_batches([0, 1, 2], []) == [[0], [1], [2]]


def _worker(monkeypatch: pytest.MonkeyPatch, name: str, run_id: str):
    """A TrainWorker assigned rank 0 of attempt 0 of ``run_id`` as the driver does, without the
    process-wide setup of a Ray actor (logging, torch threads, metrics, imports ahead)."""
    from raytrain_ckpt.rank import worker as worker_module
    from raytrain_ckpt.spec import JobSpec

    monkeypatch.setattr(worker_module, "TrainerMetrics", lambda *a: None)
    monkeypatch.setattr(worker_module.TrainWorker, "warm", lambda self: None)
    monkeypatch.setattr(worker_module.torch, "set_num_threads", lambda n: None)
    w = object.__new__(worker_module.TrainWorker)
    w.trainer, w.served, w.was_spare, w._evicted_until = None, [], False, None
    w.assign(JobSpec(name=name).model_dump_json(), 0, 2, 0, run_id)
    return w


def test_two_runs_of_one_job_name_on_a_node_never_read_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sweep over checkpoint.dir runs the same job name twice on a node: same attempt, same
    ranks. Each run's poll reads its own ranks' progress, never the other run's."""
    a, b = _worker(monkeypatch, "sweep", RUN_A), _worker(monkeypatch, "sweep", RUN_B)
    b._progress = Progress(0, 3, 2.0, 50.0, "training")                # this run is stuck at step 3
    a._progress = Progress(0, 901, 0.5, time.time(), "training")       # the other one advances
    assert b.node_progress([0]).progress == {0: Progress(0, 3, 2.0, 50.0, "training")}
    assert a.node_progress([0]).progress[0].step == 901
    assert read_node(RUN_B, 0, [0, 1]).ask == [1]  # rank 1 of this run never wrote: asked, not read


def test_a_file_left_by_a_killed_rank_of_another_run_is_removed(tmp_path: Path) -> None:
    folder = tmp_path / "progress"
    _Rank(RUN_A, 0, 0)
    left = folder / f"{RUN_A}.rank0.json"
    left.write_text(left.read_text().replace(f'"pid": {os.getpid()}', '"pid": 999999999'))  # its process is gone
    live = _Rank(RUN_A, 0, 1)._progress_file.path
    killed_writing = folder / f".{RUN_A}.rank2.json.999999999.0a1b2c3d4e5f.tmp"  # SIGKILL before the rename
    killed_writing.write_bytes(b"")
    writing = folder / f".{RUN_A}.rank1.json.{os.getpid()}.0a1b2c3d4e5f.tmp"       # a live rank mid-write
    writing.write_bytes(b"")
    _Rank(RUN_B, 0, 0)                  # the next rank to start on the node
    assert not left.exists()
    assert live.exists()                # a live rank's file stays
    assert not killed_writing.exists()
    assert writing.exists()


needs_root = pytest.mark.skipif(os.getuid() != 0, reason="handing a folder to another user needs root")


@needs_root
def test_a_folder_another_user_made_world_writable_is_never_used(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "progress"
    _Rank(RUN_A, 0, 0)._progress = Progress(0, 5, 1.0, time.time(), "training")  # a record that looks right
    os.chmod(folder, 0o777)
    os.chown(folder, 54321, 54321)       # ... in a folder another user made first, open to all
    planted = sorted(os.listdir(folder))
    rank = _Rank(RUN_A, 0, 1)
    rank._progress = Progress(1, 5, 1.0, time.time(), "training")
    assert sorted(os.listdir(folder)) == planted   # nothing written there
    assert "owned by uid 54321" in caplog.text and "the poll asks this rank directly" in caplog.text
    answer = read_node(RUN_A, 0, [0, 1])           # nothing read from there either
    assert (answer.progress, answer.ask) == ({}, [0, 1])


def test_a_folder_of_ours_that_others_may_write_is_never_used(tmp_path: Path) -> None:
    folder = tmp_path / "progress"
    folder.mkdir()
    os.chmod(folder, 0o777)
    rank = _Rank(RUN_A, 0, 0)
    rank._progress = Progress(0, 5, 1.0, time.time(), "training")
    assert os.listdir(folder) == []
    assert read_node(RUN_A, 0, [0]).ask == [0]


def test_links_planted_for_the_folder_or_its_files_are_never_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "progress").symlink_to(elsewhere)        # the folder is a link
    _Rank(RUN_A, 0, 0)._progress = Progress(0, 5, 1.0, time.time(), "training")
    assert os.listdir(elsewhere) == []
    assert read_node(RUN_A, 0, [0]).ask == [0]
    (tmp_path / "progress").unlink()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    folder = tmp_path / "progress"
    folder.mkdir(mode=0o700)
    # links at the file's name and at the name the old code used for its temporary file
    (folder / f"{RUN_A}.rank0.json").symlink_to(victim)
    (folder / f"{RUN_A}.rank0.json.{os.getpid()}.tmp").symlink_to(victim)
    _Rank(RUN_A, 0, 0)._progress = Progress(0, 6, 1.0, time.time(), "training")
    assert victim.read_text() == "precious"
    assert read_node(RUN_A, 0, [0]).progress[0].step == 6
