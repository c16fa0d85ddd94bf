"""Fault tolerance is on by default: a spec that says nothing checkpoints (interval auto) under a
persistent results base and restarts a bounded number of times within a window; opting out is
explicit, and the job says at start what it is not protected against."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from raytrain_ckpt.control.preflight import in_ray_package_dir, persistent_paths, protection_line
from raytrain_ckpt.spec import JobSpec, SpecError
from raytrain_ckpt.common.locations import mask_uri


def test_a_spec_that_says_nothing_checkpoints_and_restarts(results_dir: Path):
    spec = JobSpec(name="new-user")
    assert spec.checkpoint.enabled and spec.checkpoint.interval_steps == "auto"
    assert spec.checkpoint.dir == results_dir  # the tests' RAYTRAIN_CKPT_RESULTS: never the real home
    assert spec.fault_tolerance.max_restarts == 3 and spec.fault_tolerance.failure_window_s == 3600.0


def test_the_results_base_defaults_to_the_home_directory(monkeypatch, tmp_path: Path):
    monkeypatch.delenv("RAYTRAIN_CKPT_RESULTS")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert JobSpec(name="x").checkpoint.dir == tmp_path / "raytrain_results"
    monkeypatch.setenv("RAYTRAIN_CKPT_RESULTS", "s3://bucket/runs/")
    assert JobSpec(name="x").checkpoint.dir == "s3://bucket/runs"


def test_opting_out_is_explicit_and_needs_no_other_change():
    spec = JobSpec(name="x", checkpoint={"enabled": False}, fault_tolerance={"max_restarts": 0})
    assert not spec.checkpoint.enabled and spec.fault_tolerance.max_restarts == 0
    with pytest.raises(ValueError, match="auto chooses how often to save"):  # said, not defaulted: still refused
        JobSpec(name="x", checkpoint={"enabled": False, "interval_steps": "auto"})


def test_the_job_says_what_it_is_not_protected_against():
    line = protection_line(JobSpec(name="x"))
    assert line.startswith("fault tolerance: restarts up to 3 times within 3600 s, checkpoints at an auto interval;")
    assert "more than 3 failures within 3600 s" in line and "a failure of this driver process" in line
    assert "\n" not in line
    off = protection_line(JobSpec(name="x", checkpoint={"enabled": False},
                                  fault_tolerance={"max_restarts": 0, "retry_on": ["crash"]}))
    assert "any worker failure ends the job (fault_tolerance.max_restarts=0)" in off
    assert "no checkpoints, a restart begins at step 0 (checkpoint.enabled=false)" in off
    some = protection_line(JobSpec(name="x", fault_tolerance={"retry_on": ["crash"], "failure_window_s": None}))
    assert "hang failures, not in fault_tolerance.retry_on" in some and "in the whole job" in some


def test_credentials_in_a_uri_are_refused_and_never_echoed():
    from raytrain_ckpt.spec import parse_spec

    with pytest.raises(SpecError) as err:
        parse_spec({"name": "x", "checkpoint": {"dir": "s3://user:hunter2@bucket/x"}}, Path.cwd())
    (line,) = err.value.problems
    assert "hunter2" not in line and "s3://user:***@bucket/x" in line and "holds credentials" in line


@pytest.mark.parametrize(("cwd", "env", "inside"), [
    ("/tmp/ray/session_1/runtime_resources/working_dir_files/_ray_pkg_0a1b", {}, True),
    ("/home/me/project", {"RAY_JOB_CONFIG_JSON_ENV_VAR": "{}"}, True),
    ("/home/me/project", {}, False),
])
def test_a_submitted_job_is_told_apart(cwd: str, env: dict, inside: bool):
    assert in_ray_package_dir(cwd, env) is inside


def test_a_relative_dir_under_ray_job_submit_goes_under_the_results_base(results_dir: Path, caplog):
    """Under `ray job submit` the working directory is Ray's copy of the code, a new one after each
    change: a relative checkpoint.dir there would start every submit from scratch."""
    caplog.set_level(logging.INFO)
    spec = JobSpec(name="x", checkpoint={"dir": "checkpoints", "final_export": {"format": "torch", "dir": "out"}})
    pkg = "/tmp/ray/session_1/runtime_resources/working_dir_files/_ray_pkg_0a1b"
    moved = persistent_paths(spec, pkg, {})
    assert moved.checkpoint.dir == results_dir / "checkpoints"
    assert moved.checkpoint.final_export.dir == results_dir / "out"
    assert "temporary copy of the code" in caplog.text
    assert persistent_paths(spec, "/home/me/project", {}) is spec  # a plain run: the working directory
    absolute = JobSpec(name="x", checkpoint={"dir": "/mnt/shared"})
    assert persistent_paths(absolute, pkg, {}) is absolute


@pytest.mark.parametrize(("text", "shown"), [
    ("s3://user:secret@bucket/x", "s3://user:***@bucket/x"),
    ("gs://token@bucket", "gs://***@bucket"),
    ("checkpoint.dir=s3://a:b@c/d: unreachable", "checkpoint.dir=s3://a:***@c/d: unreachable"),
    ("s3://bucket/x", "s3://bucket/x"),
])
def test_a_secret_in_a_uri_is_masked(text: str, shown: str):
    assert mask_uri(text) == shown
    assert SpecError([text]).problems == [shown]


@pytest.mark.parametrize("job", sorted((Path(__file__).resolve().parents[2] / "jobs").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_job_checkpoints_and_restarts(job: Path):
    from raytrain_ckpt.spec import parse_spec, read_spec

    spec = parse_spec(read_spec(job), job.parent)
    assert spec.checkpoint.enabled and spec.fault_tolerance.max_restarts > 0
    assert spec.checkpoint.interval_steps is not None or spec.checkpoint.interval_seconds is not None
