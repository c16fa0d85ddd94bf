"""Preemption benchmark: a drain notice with a 30 s deadline on the node of one rank.

The same job (the demo's ~1M-param Llama, FSDP2 over 2 CPU workers, one per 1-CPU node of a
``ray.cluster_utils.Cluster``, a DCP checkpoint every 50 steps) gets, once step 50 committed, the
real ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds 30`` on
the node of one rank; a replacement node joins at once and the drained node is removed at the deadline:

* raytrain_ckpt: ``run_job`` as configured by default (``fault_tolerance.watch_drains``), with
  ``max_restarts: 0``: the ranks save the step in hand, stop, and resume off the node;
* no handling: the same with ``watch_drains: false`` and ``max_restarts: 1``: the node's rank
  dies at the deadline and the job resumes from step 50;
* Ray Train: ``TorchTrainer`` running the same ``Trainer`` with its documented pattern
  (``ray.train.get_preemption_info()`` checked in the loop, then ``dcp.save`` +
  ``ray.train.report(checkpoint=...)``), ``FailureConfig(max_failures=1)``; needs
  ``pip install "ray[train]"`` (skipped when missing, as in ``bench/recovery.py``).

Printed per row: steps lost per preemption (trained, then trained again), notice -> first step
on the replacement, restarts spent; and the ratio of notice -> training again against Ray Train.

    .venv/bin/python bench/preemption.py [--reps 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import ray

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "jobs" / "llama_debug_fsdp.yaml"
DEADLINE_S, INTERVAL, STEPS = 30, 50, 600


def _overrides(ckpt_dir: Path, *extra: str) -> list[str]:
    return [f"training.steps={STEPS}", "training.log_every_steps=1", "training.seq_len=32",
            "resources.num_workers=2", "resources.cpus_per_worker=1", "resources.placement_strategy=SPREAD",
            f"checkpoint.dir={ckpt_dir}", f"checkpoint.interval_steps={INTERVAL}", "checkpoint.keep_latest_k=null",
            "fault_tolerance.poll_interval_s=0.2", *extra]


def _cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}}, log_to_driver=False)
    return cluster, nodes


def _drain(cluster, node_id: str) -> float:
    """The real drain, through Ray's CLI; returns when it was raised (time.time())."""
    subprocess.run([str(Path(sys.executable).with_name("ray")), "drain-node", "--address", cluster.address,
                    "--node-id", node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "bench",
                    "--deadline-remaining-seconds", str(DEADLINE_S)], check=True, capture_output=True)
    return time.time()


def _job_step(job: str) -> int:
    """The slowest rank's step, as the driver last told the CheckpointActor."""
    from raytrain_ckpt.checkpoint.roles.names import NAMESPACE, actor_name

    status = ray.get(ray.get_actor(actor_name(job), namespace=NAMESPACE).status.remote(), timeout=30)
    return status.job_info.train_step if status.job_info is not None else 0


def ours(tmp: Path, handle: bool) -> dict[str, float]:
    from raytrain_ckpt.driver import run_job
    from raytrain_ckpt.preflight import load_spec

    cluster, nodes = _cluster()
    extra = ("fault_tolerance.max_restarts=0",) if handle else ("fault_tolerance.watch_drains=false",
                                                                 "fault_tolerance.max_restarts=1")
    spec = load_spec(SPEC, _overrides(tmp / "ckpt", *extra))
    box: dict = {}
    job = threading.Thread(target=lambda: box.setdefault("result", run_job(spec)))
    job.start()
    step = tmp / "ckpt" / spec.name / f"step-{INTERVAL:08d}"
    deadline = time.monotonic() + 300
    while not step.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    victim = nodes[1]  # SPREAD: one rank on each node
    noticed = _drain(cluster, victim.node_id)
    cluster.add_node(num_cpus=1)
    reached = 0
    while time.time() < noticed + DEADLINE_S:
        try:
            reached = max(reached, _job_step(spec.name))
        except Exception:  # noqa: BLE001 - the actor restarting: the next look answers
            pass
        time.sleep(0.5)
    cluster.remove_node(victim)
    job.join(timeout=600)
    r = box["result"]
    assert r.state.value == "SUCCEEDED", r.error
    start = r.results[0].start_step
    lost = sum(p["steps_lost"] for p in r.preemptions) if handle else max(0, reached - start)
    out = {"lost": float(lost), "back": max(x.timings["first_step_at"] for x in r.results) - noticed,
           "restarts": float(sum(f.kind != "preemption" for f in r.failures)), "resumed": float(start)}
    ray.shutdown()
    cluster.shutdown()
    return out


