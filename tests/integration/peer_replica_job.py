"""Run by test_peer_replica.py in its own process: a 3-node Ray cluster on this machine
(ray.cluster_utils.Cluster: a 0-CPU head and two 1-CPU nodes, one rank each) with
checkpoint.replication on. Rank 1 waits (a hang fault) after step 12; once step 10 is committed and each node
holds the other's replica, the shard file of step 10 of the rank on the node to be lost is
overwritten with random bytes on storage (same size: checkpoint.verify_on_load=size lets the
step be chosen, so loading that file would load garbage), that node is removed and a
replacement node added. The job
restarts on the survivor and the replacement and must finish with the state of an
uninterrupted run, which this script runs first on the same cluster. Prints one JSON line."""

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

from raytrain_ckpt.checkpoint.roles.names import NAMESPACE, actor_name, writer_name  # noqa: E402
from raytrain_ckpt.control.driver import run_job  # noqa: E402
from raytrain_ckpt.common.logs import setup_logging  # noqa: E402
from raytrain_ckpt.control.preflight import load_spec  # noqa: E402

SAVED = 10


def _spec(ckpt_dir: str, extra: list[str]):
    return load_spec(REPO / "jobs" / "llama_debug_fsdp.yaml", [
        "training.steps=20", "training.log_every_steps=1", "resources.num_workers=2", "parallelism.dp_shard=-1",
        f"checkpoint.dir={ckpt_dir}", f"checkpoint.interval_steps={SAVED}", "checkpoint.keep_latest_k=null",
        "checkpoint.verify_on_load=size", "checkpoint.replication.mode=auto",
        "fault_tolerance.max_restarts=2", "fault_tolerance.poll_interval_s=0.2", *extra])


def _copies(job: str, node: str) -> list:
    try:
        writer = ray.get_actor(writer_name(job, node), namespace=NAMESPACE)
        return ray.get(writer.copies_held.remote(SAVED), timeout=10)
    except Exception:  # not started yet
        return []


def main(base: str) -> None:
    setup_logging()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=True)
    clean = run_job(_spec(f"{base}/clean", []))
    spec = _spec(f"{base}/faulty", [])
    os.environ["RAYTRAIN_CKPT_FAULTS"] = f"hang@step:rank=1,step={SAVED + 2}"
    box: dict = {}
    job = threading.Thread(target=lambda: box.setdefault("result", run_job(spec)))
    job.start()
    ids = {w.node_id: w for w in workers}
    deadline, held = time.monotonic() + 240, {}
    while time.monotonic() < deadline:  # both copies of both ranks of step 10: own and replica
        held = {n: {(c.rank, c.step, c.source_node) for c in _copies(spec.name, n)} for n in ids}
        if all(len({(r, src) for r, s, src in h if s == SAVED}) == 2 for h in held.values()):
            break
        time.sleep(0.2)
    # Both nodes hold both ranks' copies: lose the one without the CheckpointActor (an actor
    # restarting on another node is another test's subject; here the copies are).
    actor = ray.get_actor(actor_name(spec.name), namespace=NAMESPACE)
    actor_node = ray.get(actor.probes_seen.remote([]), timeout=30).node_id
    lost = next(n for n in sorted(held) if n != actor_node)
    rank = next(r for r, s, src in held[lost] if src == lost and s == SAVED)
    shard = next((Path(base) / "faulty" / spec.name / f"step-{SAVED:08d}").glob(f"__{rank}_*.distcp"))
    shard.write_bytes(os.urandom(shard.stat().st_size))
    cluster.remove_node(ids[lost])
    cluster.add_node(num_cpus=1)
    job.join(timeout=400)
    r = box["result"]
    print(json.dumps({
        "state": r.state.value, "attempts": r.attempts, "error": r.error, "failures": [str(f) for f in r.failures],
        "start_steps": [x.start_step for x in r.results], "fingerprints": [x.fingerprint for x in r.results],
        "clean_fingerprints": [x.fingerprint for x in clean.results], "clean_state": clean.state.value,
        "copy_loaded": [x.timings.get("loaded_from_memory") == 1.0 for x in r.results],
        "held_before_loss": {n[:12]: sorted(map(list, h)) for n, h in held.items()}, "lost": lost[:12], "lost_rank": rank,
        "committed": (r.checkpoints or {}).get("committed"),
    }, default=str))
    sys.stdout.flush()
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
