"""The Python API on the session's Ray: a shortened demo job run in-process, quietly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import raytrain_ckpt

pytestmark = pytest.mark.integration

DEMO = "jobs/llama_debug_fsdp.yaml"
SHORT = ["training.steps=4", "training.log_every_steps=1", "lr_scheduler.warmup_steps=2",
         "resources.cpus_per_worker=1", "fault_tolerance.max_restarts=0"]


def test_run_returns_the_result_and_inspection_sees_the_checkpoint(ray_cluster, tmp_path, capfd):
    from raytrain_ckpt.observe.dashboard import DASHBOARD_FILE, dashboards_dir

    dashboard = dashboards_dir() / DASHBOARD_FILE
    dashboard.unlink(missing_ok=True)  # an earlier test's job may have put it there
    result = raytrain_ckpt.run(DEMO, [*SHORT, f"checkpoint.dir={tmp_path}"])
    assert dashboard.is_file()  # the job put it beside Ray's own dashboards: no import step
    assert result.state is raytrain_ckpt.JobState.SUCCEEDED, result.error
    assert sorted(result.losses) == [1, 2, 3, 4] and result.failures == []
    root = tmp_path / "llama-debug-fsdp"
    rows = raytrain_ckpt.ls(root)
    assert [(r.step, r.status) for r in rows] == [(4, "valid")]
    assert raytrain_ckpt.verify(root / "step-00000004") == []
    assert raytrain_ckpt.status(root)["resume_step"] == 4
    # Ray's core worker prints this when an actor that may restart got constructor arguments
    # it keeps in the object store (an actor handle): the restart could fail once they are gone.
    err = capfd.readouterr().err
    assert "constructor arguments in the object store" not in err


def test_run_takes_a_dict_and_overrides_beat_it(tmp_path):
    import yaml

    raw = yaml.safe_load(open(DEMO))
    spec = raytrain_ckpt.resolve_spec(raw, ["training.steps=3", f"checkpoint.dir={tmp_path}"])
    assert spec.training.steps == 3 and spec.name == raw["name"]
    assert raytrain_ckpt.resolve_spec(spec) is spec
    with pytest.raises(raytrain_ckpt.SpecError, match="training.steps"):
        raytrain_ckpt.resolve_spec(spec, ["training.steps=0"])


def test_the_dashboard_lands_in_the_sessions_grafana_directory(ray_cluster):
    from raytrain_ckpt.observe.dashboard import DASHBOARD_FILE, dashboards_dir, install_dashboard
    from raytrain_ckpt.observe.metrics import exported_names

    target = dashboards_dir()
    session = Path(ray_cluster._private.worker._global_node.get_session_dir_path())
    assert target == session / "metrics" / "grafana" / "dashboards"
    out = install_dashboard()
    assert out == target / DASHBOARD_FILE and out.is_file()
    dashboard = json.loads(out.read_text())
    assert dashboard["title"].startswith("raytrain_ckpt")
    queried = set(re.findall(r"\bray_[a-z0-9_]+", out.read_text()))
    assert queried and queried <= exported_names()
    # the same file stays in cluster/ for a Grafana that Ray does not provision
    assert (Path(__file__).resolve().parents[2] / "cluster" / "grafana_dashboard.json").read_bytes() == out.read_bytes()
