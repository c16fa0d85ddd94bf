"""The staging copy's progress in the buffer's first bytes (``StageProgress``): what a writer
that holds a save before its copy is done reads, and when it gives the save up. Real shared
buffers, a real staging thread, a real second process for the lease."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from raytrain_ckpt.checkpoint.datapath.buffers import is_leased
from raytrain_ckpt.checkpoint.format.crc import address_of
from raytrain_ckpt.checkpoint.datapath.progress import StageProgress
from raytrain_ckpt.checkpoint.errors import StagingAborted
from raytrain_ckpt.checkpoint.datapath.staging import SharedMemoryStaging, allocate_buffer, map_buffer, map_whole, plan_slots
from tests.unit.test_staging_buffers import REPO, _kill, _leaser


def _waiter(progress: StageProgress, token: int, end: int, alive=lambda: True) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        try:
            out.append(progress.wait(token, end, alive, check_s=0.001))
        except StagingAborted as exc:
            out.append(exc)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _still_waiting(t: threading.Thread) -> bool:
    t.join(timeout=0.05)
    return t.is_alive()


def test_a_wait_returns_only_once_the_copy_of_its_own_save_reached_the_end(tmp_path: Path) -> None:
    owned = allocate_buffer(tmp_path / "rtc-p.buf", 4096)
    try:
        buffer = map_buffer(owned.path, 4096)
        trainer = StageProgress(buffer.data_ptr(), buffer)
        whole = map_whole(owned.path, 4096)                 # the writer's own mapping of the same file
        writer = StageProgress(address_of(whole), whole)
        trainer.begin(7)
        trainer.advance(4096)
        trainer.done(4096, 0.25)                            # save 7 is complete ...
        trainer.begin(8)                                    # ... and save 8 starts over it
        assert writer.staged(7) is None and writer.staged(8) == 0
        t, out = _waiter(writer, 8, 2048)
        assert _still_waiting(t)
        trainer.advance(1024)
        assert _still_waiting(t)
        trainer.advance(2048)
        t.join(timeout=10)
        assert not t.is_alive() and isinstance(out[0], float)
        trainer.done(4096, 0.125)
        assert writer.staged(8) == 4096 and writer.copy_s() == 0.125
    finally:
        owned.remove()


def test_a_failed_copy_or_a_trainer_gone_with_its_copy_short_gives_the_save_up(tmp_path: Path) -> None:
    owned = allocate_buffer(tmp_path / "rtc-q.buf", 4096)
    try:
        buffer = map_buffer(owned.path, 4096)
        progress = StageProgress(buffer.data_ptr(), buffer)
        progress.begin(3)
        t, out = _waiter(progress, 3, 4096)
        assert _still_waiting(t)
        progress.failed()
        t.join(timeout=10)
        assert isinstance(out[0], StagingAborted) and "copy failed" in str(out[0])

        progress.begin(4)
        progress.advance(1024)
        holder = _leaser(owned.path)                        # a real trainer process holding the lease
        t, out = _waiter(progress, 4, 4096, lambda: is_leased(owned.path))
        assert _still_waiting(t)                            # alive: waited for, however long
        _kill(holder)                                       # SIGKILL mid-copy
        t.join(timeout=10)
        assert isinstance(out[0], StagingAborted) and "went away with 1024" in str(out[0])

        progress.begin(5)
        progress.done(4096, 0.0)                            # complete, then gone: the save stands
        assert progress.wait(5, 4096, lambda: False) >= 0.0
    finally:
        owned.remove()


def test_the_staging_thread_records_its_progress_and_a_failure(tmp_path: Path) -> None:
    tensors = {f"t{i}": torch.full((1024,), float(i)) for i in range(4)}
    slots, size = plan_slots(tensors)
    assert slots[0].offset >= 24                           # the progress words come first
    owned = allocate_buffer(tmp_path / "rtc-s.buf", size)
    try:
        buffer = map_buffer(owned.path, size)
        staging = SharedMemoryStaging(buffer, slots)
        begun = []
        staging.start(tensors, lambda: None, token=11, on_begin=lambda: begun.append(staging.progress.staged(11)))
        staging.wait()
        staging.finish()
        assert begun == [0]                                 # reset for the save before the hand-off ran
        assert staging.progress.staged(11) == size
        staging.start({"t0": tensors["t0"]}, lambda: None, token=12)  # t1 is missing: the copy raises
        with pytest.raises(KeyError):
            staging.wait()
        assert staging.progress.staged(12) == -1
    finally:
        owned.remove()


_WRITER = """
import resource, sys, time
from pathlib import Path
from raytrain_ckpt.checkpoint.format.crc import address_of
from raytrain_ckpt.checkpoint.datapath.progress import StageProgress
from raytrain_ckpt.checkpoint.datapath.staging import map_whole
whole = map_whole(Path(sys.argv[1]), 4096)
progress = StageProgress(address_of(whole), whole)
print("ready", flush=True)
c0 = resource.getrusage(resource.RUSAGE_SELF)
waited = progress.wait(21, 2048, lambda: True, check_s=5.0)
c1 = resource.getrusage(resource.RUSAGE_SELF)
print(waited, c1.ru_utime - c0.ru_utime + c1.ru_stime - c0.ru_stime, flush=True)
"""


def test_a_writer_in_another_process_sleeps_until_the_copy_moves_on(tmp_path: Path) -> None:
    """The wait sleeps on the futex in the header, shared through the file mapping: a writer
    process waiting a whole second for the trainer's copy uses next to no CPU (polling every
    0.2 ms took about 0.1 s of it), and the trainer's advance wakes it long before its check."""
    owned = allocate_buffer(tmp_path / "rtc-f.buf", 4096)
    try:
        buffer = map_buffer(owned.path, 4096)
        trainer = StageProgress(buffer.data_ptr(), buffer)
        trainer.begin(21)
        writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(owned.path)], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
            time.sleep(1.0)                                 # the copy makes no progress for a second
            trainer.advance(1024)                           # short of the end: wakes it, it sleeps again
            time.sleep(0.2)
            t_advance = time.monotonic()
            trainer.advance(2048)
            waited, cpu = map(float, writer.stdout.readline().split())
            returned = time.monotonic()
            assert writer.wait(timeout=30) == 0
        finally:
            writer.kill()
        assert waited >= 1.2                                # it returned for the end it needs, no sooner
        assert returned - t_advance < 2.5                   # woken by the advance, not its 5 s check
        assert cpu < 0.03, f"the waiting writer used {cpu:.3f} CPU s in {waited:.2f} s"
    finally:
        owned.remove()


