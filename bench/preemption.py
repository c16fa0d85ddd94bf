"""Preemption benchmark: a drain notice with a 30 s deadline on the node of one rank.

The same job (the demo's ~1M-param Llama, FSDP2 over 2 CPU workers, one per 1-CPU node of a
``ray.cluster_utils.Cluster``, a DCP checkpoint every 50 steps) gets, once step 50 committed, the
real ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds 30`` on
the node of one rank; a replacement node joins at once and the drained node is removed at the deadline:

* raytrain_ckpt: ``run_job`` as configured by default (``fault_tolerance.watch_drains``), with
  ``max_restarts: 0``: the ranks save the step in hand, stop, and resume off the node;
* no handling: the same with ``watch_drains: false`` and ``max_restarts: 1``: the node's rank
  dies at the deadline and the job resumes from step 50;
* Ray Train: ``TorchTrainer`` running the same ``Trainer`` (``bench/raytrain_peer.py``) with the
  pattern of the ``ray.train.get_preemption_info()`` docstring: asked after every step, one
  ``dcp.save`` + ``ray.train.report(checkpoint=...)`` when a preemption is announced, training
  goes on; ``FailureConfig(max_failures=0, max_preemption_failures=1)`` (a preemption spends only
  its own budget; the run fails if it spent a restart); needs ``pip install -e ".[bench]"``
  (skipped when missing).

Printed per row: steps lost per preemption (trained, then trained again), notice -> first step
on the replacement, restarts spent; and the ratio of notice -> training again against Ray Train.

    .venv/bin/python bench/preemption.py [--reps 1] [--rows raytrain_ckpt "no handling" "Ray Train"]
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
import raytrain_peer

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "jobs" / "llama_debug_fsdp.yaml"
DEADLINE_S, INTERVAL, STEPS = 30, 50, 600
ROWS = ("raytrain_ckpt", "no handling", "Ray Train")


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
    from raytrain_ckpt.control.driver import run_job
    from raytrain_ckpt.control.preflight import load_spec

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
    """Ray Train's documented preemption pattern (``ray.train.get_preemption_info`` docstring): ask
    after every step, save once when a preemption is announced, and keep training; Ray Train
    restarts the run from that save when the node goes."""
    from ray import train

    trainer, rank, resumed = raytrain_peer.start(config)
    tmp, steps = Path(config["tmp"]), trainer.spec.training.steps
    attempt = "first" if resumed is None else "resumed"
    saved_on_preemption = False
    while trainer.state.step < steps:
        trainer.train_step()
        step = trainer.state.step
        if resumed is not None and step == resumed + 1 and rank == 0:
            (tmp / "rt-back").write_text(f"{time.time()!r} {resumed}")
        (tmp / f"rt-reached-{rank}-{attempt}").write_text(str(step))
        if step % INTERVAL == 0:
            raytrain_peer.save(trainer, tmp, rank, {"step": step})
        if train.get_preemption_info() is not None and not saved_on_preemption:
            raytrain_peer.save(trainer, tmp, rank, {"step": step})
            saved_on_preemption = True
            if rank == 0:
                (tmp / "rt-saved").write_text(f"{time.time()!r} {step}")


def ray_train(tmp: Path) -> dict[str, float] | None:
    from ray.train import FailureConfig

    from raytrain_ckpt.control.preflight import load_spec

    cluster, nodes = _cluster()
    spec = load_spec(SPEC, _overrides(tmp / "unused"))
    # max_failures=0: a preemption may only spend Ray Train's own budget (max_preemption_failures,
    # unlimited by default); the run fails if the lost node counted as a failure.
    trainer = raytrain_peer.torch_trainer(_ray_train_loop, {"spec": spec.model_dump_json(), "tmp": str(tmp)}, tmp,
                                          "preemption", FailureConfig(max_failures=0, max_preemption_failures=1))
    box: dict = {}
    fit = threading.Thread(target=lambda: box.setdefault("result", trainer.fit()))
    fit.start()
    deadline = time.monotonic() + 300
    while not (tmp / f"rt-step-{INTERVAL}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    victim = nodes[1]
    noticed = _drain(cluster, victim.node_id)
    cluster.add_node(num_cpus=1)
    time.sleep(max(0.0, noticed + DEADLINE_S - time.time()))
    cluster.remove_node(victim)
    fit.join(timeout=600)
    assert box["result"].error is None, box["result"].error
    reached = max(int((tmp / f"rt-reached-{r}-first").read_text()) for r in range(2))
    back_at, resumed = (tmp / "rt-back").read_text().split()
    saved_at, _ = (tmp / "rt-saved").read_text().split()
    out = {"lost": float(max(0, reached - int(resumed))), "back": float(back_at) - noticed, "restarts": 0.0,
           "resumed": float(resumed), "seen": float(saved_at) - noticed}
    ray.shutdown()
    cluster.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), help="the rows to run (default: all)")
    args = p.parse_args()
    # A private session root and no auth: these clusters must not touch any other Ray on the machine.
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rtc-", dir="/tmp")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.pop("RAY_ADDRESS", None)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in args.rows}
    for _ in range(args.reps):
        for name in args.rows:
            if name == "Ray Train" and not raytrain_peer.available():
                continue
            with tempfile.TemporaryDirectory() as d:
                rows[name].append(ray_train(Path(d)) if name == "Ray Train" else ours(Path(d), handle=name != "no handling"))
    print(f"drain notice ({DEADLINE_S} s deadline) on one rank's node after step {INTERVAL} committed, a replacement "
          f"node joins, the node goes at the deadline; median of {args.reps} run(s)")
    print(f"{'':<14} {'steps lost':>10} {'notice -> training again (s)':>30} {'restarts spent':>15} {'resumed at':>11}")
    med = {n: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for n, runs in rows.items() if runs}
    for name, m in med.items():
        print(f"{name:<14} {m['lost']:>10.0f} {m['back']:>30.2f} {m['restarts']:>15.0f} {m['resumed']:>11.0f}")
    if "Ray Train" in med:
        print(f"Ray Train: notice -> its preemption save done {med['Ray Train']['seen']:.2f} s")
    if "Ray Train" in med and "raytrain_ckpt" in med:
        print(f"ratio notice -> training again, raytrain_ckpt / Ray Train: "
              f"{med['raytrain_ckpt']['back'] / med['Ray Train']['back']:.2f}")
    elif not raytrain_peer.available():
        print('Ray Train not installed (pip install -e ".[bench]"): not compared')


if __name__ == "__main__":
    main()
