"""Screenshots of the Ray dashboard's Jobs, job and Actors pages while a job submitted with
``ray job submit`` runs.

Starts a private head the way ``cluster/start_head.sh`` documents it (``--block`` in its own
session, free ports, a private temp dir, token authentication with a private token given as
``RAY_AUTH_TOKEN``: ``~/.ray/auth_token`` is neither read nor created), submits the demo model
under the name ``dash-demo`` with ``ray job submit --no-wait`` (rank 0 slowed by 0.5 s a step,
checkpoints every 10 steps), waits until the job is RUNNING, step 10 is committed and its
``TrainWorker``/``CheckpointActor``/``CheckpointWriter`` actors are ALIVE, then has headless
Chromium (Debian package ``chromium``) render the pages to PNGs. The browser gets into the
token-protected dashboard the way its own login dialog does it: the ``ray-authentication-token``
cookie, set here through the DevTools protocol over a pipe (``--remote-debugging-pipe``: no
port is opened). Afterwards ``ray job stop`` (the driver commits the step in hand and the job
ends STOPPED), then a SIGTERM to the head's process group; it checks that no process of the
head and no staging buffer of the job is left. Usage::

    .venv/bin/python bench/dashboard_screenshot.py --out-dir docs/img
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import json
import logging
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
logger = logging.getLogger("dashboard_screenshot")

JOB = "dash-demo"
"""The job's name: only in its spec file, so a page that shows it got it from the job's metadata
or its actors, not from the entrypoint's command line (the Jobs page shows that too)."""
WORKERS = 2
STEPS = 2000
"""Far more than are run: the job is stopped once the pages are taken (at 0.5 s a step or more it
would run for over 15 minutes)."""
TOKEN_COOKIE = "ray-authentication-token"
"""Ray 2.60's dashboard cookie (``authentication_constants.AUTHENTICATION_TOKEN_COOKIE_NAME``):
its login dialog posts the token to ``/api/authenticate``, which sets it."""
REPRS = (f"TrainWorker({JOB} rank 0/{WORKERS})", f"TrainWorker({JOB} rank 1/{WORKERS})", f"CheckpointActor({JOB})",
         f"CheckpointWriter({JOB})")