def _ray_train_loop(config: dict) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from ray import train

    from raytrain_ckpt.checkpoint.recovery.state import app_state, load_app_state
    from raytrain_ckpt.spec import JobSpec
    from raytrain_ckpt.trainer import Trainer

    torch.set_num_threads(1)
    spec = JobSpec.model_validate_json(config["spec"])
    trainer = Trainer(spec, torch.device("cpu"))
    resumed = train.get_checkpoint()
    if resumed is not None:
        with resumed.as_directory() as d:
            load_app_state(trainer, d, same_world_size=True)
    rank = train.get_context().get_world_rank()
    tmp = Path(config["tmp"])
    first = True
    while trainer.state.step < spec.training.steps:
        trainer.train_step()
        step = trainer.state.step
        if resumed is not None and first and rank == 0:
            (tmp / "rt-back").write_text(f"{time.time()!r} {trainer.state.step - 1}")
        first = False
        (tmp / f"rt-reached-{rank}").write_text(str(step))
        preempted = train.get_preemption_info() is not None  # the documented pattern: save when told
        if step % INTERVAL == 0 or preempted:
            d = tmp / f"rt-step-{step}"
            dcp.save(app_state(trainer), checkpoint_id=str(d))
            train.report({"step": step}, checkpoint=train.Checkpoint.from_directory(str(d)) if rank == 0 else None)
        if preempted:
            time.sleep(DEADLINE_S)  # wait for the node to go; the next attempt resumes from the save


def ray_train(tmp: Path) -> dict[str, float] | None:
    try:
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer
    except ImportError:
        return None
    from raytrain_ckpt.preflight import load_spec

    cluster, nodes = _cluster()
    spec = load_spec(SPEC, _overrides(tmp / "unused"))
    trainer = TorchTrainer(
        _ray_train_loop, train_loop_config={"spec": spec.model_dump_json(), "tmp": str(tmp)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=str(tmp / "storage"), name="preemption",
                             failure_config=FailureConfig(max_failures=1)))
    fit = threading.Thread(target=trainer.fit)
    fit.start()
    deadline = time.monotonic() + 300
    while not (tmp / f"rt-step-{INTERVAL}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    victim = nodes[1]
    noticed = _drain(cluster, victim.node_id)
    cluster.add_node(num_cpus=1)
    time.sleep(max(0.0, noticed + DEADLINE_S - time.time()))
    reached = max(int((tmp / f"rt-reached-{r}").read_text()) for r in range(2))
    cluster.remove_node(victim)
    fit.join(timeout=600)
    back_at, resumed = (tmp / "rt-back").read_text().split()
    out = {"lost": float(max(0, reached - int(resumed))), "back": float(back_at) - noticed, "restarts": 1.0,
           "resumed": float(resumed)}
    ray.shutdown()
    cluster.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=1)
    args = p.parse_args()
    # A private session root and no auth: these clusters must not touch any other Ray on the machine.
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rtc-", dir="/tmp")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.pop("RAY_ADDRESS", None)
    rows: dict[str, list[dict[str, float]]] = {"raytrain_ckpt": [], "no handling": [], "Ray Train": []}
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory() as d:
            rows["raytrain_ckpt"].append(ours(Path(d), handle=True))
        with tempfile.TemporaryDirectory() as d:
            rows["no handling"].append(ours(Path(d), handle=False))
        with tempfile.TemporaryDirectory() as d:
            r = ray_train(Path(d))
            if r is not None:
                rows["Ray Train"].append(r)
    print(f"drain notice ({DEADLINE_S} s deadline) on one rank's node after step {INTERVAL} committed, a replacement "
          f"node joins, the node goes at the deadline; median of {args.reps} run(s)")
    print(f"{'':<14} {'steps lost':>10} {'notice -> training again (s)':>30} {'restarts spent':>15} {'resumed at':>11}")
    med = {n: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for n, runs in rows.items() if runs}
    for name, m in med.items():
        print(f"{name:<14} {m['lost']:>10.0f} {m['back']:>30.2f} {m['restarts']:>15.0f} {m['resumed']:>11.0f}")
    if "Ray Train" in med:
        print(f"ratio notice -> training again, raytrain_ckpt / Ray Train: "
              f"{med['raytrain_ckpt']['back'] / med['Ray Train']['back']:.2f}")
    else:
        print('Ray Train not installed (its dependencies: pip install "ray[train]"): not compared')


if __name__ == "__main__":
    main()
