#!/usr/bin/env bash
# Prometheus and Grafana for a running Ray cluster: Ray's generated configuration, and the
# raytrain_ckpt dashboard provisioned beside Ray's own dashboards.
#
#   scripts/metrics_stack.sh [SESSION_DIR]   # default /tmp/ray/session_latest (run it on the head)
#
# Environment: PROM_PORT (default 9090), PYTHON (default the repository's .venv/bin/python, else python3),
# GRAFANA_HOME (default /usr/share/grafana). Ctrl-C stops both (they are this script's children).
#
# It follows Ray's conventions: Prometheus runs with <session>/metrics/prometheus/prometheus.yml
# (plus honor_labels, see below), which finds every node's metrics endpoint through Ray's
# service-discovery file (what `ray metrics launch-prometheus` runs, with Debian's `prometheus`
# instead of a download), and
# Grafana with <session>/metrics/grafana/grafana.ini, whose provisioning loads every dashboard in
# <session>/metrics/grafana/dashboards/, where our dashboard is copied (a job's driver does the
# same at start). Ray writes both files when the head runs the dashboard (the default).
# Grafana is not packaged in Debian (`apt-get install prometheus` is): without grafana-server,
# Prometheus runs alone and the script shows what the nodes' metrics endpoints serve.
set -euo pipefail
session=$(readlink -f "${1:-/tmp/ray/session_latest}")
prom_port=${PROM_PORT:-9090}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-$( [ -x "$repo/.venv/bin/python" ] && echo "$repo/.venv/bin/python" || echo python3 )}
prom_cfg=$session/metrics/prometheus/prometheus.yml
grafana_ini=$session/metrics/grafana/grafana.ini
if [ ! -f "$prom_cfg" ]; then
    echo "error: $prom_cfg not found: pass the head's session directory (Ray writes it when the head runs the dashboard)" >&2
    exit 2
fi
command -v prometheus >/dev/null || { echo "error: prometheus not found: apt-get install -y prometheus" >&2; exit 2; }

# the repository on the path: the script works from any directory, installed or not
dashboard=$(PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$python" -c \
    'import yaml; from raytrain_ckpt.observe.dashboard import packaged_dashboard; print(packaged_dashboard())' 2>/dev/null) \
    || { echo "error: $python cannot import raytrain_ckpt and yaml: set PYTHON to the interpreter raytrain_ckpt is installed in (or create $repo/.venv: pip install -e $repo)" >&2; exit 2; }
dashboards=$session/metrics/grafana/dashboards
mkdir -p "$dashboards"
cp "$dashboard" "$dashboards/raytrain_ckpt_grafana_dashboard.json"
echo "dashboard: $dashboards/raytrain_ckpt_grafana_dashboard.json"

# Ray's configuration with honor_labels: our metrics carry a `job` label (the job's name), which
# Prometheus would otherwise rename to `exported_job` under its own scrape-job label `job="ray"`:
# every panel of our dashboard (which selects job=~"$job") would show nothing.
ours=$session/metrics/prometheus/prometheus_raytrain_ckpt.yml
"$python" - "$prom_cfg" "$ours" <<'PY'
import sys, yaml
cfg = yaml.safe_load(open(sys.argv[1]))
for scrape in cfg.get("scrape_configs", []):
    scrape["honor_labels"] = True
yaml.safe_dump(cfg, open(sys.argv[2], "w"), sort_keys=False)
PY

pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait' EXIT INT TERM
prometheus --config.file="$ours" --storage.tsdb.path="$session/metrics/prometheus/data" \
    --web.listen-address=":$prom_port" >"$session/logs/prometheus.log" 2>&1 &
pids+=($!)
echo "prometheus: http://localhost:$prom_port (config $ours: Ray's $prom_cfg with honor_labels; log $session/logs/prometheus.log)"

if command -v grafana-server >/dev/null; then
    grafana-server --config "$grafana_ini" --homepath "${GRAFANA_HOME:-/usr/share/grafana}" web \
        >"$session/logs/grafana.log" 2>&1 &
    pids+=($!)
    echo "grafana: http://localhost:3000 (Ray's grafana.ini); dashboard 'raytrain_ckpt: checkpoint progress' beside Ray's"
    echo "for the Ray dashboard's Metrics view, start the head with RAY_GRAFANA_HOST=http://localhost:3000" \
         "RAY_PROMETHEUS_HOST=http://localhost:$prom_port"
else
    echo "note: grafana-server is not installed (Grafana is not in Debian; see https://apt.grafana.com)." \
         "Prometheus runs alone; query it at http://localhost:$prom_port/graph"
    echo "what the nodes' metrics endpoints serve now (raytrain_ckpt's series):"
    for target in $("$python" -c 'import json,sys; print(" ".join(t for g in json.load(open(sys.argv[1])) for t in g["targets"]))' \
                    "$session/prom_metrics_service_discovery.json" 2>/dev/null); do
        echo "--- http://$target/metrics"
        curl -s --max-time 5 "http://$target/metrics" | grep '^ray_raytrain_ckpt' | head -25 || true
    done
fi
wait
