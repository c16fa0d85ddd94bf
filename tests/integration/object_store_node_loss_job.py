"""Run by test_object_store_job.py in its own process: a multi-node Ray cluster on this machine
(ray.cluster_utils.Cluster: a 0-CPU head and three 1-CPU nodes, no shared directory between the
job's actors other than the S3 bucket) trains the demo job with ``checkpoint.dir`` on the S3
endpoint given on the command line. Rank 0 hangs after step 12 (attempt 0 only), so the job
cannot finish before the fault; once step 10's manifest is in the bucket, a node hosting a rank is
removed: the CheckpointActor's node when it hosts a rank, else rank 1's node, and then the
actor's process is killed. Either way the actor is lost with the rank, and Ray restarts it (on
another node, if its node went) while the job restarts; it rebuilds its state from the bucket. The job restarts on the surviving node and the spare one, resumes from S3 and
finishes. Prints one JSON line with what happened.

argv: <S3 endpoint URL> <s3://bucket/prefix>
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
os.environ["PYTHONPATH"] = str(REPO)  # inherited by the cluster's processes (see driver._init_ray)
sys.path.insert(0, str(REPO))  # tests.conftest, this checkout's package and bench/, whichever the venv installed
from tests.conftest import ray_tmpdir  # noqa: E402

# A private session root and no auth: this cluster must not touch any other Ray on the machine.
os.environ["RAY_TMPDIR"] = ray_tmpdir()  # removed when this run exits
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ.pop("RAY_ADDRESS", None)

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util import placement_group_table  # noqa: E402

from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout  # noqa: E402
from raytrain_ckpt.checkpoint.roles.names import NAMESPACE, actor_name  # noqa: E402
from raytrain_ckpt.control.driver import run_job  # noqa: E402
from raytrain_ckpt.common.faults import ENV_VAR  # noqa: E402
from raytrain_ckpt.control.preflight import load_spec  # noqa: E402

STEP_TIMEOUT_S = 240.0


def _rank_node(rank: int) -> str:
    """The node of bundle ``rank`` of the job's placement group (the only one created)."""
    for table in placement_group_table().values():
        if table["state"] == "CREATED" and len(table["bundles_to_node_id"]) == 2:
            return table["bundles_to_node_id"][rank]
    raise RuntimeError("the job's placement group was not found")


def main(endpoint: str, root: str) -> None:
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    os.environ[ENV_VAR] = "hang@step:rank=0,step=12"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(3)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    opts = ",".join(f"{k}: {v}" for k, v in options.items())
    spec = load_spec(REPO / "jobs" / "llama_debug_fsdp.yaml", [
        "training.log_every_steps=1", "lr_scheduler.warmup_steps=2", "training.seq_len=32", "checkpoint.enabled=true",
        "checkpoint.interval_steps=5", "training.steps=20", "checkpoint.keep_latest_k=null",
        f"checkpoint.dir={root}", f"checkpoint.storage_options={{{opts}}}", "fault_tolerance.max_restarts=1",
        "fault_tolerance.poll_interval_s=0.2", "fault_tolerance.placement_timeout_s=30"])
    layout = CheckpointLayout(f"{root}/{spec.name}", options=options)
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = run_job(spec)
        except BaseException as exc:  # reported in the JSON line: the test shows it
            box["error"] = f"{type(exc).__name__}: {exc}"

    job = threading.Thread(target=run)
    job.start()
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while not layout.is_committed_name(10) and time.monotonic() < deadline:
        time.sleep(0.2)
    committed_before = sorted(layout.step_dirs())
    actor = ray.get_actor(actor_name(spec.name), namespace=NAMESPACE)
    actor_node = ray.get(actor.probes_seen.remote([])).node_id
    ranks = [_rank_node(0), _rank_node(1)]
    victim = actor_node if actor_node in ranks else ranks[1]
    survivor = next(n for n in ranks if n != victim) if len(set(ranks)) == 2 else None
    cluster.remove_node(next(n for n in nodes if n.node_id == victim))
    if actor_node != victim:
        ray.kill(actor, no_restart=False)  # the process dies; Ray restarts it (max_restarts=-1)
    job.join(timeout=400)
    if "result" not in box:
        print(json.dumps({"state": "RAISED", "error": box.get("error", "still running after 400s")}))
        ray.shutdown()
        cluster.shutdown()
        return
    r = box["result"]
    print(json.dumps({
        "state": r.state.value, "attempts": r.attempts, "error": r.error, "failures": [str(f) for f in r.failures],
        "start_steps": [x.start_step for x in r.results], "fingerprints": [x.fingerprint for x in r.results],
        "losses": {str(k): v for k, v in r.losses.items()}, "committed": (r.checkpoints or {}).get("committed"),
        "committed_before_loss": committed_before, "valid_in_bucket": sorted(layout.valid_steps("checksum")),
        "removed_node": victim, "surviving_node": survivor, "actor_on_removed_node": actor_node == victim,
        "alive_nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"]),
    }))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
