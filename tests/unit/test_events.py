"""Failures as data: the headline of an error text, and how a Failure reads."""

from __future__ import annotations

import pytest

from raytrain_ckpt.common.events import Failure, headline

TRACEBACK = """rank 1 (attempt 0) failed:
Traceback (most recent call last):
  File "/x/worker.py", line 10, in run
    raise InjectedFault("boom")
raytrain_ckpt.common.faults.InjectedFault: boom
"""
RAY_TASK = """ray::CheckpointWriter.accept() (pid=12, ip=10.0.0.1, actor_id=ab)
  File "/x/writer.py", line 80, in accept
    raise OSError("disk full")
OSError: disk full"""


@pytest.mark.parametrize(("text", "expected"), [
    (TRACEBACK, "rank 1 (attempt 0) failed: raytrain_ckpt.common.faults.InjectedFault: boom"),
    (TRACEBACK.split("\n", 1)[1], "raytrain_ckpt.common.faults.InjectedFault: boom"),   # a bare traceback
    (RAY_TASK, "ray::CheckpointWriter.accept() (pid=12, ip=10.0.0.1, actor_id=ab) OSError: disk full"),
    ("The actor died unexpectedly before finishing this task.\n\tclass_name: TrainWorker",
     "The actor died unexpectedly before finishing this task."),
    ("  \n", "(no message)"),
    ("\x1b[36mray::CheckpointWriter.accept()\x1b[39m (pid=12)\n  File \"/x/w.py\", line 1, in f\nOSError: gone",
     "ray::CheckpointWriter.accept() (pid=12) OSError: gone"),                  # Ray's colours dropped
])
def test_headline_names_what_happened(text, expected):
    assert headline(text) == expected


def test_failure_reads_as_one_line_and_is_frozen():
    f = Failure(2, "crash", 1, "worker process died")
    assert str(f) == "attempt 2 crash: rank 1: worker process died"
    assert str(Failure(0, "hang", None, "no step finished for 4s")) == "attempt 0 hang: no step finished for 4s"
    with pytest.raises(AttributeError):
        f.kind = "hang"  # type: ignore[misc]
