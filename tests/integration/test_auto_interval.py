"""``checkpoint.interval_steps: auto`` on a real Ray job with failures injected at a known rate:
the interval it settles on is the Young-Daly optimum for the save cost it measured and the
failure rate the job really had, within what the spec's prior can pull it away."""

from __future__ import annotations

import math
import time

import pytest

from raytrain_ckpt.checkpoint.policy.interval import PRIOR_WEIGHT
from raytrain_ckpt.control.controller import JobState
from raytrain_ckpt.control.driver import run_job
from raytrain_ckpt.common.faults import ENV_VAR
from raytrain_ckpt.control.preflight import load_spec

pytestmark = pytest.mark.integration

PRIOR_S = 20.0
FAULTS = ["exit@step:rank=1,step=14,attempt=0", "exit@step:rank=1,step=24,attempt=1",
          "exit@step:rank=1,step=34,attempt=2"]


def test_auto_interval_settles_near_the_young_daly_optimum(ray_cluster, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, ";".join(FAULTS))
    spec = load_spec("jobs/llama_debug_fsdp.yaml", [
        "training.steps=40", "checkpoint.enabled=true", "checkpoint.interval_steps=auto",
        f"fault_tolerance.expected_mtbf_s={PRIOR_S}", "fault_tolerance.max_restarts=3",
        "checkpoint.keep_latest_k=2", f"checkpoint.dir={tmp_path}"])
    t0 = time.time()
    result = run_job(spec)
    t1 = time.time()
    assert result.state is JobState.SUCCEEDED, result.error
    assert result.attempts == len(FAULTS) + 1
    d = result.checkpoints["interval"]
    assert d is not None and d["reason"] == "young-daly", d
    # the facts the last attempt decided from are the job's: every injected failure, the time it ran
    failures = len(FAULTS)
    assert d["failures"] == failures
    started = min(t for t, what in result.events if what == "attempt 0 starting")
    last_start = max(t for t, what in result.events if what == f"attempt {failures} starting")
    assert last_start - started <= d["survived_s"] <= t1 - t0
    assert d["cost_s"] > 0 and d["step_time_s"] > 0
    # The analytic optimum at the injected rate: failures over the time survived.
    observed_mtbf = d["survived_s"] / failures
    optimum = math.sqrt(2 * d["cost_s"] * observed_mtbf) / d["step_time_s"]
    # The policy's estimate is the weighted mean of the prior (weight w) and that rate (weight
    # failures), so the interval is off the optimum by at most the factor sqrt(estimate / rate),
    # plus half a step of rounding; it is clamped to [1, steps].
    estimate = (PRIOR_WEIGHT * PRIOR_S + failures * observed_mtbf) / (PRIOR_WEIGHT + failures)
    assert d["mtbf_s"] == pytest.approx(estimate)
    factor = math.sqrt(estimate / observed_mtbf)
    low, high = sorted((optimum, optimum * factor))
    low, high = max(1, math.floor(low - 0.5)), min(spec.training.steps, math.ceil(high + 0.5))
    assert low <= d["steps"] <= high, (d, optimum, factor)
