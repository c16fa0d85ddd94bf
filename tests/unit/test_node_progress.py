"""Progress read one node at a time (``nodeprogress.py``): a rank's file says what its
``progress()`` says, and whatever a file cannot say is left for the rank itself to answer."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from raytrain_ckpt import nodeprogress
from raytrain_ckpt.events import Progress
from raytrain_ckpt.nodeprogress import ProgressFile, PublishedProgress, node_batches, read_node


@pytest.fixture(autouse=True)
def _own_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nodeprogress, "_dir", lambda: tmp_path / "progress")


class _Rank(PublishedProgress):
    """What TrainWorker does with its progress: assigns ``_progress`` and ``_rollbacks``."""

    def __init__(self, job: str, attempt: int, rank: int) -> None:
        self._progress_file = ProgressFile(job, attempt, rank)
        self._progress = Progress(rank, 0, None, time.time(), "setup")
        self._rollbacks = ()


def test_every_change_of_a_ranks_progress_is_what_its_node_reads() -> None:
    ranks = [_Rank("job/a", 3, r) for r in range(4)]
    ranks[2]._progress = Progress(2, 17, 1.25, 123.0, "saving", stall_s=0.5, eval_s=0.25, step_started_at=120.0)
    answer = read_node("job/a", 3, [0, 1, 2, 3])
    assert answer.ask == []
    assert answer.progress == {r._progress.rank: r._progress for r in ranks}
    assert answer.progress[2] == Progress(2, 17, 1.25, 123.0, "saving", stall_s=0.5, eval_s=0.25, step_started_at=120.0)


def test_what_a_file_cannot_say_is_asked_of_the_rank(tmp_path: Path) -> None:
    _Rank("job", 1, 0)
    _Rank("job", 0, 1)  # an earlier attempt's file
    with_rollbacks = _Rank("job", 1, 2)
    with_rollbacks._rollbacks = ("a rollback record",)  # the records stay with the rank
    gone = _Rank("job", 1, 3)
    path = gone._progress_file.path
    path.write_text(path.read_text().replace(f'"pid": {os.getpid()}', '"pid": 999999999'))  # an exited process
    (tmp_path / "progress" / "job.rank5.json").write_text('{"attempt": 1, "rank": 5}')  # another shape
    (tmp_path / "progress" / "job.rank6.json").write_text('[1, 2]')
    answer = read_node("job", 1, [0, 1, 2, 3, 4, 5, 6])  # rank 4 never wrote one
    assert sorted(answer.progress) == [0]
    assert answer.ask == [1, 2, 3, 4, 5, 6]


def test_an_evicted_ranks_deadline_reaches_its_nodes_file() -> None:
    class _Evicted(_Rank):
        evicted_until: float | None = None

        def _shown(self) -> Progress:
            from dataclasses import replace
            return replace(self._progress, evicted_until=self.evicted_until)

    rank = _Evicted("job", 0, 0)
    rank.evicted_until = 1234.5           # SIGTERM: the training thread's next change writes it
    rank._progress = Progress(0, 8, None, time.time(), "saving")
    assert read_node("job", 0, [0]).progress[0].evicted_until == 1234.5


def test_a_run_that_ended_leaves_no_file_and_is_asked_of_the_rank(tmp_path: Path) -> None:
    done, failed = _Rank("job", 0, 0), _Rank("job", 0, 1)
    done._progress = Progress(0, 20, 1.0, time.time(), "done")
    assert read_node("job", 0, [0, 1]).ask == [0]
    failed._progress = Progress(1, 7, None, time.time(), "failed")
    assert read_node("job", 0, [0, 1]).ask == [0, 1]
    assert not (tmp_path / "progress").exists()  # nothing of the job left in shared memory
    _Rank("job", 1, 0)                            # a kept process's next attempt writes again
    assert sorted(read_node("job", 1, [0]).progress) == [0]


def test_ranks_are_asked_per_node_or_one_by_one_when_nodes_are_unknown() -> None:
    assert node_batches([0, 1, 2, 3, 5], ["a", "b", "a", "b", "a", "c"]) == [[0, 2], [1, 3], [5]]
    assert node_batches([0, 1, 2], []) == [[0], [1], [2]]