def test_only_the_end_of_the_copy_says_the_whole_buffer_is_staged(tmp_path: Path) -> None:
    """The last slot may end at the buffer's size: its end is not published by the per-slot
    advance, only by ``done`` after the duration, so a writer that sees the whole buffer staged
    reads a header that no longer changes (it checksums the header with the buffer)."""
    tensors = {f"t{i}": torch.full((4096,), float(i)) for i in range(3)}
    slots, size = plan_slots(tensors)
    assert slots[-1].offset + slots[-1].nbytes == size   # the case: the last slot ends the buffer
    owned = allocate_buffer(tmp_path / "rtc-e.buf", size)
    try:
        buffer = map_buffer(owned.path, size)
        staging = SharedMemoryStaging(buffer, slots)
        published: list[tuple[str, int]] = []
        advance, done = staging.progress.advance, staging.progress.done
        staging.progress.advance = lambda end: (published.append(("advance", end)), advance(end))[1]
        staging.progress.done = lambda end, s: (published.append(("done", end)), done(end, s))[1]
        staging.start(tensors, lambda: None, token=31)
        staging.wait()
        staging.finish()
        assert published[-1] == ("done", size) and all(end < size for kind, end in published[:-1])
        assert staging.progress.staged(31) == size and staging.progress.copy_s() > 0
    finally:
        owned.remove()
