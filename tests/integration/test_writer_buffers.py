"""A real CheckpointWriter actor and real processes: a starting writer removes the buffers of a
SIGKILLed owner and leaves a live owner's alone; it owns (0600, locked) what it allocates and
releases only that; a new attempt reuses a rank's buffer unless a live process still leases it,
and a late hand-off of the old attempt is refused. Buffers live in a private directory (RAYTRAIN_CKPT_SHM_DIR)."""

from __future__ import annotations

import os
import pickle
import stat
from pathlib import Path

import pytest
import ray
from torch.distributed.checkpoint.planner import SavePlan

from raytrain_ckpt.checkpoint.datapath.buffers import SHM_DIR_ENV, sweep_orphans

from raytrain_ckpt.checkpoint.errors import StagingFileError
from raytrain_ckpt.checkpoint.records import PersistRequest
from raytrain_ckpt.checkpoint.roles.writer import CheckpointWriter
from tests.unit.test_staging_buffers import _holder, _kill, _leaser


def test_a_starting_writer_removes_dead_owners_buffers_only(ray_cluster, tmp_path: Path) -> None:
    dead = [tmp_path / "rtc-gone-1234abcd-a0-rank0.buf", tmp_path / "rtc-gone-1234abcd-a0-rank1.buf"]
    alive = tmp_path / "rtc-other-5678abcd-a0-rank0.buf"
    a, b = _holder(*dead), _holder(alive)
    try:
        _kill(a)                                    # a job whose driver and writer were killed
        writer = ray.remote(CheckpointWriter).options(
            num_cpus=0, max_concurrency=4, runtime_env={"env_vars": {SHM_DIR_ENV: str(tmp_path)}},
        ).remote("job", str(tmp_path / "ckpt"), None)
        first = Path(ray.get(writer.allocate.remote(0, 0, 4096)))
        assert not any(p.exists() for p in dead) and alive.exists()
        assert first.parent == tmp_path and stat.S_IMODE(os.stat(first).st_mode) == 0o600
        assert sweep_orphans(tmp_path, dry_run=True) == []      # the writer's buffer is locked by a live owner
        second = Path(ray.get(writer.allocate.remote(0, 1, 4096)))
        assert second == first and second.exists()              # a new attempt reuses the rank's buffer
        ray.get(writer.release_all.remote())
        assert not second.exists() and alive.exists()
        ray.kill(writer, no_restart=True)
    finally:
        _kill(b)


def test_a_buffer_still_leased_or_read_is_not_given_to_the_next_attempt(ray_cluster, tmp_path: Path) -> None:
    writer = ray.remote(CheckpointWriter).options(
        num_cpus=0, max_concurrency=4, runtime_env={"env_vars": {SHM_DIR_ENV: str(tmp_path)}},
    ).remote("job", str(tmp_path / "ckpt"), None)
    first = Path(ray.get(writer.allocate.remote(0, 0, 8192)))
    old_rank = _leaser(first)                                   # a rank of attempt 0 that has not exited yet
    try:
        second = Path(ray.get(writer.allocate.remote(0, 1, 8192)))
        assert second != first and second.exists() and first.exists()  # unlinked after a write of attempt 1
    finally:
        _kill(old_rank)
    third = Path(ray.get(writer.allocate.remote(0, 2, 16384)))  # nobody leases them now: one is reused, resized
    assert third in (first, second) and os.stat(third).st_size == 16384
    late = PersistRequest(step=3, rank=0, attempt=1, plan_id="1.3", buffer_path=str(third), buffer_bytes=16384,
                          slots=[], objects=pickle.dumps({}), plan=SavePlan([]))
    with pytest.raises(StagingFileError, match="no longer belongs to attempt 1"):
        ray.get(writer.accept.remote(late))                     # attempt 1's late hand-off is refused
    ray.get(writer.release_all.remote())
    assert not first.exists() and not second.exists()
    ray.kill(writer, no_restart=True)
