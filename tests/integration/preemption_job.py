"""Run by test_preemption_drain.py in its own process: a Ray cluster on this machine
(ray.cluster_utils.Cluster) with two 1-CPU nodes, a 2-rank job, and one rank's node drained with
the real `ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N`.
The drained node is removed at its deadline. Prints one JSON line.

    preemption_job.py CKPT_DIR replace   a replacement node joins at the notice
    preemption_job.py CKPT_DIR shrink    none: the job shrinks to min_workers; a node joins later
                                         and the job grows back while it runs
    preemption_job.py CKPT_DIR ram       a replacement node joins at the notice; the notice is
                                         shorter than the last durable save took (step 5's write
                                         is slowed to RAM_PERSIST_S): the RAM tier
    preemption_job.py CKPT_DIR rankless  three nodes for two ranks: the node that hosts no rank (its
                                         checkpoint writer, the CheckpointActor if Ray put it there) is drained
    preemption_job.py CKPT_DIR replicas  two replica groups of one rank (dp_replicate 2); the second
                                         group's node is drained and a replacement node joins
    preemption_job.py CKPT_DIR replicas0 the same, the first group's node (the group that saves)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
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
from raytrain_ckpt.common.faults import ENV_VAR  # noqa: E402
from raytrain_ckpt.control.watch.drains import actor_node  # noqa: E402
from raytrain_ckpt.control.preflight import load_spec  # noqa: E402
from tests.conftest import REFERENCE_20  # noqa: E402

DEADLINE_S = 25
NOTICE_AT = 7
"""The drain is raised once the job reached this step; rank 0 pauses 3 s after each of the next
three steps (slow faults), so the notice reaches the ranks mid-run whatever the machine's speed."""


def _spec(ckpt_dir: Path, *extra: str):
    # tests.conftest.REFERENCE_20 (the session's uninterrupted run), with an interval that never
    # falls before the notice: a resume at the step in hand cannot be an interval save's
    return load_spec(REPO / "jobs" / "llama_debug_fsdp.yaml", [
        *REFERENCE_20, "resources.num_workers=2", "resources.cpus_per_worker=1", "resources.placement_strategy=SPREAD",
        f"checkpoint.dir={ckpt_dir}", "checkpoint.interval_steps=50", "fault_tolerance.poll_interval_s=0.2", *extra])


RAM_DEADLINE_S = 12
RAM_PERSIST_S = 15
"""The ram mode: step 5's durable write takes this long (slow@persist), so the measured durable
save does not fit RAM_DEADLINE_S; rank 0 pauses 5 s after steps 6 to 9, so the notice, raised
once step 5 committed, reaches the ranks before step 10's interval save."""


def _drain(cluster: Cluster, node_id: str, deadline_s: int = DEADLINE_S) -> None:
    """The operator's (or autoscaler's) drain, through Ray's own CLI."""
    ray_cli = Path(sys.executable).with_name("ray")
    subprocess.run([str(ray_cli), "drain-node", "--address", cluster.address, "--node-id", node_id,
                    "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot instance reclaimed",
                    "--deadline-remaining-seconds", str(deadline_s)], check=True, capture_output=True, text=True)


def _status(job: str):
    try:
        return ray.get(ray.get_actor(actor_name(job), namespace=NAMESPACE).status.remote(), timeout=10)
    except Exception:  # noqa: BLE001 - not up yet, or restarting: ask again
        return None


def _note(job: str) -> dict:
    """The driver's last note to the CheckpointActor (state, attempt, train_step), {} until there is one."""
    status = _status(job)
    return asdict(status.job_info) if status is not None and status.job_info is not None else {}


def _summary(r) -> dict:
    return {"state": r.state.value, "attempts": r.attempts, "error": r.error, "failures": [str(f) for f in r.failures],
            "kinds": [f.kind for f in r.failures], "preemptions": r.preemptions,
            "world_sizes": [len(r.results)], "start_steps": [x.start_step for x in r.results],
            "steps": [x.steps for x in r.results], "events": [e for _, e in r.events],
            "fingerprints": [x.fingerprint for x in r.results], "losses": {str(k): v for k, v in r.losses.items()},
            "committed": (r.checkpoints or {}).get("committed"), "tokens_seen": [x.tokens_seen for x in r.results],
            "loaded_from_memory": [(x.timings or {}).get("loaded_from_memory") for x in r.results],
            "heals": r.heals, "replicas": [x.replicas for x in r.results]}


def _ready_to_drain(job: str, mode: str) -> bool:
    """ram: once step 5 (whose write was slow) committed; else once the job reached NOTICE_AT."""
    if mode != "ram":
        return (_note(job).get("train_step") or 0) >= NOTICE_AT
    status = _status(job)
    return status is not None and status.latest == 5


def _committed(ckpt_dir: Path) -> dict[str, str]:
    """Every step directory on storage with a manifest -> the manifest's SHA-256."""
    return {p.parent.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(ckpt_dir.glob("*/step-*/manifest.json"))}


def _rank_nodes() -> set[str]:
    """The nodes of the job's placement group (the only one on this cluster)."""
    return {n for pg in ray.util.placement_group_table().values() if pg["state"] == "CREATED"
            for n in pg["bundles_to_node_id"].values()}


def _writer_alive(job: str, node: str) -> bool:
    try:
        ray.get_actor(writer_name(job, node), namespace=NAMESPACE)
        return True
    except ValueError:
        return False


