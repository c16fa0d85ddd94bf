"""Run by test_quarantine_nodes.py in its own process: a Ray cluster of three 1-CPU nodes on this machine
(ray.cluster_utils.Cluster, the head one of them), a 2-rank job whose rank 1 dies twice on the same node.
Prints one JSON line with what happened."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # tests.conftest, and this checkout's package
os.environ["PYTHONPATH"] = str(REPO)  # inherited by the cluster's processes (see driver._init_ray)
# A private session root and no auth: this cluster must not touch any other Ray on the machine.
from tests.conftest import ray_tmpdir  # noqa: E402

os.environ["RAY_TMPDIR"] = ray_tmpdir()  # removed when this run exits
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ.pop("RAY_ADDRESS", None)
# rank 1 dies after step 3; in the restart (same placement group, rank 1 on the same node) after step 5
os.environ["RAYTRAIN_CKPT_FAULTS"] = "exit@step:rank=1,step=3;exit@step:rank=1,step=5,attempt=1"

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from raytrain_ckpt.control.driver import run_job  # noqa: E402
from raytrain_ckpt.control.preflight import load_spec  # noqa: E402


def main(ckpt_dir: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    spec = load_spec(REPO / "jobs" / "llama_debug_fsdp.yaml", [
        "training.steps=8", "training.seq_len=32", f"checkpoint.dir={ckpt_dir}", "checkpoint.interval_steps=2",
        "fault_tolerance.max_restarts=2", "fault_tolerance.spare_workers=0"])
    r = run_job(spec)
    print(json.dumps({"state": r.state.value, "attempts": r.attempts, "failures": [str(f) for f in r.failures],
                      "quarantined": r.quarantined, "events": [what for _, what in r.events],
                      "error": r.error}))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