def chromium() -> str | None:
    """Debian's Chromium, or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def free_ports(n: int) -> list[int]:
    """``n`` ports free right now (bind and release: a head started at once gets them)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def session_pids(sid: int) -> list[int]:
    """Live processes whose session is ``sid``: the head and everything it spawned."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # the command name may hold spaces
        if fields[0] != "Z" and int(fields[3]) == sid:
            pids.append(int(entry))
    return pids


def api_get(api: str, token: str, path: str, timeout_s: float = 10) -> tuple[int, str]:
    """(status, body) of a GET of the dashboard's ``path`` with the token as bearer."""
    req = urllib.request.Request(api + path, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


@dataclass
class SubmittedJob:
    """What the pages are taken of: the dashboard's URL, its token and the job's submission id."""

    api: str
    token: str
    submission_id: str

    def get(self, path: str) -> tuple[int, str]:
        return api_get(self.api, self.token, path)


class _Head:
    """``cluster/start_head.sh --block`` in its own session (pid == pgid == sid): one SIGTERM to
    that group stops this head and nothing else (never ``ray stop``, which stops every Ray on
    the machine)."""

    def __init__(self, tmp: Path, num_cpus: int) -> None:
        self.port, dash = free_ports(2)
        self.api = f"http://127.0.0.1:{dash}"
        self.token = secrets.token_hex(32)
        env = {k: v for k, v in os.environ.items()
               if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", "RAYTRAIN_CKPT_FAULTS", "PYTHONPATH")}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        self.env = env
        # short path: Ray's unix sockets live under it (~107 characters at most)
        self.temp_dir = tmp / "ray"
        self.log_path = tmp / "head.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                ["bash", str(REPO / "cluster" / "start_head.sh"), "--block", "--port", str(self.port),
                 "--dashboard-port", str(dash), "--num-cpus", str(num_cpus), "--temp-dir", str(self.temp_dir)],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.sid = self.proc.pid

    def get(self, path: str) -> tuple[int, str]:
        return api_get(self.api, self.token, path)

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.is_file() else ""

    def wait_ready(self, timeout_s: float = 180) -> None:
        """Until the job API answers with the token: the job agent is up, a submit works."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the head exited {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(OSError):
                if self.get("/api/jobs/")[0] == 200:
                    return
            time.sleep(1)
        raise TimeoutError(f"job API at {self.api} not ready after {timeout_s:g}s:\n{self.log_tail()}")

    def ray_job(self, *args: str, timeout_s: float = 180) -> str:
        """``ray job ARGS`` against this head."""
        done = subprocess.run(["ray", "job", args[0], "--address", self.api, *args[1:]], env=self.env,
                              capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
        if done.returncode != 0:
            tail = (done.stdout + done.stderr)[-3000:]
            raise RuntimeError(f"ray job {' '.join(args)} exited {done.returncode}:\n{tail}")
        return done.stdout + done.stderr

    def job(self, sub_id: str) -> dict:
        code, body = self.get(f"/api/jobs/{sub_id}")
        if code != 200:
            raise RuntimeError(f"/api/jobs/{sub_id}: {code} {body[:500]}")
        return json.loads(body)

    def alive_actors(self) -> list[dict]:
        code, body = self.get("/api/v0/actors?limit=1000&detail=true&filter_keys=state&filter_predicates=%3D"
                              "&filter_values=ALIVE")
        if code != 200:
            return []
        return json.loads(body).get("data", {}).get("result", {}).get("result", [])

    def stop(self) -> list[int]:
        """SIGTERM the head's process group; the pids that outlived it (then SIGKILLed)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.sid, signal.SIGTERM)
        deadline = time.monotonic() + 60  # start_head.sh caps Ray's drain at 3 s; the rest is exits
        while time.monotonic() < deadline and (self.proc.poll() is None or session_pids(self.sid)):
            time.sleep(0.5)
        left = session_pids(self.sid)
        if left:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.sid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        return left


@contextlib.contextmanager
def submitted_job(timeout_s: float = 420) -> Iterator[SubmittedJob]:
    """A private token-auth head and the demo job submitted to it with ``ray job submit
    --no-wait``, RUNNING with step 10 committed and its actors ALIVE; afterwards the job is
    stopped (``ray job stop``: it ends STOPPED), the head stopped, and what is left checked."""
    from raytrain_ckpt.checkpoint.datapath.buffers import BUFFER_GLOB, SHM_DIR_ENV, shm_dir

    tmp = Path(tempfile.mkdtemp(prefix="rtd-", dir="/tmp"))
    # the job's staging buffers in a folder of their own (RAM-backed still): what is left there is the job's
    shm = Path(tempfile.mkdtemp(prefix="rtd-", dir=shm_dir()))
    head: _Head | None = None
    sub_id = f"rtc-dash-{secrets.token_hex(4)}"
    running, ours = False, set()
    try:
        # the project as a user's directory: the package and the spec, shipped by --working-dir
        project = tmp / "project"
        shutil.copytree(REPO / "raytrain_ckpt", project / "raytrain_ckpt",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        spec = (REPO / "jobs" / "llama_debug_fsdp.yaml").read_text()
        (project / "dash_demo.yaml").write_text(spec.replace("name: llama-debug-fsdp", f"name: {JOB}"))
        ckpt = tmp / "ckpt"
        head = _Head(tmp, num_cpus=WORKERS + 1)  # the ranks, and one for a spare or a writer
        head.wait_ready()
        env_vars = {"RAY_JOB_STOP_WAIT_TIME_S": "120",  # the SIGTERM's grace before Ray's SIGKILL
                    SHM_DIR_ENV: str(shm), "RAYTRAIN_CKPT_FAULTS": "slow@step:rank=0,step=-1,seconds=0.5"}
        running = True
        out = head.ray_job("submit", "--no-wait", "--submission-id", sub_id, "--working-dir", str(project),
                           "--runtime-env-json", json.dumps({"env_vars": env_vars}), "--",
                           "python", "-m", "raytrain_ckpt", "run", "dash_demo.yaml",
                           "--set", f"training.steps={STEPS}", "--set", "checkpoint.interval_steps=10",
                           "--set", f"checkpoint.dir={ckpt}", "--set", "training.log_every_steps=10")
        logger.info("submitted %s to %s", sub_id, head.api)
        manifest = ckpt / JOB / "step-00000010" / "manifest.json"
        deadline = time.monotonic() + timeout_s
        while True:
            status = head.job(sub_id)["status"]
            if status in ("FAILED", "STOPPED", "SUCCEEDED"):
                raise RuntimeError(f"job {sub_id} is {status}:\n{head.ray_job('logs', sub_id)[-4000:]}")
            reprs = {a.get("repr_name") for a in head.alive_actors()}
            if status == "RUNNING" and manifest.is_file() and set(REPRS) <= reprs:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {sub_id}: {status}, actors {sorted(map(str, reprs))}, step 10 committed: "
                                   f"{manifest.is_file()}; after {timeout_s:g}s:\n{out[-2000:]}")
            time.sleep(2)
        logger.info("job %s RUNNING, step 10 committed, actors alive", sub_id)
        ours = set(session_pids(head.sid))  # the ranks' processes among them
        yield SubmittedJob(head.api, head.token, sub_id)
        # the job ends the way a user stops it: SIGTERM, the step in hand committed, STOPPED
        head.ray_job("stop", sub_id)
        running = False
        end = head.job(sub_id)
        if end["status"] != "STOPPED":
            raise RuntimeError(f"job {sub_id} ended {end['status']} after `ray job stop`: {end.get('message')}")
        logger.info("job %s STOPPED: %s", sub_id, end.get("message"))
    finally:
        left: list[int] = []
        if head is not None:
            if running and head.proc.poll() is None:
                with contextlib.suppress(Exception):  # a failure above: the job may still run
                    head.ray_job("stop", sub_id, timeout_s=180)
            left = head.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        left_buffers = sorted(map(str, shm.glob(BUFFER_GLOB)))
        shutil.rmtree(shm, ignore_errors=True)
        left_progress = [p for p in _progress_files() if p[1] in ours]
        if left:
            raise RuntimeError(f"processes of the head outlived its SIGTERM (SIGKILLed): {left}")
        if left_buffers:
            raise RuntimeError(f"staging buffers left behind: {left_buffers}")
        if left_progress:
            raise RuntimeError(f"progress files of the job's ranks left behind: {left_progress}")


def _progress_files() -> list[tuple[str, int]]:
    """(path, pid) of each rank progress file on this node (``rank/progress.py``)."""
    from raytrain_ckpt.rank import progress as nodeprogress

    out = []
    for path in nodeprogress._dir().glob("*.json") if nodeprogress._dir().is_dir() else ():
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            out.append((str(path), int(json.loads(path.read_text())["pid"])))
    return out


class Browser:
    """Headless Chromium driven through the DevTools protocol over a pipe (fds 3 and 4), with
    the dashboard's token cookie set for ``api``."""

    def __init__(self, api: str, token: str, width: int = 1600) -> None:
        exe = chromium()
        if exe is None:
            raise SystemExit("chromium not found: apt-get install -y chromium")
        self.width = width
        self._profile = tempfile.mkdtemp(prefix="rtc-chromium-")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def fds() -> None:  # the child's fd 3 reads commands, fd 4 writes answers
            r, w = fcntl.fcntl(to_child_r, fcntl.F_DUPFD, 10), fcntl.fcntl(from_child_w, fcntl.F_DUPFD, 10)
            os.dup2(r, 3)  # (above 10 first: neither end is overwritten by the other's move)
            os.dup2(w, 4)

        self.proc = subprocess.Popen(
            [exe, "--headless=new", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
             "--disable-background-networking", "--disable-dev-shm-usage", "--hide-scrollbars", "--no-first-run",
             f"--user-data-dir={self._profile}", f"--window-size={width},1000", "about:blank"],
            pass_fds=(3, 4), preexec_fn=fds, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        os.close(to_child_r)
        os.close(from_child_w)
        self._buf = b""
        self._id = 0
        try:
            target = self.call("Target.createTarget", url="about:blank")["targetId"]
            self._session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
            self.call("Network.enable", session=True)
            # what the dashboard's token dialog gets from /api/authenticate: the token as an HttpOnly cookie
            self.call("Network.setCookie", session=True, name=TOKEN_COOKIE, value=token, url=api, httpOnly=True,
                      sameSite="Strict")
        except BaseException:
            self.close()
            raise

    def call(self, method: str, session: bool = False, timeout_s: float = 120, **params: object) -> dict:
        self._id += 1
        msg: dict = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self._session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                answer = json.loads(raw)
                if answer.get("id") == self._id:  # events and other answers pass by
                    if "error" in answer:
                        raise RuntimeError(f"{method}: {answer['error']}")
                    return answer.get("result", {})
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_child], [], [], left)[0]:
                raise TimeoutError(f"Chromium did not answer {method} in {timeout_s:g}s")
            chunk = os.read(self._from_child, 1 << 20)
            if not chunk:
                raise RuntimeError(f"Chromium exited ({self.proc.poll()}) during {method}")
            self._buf += chunk

    def text(self) -> str:
        """The page's rendered text (the dashboard is a script-built page: its HTML alone is empty)."""
        got = self.call("Runtime.evaluate", session=True, expression="document.body ? document.body.innerText : ''",
                        returnByValue=True)
        return got.get("result", {}).get("value", "")

    def open(self, url: str, wait_for: tuple[str, ...] = (), height: int = 1000, timeout_s: float = 120) -> str:
        """Load ``url`` in a window ``height`` pixels high and wait until its text holds every
        string of ``wait_for``; the text."""
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=self.width, height=height,
                  deviceScaleFactor=1, mobile=False)
        self.call("Page.navigate", session=True, url=url)
        deadline = time.monotonic() + timeout_s
        while True:
            time.sleep(2)
            text = self.text()
            missing = [w for w in wait_for if w not in text]
            if not missing and "Loading" not in text:
                time.sleep(3)  # tables lay out after their text is in
                return self.text()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url}: {missing} not on the page after {timeout_s:g}s:\n{text[:3000]}")

    def screenshot(self, out: Path) -> None:
        """A PNG of the window."""
        data = self.call("Page.captureScreenshot", session=True, format="png")["data"]
        out.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call("Browser.close", timeout_s=10)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=20)
        with contextlib.suppress(ProcessLookupError):  # its helpers (renderer, zygote) too: its own group
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        os.close(self._to_child)
        os.close(self._from_child)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pages(job: SubmittedJob) -> list[tuple[str, str, tuple[str, ...], int]]:
    """(file name, route, text to wait for, window height) of each page taken: the Jobs list
    (Name from the job's metadata), the job's page (its metadata, the driver's log with the
    ranks' log prefixes) and the Actors list (the reprs)."""
    return [("dashboard_jobs.png", "#/jobs", (job.submission_id, JOB, "RUNNING"), 580),
            ("dashboard_job.png", f"#/jobs/{job.submission_id}",
             (job.submission_id, '"job_name": "dash-demo"', "RUNNING", REPRS[0]), 1160),
            ("dashboard_actors.png", "#/actors", REPRS, 1060)]


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, default=REPO / "docs" / "img")
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with submitted_job() as job, Browser(job.api, job.token) as browser:
        for name, route, wait_for, height in pages(job):
            out = args.out_dir / name
            browser.open(f"{job.api}/{route}", wait_for, height)
            browser.screenshot(out)
            logger.info("wrote %s (%d bytes)", out, out.stat().st_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
