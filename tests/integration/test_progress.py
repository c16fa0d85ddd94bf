"""Checkpoint progress, end to end on a real Ray head with a metrics export port.

A job trains 12 steps (checkpoints at 5 and 10), then rank 0 hangs, which freezes the job in
a known state while its actors are alive. The Prometheus endpoint, ``raytrain-ckpt status
--job`` and the checkpoint directory must then agree: committed step 10, its bytes equal the
files' sizes, 2 steps at risk. The same real directory, copied and damaged, drives the
offline ``status``, ``ls`` and ``verify``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from raytrain_ckpt.checkpoint.storage.layout import CheckpointLayout

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYTRAIN_CKPT_FAULTS")}
    # Ray reports metrics every 10 s by default; 1 s keeps the test short.
    env.update(RAY_AUTH_MODE="token", RAY_metrics_report_interval_ms="1000",
               RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="3", PYTHONPATH=str(REPO), **extra)
    return env


class Head:
    """A private Ray head (``ray start --block`` in its own session) on free ports."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="rtm-", dir="/tmp"))  # short: Ray's socket paths
        gcs, self.metrics_port, *aux = _free_ports(6)
        from ray.util import get_node_ip_address

        self.address = f"{get_node_ip_address()}:{gcs}"
        if not Path("~/.ray/auth_token").expanduser().is_file():
            subprocess.run([RAY, "get-auth-token", "--generate"], check=True, capture_output=True)
        cmd = [RAY, "start", "--head", "--block", "--port", str(gcs),
               "--metrics-export-port", str(self.metrics_port), "--include-dashboard=false",
               "--ray-client-server-port", str(aux[0]), "--dashboard-agent-listen-port", str(aux[1]),
               "--dashboard-agent-grpc-port", str(aux[2]), "--runtime-env-agent-port", str(aux[3]),
               "--num-cpus", "4", "--temp-dir", str(self.tmp), "--disable-usage-stats"]
        self.log = open(self.tmp / "head.log", "w")
        self.proc = subprocess.Popen(cmd, env=_env(), stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_for_gcs(self, timeout_s: float = 60) -> None:
        """Return once the head's GCS port accepts connections."""
        host, port = self.address.rsplit(":", 1)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                return
            except OSError:
                assert self.proc.poll() is None, (self.tmp / "head.log").read_text()[-3000:]
                assert time.monotonic() < deadline, f"the head's GCS did not listen within {timeout_s} s"
                time.sleep(0.1)

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """raytrain metrics on the node's endpoint, keyed by (name, sorted labels we set)."""
        from prometheus_client.parser import text_string_to_metric_families

        keep = {"job", "rank", "phase", "stage", "state", "cause"}
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if "raytrain_ckpt" in s.name and not s.name.endswith("_bucket"):
                    out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k in keep)))] = s.value
        return out

    def stop(self) -> None:
        """SIGTERM to ``ray start --block`` stops every process of this head, and nothing else."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def hung_job(tmp_path_factory) -> Iterator[dict]:
    """A job frozen after step 12 (rank 0 hangs), checkpoints at 5 and 10, on a private head."""
    head = Head()
    ckpt_dir = tmp_path_factory.mktemp("ckpt")
    name = f"metrics-{uuid.uuid4().hex[:6]}"
    args = [sys.executable, "-m", "raytrain_ckpt", "run", "jobs/llama_debug_fsdp.yaml", "--set", f"name={name}",
            "--set", "training.steps=20", "--set", "checkpoint.interval_steps=5", "--set",
            f"checkpoint.dir={ckpt_dir}", "--set", "fault_tolerance.hang_timeout_s=600"]
    env = _env(RAY_ADDRESS=head.address, RAYTRAIN_CKPT_FAULTS="hang@step:rank=0,step=12")
    log = open(ckpt_dir / "driver.log", "w")
    driver = None
    try:
        head.wait_for_gcs()  # the driver connects once
        driver = subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        job = {"head": head, "name": name, "root": ckpt_dir / name, "env": env, "driver": driver}
        job["metrics"] = _wait_for_frozen(head, name, driver, ckpt_dir / "driver.log")
        yield job
    finally:
        if driver is not None and driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)  # the driver's actors die with it
            driver.wait()
        log.close()
        head.stop()


def _wait_for_frozen(head: Head, name: str, driver: subprocess.Popen, log: Path) -> dict:
    deadline = time.monotonic() + 240
    want = {("ray_raytrain_ckpt_checkpoint_committed_step", (("job", name),)): 10.0,
            ("ray_raytrain_ckpt_train_step", (("job", name), ("rank", "0"))): 12.0,
            ("ray_raytrain_ckpt_work_at_risk_steps", (("job", name),)): 2.0}
    seen: dict = {}
    while time.monotonic() < deadline:
        assert driver.poll() is None, f"driver exited {driver.returncode}:\n{log.read_text()[-3000:]}"
        try:
            seen |= head.scrape()  # the agent drops a gauge value once it was scraped: accumulate
        except OSError:
            pass  # the metrics agent is still starting
        if all(seen.get(k) == v for k, v in want.items()):
            return seen
        time.sleep(1)
    raise AssertionError(f"metrics never showed {want}; last: {sorted(seen.items())}\n{log.read_text()[-3000:]}")


def _sizes(step_dir: Path) -> dict[str, int]:
    manifest = CheckpointLayout(step_dir.parent).verify(step_dir, "checksum")
    return {name: (step_dir / name).stat().st_size for name in manifest.files}


def test_metrics_match_the_checkpoint_directory(hung_job):
    name, root, m = hung_job["name"], hung_job["root"], hung_job["metrics"]

    def v(metric: str, **tags: str) -> float | None:
        return m.get((f"ray_raytrain_ckpt_{metric}", tuple(sorted({"job": name, **tags}.items()))))

    layout = CheckpointLayout(root)
    assert sorted(layout.valid_steps()) == [5, 10]
    newest = layout.read_manifest(layout.step_dir(10))
    assert v("checkpoint_committed_step") == newest.step == 10
    sizes = {s: _sizes(layout.step_dir(s)) for s in (5, 10)}
    assert v("checkpoint_last_bytes") == sum(sizes[10].values()) == newest.total_bytes
    assert v("checkpoint_bytes_written_total") == sum(sum(s.values()) for s in sizes.values())
    assert v("checkpoint_commits_total") == 2
    assert v("checkpoint_last_commit_timestamp_seconds") == pytest.approx(newest.created_unix)
    for rank in (0, 1):  # the writer's per-rank bytes are that rank's shard files
        shard = sum(size for s in sizes.values() for f, size in s.items() if f.startswith(f"__{rank}_"))
        assert v("checkpoint_rank_bytes_written_total", rank=str(rank)) == shard
        assert v("checkpoint_stall_seconds_count", rank=str(rank)) == 2
    assert v("checkpoint_phase_seconds_count", phase="commit") == 2
    assert v("checkpoint_inflight_step") == -1 and v("checkpoint_inflight_phase", phase="idle") == 1
    assert v("job_state", state="RUNNING") == 1 and v("job_attempt") == 0
    assert v("work_at_risk_steps") == 2 and v("work_at_risk_seconds") > 0
    assert v("train_loss") is not None and v("train_tokens_per_second", rank="1") > 0


def test_live_status_from_the_running_job(hung_job):
    out = subprocess.run([sys.executable, "-m", "raytrain_ckpt", "status", "--job", hung_job["name"], "--json"],
                         cwd=REPO, env=hung_job["env"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["resume_step"] == 10 and data["summary"] == "committed=10 inflight=-"
    assert data["job"]["state"] == "RUNNING" and data["job"]["train_step"] == 12
    assert data["job"]["hang_timeout_s"] == 600 and 0 < data["job"]["goodput"] < 1   # the ledger so far
    text = subprocess.run([sys.executable, "-m", "raytrain_ckpt", "status", "--job", hung_job["name"]],
                          cwd=REPO, env=hung_job["env"], capture_output=True, text=True, timeout=120).stdout
    assert any(ln.startswith("hang timeout 600s (fixed); goodput so far ") for ln in text.splitlines()), text
    assert data["at_risk"]["steps"] == 2
    rows = {r["step"]: r for r in data["steps"]}
    assert sorted(rows) == [5, 10] and all(r["status"] == "valid" for r in rows.values())
    assert rows[10]["bytes"] == sum(_sizes(hung_job["root"] / "step-00000010").values())
    assert rows[10]["stall_s"] is not None and rows[10]["save_s"] > 0
    missing = subprocess.run([sys.executable, "-m", "raytrain_ckpt", "status", "--job", "no-such-job"],
                             cwd=REPO, env=hung_job["env"], capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no running job" in missing.stderr and "Traceback" not in missing.stderr


@pytest.fixture(scope="module")
def damaged(hung_job, tmp_path_factory) -> Path:
    """Copies of the job's real steps: valid, truncated, flipped byte, torn, never committed, moved aside."""
    src, root = hung_job["root"], tmp_path_factory.mktemp("damaged") / "job"
    root.mkdir()
    good = src / "step-00000010"
    shutil.copytree(src / "step-00000005", root / "step-00000005")
    shutil.copytree(good, root / "step-00000010")
    for target in ("step-00000020", "step-00000025", "step-00000030", "step-00000035.tmp-0123456789ab",
                   "step-00000010.invalid-deadbeef"):
        shutil.copytree(good, root / target)
    manifest = json.loads((good / "manifest.json").read_text())
    for step in (20, 25, 30):
        (root / f"step-{step:08d}" / "manifest.json").write_text(json.dumps({**manifest, "step": step}))
    with open(root / "step-00000020" / "__0_0.distcp", "r+b") as f:
        f.truncate(100)  # a torn write: the size no longer matches
    data = bytearray((root / "step-00000025" / "__1_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0xFF  # bit rot: same size, wrong CRC-32
    (root / "step-00000025" / "__1_0.distcp").write_bytes(bytes(data))
    (root / "step-00000030" / "manifest.json").unlink()  # never committed
    (root / "step-00000035.tmp-0123456789ab" / "manifest.json").unlink()  # a save still being written
    return root


class _Cli:
    """``raytrain-ckpt`` in this process (the offline commands need no Ray; a subprocess would
    spend most of its time importing torch)."""

    def __init__(self, capsys) -> None:
        self.capsys = capsys

    def __call__(self, *args: str) -> subprocess.CompletedProcess:
        from raytrain_ckpt.cli.main import main

        code = main(list(args))
        out = self.capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out.out, out.err)


def test_offline_status_and_ls_show_each_damage(damaged, capsys):
    _cli = _Cli(capsys)
    out = _cli("status", str(damaged), "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["name"]: r["status"] for r in json.loads(out.stdout)["steps"]}
    assert rows == {"step-00000005": "valid", "step-00000010": "valid", "step-00000020": "corrupt",
                    "step-00000025": "valid", "step-00000030": "torn", "step-00000035.tmp-0123456789ab": "torn",
                    "step-00000010.invalid-deadbeef": "moved-aside"}
    # a size check cannot see the flipped byte; --checksum can, and moves the resume point back
    assert json.loads(out.stdout)["resume_step"] == 25
    deep = json.loads(_cli("status", str(damaged), "--checksum", "--json").stdout)
    assert {r["name"]: r["status"] for r in deep["steps"]}["step-00000025"] == "corrupt"
    assert deep["resume_step"] == 10
    text = _cli("ls", str(damaged)).stdout
    assert "step-00000020" in text and "corrupt" in text and "has 100 bytes" in text
    assert _cli("status", str(damaged / "nope")).returncode == 2


def test_verify_exit_codes(damaged, capsys):
    _cli = _Cli(capsys)
    ok = _cli("verify", str(damaged / "step-00000010"))
    assert ok.returncode == 0 and "VALID" in ok.stdout
    for step, why in (("step-00000020", "has 100 bytes"), ("step-00000025", "CRC-32"),
                      ("step-00000030", "manifest.json"), ("step-00000035.tmp-0123456789ab", "manifest.json")):
        bad = _cli("verify", str(damaged / step))
        assert bad.returncode == 1, (step, bad.stdout)
        assert why in bad.stdout, (step, bad.stdout)
    assert _cli("verify", str(damaged / "step-00000099")).returncode == 2
    assert _cli("verify", str(damaged)).returncode == 2  # the job root, not a step
