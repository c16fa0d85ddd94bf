"""The metric catalogue, the Grafana dashboard built on it, and the pure parts of progress reporting."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from raytrain_ckpt.cli.main import main
from raytrain_ckpt.checkpoint.roles.summary import summary_line
from raytrain_ckpt.checkpoint.roles.steps import inflight_phase
from raytrain_ckpt.observe.metrics import METRICS, PHASES, exported_names

DASHBOARD = Path(__file__).resolve().parents[2] / "cluster" / "grafana_dashboard.json"
_NAME = re.compile(r"\bray_[a-z0-9_]+")
_SELECTOR = re.compile(r"\b(ray_[a-z0-9_]+)\{([^}]*)\}")


def _queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return exprs + [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]


def test_every_dashboard_query_names_an_exported_metric():
    dashboard = json.loads(DASHBOARD.read_text())
    queries = _queries(dashboard)
    assert len(queries) >= 20
    names = exported_names()
    for expr in queries:
        used = _NAME.findall(expr)
        assert used, f"query names no metric: {expr}"
        unknown = set(used) - names
        assert not unknown, f"{expr}: {sorted(unknown)} are not defined in raytrain_ckpt/observe/metrics.py"


def test_dashboard_selectors_use_only_tags_the_metric_has():
    tags = {n: METRICS[n.removeprefix("ray_raytrain_ckpt_").removesuffix(s)].tags
            for n in exported_names() for s in ("_bucket", "_sum", "_count", "") if n.endswith(s)
            and n.removeprefix("ray_raytrain_ckpt_").removesuffix(s) in METRICS}
    for expr in _queries(json.loads(DASHBOARD.read_text())):
        for name, selector in _SELECTOR.findall(expr):
            labels = {part.split("=")[0].strip(" !~") for part in selector.split(",") if part}
            assert labels <= set(tags[name]) | {"le"}, f"{expr}: {name} has tags {tags[name]}"


def test_every_metric_is_on_the_dashboard():
    text = DASHBOARD.read_text()
    missing = [m.name for m in METRICS.values() if f"ray_{m.name}" not in text]
    assert not missing, f"metrics with no panel: {missing}"


def test_metric_definitions_are_well_formed():
    for short, m in METRICS.items():
        assert m.name == f"raytrain_ckpt_{short}" and re.fullmatch(r"[a-z][a-z0-9_]*", m.name)
        assert m.help.endswith(".") and m.tags[0] == "job"
        assert (m.kind == "counter") == m.name.endswith("_total")


@pytest.mark.parametrize("planning, handed_off, written, phase", [
    (True, 0, 0, "planning"), (False, 0, 0, "staging"), (True, 1, 0, "staging"), (False, 3, 0, "staging"),
    (False, 4, 0, "writing"), (False, 4, 3, "writing"), (False, 4, 4, "committing"),
])
def test_inflight_phase(planning, handed_off, written, phase):
    assert inflight_phase(planning, handed_off, written, world_size=4) == phase
    assert phase in PHASES


def test_summary_line():
    status = {"latest": 120, "world_size": 4, "inflight": {"step": 130, "phase": "writing",
                                                          "ranks": {0: 2, 1: 2, 2: 2, 3: 1}}}
    assert summary_line(status) == "committed=120 inflight=130 writing 3/4 ranks"
    assert summary_line({**status, "latest": None, "inflight": {"step": None, "phase": "idle", "ranks": {}}}) == \
        "committed=- inflight=-"


def test_inspect_commands_reject_bad_paths(tmp_path, capsys):
    assert main(["verify", str(tmp_path / "step-00000001")]) == 2
    assert "no such step directory" in capsys.readouterr().err
    assert main(["status"]) == 2
    assert main(["status", str(tmp_path), "--job", "x"]) == 2
    assert main(["ls", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("error:") == 3


def test_status_watch_refreshes(tmp_path, capsys):
    import argparse

    from raytrain_ckpt.cli import status as ckpt_inspect

    args = argparse.Namespace(command="status", dir=str(tmp_path), job=None, address=None, watch=0.01, json=False,
                              checksum=False)
    assert ckpt_inspect.run(args, refreshes=2) == 0
    out = capsys.readouterr().out
    assert out.count("checkpoints in") == 2 and "resume point: none (a fresh start)" in out


def test_controller_observer_counts_failures_and_restarts_by_cause(monkeypatch):
    from raytrain_ckpt.observe import metrics
    from raytrain_ckpt.control.controller import Controller, JobState
    from raytrain_ckpt.control.metrics import ControllerMetrics
    from raytrain_ckpt.spec import JobSpec
    from tests.unit.test_controller import FakeWorkerGroup

    recorded: list[tuple[str, float, dict]] = []
    monkeypatch.setattr(metrics, "record", lambda name, value, tags: recorded.append((name, value, dict(tags))))
    groups: list[FakeWorkerGroup] = []

    def factory(spec: JobSpec, attempt: int) -> FakeWorkerGroup:
        groups.append(FakeWorkerGroup(spec, attempt))
        return groups[-1]

    spec = JobSpec(name="obs", fault_tolerance={"max_restarts": 2})
    ctrl = Controller(spec, factory, sleep=lambda s: None, observer=ControllerMetrics("obs"))
    ctrl.step()  # STARTING -> RUNNING
    groups[-1].advance(3)
    ctrl.step()  # a poll: step 3 and no checkpoints, so 3 steps at risk
    groups[-1].kill(1)
    ctrl.step()  # RUNNING -> RECOVERING (crash)
    ctrl.step()  # -> STARTING
    ctrl.step()  # -> RUNNING, attempt 1
    groups[-1].fail(0)
    ctrl.step()  # exception
    assert ctrl.state is JobState.RECOVERING and ctrl.restarts == 2

    def values(name: str, **tags: str) -> list[float]:
        return [v for n, v, t in recorded if n == name and tags.items() <= t.items()]

    assert values("job_failures_total", cause="crash") == [1] and values("job_failures_total", cause="exception") == [1]
    assert values("job_restarts_total", cause="crash") == [1] and values("job_restarts_total", cause="exception") == [1]
    assert values("job_attempt")[-1] == 1
    assert values("job_state", state="RECOVERING")[-1] == 1 and values("job_state", state="RUNNING")[-1] == 0
    at_risk = values("work_at_risk_steps")
    assert at_risk[0] == 3 and at_risk[-1] == 0  # without checkpoints a restart starts over


def test_the_packaged_dashboard_is_the_one_in_cluster():
    from raytrain_ckpt.observe.dashboard import packaged_dashboard

    assert packaged_dashboard().read_bytes() == DASHBOARD.read_bytes()


RARE_EVENT_COUNTERS = ("job_failures_total", "job_restarts_total", "job_replica_heals_total", "job_preemption_steps_lost_total",
                       "train_rollbacks_total", "train_skipped_samples_total")


def test_rare_event_counters_are_not_read_with_increase():
    """A Ray counter's series appears at its first increment, already at its value: Prometheus's
    increase()/rate() of a series whose first sample is 1 is 0, so a panel built that way reads 0
    for a job's one crash, preemption or rollback (seen on a real scrape). These panels read the
    counter's value (max_over_time) instead."""
    dashboard = json.loads(DASHBOARD.read_text())
    for name in RARE_EVENT_COUNTERS:
        exprs = [q for q in _queries(dashboard) if f"ray_raytrain_ckpt_{name}" in q]
        assert exprs, name
        for q in exprs:
            assert not re.search(r"\b(increase|rate|irate)\(", q), q


