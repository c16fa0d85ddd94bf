"""The replicas' heal from a live peer (``raytrain_ckpt/replicas``, torchft) on real Ray actors:
one replica's process is killed with SIGKILL mid-training and replaced; the other keeps stepping."""

from __future__ import annotations

import os
import time

import pytest

from bench.replica_heal import one_run

pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_killed_replica_heals_from_its_live_peer_while_the_other_never_steps_back(ray_cluster):
    steps, kill_step = 40, 15
    run = one_run(steps, kill_step, heartbeat_ms=500)
    deadline = time.time() + 10
    while _alive(run.killed_pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(run.killed_pid), "the failed replica's process was not killed"
    # the healthy replica trains on through the fault: its step never goes back, and it ends
    healthy_steps = [s for s, _, _ in run.healthy]
    assert healthy_steps == sorted(healthy_steps) and healthy_steps[-1] >= steps
    assert any(p == 1 for s, t, p in run.healthy if t > run.killed_at), "no step was taken without the failed replica"
    # the new replica starts from its peer's step, not from 0: its state came from the live peer
    assert run.failed[-1][0] >= kill_step
    assert run.healer[0][0] > kill_step
    assert any(p == 2 for _, _, p in run.healer) and run.healer[-1][0] == healthy_steps[-1]
    # both replicas end with the same parameters, bit for bit
    assert run.sums[0] == run.sums[1]


def test_the_replicas_room_is_not_imported_by_a_job_without_replicas():
    import subprocess
    import sys

    code = ("import sys, raytrain_ckpt.api; "
            "print(sorted(m for m in sys.modules if m.startswith(('torchft', 'raytrain_ckpt.replicas'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

