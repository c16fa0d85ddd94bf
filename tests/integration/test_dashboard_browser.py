"""The Ray dashboard in a real headless browser (Debian's Chromium) while a job runs: the
actors page shows each actor's short repr with the job's name (given only in the spec file),
and the dashboard's job API (what its Jobs page is built from) has the job's name and spec in
the job's metadata (Ray 2.60's job page does not render a driver job's metadata).
``bench/dashboard_screenshot.py`` drives the same job and browser to take the README's
screenshot. Skipped, saying why, where Chromium is not installed."""

from __future__ import annotations

import json
import urllib.request

import pytest

from bench.dashboard_screenshot import JOB, chromium, frozen_job, page_text

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(chromium() is None, reason="no Chromium (Debian package chromium: "
                                                            "apt-get install -y chromium)")]


def test_the_dashboard_names_the_job_and_its_actors():
    with frozen_job() as port:
        actors = page_text(f"http://127.0.0.1:{port}/#/actors")
        jobs = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/api/jobs/", timeout=30))
        driver_jobs = [j for j in jobs if (j.get("metadata") or {}).get("job_name") == JOB]
        assert len(driver_jobs) == 1, jobs
    for repr_ in (f"TrainWorker({JOB} rank 0/2)", f"TrainWorker({JOB} rank 1/2)", f"CheckpointActor({JOB})",
                  f"CheckpointWriter({JOB})"):
        assert repr_ in actors, repr_
    assert "object at 0x" not in actors
    meta = driver_jobs[0]["metadata"]
    assert meta["raytrain_ckpt.workers"] == "2" and meta["raytrain_ckpt.steps"] == "20"
    assert meta["raytrain_ckpt.spec_hash"]