def rankless(ckpt_dir: str) -> None:
    """The drained node hosts no rank: the job neither stops nor restarts, its writer there goes (and
    the CheckpointActor moves, if Ray put it there)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(3)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    spec = _spec(Path(ckpt_dir), "checkpoint.interval_steps=5")  # REFERENCE_20's interval: the same run
    os.environ[ENV_VAR] = ";".join(f"slow@step:rank=0,step={s}" for s in range(NOTICE_AT + 1, NOTICE_AT + 4))
    box: dict = {}
    job = threading.Thread(target=lambda: box.setdefault("result", run_job(spec)))
    job.start()
    deadline = time.monotonic() + 240
    while (_note(spec.name).get("train_step") or 0) < NOTICE_AT and time.monotonic() < deadline:
        time.sleep(0.1)
    [victim] = [n for n in nodes if n.node_id not in _rank_nodes()]
    service = ray.get_actor(actor_name(spec.name), namespace=NAMESPACE)
    out: dict = {"victim": victim.node_id, "actor_node": actor_node(service), "rank_nodes": sorted(_rank_nodes()),
                 "writer_before": _writer_alive(spec.name, victim.node_id),
                 "committed_before": sorted(int(p.name[5:]) for p in (Path(ckpt_dir) / spec.name).glob("step-????????"))}
    # The CheckpointActor asks for no resources: Ray places it, mostly on the head, the driver's node,
    # whose drain would stop the driver with it (a drained raylet exits once idle). Only the victim is drained.
    _drain(cluster, victim.node_id)
    drained_at = time.time()
    while _writer_alive(spec.name, victim.node_id) and time.time() < drained_at + DEADLINE_S:
        time.sleep(0.2)
    out["writer_gone_after_s"] = None if _writer_alive(spec.name, victim.node_id) else round(time.time() - drained_at, 1)
    while job.is_alive() and time.time() < drained_at + DEADLINE_S:
        job.join(timeout=0.2)
    out["actor_node_after"] = actor_node(service)
    cluster.remove_node(victim)  # the node goes at its deadline
    job.join(timeout=300)
    out["drained"] = _summary(box["result"])
    print(json.dumps(out))
    ray.shutdown()
    cluster.shutdown()


def main(ckpt_dir: str, mode: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    extra = ("resources.min_workers=1", "fault_tolerance.placement_timeout_s=3", "fault_tolerance.grow_check_s=1",
             "training.steps=60") if mode == "shrink" else ("checkpoint.interval_steps=5",) if mode == "ram" else \
        ("parallelism.dp_replicate=2", "parallelism.dp_shard=1", "fault_tolerance.heal_steps=3") if mode.startswith("replicas") else ()
    spec = _spec(Path(ckpt_dir), *extra)
    deadline_s = RAM_DEADLINE_S if mode == "ram" else DEADLINE_S
    if mode == "ram":
        os.environ[ENV_VAR] = ";".join([f"slow@persist:rank=1,step=5,seconds={RAM_PERSIST_S}",
                                        *(f"slow@step:rank=0,step={s},seconds=5" for s in range(6, 10))])
    else:
        os.environ[ENV_VAR] = ";".join(f"slow@step:rank=0,step={s}" for s in range(NOTICE_AT + 1, NOTICE_AT + 4))
    box: dict = {}
    job = threading.Thread(target=lambda: box.setdefault("result", run_job(spec)))
    job.start()
    deadline = time.monotonic() + 240
    while not _ready_to_drain(spec.name, mode) and job.is_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    victim = nodes[1]  # SPREAD: one rank on each node
    if mode.startswith("replicas"):  # the node of rank 1 (the second replica group), or of rank 0 (the first)
        [table] = [pg["bundles_to_node_id"] for pg in ray.util.placement_group_table().values() if pg["state"] == "CREATED"]
        [victim] = [n for n in nodes if n.node_id == table[0 if mode == "replicas0" else 1]]
    out: dict = {"victim": victim.node_id, "actor_node": actor_node(ray.get_actor(actor_name(spec.name),
                                                                                namespace=NAMESPACE))}
    out["committed_before"] = _committed(Path(ckpt_dir))
    _drain(cluster, victim.node_id, deadline_s)
    drained_at = time.time()
    out["draining_seen"] = sorted(ray._private.state.state.get_draining_nodes())
    if mode in ("replace", "ram", "replicas", "replicas0"):
        cluster.add_node(num_cpus=1)
    else:  # no replacement: the job shrinks to min_workers; a node joins once it trains there
        while job.is_alive():
            status = _status(spec.name)
            note = status.job_info if status is not None else None
            if note is not None and note.attempt >= 1 and note.state == "RUNNING" and status.world_size == 1:
                out["shrunk_at_step"] = note.train_step
                break
            time.sleep(0.2)
        cluster.add_node(num_cpus=1)
    while job.is_alive() and time.time() < drained_at + deadline_s:
        job.join(timeout=0.2)
    cluster.remove_node(victim)  # the node goes at its deadline
    out["removed_after_s"] = round(time.time() - drained_at, 1)
    job.join(timeout=300)
    out["drained"] = _summary(box["result"])
    out["committed_after"] = _committed(Path(ckpt_dir))
    out["tokens_per_step"] = spec.training.global_batch_size * spec.training.seq_len
    print(json.dumps(out))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    if sys.argv[2] == "rankless":
        rankless(sys.argv[1])
    else:
        main(sys.argv[1], sys.argv[2])