def test_a_replica_groups_heal_is_counted_as_a_heal_not_a_restart(monkeypatch):
    from raytrain_ckpt.observe import metrics
    from raytrain_ckpt.control.controller import Controller, JobState
    from raytrain_ckpt.control.metrics import ControllerMetrics
    from raytrain_ckpt.spec import JobSpec
    from tests.unit.test_controller import FakeWorkerGroup, HealingGroup

    recorded: list[tuple[str, float, dict]] = []
    monkeypatch.setattr(metrics, "record", lambda name, value, tags: recorded.append((name, value, dict(tags))))
    FakeWorkerGroup.created = []
    spec = JobSpec(name="obs", resources={"num_workers": 2}, parallelism={"dp_replicate": 2, "dp_shard": 1},
                   fault_tolerance={"max_restarts": 2})
    ctrl = Controller(spec, lambda s, a: HealingGroup(s, a), sleep=lambda s: None, observer=ControllerMetrics("obs"))
    ctrl.step()
    FakeWorkerGroup.created[-1].kill(1)
    ctrl.step()  # replica group 1 replaced: the job trains on
    assert ctrl.state is JobState.RUNNING
    FakeWorkerGroup.created[-1].kill(1)
    FakeWorkerGroup.created[-1].kill(0)
    ctrl.step()  # ranks of both groups together: a whole-job restart
    assert ctrl.state is JobState.RECOVERING

    def values(name: str, **tags: str) -> list[float]:
        return [v for n, v, t in recorded if n == name and tags.items() <= t.items()]

    assert values("job_replica_heals_total", cause="crash") == [1]
    assert values("job_restarts_total", cause="crash") == [1] and values("job_failures_total") == [1, 1]


