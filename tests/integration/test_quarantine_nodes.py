"""Bad nodes out, on a real multi-node Ray cluster (ray.cluster_utils.Cluster, in a subprocess so
it does not share the session's Ray): a node whose rank died twice gets no rank in the next
attempt while another node is free."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).with_name("quarantine_job.py")


def test_a_node_whose_rank_failed_twice_gets_no_rank_while_another_is_free(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=600,
                         cwd=SCRIPT.parents[2])
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    r = json.loads(lines[-1])
    assert r["state"] == "SUCCEEDED" and r["attempts"] == 3, r
    assert [f.split(":")[0] for f in r["failures"]] == ["attempt 0 crash", "attempt 1 crash"], r
    (line,) = r["quarantined"]
    bad = re.match(r"node (\w+) quarantined for 1800s \(fault_tolerance.quarantine_s\): its ranks failed 2 times, "
                   r"the latest rank 1 \(crash\)", line)
    assert bad, line
    placed = {int(e.split()[1]): e.split()[-1].split(",") for e in r["events"] if " placed on " in e}
    assert placed[0][1] == placed[1][1] == bad.group(1)     # rank 1 died twice on that node
    assert bad.group(1) not in placed[2], placed              # the next attempt went around it
