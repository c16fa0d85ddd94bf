"""A finished job stays on the dashboard: Prometheus marks a series stale five minutes after its
last sample (the driver and workers are gone), so every stat panel (the controller state, the
attempt, the steps, the work at risk) reads the last value within the dashboard's time range
(``last_over_time(...[$__range])``); the time series panels show the job's history in that range."""

from __future__ import annotations

import json
import re

from raytrain_ckpt.observe.dashboard import packaged_dashboard


def _panels(panels: list[dict]) -> list[dict]:
    out = []
    for panel in panels:
        out += [panel, *_panels(panel.get("panels", []))]
    return out


def test_every_stat_panel_reads_the_last_value_in_the_time_range():
    dashboard = json.loads(packaged_dashboard().read_text())
    stats = [p for p in _panels(dashboard["panels"]) if p.get("type") == "stat"]
    assert {p["title"] for p in stats} >= {"Controller state", "Attempt", "Training step", "Committed step"}
    for panel in stats:
        for target in panel["targets"]:
            selectors = re.findall(r'(\w*\(?)ray_raytrain_ckpt_\w+\{[^}]*\}(\[\$__range\])?', target["expr"])
            assert selectors and all(fn == "last_over_time(" and rng for fn, rng in selectors), (panel["title"],
                                                                                                 target["expr"])