def _recorded(monkeypatch) -> tuple[list[tuple[str, float, dict]], Callable[..., list[float]]]:
    from raytrain_ckpt.observe import metrics

    recorded: list[tuple[str, float, dict]] = []
    monkeypatch.setattr(metrics, "record", lambda name, value, tags: recorded.append((name, value, dict(tags))))

    def values(name: str, **tags: str) -> list[float]:
        return [v for n, v, t in recorded if n == name and tags.items() <= t.items()]

    return recorded, values


def test_a_finished_job_the_driver_rejects_reads_failed_in_the_metrics(monkeypatch):
    """The end check fails a job whose final checkpoint did not commit after ``run()`` returned:
    the job's state and failures by cause say FAILED and "checkpoint", as the JobResult does."""
    from raytrain_ckpt.control.controller import Controller, JobState
    from raytrain_ckpt.control.metrics import ControllerMetrics
    from raytrain_ckpt.spec import JobSpec
    from tests.unit.test_controller import FakeWorkerGroup

    _, values = _recorded(monkeypatch)
    FakeWorkerGroup.created = []
    ctrl = Controller(JobSpec(name="obs"), FakeWorkerGroup, sleep=lambda s: None, observer=ControllerMetrics("obs"))
    ctrl.step()
    FakeWorkerGroup.created[-1].finish()
    assert ctrl.run().state is JobState.SUCCEEDED and values("job_state", state="SUCCEEDED")[-1] == 1
    ctrl.reject("checkpoint", "the final checkpoint (step 10) did not commit: disk full")
    assert ctrl.result.state is JobState.FAILED
    assert values("job_state", state="FAILED")[-1] == 1 and values("job_state", state="SUCCEEDED")[-1] == 0
    assert values("job_failures_total", cause="checkpoint") == [1]


