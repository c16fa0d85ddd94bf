"""Node loss restored from the peer replica (ray.cluster_utils.Cluster, in a subprocess so it
does not share the session's Ray): with the lost node's rank's storage shard overwritten by random
bytes, the restarted job loads step 10 from the committed copies in memory (that rank's from
the replica its lost node sent to the survivor), and finishes with the state of an uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).with_name("peer_replica_job.py")


def test_lost_node_ranks_restore_from_the_peer_replica(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=600,
                         cwd=SCRIPT.parents[2])
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    r = json.loads(lines[-1])
    r["log"] = [ln[-220:] for ln in out.stderr.splitlines() if any(w in ln for w in ("replica", "restor", "copies"))]
    assert r["clean_state"] == "SUCCEEDED" and r["state"] == "SUCCEEDED", r
    assert r["attempts"] == 2 and "node" in r["error"], r
    # before the loss each node held both ranks' copies of step 10: its own and the peer's replica
    assert all({(rank, step) for rank, step, _ in h} >= {(0, 10), (1, 10)} for h in r["held_before_loss"].values())
    assert r["start_steps"] == [10, 10]               # step 10, though the lost rank's shard on storage is garbage
    assert r["copy_loaded"] == [True, True]           # every rank loaded from memory, none from storage
    assert r["fingerprints"] == r["clean_fingerprints"]  # the state of an uninterrupted run
    assert r["committed"] == [10, 20]
    assert "from the peer replica" in out.stderr and f"(copy of node {r['lost']})" in out.stderr, r["log"]
