"""A real CheckpointWriter actor and real processes: a starting writer removes the buffers of a
SIGKILLed owner and leaves a live owner's alone; it owns (0600, locked) what it allocates and
releases only that. Buffers live in a private directory (RAYTRAIN_CKPT_SHM_DIR)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import ray

from raytrain_ckpt.checkpoint.buffers import SHM_DIR_ENV, sweep_orphans
from raytrain_ckpt.checkpoint.writer import CheckpointWriter
from tests.unit.test_staging_buffers import _holder, _kill


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
        assert not first.exists() and second.exists()           # a new attempt's buffer replaces the old one
        ray.get(writer.release_all.remote())
        assert not second.exists() and alive.exists()
        ray.kill(writer, no_restart=True)
    finally:
        _kill(b)
