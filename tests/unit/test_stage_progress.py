"""The staging copy's progress in the buffer's first bytes (``StageProgress``): what a writer
that holds a save before its copy is done reads, and when it gives the save up. Real shared
buffers, a real staging thread, a real second process for the lease."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from raytrain_ckpt.checkpoint.buffers import is_leased
from raytrain_ckpt.checkpoint.crc import address_of
from raytrain_ckpt.checkpoint.staging import (SharedMemoryStaging, StageProgress, StagingAborted, allocate_buffer,
                                              map_buffer, map_whole, plan_slots)
from tests.unit.test_staging_buffers import _kill, _leaser


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