def test_a_job_its_observer_stops_reads_failed_in_the_metrics(monkeypatch):
    """Another run took the checkpoint root over: the driver's observer stops the job after the
    poll it observed; the metrics see the FAILED state and its failure, not the RUNNING before."""
    from raytrain_ckpt.control.controller import Controller, JobState
    from raytrain_ckpt.control.metrics import ControllerMetrics
    from raytrain_ckpt.spec import JobSpec
    from tests.unit.test_controller import FakeWorkerGroup

    _, values = _recorded(monkeypatch)
    metrics_of = ControllerMetrics("obs")
    lost: list[str] = []

    def observe(ctrl: Controller) -> None:  # as the driver's: metrics, then the run lock's check
        metrics_of(ctrl)
        if lost:
            ctrl.stop("checkpoint", lost[0])

    FakeWorkerGroup.created = []
    ctrl = Controller(JobSpec(name="obs"), FakeWorkerGroup, sleep=lambda s: None, observer=observe)
    ctrl.step()
    lost.append("the run lock was taken over by another run")
    assert ctrl.run().state is JobState.FAILED
    assert values("job_state", state="FAILED")[-1] == 1 and values("job_state", state="RUNNING")[-1] == 0
    assert values("job_failures_total", cause="checkpoint") == [1]


class _HealFails:
    """A replica group whose replacement cannot start: the restart the heal spent restarts the job."""

    def heal(self, replica: int) -> None:
        from raytrain_ckpt.control.poll import GroupStartError

        raise GroupStartError("no bundle for the replacement")


def _replica_job(monkeypatch, group_class):
    """A 2-replica job on ``group_class`` (fake groups), its controller observed by the metrics and
    stepped once; with the recorded metric values."""
    from raytrain_ckpt.control.controller import Controller
    from raytrain_ckpt.control.metrics import ControllerMetrics
    from raytrain_ckpt.spec import JobSpec
    from tests.unit.test_controller import FakeWorkerGroup

    _, values = _recorded(monkeypatch)
    FakeWorkerGroup.created = []
    spec = JobSpec(name="obs", resources={"num_workers": 2}, parallelism={"dp_replicate": 2, "dp_shard": 1},
                   fault_tolerance={"max_restarts": 2})
    ctrl = Controller(spec, group_class, sleep=lambda s: None, observer=ControllerMetrics("obs"))
    ctrl.step()
    return ctrl, values


def test_a_heal_whose_replacement_did_not_start_is_counted_as_the_restart_it_became(monkeypatch):
    from raytrain_ckpt.control.controller import JobState
    from tests.unit.test_controller import FakeWorkerGroup, HealingGroup

    class Group(_HealFails, HealingGroup):
        pass

    ctrl, values = _replica_job(monkeypatch, Group)
    FakeWorkerGroup.created[-1].kill(1)
    ctrl.step()  # replica group 1's replacement does not start: the whole job restarts
    assert ctrl.state is JobState.RECOVERING and ctrl.restarts == 1 and len(ctrl.result.heals) == 1
    assert values("job_restarts_total", cause="crash") == [1]
    assert ctrl.result.restarts == {"crash": 1}


def test_a_drains_heal_spends_no_restart_and_takes_none_from_the_count(monkeypatch):
    """A replica group moved off a draining node spends no restart; the crash restart after it is
    counted, and the counter never goes back."""
    from raytrain_ckpt.control.controller import JobState
    from raytrain_ckpt.control.watch.replicas import ReplicaHeals
    from tests.unit.test_controller import FakeWorkerGroup, HealingGroup

    class Group(HealingGroup):
        def heal(self, replica: int, off_node: bool = False) -> None:
            super().heal(replica)

    ctrl, values = _replica_job(monkeypatch, Group)
    group = FakeWorkerGroup.created[-1]
    heals = ctrl.watch(ReplicaHeals)
    assert heals is not None and heals.move_off(group, "n1", (1,), 0, 0, "drain")
    assert group.healed == [1] and ctrl.restarts == 0
    group.kill(0)
    group.kill(1)
    ctrl.step()  # ranks of both groups: a whole-job restart
    assert ctrl.state is JobState.RECOVERING and ctrl.restarts == 1 and len(ctrl.result.heals) == 1
    assert values("job_restarts_total", cause="crash") == [1]
    assert ctrl.result.restarts == {"crash": 1}
    assert all(v > 0 for v in values("job_restarts_total"))
