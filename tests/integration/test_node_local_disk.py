"""Node-local checkpoint disks on a real multi-node Ray cluster: one node runs in its own mount
namespace with a private tmpfs at the checkpoint path (needs root, unshare and nsenter). The
shared-storage preflight passes while every node shares the directory, and refuses the job with
exit code 2 and one line naming the private node once it joins, before anything trains; a job
that started before it joined probes it when it first needs its writer (a restart placing ranks
there) and refuses it the same way. A directory a node cannot write is refused the same way."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).with_name("node_local_disk_job.py")


@pytest.fixture
def private_mounts(tmp_path) -> None:
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("unshare", "nsenter", "mount")):
        pytest.skip("needs root, unshare and nsenter to give one Ray node a private tmpfs")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1M tmpfs {tmp_path}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a private mount namespace: {probe.stderr.strip()}")


def _own_lines(stderr: str) -> list[str]:
    """The CLI's own stderr lines, without what Ray forwards from actors and raylets."""
    return [ln for ln in stderr.splitlines() if not ln.lstrip("\x1b[0123456789m").startswith("(")]


def test_preflight_refuses_a_node_local_checkpoint_dir(private_mounts, tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=300,
                         cwd=SCRIPT.parents[2])
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    r = json.loads(lines[-1])
    # every node shares the directory: the preflight probes both nodes (head and one more) and leaves no probe
    shared = r["shared"]
    assert shared["error"] is None, shared
    assert any("shared by the 2 node(s)" in m for m in shared["logs"]), shared
    assert not any(".probe-" in f for f in shared["files"]), shared
    # it joined after the start: the running job's service probes it before handing out its writer
    late = r["late"]
    assert late["shared_error"] is None, late
    assert late["error"] is not None and late["error"].startswith("StorageNotShared: "), late
    assert "not shared by every node" in late["error"] and r["private_node"][:12] in late["error"], late
    # the node with a private disk joined: the run is refused as a user mistake, in one line
    refused = r["refused"]
    own = _own_lines(refused["stderr"])
    errors = [ln for ln in own if ln.startswith("error:")]
    assert refused["rc"] == 2, refused["stderr"]
    assert len(errors) == 1 and "Traceback" not in "\n".join(own), refused["stderr"]
    line = errors[0]
    assert "not shared by every node" in line and "NFS" in line and "s3://" in line, line
    # the node named is the one whose disk the actor cannot see: the private node, or (when the
    # actor itself landed on the private node) both shared ones
    culprits = [r["private_node"][:12]] if r["private_node"][:12] in line.split("node(s)")[1] \
        else [n[:12] for n in r["shared_nodes"]]
    assert all(c in line.split("node(s)")[1] for c in culprits), line
    assert "SUCCEEDED" not in refused["stdout"] and "FAILED" not in refused["stderr"], refused
    # nothing trained or saved, and every probe was removed, in both views of the directory
    for view in (r["host_view"], r["private_view"]):
        assert not any(".probe-" in f or "step-" in f or ".group.json" in f for f in view), view
    assert "/host-only" in r["host_view"] and "/host-only" not in r["private_view"], r   # really two disks


def test_a_checkpoint_dir_a_node_cannot_write_is_refused_before_training(ray_cluster, tmp_path):
    from raytrain_ckpt.checkpoint.errors import StorageNotShared
    from raytrain_ckpt.control.driver import run_job
    from raytrain_ckpt.control.preflight import load_spec

    spec = load_spec("jobs/llama_debug_fsdp.yaml", [f"checkpoint.dir={tmp_path}", "training.steps=2",
                                                    "fault_tolerance.max_restarts=0"])
    blocker = tmp_path / spec.name  # the job's root: a file where the writers need a directory
    blocker.write_text("a file where the job's checkpoint root should be")
    with pytest.raises(StorageNotShared, match=r"^checkpoint\.dir=.*: a node cannot write there \(.*File exists.*\); "
                                               r"make the path writable on every node$"):
        run_job(spec)
    assert blocker.read_text().startswith("a file")
