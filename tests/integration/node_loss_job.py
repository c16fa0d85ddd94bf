"""Run by test_node_loss.py in its own process: a 3-node Ray cluster on this machine
(ray.cluster_utils.Cluster), a 4-worker job spread over two 2-CPU nodes, and one of those nodes
removed mid-run. Prints one JSON line with what happened."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # tests.conftest, and this checkout's package
os.environ["PYTHONPATH"] = str(REPO)  # inherited by the cluster's processes (see driver._init_ray)
# A private session root and no auth: this cluster must not touch any other Ray on the machine.
from tests.conftest import ray_tmpdir  # noqa: E402

os.environ["RAY_TMPDIR"] = ray_tmpdir()  # removed when this run exits
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ.pop("RAY_ADDRESS", None)

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from raytrain_ckpt.control.driver import run_job  # noqa: E402
from raytrain_ckpt.control.preflight import load_spec  # noqa: E402


def main(ckpt_dir: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=2) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    spec = load_spec(REPO / "jobs" / "llama_debug_fsdp.yaml", [
        "training.steps=30", "training.log_every_steps=1", "resources.num_workers=4", "resources.min_workers=2",
        "parallelism.dp_shard=-1", f"checkpoint.dir={ckpt_dir}", "checkpoint.interval_steps=5",
        "checkpoint.keep_latest_k=null", "fault_tolerance.max_restarts=1", "fault_tolerance.placement_timeout_s=5",
        "fault_tolerance.poll_interval_s=0.2"])
    box: dict = {}
    job = threading.Thread(target=lambda: box.setdefault("result", run_job(spec)))
    job.start()
    step10 = Path(ckpt_dir) / spec.name / "step-00000010"
    deadline = time.monotonic() + 180
    while not step10.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    removed_at_committed = sorted(p.name for p in step10.parent.glob("step-*") if ".tmp" not in p.name)
    cluster.remove_node(workers[1])
    job.join(timeout=400)
    r = box["result"]
    print(json.dumps({
        "state": r.state.value, "attempts": r.attempts, "error": r.error, "failures": [str(f) for f in r.failures],
        "world_sizes": [len(r.results)], "start_steps": [x.start_step for x in r.results],
        "losses": {str(k): v for k, v in r.losses.items()}, "committed": (r.checkpoints or {}).get("committed"),
        "committed_before_loss": removed_at_committed,
    }))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
