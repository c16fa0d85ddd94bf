"""Screenshot of the Ray dashboard's actor list while a raytrain_ckpt job runs.

Starts a private one-node cluster with the dashboard (``cluster/local_cluster.py`` on a free
port, without token auth: the dashboard's web page would otherwise ask for the token), runs
the demo model with checkpoints every 5 steps and rank 0 made to hang after step 12 (so the
job stays up in a known state), waits for the commit of step 10, then has headless Chromium
(Debian package ``chromium``) render the actors page to a PNG, and stops everything it
started. Usage::

    .venv/bin/python bench/dashboard_screenshot.py --out docs/dashboard_actors.png
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
logger = logging.getLogger("dashboard_screenshot")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAYTRAIN_CKPT_FAULTS")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(RAY_AUTH_MODE="disabled", PYTHONPATH=str(REPO), **extra)
    return env


def _wait_for(path: Path, text: str, timeout_s: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and text in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            tail = path.read_text(errors="replace")[-2000:] if path.is_file() else ""
            raise RuntimeError(f"process {proc.pid} exited {proc.returncode} while waiting for {path}:\n{tail}")
        time.sleep(1)
    raise TimeoutError(f"{text!r} not in {path} after {timeout_s:g}s")


JOB = "dash-demo"
"""The job's name: only in its spec file, so a page that shows it got it from the job's metadata
or its actors, not from the driver's command line (the Jobs page shows that as entrypoint)."""


def chromium() -> str | None:
    """Debian's Chromium, or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _chromium_args(profile: str, budget_ms: int) -> list[str]:
    exe = chromium()
    if exe is None:
        raise SystemExit("chromium not found: apt-get install -y chromium")
    return [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-dev-shm-usage", "--hide-scrollbars", f"--user-data-dir={profile}", "--window-size=1700,1000",
            f"--virtual-time-budget={budget_ms}"]


def screenshot(url: str, out: Path, budget_ms: int = 20000) -> None:
    """A PNG of the page as headless Chromium renders it."""
    with tempfile.TemporaryDirectory(prefix="rtc-chromium-") as profile:
        subprocess.run([*_chromium_args(profile, budget_ms), f"--screenshot={out}", url],
                       check=True, capture_output=True, timeout=180)


def page_text(url: str, budget_ms: int = 20000) -> str:
    """The page's DOM once rendered (the dashboard is a script-built page: its HTML alone is empty)."""
    with tempfile.TemporaryDirectory(prefix="rtc-chromium-") as profile:
        out = subprocess.run([*_chromium_args(profile, budget_ms), "--dump-dom", url],
                             check=True, capture_output=True, text=True, timeout=180)
    return out.stdout


@contextlib.contextmanager
def frozen_job() -> Iterator[int]:
    """A private one-node cluster with the dashboard and a job held after step 12 (step 10
    committed); yields the dashboard's port, then stops everything it started."""
    tmp = Path(tempfile.mkdtemp(prefix="rts-", dir="/tmp"))
    dash, address_file = _free_port(), tmp / "address"
    spec = tmp / "dash_demo.yaml"
    spec.write_text((REPO / "jobs" / "llama_debug_fsdp.yaml").read_text().replace("name: llama-debug-fsdp", f"name: {JOB}"))
    cluster = subprocess.Popen(
        [sys.executable, str(REPO / "cluster" / "local_cluster.py"), "--workers", "0", "--head-cpus", "4",
         "--dashboard-port", str(dash), "--no-auth", "--temp-dir", str(tmp / "ray"),
         "--address-file", str(address_file)],
        env=_env(), stdout=open(tmp / "cluster.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
    driver = None
    try:
        _wait_for(address_file, ":", 180, cluster)
        env = _env(RAY_ADDRESS=address_file.read_text().strip(), RAYTRAIN_CKPT_FAULTS="hang@step:rank=0,step=12")
        log = tmp / "driver.log"
        cmd = [sys.executable, "-m", "raytrain_ckpt", "run", str(spec), "--set", "training.steps=20",
               "--set", "checkpoint.interval_steps=5", "--set", f"checkpoint.dir={tmp / 'ckpt'}",
               "--set", "fault_tolerance.hang_timeout_s=600"]
        with open(log, "w") as f:
            driver = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        _wait_for(log, "committed step 10", 300, driver)
        time.sleep(5)  # let the dashboard's actor table catch up
        yield dash
    finally:
        if driver is not None and driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
        cluster.send_signal(signal.SIGTERM)  # local_cluster.py removes every node it started
        cluster.wait(timeout=120)
        shutil.rmtree(tmp, ignore_errors=True)
        # the job was killed, not stopped: its writers' staging buffers are orphans now (what
        # `raytrain-ckpt clean-buffers` removes); a live job's buffers are left alone
        from raytrain_ckpt.checkpoint.datapath.buffers import shm_dir, sweep_orphans

        sweep_orphans(shm_dir())


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "docs" / "dashboard_actors.png")
    p.add_argument("--page", default="#/actors", help="dashboard route to render")
    p.add_argument("--budget-ms", type=int, default=20000, help="Chromium virtual time for the page to render")
    p.add_argument("--also", nargs=2, action="append", default=[], metavar=("PAGE", "OUT"),
                   help="another route and PNG of the same job (e.g. '#/jobs' docs/dashboard_jobs.png)")
    args = p.parse_args()
    with frozen_job() as dash:
        for page, out in [(args.page, args.out), *((pg, Path(o)) for pg, o in args.also)]:
            out.parent.mkdir(parents=True, exist_ok=True)
            screenshot(f"http://127.0.0.1:{dash}/{page}", out, args.budget_ms)
            logger.info("wrote %s (%d bytes)", out, out.stat().st_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
