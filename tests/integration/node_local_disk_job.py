"""Run by test_node_local_disk.py in its own process (as root): a multi-node Ray cluster on this
machine (ray.cluster_utils.Cluster) whose nodes share the checkpoint directory, then one more
node started by `ray start` inside its own mount namespace (`unshare -m`) with a private tmpfs
mounted over the checkpoint directory: a node-local disk, for real.

1. A 2-CPU head + one 2-CPU node: the shared-storage preflight passes and removes its probes.
2. The private-disk node joins after that preflight: the same job's service, asked for the new
   node's writer (what a restart does for a replacement node), probes it and refuses it.
3. `raytrain-ckpt run` refuses a new job (exit 2, one line naming the node that does not share
   the directory) before anything trains.

Prints one JSON line with what happened.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # tests.conftest, this checkout's package and bench/, whichever the venv installed
from tests.conftest import ray_tmpdir  # noqa: E402

# A private session root and no auth: this cluster must not touch any other Ray on the machine.
os.environ["RAY_TMPDIR"] = ray_tmpdir()  # removed when this run exits
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "3"
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
os.environ.pop("RAY_ADDRESS", None)

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from bench.dashboard_screenshot import free_ports  # noqa: E402
from raytrain_ckpt.checkpoint.roles.service import CheckpointService  # noqa: E402
from raytrain_ckpt.control.preflight import load_spec  # noqa: E402

JOB = REPO / "jobs" / "llama_debug_fsdp.yaml"
NODE_TIMEOUT_S = 60.0


def _private_disk_node(address: str, ckpt: Path) -> subprocess.Popen:
    """`ray start --block` in its own mount namespace, with a tmpfs over ``ckpt`` only it sees."""
    agent, grpc, metrics, renv = free_ports(4)
    start = (f"exec {Path(sys.executable).with_name('ray')} start --address={address} --num-cpus=2 --block "
             f"--dashboard-agent-listen-port={agent} --dashboard-agent-grpc-port={grpc} "
             f"--metrics-export-port={metrics} --runtime-env-agent-port={renv}")
    command = f"mount -t tmpfs -o size=16M tmpfs {ckpt} && {start}"
    return subprocess.Popen(["unshare", "-m", "sh", "-c", command], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_nodes(n: int) -> None:
    deadline = time.monotonic() + NODE_TIMEOUT_S
    while sum(node["Alive"] for node in ray.nodes()) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {n} Ray nodes alive after {NODE_TIMEOUT_S:g}s")
        time.sleep(0.2)


def _listing(ckpt: Path, pid: int | None = None) -> list[str]:
    """Every path under ``ckpt`` as this process sees it, or as process ``pid``'s mount namespace does."""
    cmd = ["find", str(ckpt), "-mindepth", "1"]
    if pid is not None:
        cmd = ["nsenter", "-t", str(pid), "-m", "--", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return sorted(line.removeprefix(str(ckpt)) for line in out.stdout.splitlines())


def _shared_preflight(ckpt: Path) -> tuple[dict, CheckpointService]:
    spec = load_spec(JOB, [f"checkpoint.dir={ckpt}", "fault_tolerance.start_timeout_s=60"])
    logs: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logs.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("raytrain_ckpt.checkpoint.roles").addHandler(handler)
    logging.getLogger("raytrain_ckpt.checkpoint.roles").setLevel(logging.INFO)
    service = CheckpointService(spec)
    try:
        service.preflight()
        error = None
    except Exception as exc:  # reported in the JSON line: the test names it
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "logs": [m for m in logs if "shared by" in m], "files": _listing(ckpt)}, service


def _late_node(service: CheckpointService, private_id: str, shared_ids: list[str]) -> dict:
    """The running job's service asked for writers: a probed node's, then the late private node's."""
    try:
        service.writer_for(shared_ids[-1])
        shared_error = None
        service.writer_for(private_id)
        error = None
    except Exception as exc:  # reported in the JSON line: the test names it
        error = f"{type(exc).__name__}: {exc}"
    finally:
        service.shutdown()
    return {"shared_error": shared_error, "error": error}


def _refused_run(address: str, ckpt: Path) -> dict:
    cmd = [sys.executable, "-m", "raytrain_ckpt", "run", str(JOB), "--address", address,
           "--set", f"checkpoint.dir={ckpt}", "--set", "training.steps=4",
           "--set", "fault_tolerance.start_timeout_s=60"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO)
    return {"rc": out.returncode, "stdout": out.stdout[-2000:], "stderr": out.stderr[-6000:]}


def main(root: str) -> None:
    ckpt = Path(root) / "ckpt"
    ckpt.mkdir()
    t0 = time.monotonic()
    seconds: dict[str, float] = {}  # where the time goes (this box is small and shared)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    private: subprocess.Popen | None = None
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        seconds["cluster"] = time.monotonic() - t0
        shared, service = _shared_preflight(ckpt)
        seconds["shared_preflight"] = time.monotonic() - t0 - sum(seconds.values())
        (ckpt / "host-only").write_text("the private node's tmpfs hides this file")
        private = _private_disk_node(cluster.address, ckpt)
        _wait_nodes(3)
        shared_ids = [cluster.head_node.node_id, *(w.node_id for w in cluster.worker_nodes)]
        private_id = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] not in shared_ids)
        seconds["private_node"] = time.monotonic() - t0 - sum(seconds.values())
        late = _late_node(service, private_id, shared_ids)
        refused = _refused_run(cluster.address, ckpt)
        seconds["refused_run"] = time.monotonic() - t0 - sum(seconds.values())
        result = {"shared": shared, "late": late, "refused": refused, "private_node": private_id, "seconds": seconds,
                  "shared_nodes": shared_ids,
                  "host_view": _listing(ckpt), "private_view": _listing(ckpt, private.pid)}
    finally:
        if private is not None:
            os.killpg(private.pid, signal.SIGTERM)
            private.wait(timeout=60)
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
