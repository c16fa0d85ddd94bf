"""Recovery benchmark: from a killed rank to the first completed step after resuming.

The same job (the demo's ~1M-param Llama, FSDP2 over 2 CPU workers, a DCP checkpoint every 5
steps) loses rank 1 to ``os._exit`` before step 13, once, and resumes from step 10:

* raytrain_ckpt: ``run_job`` with ``fault_tolerance.max_restarts=1``, as configured by default
  (the surviving rank's process and the placement group are kept, a warm spare takes rank 1);
* raytrain_ckpt, no reuse: the same with ``fault_tolerance.reuse_workers=false`` (every process
  and the placement group are rebuilt), to show what the reuse saves;
* Ray Train: ``TorchTrainer`` running the same ``Trainer`` with ``FailureConfig(max_failures=1)``,
  saving with ``dcp.save`` + ``ray.train.report(checkpoint=...)`` and loading from
  ``ray.train.get_checkpoint()`` (``bench/raytrain_peer.py``; needs ``pip install -e ".[bench]"``;
  skipped when missing).

Printed: kill -> first step after resume, with raytrain_ckpt's breakdown, and the ratio.

With ``--memory``, instead: the load part of a restart from the node's memory (every rank
loads its shard from its writer's in-memory copy, ``checkpoint.memory_copies: 2``) against the
same restart from storage (``memory_copies: 1``), on a model made large enough for loading to
matter (``--dim``/``--layers``/``--ffn``: by default about 2 x 480 MiB of state, one half per
rank); rank 1 dies before step 4 and both restarts resume from step 2. Each row also shows what
the driver did before any rank loaded: the resume plan (verifying the step on storage, to sizes
only when every rank may load from memory, else to ``verify_on_load``; choosing each rank's source).

``--node-loss``: instead, on a 3-node ``ray.cluster_utils.Cluster`` (a 0-CPU head, two 1-CPU
nodes with one rank each), the node of one rank is removed after step 10 committed (the ranks
wait before step 13) and a replacement node added; the job resumes from step 10 either from
the committed copies in memory (``checkpoint.replication.mode=auto``: the lost node's copy
from its peer's replica) or from storage (``off``). Printed: node removed -> first step after
resume, and the load time.

    .venv/bin/python bench/recovery.py [--reps 2]
    .venv/bin/python bench/recovery.py --memory [--cold] [--reps 2] [--dim 1536 --layers 3 --ffn 4864]
    .venv/bin/python bench/recovery.py --node-loss [--reps 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import ray
import raytrain_peer

from raytrain_ckpt.common.faults import ENV_VAR, STAMP_VAR

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "jobs" / "llama_debug_fsdp.yaml"
KILL_STEP, STEPS = 12, 16


def _overrides(ckpt_dir: str) -> list[str]:
    return ["training.steps=%d" % STEPS, f"checkpoint.dir={ckpt_dir}", "checkpoint.interval_steps=5",
            "checkpoint.resume=none", "fault_tolerance.max_restarts=1", "fault_tolerance.poll_interval_s=0.1",
            "training.log_every_steps=100"]


def ours(tmp: Path, reuse: bool = True) -> dict[str, float]:
    from raytrain_ckpt.control.driver import run_job
    from raytrain_ckpt.control.preflight import load_spec

    stamp = tmp / "kill"
    os.environ[STAMP_VAR] = str(stamp)
    os.environ[ENV_VAR] = f"exit@step:rank=1,step={KILL_STEP}"
    try:
        overrides = _overrides(str(tmp / "ckpt")) + [f"fault_tolerance.reuse_workers={str(reuse).lower()}"]
        result = run_job(load_spec(SPEC, overrides))
    finally:
        del os.environ[ENV_VAR]
    assert result.state.value == "SUCCEEDED" and result.results[0].start_step == 10, result.error
    kill = float(stamp.read_text())
    ev = {what: t for t, what in result.events}
    timings = [r.timings for r in result.results]
    setup = max(t["pg_init_s"] + t["build_s"] + t["load_s"] for t in timings)
    first = max(t["first_step_at"] for t in timings)
    return {
        "total": first - kill,
        "detect": ev["attempt 0 crash detected"] - kill,
        "teardown": ev["attempt 1 starting"] - ev["attempt 0 crash detected"],
        "place+start": ev["attempt 1 running"] - ev["attempt 1 starting"] - setup,
        "pg_init": max(t["pg_init_s"] for t in timings),
        "build": max(t["build_s"] for t in timings),
        "ckpt_load": max(t["load_s"] for t in timings),
        "first_step": first - ev["attempt 1 running"],
        "reused": sum(1 for r in result.results if len(r.served) > 1 or r.was_spare),
    }


def _evict_when_killed(stamp: Path, root: Path, done: threading.Event) -> None:
    """``--cold``: once the rank is killed, drop the checkpoint files from the page cache
    (``POSIX_FADV_DONTNEED``, these files only), as on a node that did not write them."""
    while not done.is_set() and not stamp.exists():
        time.sleep(0.01)
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def load_rows(tmp: Path, copies: int, shape: dict[str, int], cold: bool) -> dict[str, float]:
    """One restart of the large model, loading from memory (``copies`` 2) or storage (1)."""
    from raytrain_ckpt.control.driver import run_job
    from raytrain_ckpt.control.preflight import load_spec

    os.environ[ENV_VAR] = "exit@step:rank=1,step=3"
    os.environ[STAMP_VAR] = str(tmp / "kill")
    done = threading.Event()
    evict = threading.Thread(target=_evict_when_killed, args=(tmp / "kill", tmp / "ckpt", done), daemon=True)
    if cold:
        evict.start()
    try:
        overrides = [*(f"model.overrides.{k}={v}" for k, v in shape.items()), "training.steps=4",
                     "training.global_batch_size=2", "training.micro_batch_size=1", "training.seq_len=32",
                     "lr_scheduler.warmup_steps=1", f"checkpoint.dir={tmp / 'ckpt'}", "checkpoint.interval_steps=2",
                     "checkpoint.resume=none", "checkpoint.save_final=false", f"checkpoint.memory_copies={copies}",
                     "fault_tolerance.max_restarts=1", "fault_tolerance.poll_interval_s=0.1",
                     "training.log_every_steps=100", *(["checkpoint.verify_on_load=size"] if cold else [])]
        result = run_job(load_spec(SPEC, overrides))
    finally:
        del os.environ[ENV_VAR]
        done.set()
    assert result.state.value == "SUCCEEDED" and result.results[0].start_step == 2, result.error
    timings = [r.timings for r in result.results]
    assert all(t["loaded_from_memory"] == float(copies == 2) for t in timings), timings
    staged = sum(info["bytes"] for info in result.checkpoints["steps"].values()) / len(result.checkpoints["steps"])
    return {"plan": max(t["resume_plan_s"] for t in timings),
            "load": max(t["load_s"] for t in timings), "verify": max(t["load_verify_s"] for t in timings),
            "checksum": max(t["load_checksum_s"] for t in timings), "read": max(t["load_read_s"] for t in timings),
            "state_mib": staged / 2**20}


def memory_vs_storage(reps: int, shape: dict[str, int], cold: bool) -> None:
    rows: dict[str, list[dict[str, float]]] = {"from memory": [], "from storage": []}
    for _ in range(reps):
        for name, copies in (("from memory", 2), ("from storage", 1)):
            with tempfile.TemporaryDirectory() as d:
                rows[name].append(load_rows(Path(d), copies, shape, cold))
    med = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in rows.items()}
    verify = "sizes" if cold else "CRC-32C"
    print(f"restart load of step 2, {med['from storage']['state_mib']:.0f} MiB of state over 2 ranks, "
          f"{'files evicted from the page cache' if cold else 'files in the page cache'} "
          f"(model {shape}); median of {reps} runs, seconds (slowest rank)")
    for name, m in med.items():
        print(f"{name:<14} load {m['load']:6.3f}, of which reading the bytes {m['read']:6.3f}"
              + (f" (checksum {m['checksum']:.3f}, then copy)" if name == "from memory" else " (dcp.load)")
              + f"; before it, the driver's resume plan {m['plan']:6.3f}"
              + (" (storage checked to sizes)" if name == "from memory" else f" (storage verified: {verify})"))
    for name, runs in rows.items():
        print(f"{name:<14} each run: plan + load " + ", ".join(f"{r['plan']:.3f} + {r['load']:.3f}" for r in runs))
    mem, sto = med["from memory"], med["from storage"]
    print(f"ratio memory / storage: whole load {mem['load'] / sto['load']:.2f}, "
          f"reading the bytes {mem['read'] / sto['read']:.2f}, "
          f"plan + load {(mem['plan'] + mem['load']) / (sto['plan'] + sto['load']):.2f}")


def _ray_train_loop(config: dict) -> None:
    trainer, rank, resumed = raytrain_peer.start(config)
    tmp, steps = Path(config["tmp"]), trainer.spec.training.steps
    marker = tmp / "killed"
    while trainer.state.step < steps:
        if rank == 1 and trainer.state.step == KILL_STEP and not marker.exists():
            marker.write_text("1")
            (tmp / "rt-kill").write_text(repr(time.time()))
            os._exit(17)
        trainer.train_step()
        if resumed is not None and rank == 0 and not (tmp / "rt-first").exists():
            (tmp / "rt-first").write_text(repr(time.time()))
        if trainer.state.step % 5 == 0:
            raytrain_peer.save(trainer, tmp, rank, {"step": trainer.state.step})


def ray_train(tmp: Path) -> dict[str, float] | None:
    if not raytrain_peer.available():
        return None
    from ray.train import FailureConfig

    from raytrain_ckpt.control.preflight import load_spec

    spec = load_spec(SPEC, _overrides(str(tmp / "unused")))
    trainer = raytrain_peer.torch_trainer(_ray_train_loop, {"spec": spec.model_dump_json(), "tmp": str(tmp)}, tmp,
                                          "recovery", FailureConfig(max_failures=1))
    trainer.fit()
    return {"total": float((tmp / "rt-first").read_text()) - float((tmp / "rt-kill").read_text())}


def _held_both(job: str, nodes: list[str], step: int) -> bool:
    from raytrain_ckpt.checkpoint.roles.names import NAMESPACE, writer_name

    for node in nodes:
        try:
            held = ray.get(ray.get_actor(writer_name(job, node), namespace=NAMESPACE).copies_held.remote(step), timeout=10)
        except Exception:  # the writer is not up yet
            return False
        if {(c.rank, c.step) for c in held} < {(0, step), (1, step)}:
            return False
    return True


def node_loss(tmp: Path, mode: str) -> dict[str, float]:
    """One node-loss run on a fresh 3-node cluster; replication ``mode`` auto or off."""
    import threading

    from ray.cluster_utils import Cluster

    from raytrain_ckpt.control.driver import run_job
    from raytrain_ckpt.control.preflight import load_spec

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}}, log_to_driver=False)
    os.environ[ENV_VAR] = f"hang@step:rank=1,step={KILL_STEP}"
    spec = load_spec(SPEC, _overrides(str(tmp / "ckpt")) + [
        "training.steps=16", "checkpoint.interval_steps=10", f"checkpoint.replication.mode={mode}",
        "resources.num_workers=2", "fault_tolerance.reuse_workers=false"])
    box: dict = {}
    job = threading.Thread(target=lambda: box.setdefault("result", run_job(spec)))
    try:
        job.start()
        step10 = tmp / "ckpt" / spec.name / "step-00000010"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not (
                step10.exists() and (mode == "off" or _held_both(spec.name, [w.node_id for w in workers], 10))):
            time.sleep(0.1)
        removed = time.time()
        cluster.remove_node(workers[1])
        cluster.add_node(num_cpus=1)
        job.join(timeout=400)
    finally:
        del os.environ[ENV_VAR]
    result = box["result"]
    assert result.state.value == "SUCCEEDED" and result.results[0].start_step == 10, result.error
    copies = all(r.timings.get("loaded_from_memory") == 1.0 for r in result.results)
    assert copies == (mode == "auto"), "the restart did not load from where it was meant to"
    first = max(r.timings["first_step_at"] for r in result.results)
    out = {"total": first - removed, "ckpt_load": max(r.timings["load_s"] for r in result.results)}
    ray.shutdown()
    cluster.shutdown()
    return out


def main_node_loss(reps: int) -> None:
    from raytrain_ckpt.common.logs import setup_logging

    setup_logging()
    # A private session root and no auth: these clusters must not touch any other Ray on the machine.
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rtc-", dir="/tmp")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ.pop("RAY_ADDRESS", None)
    rows: dict[str, list[dict[str, float]]] = {"peer replica": [], "storage": []}
    for _ in range(reps):
        for name, mode in (("peer replica", "auto"), ("storage", "off")):
            with tempfile.TemporaryDirectory() as d:
                rows[name].append(node_loss(Path(d), mode))
    print(f"node loss after step 10 committed, resume from step 10; median of {reps} runs, seconds")
    for name, runs in rows.items():
        m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{name:<14} node removed -> first step after resume {m['total']:6.2f}  (ckpt_load {m['ckpt_load']:.2f})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--memory", action="store_true", help="restart from memory vs from storage, large state")
    p.add_argument("--dim", type=int, default=1536)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--ffn", type=int, default=4864)
    p.add_argument("--cold", action="store_true", help="--memory: evict the checkpoint files from the page cache "
                   "when the rank dies (storage reads the disk; checkpoint.verify_on_load=size, or the "
                   "verification would read them back in)")
    p.add_argument("--node-loss", action="store_true", help="node loss: peer replica vs storage (3-node cluster)")
    args = p.parse_args()
    if args.node_loss:
        main_node_loss(args.reps)
        return
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
    if args.memory:
        memory_vs_storage(args.reps, {"dim": args.dim, "n_layers": args.layers, "n_heads": 12, "ffn_dim": args.ffn},
                          args.cold)
        ray.shutdown()
        return
    rows: dict[str, list[dict[str, float]]] = {"raytrain_ckpt": [], "  no reuse": [], "Ray Train": []}
    errors: dict[str, list[str]] = {name: [] for name in rows}
    runners = {"raytrain_ckpt": ours, "  no reuse": lambda tmp: ours(tmp, reuse=False), "Ray Train": ray_train}
    for _ in range(args.reps):
        for name, runner in runners.items():
            with tempfile.TemporaryDirectory() as d:
                r = _measured(name, runner, Path(d), errors[name])
                if r is not None:
                    rows[name].append(r)
    ray.shutdown()
    _print_recovery(rows, errors, args.reps, raytrain_peer.available())


def _measured(name: str, runner, tmp: Path, errors: list[str]) -> dict[str, float] | None:
    """One run of a row; a run that fails (a peer's error on a loaded machine) is kept as its error
    line, and the other rows still run and print."""
    try:
        return runner(tmp)
    except Exception as exc:  # reported below as the row's failure, with its error
        errors.append(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300])
        print(f"{name.strip()}: run failed: {errors[-1]}", flush=True)
        return None


def _print_recovery(rows: dict[str, list[dict[str, float]]], errors: dict[str, list[str]], reps: int,
                    peer_installed: bool) -> None:
    print(f"kill rank 1 before step {KILL_STEP + 1}, resume from step 10; median of {reps} runs, seconds")
    med = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in rows.items() if runs}
    for name, m in med.items():
        parts = ", ".join(f"{k} {v:.0f}" if k == "reused" else f"{k} {v:.2f}" for k, v in m.items() if k != "total")
        print(f"{name:<14} kill -> first step after resume {m['total']:6.2f}" + (f"  ({parts})" if parts else ""))
    for name, runs in rows.items():
        if runs:
            print(f"{name.strip():<14} each run: " + ", ".join(f"{r['total']:.2f}" for r in runs)
                  + (" (first step " + ", ".join(f"{r['first_step']:.2f}" for r in runs) + ")"
                     if "first_step" in runs[0] else ""))
        if errors[name]:
            print(f"{name.strip():<14} FAILED {len(errors[name])} of {reps} run(s): " + "; ".join(errors[name]))
    if "Ray Train" in med:
        for name in ("raytrain_ckpt", "  no reuse"):
            if name in med:
                print(f"ratio {name.strip()} / Ray Train: {med[name]['total'] / med['Ray Train']['total']:.3f}")
    elif not peer_installed:
        print('Ray Train not installed: pip install -e ".[bench]" to compare')
    else:
        print("Ray Train: no run completed, so no ratio (its errors are above)")


if __name__ == "__main__":
    main()
