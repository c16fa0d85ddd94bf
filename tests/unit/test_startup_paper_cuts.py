"""Starting up from anywhere. ``scripts/metrics_stack.sh`` from any directory: with an interpreter that cannot import
raytrain_ckpt it fails with one ``error:`` line (no traceback, no ``cp: cannot stat ''``); with
one that can, it finds the repository from its own path and provisions the dashboard. ``run``
logs where a relative checkpoint.dir of a submitted job went, after logging starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "metrics_stack.sh"


def _session(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A head's session directory with Ray's Prometheus config, and a PATH whose ``prometheus`` exits at once."""
    session = tmp_path / "session"
    (session / "metrics" / "prometheus").mkdir(parents=True)
    (session / "metrics" / "prometheus" / "prometheus.yml").write_text("scrape_configs:\n- job_name: ray\n")
    (session / "logs").mkdir()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "prometheus").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "prometheus").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "PYTHONPATH")}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    return session, env


def test_an_interpreter_without_raytrain_ckpt_is_one_error_line(tmp_path):
    session, env = _session(tmp_path)
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'ModuleNotFoundError: raytrain_ckpt' >&2\nexit 1\n")
    broken.chmod(0o755)
    proc = subprocess.run(["bash", str(SCRIPT), str(session)], cwd=tmp_path, capture_output=True, text=True,
                          env={**env, "PYTHON": str(broken)}, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and proc.stderr.startswith("error: "), proc.stderr
    assert "cannot import raytrain_ckpt" in proc.stderr and "cp:" not in proc.stderr


def test_outside_the_repository_it_finds_the_repository_from_its_own_path(tmp_path):
    session, env = _session(tmp_path)
    proc = subprocess.run(["bash", str(SCRIPT), str(session)], cwd=tmp_path, capture_output=True, text=True,
                          env={**env, "PYTHON": sys.executable}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (session / "metrics" / "grafana" / "dashboards" / "raytrain_ckpt_grafana_dashboard.json").is_file()
    assert "error:" not in proc.stderr


def test_run_logs_where_a_relative_checkpoint_dir_went_in_a_submitted_job(tmp_path):
    """Under ``ray job submit`` a relative checkpoint.dir is resolved against the results base; the
    line saying so comes after logging starts (a bad fault plan stops ``run`` before Ray)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_JOB_CONFIG_JSON_ENV_VAR": "{}",
           "RAYTRAIN_CKPT_RESULTS": str(tmp_path / "results"), "RAYTRAIN_CKPT_FAULTS": "nonsense"}
    proc = subprocess.run([sys.executable, "-m", "raytrain_ckpt", "run", str(REPO / "jobs" / "llama_debug_fsdp.yaml"),
                           "--set", "checkpoint.dir=ckpts"], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "checkpoint.dir is relative and this is a submitted Ray job" in proc.stderr, proc.stderr
    assert f"using {tmp_path / 'results' / 'ckpts'}" in proc.stderr
