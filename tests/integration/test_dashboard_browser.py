"""The Ray dashboard in a real headless browser (Debian's Chromium) while a job submitted with
``ray job submit`` runs on a token-auth head (``cluster/start_head.sh``): the browser gets in
with the dashboard's token cookie; the Jobs page names the submitted job (its name is given
only in the spec file, so it comes from the metadata the driver added), the job's page shows
that metadata, and the Actors page each actor's short repr. Afterwards ``ray job stop`` ends the
job STOPPED and nothing of the head or the job is left (``submitted_job`` checks and raises).
``bench/dashboard_screenshot.py`` drives the same job and browser to take the README's
screenshots. Skipped, saying why, where Chromium is not installed."""

from __future__ import annotations

import json
import shutil

import pytest

from bench.dashboard_screenshot import JOB, REPRS, Browser, chromium, submitted_job

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(chromium() is None, reason="no Chromium (Debian package chromium: "
                                                            "apt-get install -y chromium)"),
              pytest.mark.skipif(shutil.which("ray") is None, reason="needs the `ray` CLI")]


def test_the_dashboard_shows_the_submitted_job_and_its_actors():
    with submitted_job() as job:
        with Browser(job.api, job.token) as browser:
            jobs = browser.open(f"{job.api}/#/jobs", (job.submission_id,))
            detail = browser.open(f"{job.api}/#/jobs/{job.submission_id}", (job.submission_id, "RUNNING"))
            actors = browser.open(f"{job.api}/#/actors", REPRS[:1])
        code, body = job.get(f"/api/jobs/{job.submission_id}")
    # the Jobs list's row: the Name column is the job's name, the submission id beside it
    row = jobs[jobs.index(job.submission_id) - 40:jobs.index(job.submission_id) + 200]
    assert JOB in row and "RUNNING" in jobs, jobs[-3000:]
    assert f'"job_name": "{JOB}"' in detail and '"raytrain_ckpt.workers": "2"' in detail, detail[:3000]
    for repr_ in REPRS:
        assert repr_ in actors, (repr_, actors[-3000:])
    assert "object at 0x" not in actors
    assert code == 200, body
    meta = json.loads(body)["metadata"]
    assert meta["job_name"] == JOB and meta["raytrain_ckpt.workers"] == "2", meta
    assert meta["raytrain_ckpt.spec_hash"]

