"""Run by test_preemption.py in its own process: a Ray cluster on this machine
(ray.cluster_utils.Cluster) with two 1-CPU nodes, a 2-rank job, and one rank's node drained with
the real `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N`.
The drained node is removed at its deadline; a replacement node may join. Prints one JSON line.

    preemption_job.py CKPT_DIR replace|shrink
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
os.environ["PYTHONPATH"] = str(REPO)  # inherited by the cluster's processes (see driver._init_ray)
# A private session root and no auth: this cluster must not touch any other Ray on the machine.
os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rtc-", dir="/tmp")
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ.pop("RAY_ADDRESS", None)

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from raytrain_ckpt.driver import run_job  # noqa: E402
from raytrain_ckpt.preflight import load_spec  # noqa: E402

DEADLINE_S = 25
STEPS = 70


def _spec(ckpt_dir: Path, *extra: str):
    return load_spec(REPO / "jobs" / "llama_debug_fsdp.yaml", [
        f"training.steps={STEPS}", "training.log_every_steps=1", "training.seq_len=32", "resources.num_workers=2",
        "resources.cpus_per_worker=1", "resources.placement_strategy=SPREAD", f"checkpoint.dir={ckpt_dir}",
        "checkpoint.interval_steps=50", "checkpoint.keep_latest_k=null", "fault_tolerance.max_restarts=0",
        "fault_tolerance.poll_interval_s=0.2", *extra])


def _drain(cluster: Cluster, node_id: str) -> None:
    """The operator's (or autoscaler's) drain, through Ray's own CLI."""
    ray_cli = Path(sys.executable).with_name("ray")
    subprocess.run([str(ray_cli), "drain-node", "--address", cluster.address, "--node-id", node_id,
                    "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot instance reclaimed",
                    "--deadline-remaining-seconds", str(DEADLINE_S)], check=True, capture_output=True, text=True)


def _actor_node(job: str) -> str | None:
    from raytrain_ckpt.checkpoint.roles.names import NAMESPACE, actor_name
    from raytrain_ckpt.preemption import actor_node

    return actor_node(ray.get_actor(actor_name(job), namespace=NAMESPACE))


def _shrunk(job: str, out: dict) -> bool:
    """Whether the job trains in a later attempt (the CheckpointActor's job note); the world size
    of its checkpoints goes in ``out``."""
    from raytrain_ckpt.checkpoint.roles.names import NAMESPACE, actor_name

    try:
        status = ray.get(ray.get_actor(actor_name(job), namespace=NAMESPACE).status.remote(), timeout=10)
    except Exception:  # noqa: BLE001 - restarting: ask again
        return False
    note, out["shrunk_world_size"] = status.job_info, status.world_size
    return note is not None and note.attempt >= 1 and note.state == "RUNNING" and (note.train_step or 0) > 60


def _summary(r) -> dict:
    return {"state": r.state.value, "attempts": r.attempts, "error": r.error, "failures": [str(f) for f in r.failures],
            "kinds": [f.kind for f in r.failures], "preemptions": r.preemptions,
            "world_sizes": [len(r.results)], "start_steps": [x.start_step for x in r.results],
            "fingerprints": [x.fingerprint for x in r.results], "losses": {str(k): v for k, v in r.losses.items()},
            "committed": (r.checkpoints or {}).get("committed"), "events": [e for _, e in r.events],
            "steps": [x.steps for x in r.results],
            "loaded_from_memory": [(x.timings or {}).get("loaded_from_memory") for x in r.results]}


def main(ckpt_dir: str, mode: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    root = Path(ckpt_dir)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    out: dict = {"steps": STEPS}
    extra = ("resources.min_workers=1", "fault_tolerance.placement_timeout_s=3", "fault_tolerance.grow_check_s=1",
             "training.steps=400") if mode == "shrink" else ()
    if mode == "replace" and os.environ.get("SKIP_REFERENCE") != "1":  # the uninterrupted run, on the same cluster
        out["reference"] = _summary(run_job(_spec(root / "reference")))
    spec = _spec(root / "drained", *extra)
    box: dict = {}
    job = threading.Thread(target=lambda: box.setdefault("result", run_job(spec)))
    job.start()
    step50 = root / "drained" / spec.name / "step-00000050"
    deadline = time.monotonic() + 240
    while not step50.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    victim = nodes[1]
    _drain(cluster, victim.node_id)
    drained_at = time.time()
    out["draining_seen"] = sorted(ray._private.state.state.get_draining_nodes())
    out["victim"] = victim.node_id
    out["actor_node"] = _actor_node(spec.name)
    if mode == "replace":
        cluster.add_node(num_cpus=1)
    else:  # no replacement: the job shrinks to min_workers; a node joins once it trains there
        while job.is_alive() and not _shrunk(spec.name, out):
            time.sleep(0.2)
        out["added_after_s"] = round(time.time() - drained_at, 1)
        cluster.add_node(num_cpus=1)
    while job.is_alive() and time.time() < drained_at + DEADLINE_S:
        job.join(timeout=0.2)
    cluster.remove_node(victim)  # the node goes at its deadline
    out["removed_after_s"] = round(time.time() - drained_at, 1)
    job.join(timeout=300)
    out["drained"] = _summary(box["result"])
    print(json.dumps(out))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
