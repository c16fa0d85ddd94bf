"""The driver's progress line: the text (a table), redrawn in place on a real terminal (a pty),
plain log lines otherwise, at their own pace and only while the step moves."""

from __future__ import annotations

import io
import logging
import os

import pytest

from raytrain_ckpt.observe.progressline import PLAIN_EVERY_S, ProgressLine, progress_text


@pytest.mark.parametrize(("args", "text"), [
    ((120, 1000, 2410.4, 100, 365.0, 0, "RUNNING"),
     "step 120/1000 (12%) | 2410 tok/s | committed 100 | ETA 6m05s | attempt 0 RUNNING"),
    ((0, 1000, None, None, None, 0, "STARTING"), "step 0/1000 (0%) | - tok/s | committed - | ETA - | attempt 0 STARTING"),
    ((999, 1000, 10.0, 990, 7300.0, 2, "RUNNING"),
     "step 999/1000 (99%) | 10 tok/s | committed 990 | ETA 2h01m | attempt 2 RUNNING"),
])
def test_progress_text(args, text):
    assert progress_text(*args) == text


def test_on_a_terminal_the_line_is_redrawn_in_place():
    master, slave = os.openpty()
    with os.fdopen(slave, "w") as tty:
        line = ProgressLine(100, 256, lambda: 5, stream=tty)
        assert line.tty
        for i, step in enumerate((1, 2, 3, 4)):
            line.update(step, 0, "RUNNING", now=10.0 + i)  # one poll a second: each one redrawn
        line.close()
    chunks = []  # a pty hands the output over in pieces under load: read it all
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the terminal's other end is closed and everything was read
            break
        if not data:
            break
        chunks.append(data)
    out = b"".join(chunks).decode()
    os.close(master)
    frames = [f for f in out.split("\r") if f]
    assert len(frames) == 5 and all(f.endswith("\x1b[K") for f in frames)  # each clears what it did not cover
    assert frames[-1] == "\x1b[K" and "\n" not in out  # close: back at the line's start, the line cleared
    assert frames[-2] == "step 4/100 (4%) | 256 tok/s | committed 5 | ETA 1m36s | attempt 0 RUNNING\x1b[K"


def test_elsewhere_plain_lines_at_their_pace_and_only_while_the_step_moves(caplog):
    caplog.set_level(logging.INFO, logger="raytrain_ckpt.observe.progressline")
    asked = []
    line = ProgressLine(50, 100, lambda: asked.append(1) or 10, stream=io.StringIO())  # not a terminal
    assert not line.tty
    t = 0.0
    for step in range(1, 21):  # a step every 5 s for 100 s
        line.update(step, 1, "RUNNING", now=t)
        t += 5.0
    for _ in range(20):  # then stuck: no new line
        line.update(20, 1, "RUNNING", now=t)
        t += 5.0
    lines = [r.getMessage() for r in caplog.records]
    # t = 0, 30, 60, 90 while it moves, then step 20 once at 120, then nothing while it is stuck
    assert len(lines) == 2 + int(95 // PLAIN_EVERY_S) == 5 and len(asked) == len(lines)  # the bulletin asked only to show
    assert lines[3] == "progress: step 19/50 (38%) | 20 tok/s | committed 10 | ETA 2m35s | attempt 1 RUNNING"
    assert lines[4].startswith("progress: step 20/50 (40%)")
    assert line.stream.getvalue() == ""  # the log handler, not raw writes


def test_a_restart_that_goes_back_restarts_the_rate(caplog):
    caplog.set_level(logging.INFO, logger="raytrain_ckpt.observe.progressline")
    line = ProgressLine(100, 10, lambda: None, stream=io.StringIO())
    line.update(30, 0, "RUNNING", now=0.0)
    line.update(40, 0, "RUNNING", now=10.0)
    line.update(31, 1, "RUNNING", now=100.0)  # replaying from the commit at 30
    line.update(32, 1, "RUNNING", now=131.0)
    assert caplog.records[-1].getMessage().startswith("progress: step 32/100 (32%) | 0 tok/s | committed -")
