"""`ray job submit` against a real head started by cluster/start_head.sh.

The head runs as `ray start --head --block` in its own session on free ports with a
private temp dir and a private token, so it neither sees nor disturbs the local Ray
that other tests in this session share through ``ray.init()``. It is torn down with a
SIGTERM to its process group, never with `ray stop` (which would kill every Ray on
the machine).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from bench.dashboard_screenshot import api_get, free_ports, session_pids

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
START_HEAD = REPO / "cluster" / "start_head.sh"
JOB_SPEC = REPO / "jobs" / "llama_debug_fsdp.yaml"
ENTRYPOINT = ["python", "-m", "raytrain_ckpt", "run", str(JOB_SPEC),
              "--set", "training.steps=5", "--set", "lr_scheduler.warmup_steps=2",
              "--set", "training.log_every_steps=1"]
# The head is sized for the demo job (2 workers x 1 CPU); the entrypoint itself takes none.
HEAD_CPUS = 2

if shutil.which("ray") is None or sys.platform != "linux":
    pytest.skip("needs the `ray` CLI and Linux /proc", allow_module_level=True)


class Head:
    """A `--block` head in its own session; ``stop()`` is idempotent."""

    def __init__(self, pythonpath: str | None = None) -> None:
        """``pythonpath``: the PYTHONPATH the head's processes (its workers) are started with."""
        self.port, self.dashboard_port = free_ports(2)
        self.api = f"http://127.0.0.1:{self.dashboard_port}"
        # Short path on purpose: Ray's unix sockets live under it (limit ~107 chars).
        self.temp_dir = tempfile.mkdtemp(prefix="rtj-", dir="/tmp")
        self.token = secrets.token_hex(32)
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH")}
        # A private token: the test neither reads nor creates ~/.ray/auth_token.
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token)
        # Whatever runs the job must find this checkout's python and package first.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        self.env = env
        head_env = dict(env, PYTHONPATH=pythonpath) if pythonpath else env
        self.log_path = os.path.join(self.temp_dir, "start_head.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            ["bash", str(START_HEAD), "--block", "--port", str(self.port),
             "--dashboard-port", str(self.dashboard_port), "--num-cpus", str(HEAD_CPUS),
             "--temp-dir", self.temp_dir],
            env=head_env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            # Own session: pid == pgid == sid, one handle for every process of this head.
            start_new_session=True,
        )
        self.sid = self.proc.pid
        self.stopped = False

    def log(self) -> str:
        self._log.flush()
        return Path(self.log_path).read_text(errors="replace")[-4000:]

    def get(self, path: str) -> tuple[int, str]:
        return api_get(self.api, self.token, path, timeout_s=3)

    def wait_ready(self, timeout: float = 60.0) -> None:
        # The jobs endpoint needs the token and the job agent: once it answers, submit works.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.get("/api/jobs/")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"job API at {self.api} not ready after {timeout:.0f}s:\n{self.log()}")

    def ray_cli(self, *args: str, auth: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        env = dict(self.env)
        if not auth:
            env.pop("RAY_AUTH_MODE", None)
        return subprocess.run(["ray", *args], env=env, capture_output=True, text=True,
                              timeout=timeout, cwd=REPO)

    def stop(self) -> list[int]:
        """SIGTERM the process group; returns the pids of this head still alive after."""
        if self.stopped:
            return []
        self.stopped = True
        try:
            os.killpg(self.sid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        # start_head.sh caps Ray's SIGTERM drain at 3 s; the rest is process exit.
        deadline = time.monotonic() + 45
        while time.monotonic() < deadline and (self.proc.poll() is None or session_pids(self.sid)):
            time.sleep(0.5)
        left = session_pids(self.sid)
        if left:
            # Never leave a stray cluster behind on a shared machine, even when failing.
            try:
                os.killpg(self.sid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self._log.close()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return left


CLUSTER_SIDE = """
def dim(asked):
    return asked
"""


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """One head for the module's tests, in order: the last one stops it and checks what is left.
    Its processes start with a directory on PYTHONPATH that only they have (``rtc_cluster_side``)."""
    site = tmp_path_factory.mktemp("cluster-site")
    (site / "rtc_cluster_side.py").write_text(CLUSTER_SIDE)
    h = Head(pythonpath=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    try:
        h.wait_ready()
        yield h
    finally:
        h.stop()


def test_job_submit_runs_the_demo_job_on_a_token_auth_head(head):
    # The submit client sends the token only with RAY_AUTH_MODE=token in its own
    # environment, even though the head turned auth on: this is the classic 401.
    denied = head.ray_cli("job", "list", "--address", head.api, auth=False, timeout=60)
    assert denied.returncode != 0
    assert "Missing authentication token" in denied.stdout + denied.stderr

    sub_id = f"rtc-test-{secrets.token_hex(4)}"
    # --working-dir ships this checkout: the entrypoint runs inside the unpacked copy,
    # so `python -m raytrain_ckpt` imports it without an install, and the job's Ray
    # workers get the same copy on their path.
    done = head.ray_cli("job", "submit", "--address", head.api, "--submission-id", sub_id,
                        "--metadata-json", '{"owner": "the-submitter"}',
                        "--working-dir", str(REPO), "--", *ENTRYPOINT, timeout=150)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert f"Job '{sub_id}' succeeded" in out, out[-6000:]
    assert "SUCCEEDED" in out, out[-6000:]
    assert f"submitted job {sub_id}: named llama-debug-fsdp on the Ray dashboard" in out, out[-6000:]

    # the job names itself where the dashboard's Jobs page (Name: metadata.job_name) and the
    # state API read a submitted job, the submitter's keys kept beside the job's own
    code, body = head.get(f"/api/jobs/{sub_id}")
    meta = json.loads(body)["metadata"]
    assert meta["job_name"] == "llama-debug-fsdp" and meta["owner"] == "the-submitter", meta
    assert meta["raytrain_ckpt.workers"] == "2" and meta["raytrain_ckpt.steps"] == "5", meta
    assert meta["raytrain_ckpt.status"] == "raytrain-ckpt status --job llama-debug-fsdp", meta
    listed = head.ray_cli("list", "jobs", "--detail", "--format", "json", "--address", head.api, timeout=60)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    [row] = [j for j in json.loads(listed.stdout) if j.get("submission_id") == sub_id]
    assert row["metadata"]["job_name"] == "llama-debug-fsdp" and row["metadata"]["owner"] == "the-submitter", row

    # `ray job status` exits 0 whatever the job's state, so read what it says.
    status = head.ray_cli("job", "status", "--address", head.api, sub_id, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "succeeded" in status.stdout + status.stderr
    code, body = head.get(f"/api/jobs/{sub_id}")
    assert code == 200 and json.loads(body)["status"] == "SUCCEEDED", body


def _project_copy(dest: Path) -> Path:
    """The package and nothing else, as a user's project directory: ``--working-dir`` ships it."""
    shutil.copytree(REPO / "raytrain_ckpt", dest / "raytrain_ckpt",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def test_a_spec_of_name_and_model_restarts_and_resumes_across_two_submits_with_a_code_change(head, tmp_path):
    """A new user's spec says only ``name`` and ``model``. Under ``ray job submit`` its working
    directory is Ray's temporary copy of the code, a new one when the code changes: the
    checkpoints go to the persistent results base instead, a crash restarts the group (restarts are
    on by default), and the second submit, after a code change, resumes where the first ended."""
    project = _project_copy(tmp_path / "project")
    (project / "job.yaml").write_text("name: submit-twice\nmodel: {name: debug}\n")
    results = tmp_path / "results"

    def submit(steps: int, faults: str = "") -> str:
        sub_id = f"rtc-twice-{secrets.token_hex(4)}"
        entry = ["env", f"RAYTRAIN_CKPT_RESULTS={results}", f"RAYTRAIN_CKPT_FAULTS={faults}",
                 "python", "-m", "raytrain_ckpt", "run", "job.yaml", "--set", f"training.steps={steps}"]
        done = head.ray_cli("job", "submit", "--address", head.api, "--submission-id", sub_id,
                            "--working-dir", str(project), "--", *entry, timeout=240)
        out = done.stdout + done.stderr
        assert done.returncode == 0 and f"Job '{sub_id}' succeeded" in out, out[-6000:]
        return out

    first = submit(8, faults="exit@step:rank=1,step=5")
    assert "checkpoint.dir is relative" not in first  # the spec names no dir: the default base, not a temp dir
    # the crash restarted the group: restarts are on by default
    assert "crash; restart 1/3" in first, first[-6000:]
    steps = sorted(p.name for p in (results / "submit-twice").glob("step-*"))
    assert steps and steps[-1] == "step-00000008", (steps, first[-4000:])

    # A code change: Ray unpacks the next submit into another _ray_pkg_ directory.
    (project / "raytrain_ckpt" / "local_note.py").write_text("NOTE = 'changed between the submits'\n")
    second = submit(10)
    assert "resumed at step 8" in second, second[-6000:]
    assert (results / "submit-twice" / "step-00000010").is_dir()


USER_FACTORY = """
from torch import nn


class Tiny(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.embed = nn.Embedding(256, dim)
        self.layers = nn.ModuleList([nn.Linear(dim, dim)])
        self.head = nn.Linear(dim, 256)

    def forward(self, tokens):
        return self.head(self.layers[0](self.embed(tokens)))


def build(dim=16):
    import rtc_cluster_side  # on the PYTHONPATH the cluster's processes were started with, not the driver's
    import rtc_relative  # on the driver's PYTHONPATH, as a path relative to the driver's working directory

    return Tiny(rtc_cluster_side.dim(rtc_relative.dim(dim)))
"""


def test_run_joins_a_started_cluster_and_its_ranks_import_a_factory_beside_the_spec(head, tmp_path):
    """`run` without --address on a machine where a cluster runs (RAY_ADDRESS, or the one `ray
    start` recorded) joins it; its workers started before the driver, so the spec file's
    directory and the driver's PYTHONPATH reach them only through the job's runtime_env, and the
    PYTHONPATH the cluster was started with stays theirs too (the factory imports from both); a
    relative entry of the driver's PYTHONPATH means the driver's directory on every node."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "rtc_beside_the_spec.py").write_text(USER_FACTORY)
    spec = project / "job.yaml"
    spec.write_text(f"""name: beside-the-spec
model: {{name: "rtc_beside_the_spec:build", overrides: {{dim: 16}}}}
training: {{steps: 3, global_batch_size: 4, micro_batch_size: 2, seq_len: 16}}
resources: {{num_workers: 2, cpus_per_worker: 1}}
checkpoint: {{enabled: true, dir: {tmp_path / "ckpt"}, interval_steps: 3}}
""")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "relative-site").mkdir(parents=True)
    (elsewhere / "relative-site" / "rtc_relative.py").write_text(CLUSTER_SIDE)
    env = dict(head.env, RAY_ADDRESS=f"127.0.0.1:{head.port}",
               PYTHONPATH=os.pathsep.join(["relative-site", head.env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    done = subprocess.run([sys.executable, "-m", "raytrain_ckpt", "run", str(spec)], env=env, cwd=elsewhere,
                          capture_output=True, text=True, timeout=150)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    assert "SUCCEEDED" in out, out[-6000:]
    assert (tmp_path / "ckpt" / "beside-the-spec" / "step-00000003").is_dir(), out[-3000:]
    # the cluster it joined ran the job (a local Ray would have been started and stopped by the driver)
    code, body = head.get("/api/jobs/")
    assert code == 200 and any(j.get("type") == "DRIVER" and j.get("status") == "SUCCEEDED"
                               for j in json.loads(body)), body[-2000:]


def test_a_joined_cluster_may_grow_so_a_spec_larger_than_it_waits(head, tmp_path):
    """Joined without --address (RAY_ADDRESS), as with --address: the cluster may be autoscaled, so
    a spec asking for more CPUs than it has now waits start_timeout_s for it to grow instead of
    failing at once as it does on a local Ray this driver started."""
    spec = tmp_path / "job.yaml"
    spec.write_text(f"""name: larger-than-the-cluster
model: {{name: debug}}
training: {{steps: 2, global_batch_size: 4, micro_batch_size: 1, seq_len: 8}}
resources: {{num_workers: {HEAD_CPUS + 2}, cpus_per_worker: 1}}
checkpoint: {{enabled: false}}
fault_tolerance: {{max_restarts: 0, start_timeout_s: 2}}
""")
    env = dict(head.env, RAY_ADDRESS=f"127.0.0.1:{head.port}")
    done = subprocess.run([sys.executable, "-m", "raytrain_ckpt", "run", str(spec)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=150)
    out = done.stdout + done.stderr
    assert done.returncode not in (0, 2), out[-4000:]  # not a usage error: the cluster might have grown
    assert f"{HEAD_CPUS + 2:g} CPU needed, {HEAD_CPUS:g} in the cluster" in out, out[-4000:]
    assert "waiting up to fault_tolerance.start_timeout_s for the cluster to grow" in out, out[-4000:]
    assert f"could not reserve {HEAD_CPUS + 2} x {{'CPU': 1.0}} within 2s" in out, out[-4000:]


def test_ray_job_stop_commits_the_step_in_hand_and_a_resubmit_resumes_there(head, tmp_path):
    """`ray job stop` sends SIGTERM to the entrypoint (then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S,
    which the job supervisor reads from the job's env_vars): the driver's handler commits the step
    in hand within fault_tolerance.stop_grace_s, and the next submit resumes there."""
    project = _project_copy(tmp_path / "project")
    (project / "job.yaml").write_text("name: stop-resume\nmodel: {name: debug}\n")
    results = tmp_path / "results"
    # a save every 5 steps; rank 0 pauses 3 s after each of steps 6 to 9 (12 s in all: two CLI starts on a
    # loaded machine fit in it): the stop comes mid-run, before the interval save of step 10
    faults = ";".join(f"slow@step:rank=0,step={s}" for s in (6, 7, 8, 9))
    env_json = json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"}})

    def submit(steps: int, *flags: str, faults: str = "") -> tuple[str, subprocess.CompletedProcess]:
        sub_id = f"rtc-stop-{secrets.token_hex(4)}"
        entry = ["env", f"RAYTRAIN_CKPT_RESULTS={results}", f"RAYTRAIN_CKPT_FAULTS={faults}", "python", "-m",
                 "raytrain_ckpt", "run", "job.yaml", "--set", f"training.steps={steps}", "--set",
                 "checkpoint.interval_steps=5", "--set", "fault_tolerance.poll_interval_s=0.2",
                 "--set", "fault_tolerance.stop_grace_s=20"]
        return sub_id, head.ray_cli("job", "submit", "--address", head.api, "--submission-id", sub_id, *flags,
                                    "--working-dir", str(project), "--runtime-env-json", env_json, "--", *entry,
                                    timeout=240)

    sub_id, done = submit(40, "--no-wait", faults=faults)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    root = results / "stop-resume"
    deadline = time.monotonic() + 180
    while not (root / "step-00000005" / "manifest.json").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (root / "step-00000005" / "manifest.json").exists(), head.ray_cli(
        "job", "logs", "--address", head.api, sub_id).stdout[-4000:]
    # the dashboard URL `ray job` takes finds the running job's cluster, and says which it used
    shown = subprocess.run([sys.executable, "-m", "raytrain_ckpt", "status", "--job", "stop-resume", "--address",
                            head.api], cwd=REPO, env=head.env, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert f"cluster: {head.api} (GCS " in shown.stdout and "job stop-resume: RUNNING" in shown.stdout, shown.stdout
    stop = head.ray_cli("job", "stop", "--address", head.api, sub_id, timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    code, body = head.get(f"/api/jobs/{sub_id}")
    assert code == 200 and json.loads(body)["status"] == "STOPPED", body
    logs = head.ray_cli("job", "logs", "--address", head.api, sub_id).stdout
    m = re.search(r"stopped: job stop-resume: SIGTERM: step (\d+) is committed and safe", logs)
    assert m, logs[-4000:]
    safe = int(m.group(1))
    assert 5 < safe < 10 and (root / f"step-{safe:08d}" / "manifest.json").exists()  # not the interval save
    # STOPPED, as Ray says, in the driver's log, the job's record and `status`: not FAILED
    line = f"SIGTERM: step {safe} is committed and safe"
    assert f"RUNNING -> STOPPED ({line})" in logs and "-> FAILED" not in logs, logs[-4000:]
    record = json.loads((root / ".job.json").read_text())
    assert record["job_info"]["state"] == "STOPPED" and record["stopped"] == line and record["error"] is None, record
    shown = subprocess.run([sys.executable, "-m", "raytrain_ckpt", "status", str(root)], cwd=REPO, env=head.env,
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "STOPPED" in shown.stdout and f"stopped by {line}" in shown.stdout, shown
    _, again = submit(safe + 2)
    out = again.stdout + again.stderr
    assert again.returncode == 0 and "succeeded" in out, out[-4000:]
    assert f"resumed at step {safe}" in out, out[-4000:]


def test_the_head_stops_with_nothing_left(head):
    left = head.stop()
    assert left == [], f"processes of the head survived SIGTERM: {left}"
    assert session_pids(head.sid) == []

    # A local Ray this pytest process shares with other tests must be untouched.
    import ray

    if ray.is_initialized():
        assert ray.get(ray.put(41)) + 1 == 42
