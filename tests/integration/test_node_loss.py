"""Node loss on a real multi-node Ray cluster (ray.cluster_utils.Cluster, in a subprocess so
it does not share the session's Ray): the job shrinks to resources.min_workers, reshards the
latest checkpoint, keeps the global batch and finishes with a sane loss."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).with_name("node_loss_job.py")


def test_node_loss_continues_on_the_surviving_node(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=600,
                         cwd=SCRIPT.parents[2])
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    r = json.loads(lines[-1])
    assert r["state"] == "SUCCEEDED", r
    assert r["attempts"] == 2 and "worker process died" in r["failures"][0]
    assert r["world_sizes"] == [2]                         # 4 workers could not be placed: shrank to 2
    start = r["start_steps"][0]
    assert start >= 10 and f"step-{start:08d}" in r["committed_before_loss"] + [f"step-{s:08d}" for s in r["committed"]]
    losses = {int(k): v for k, v in r["losses"].items()}
    assert sorted(losses) == list(range(start + 1, 31))   # resumed where the checkpoint was, nothing retrained
    assert all(math.isfinite(v) for v in losses.values()) and losses[30] < 3.0
    assert 30 in r["committed"]
    # nothing committed before the loss was lost
    assert set(int(s.split("-")[1]) for s in r["committed_before_loss"]) <= set(r["committed"])
