"""Ask a Prometheus for every query of the shipped Grafana dashboard, as Grafana would for one
job, and print how many series each returns and the largest value among them: which panels show
data for a real run, and what they show (a panel of event counts reads 0 when it misses an event).

    .venv/bin/python scripts/check_panels.py --job demo [--prometheus http://localhost:9090]

Exit 0 when every panel has data, 1 otherwise (the panels without are listed).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.parse
import urllib.request

from raytrain_ckpt.observe.dashboard import packaged_dashboard


def _targets(panels: list[dict]) -> list[tuple[str, str]]:
    out = []
    for panel in panels:
        out += _targets(panel.get("panels", []))
        out += [(panel.get("title", "?"), t["expr"]) for t in panel.get("targets", []) if t.get("expr")]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", required=True, help="the job's name (the dashboard's $job)")
    p.add_argument("--prometheus", default="http://localhost:9090")
    args = p.parse_args()
    dashboard = json.loads(packaged_dashboard().read_text())
    empty: dict[str, int] = {}
    seen: dict[str, int] = {}
    top: dict[str, float] = {}
    for title, expr in _targets(dashboard["panels"]):
        query = expr.replace("$job", args.job).replace("$__rate_interval", "1m").replace("$__range", "1h")
        url = f"{args.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": query})
        result = json.load(urllib.request.urlopen(url, timeout=10))["data"]["result"]
        seen[title] = seen.get(title, 0) + len(result)
        for series in result:
            top[title] = max(top.get(title, float("-inf")), float(series["value"][1]))
    for title, n in seen.items():
        print(f"{n:>4} series  {'max ' + format(top[title], '.6g') if title in top else '':<16} {title}")
        if n == 0:
            empty[title] = n
    print(f"{len(seen) - len(empty)} of {len(seen)} panels have data" + (f"; none: {', '.join(empty)}" if empty else ""))
    return 1 if empty else 0


if __name__ == "__main__":
    sys.exit(main())
