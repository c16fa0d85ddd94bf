#!/usr/bin/env bash
# Start a single Ray head for development / testing, with token auth set up so that
# `ray job submit` works, and print the exact submit command.
#
#   cluster/start_head.sh                      # background; prints how to stop it
#   cluster/start_head.sh --block              # foreground; Ctrl-C / SIGTERM stops it
#   cluster/start_head.sh --stop               # stop a background head started earlier
#
# Options (flag, or env var):
#   --port N            RAY_HEAD_PORT        GCS port (default 6379; 0 = any free port)
#   --dashboard-port N  RAY_DASHBOARD_PORT   dashboard / job API port (default 8265)
#   --dashboard-host H  RAY_DASHBOARD_HOST   bind address of the job API (default 127.0.0.1)
#   --num-cpus N        RAY_NUM_CPUS         logical CPUs (default: all cores)
#   --num-gpus N        RAY_NUM_GPUS         GPUs (default: autodetected)
#   --temp-dir DIR      RAY_HEAD_TEMP_DIR    session files (default /tmp/rth-<dashboard port>)
#   --block                                  stay in the foreground
#   --stop                                   SIGTERM the background head of this temp dir
#   --timeout S         RAY_HEAD_TIMEOUT     seconds to wait for the job API (default 90)
#
# Why it is written this way:
# * `ray start` turns token auth on by itself when ~/.ray/auth_token exists, but the
#   `ray job submit` client only sends the token when RAY_AUTH_MODE=token is in ITS
#   environment (otherwise: "401 Missing authentication token"). So this script makes
#   sure a token exists, exports RAY_AUTH_MODE=token for the head (the job supervisor,
#   the entrypoint and all workers inherit it), and prints the submit command with it.
# * The head always runs as `ray start --block` in its own session: one SIGTERM to that
#   process drains and stops every process of this head (gcs_server, raylet, dashboard,
#   agents, workers) and nothing else. `ray stop` is never used: it kills every Ray
#   process on the machine, including other people's clusters.
# * A private --temp-dir keeps this head's "latest cluster" record out of /tmp/ray, so a
#   bare ray.init() elsewhere on the machine keeps starting its own local cluster
#   instead of silently attaching to this one.
# * The auxiliary ports (client server, agents, metrics) are picked free rather than
#   left at Ray's fixed defaults, so this head can run beside another Ray on one box.
set -euo pipefail

port="${RAY_HEAD_PORT:-6379}"
dash_port="${RAY_DASHBOARD_PORT:-8265}"
dash_host="${RAY_DASHBOARD_HOST:-127.0.0.1}"
num_cpus="${RAY_NUM_CPUS:-}"
num_gpus="${RAY_NUM_GPUS:-}"
temp_dir="${RAY_HEAD_TEMP_DIR:-}"
timeout_s="${RAY_HEAD_TIMEOUT:-90}"
block=0
stop=0

usage() { sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; }

while [ $# -gt 0 ]; do
  case "$1" in
    --port) port="$2"; shift 2 ;;
    --dashboard-port) dash_port="$2"; shift 2 ;;
    --dashboard-host) dash_host="$2"; shift 2 ;;
    --num-cpus) num_cpus="$2"; shift 2 ;;
    --num-gpus) num_gpus="$2"; shift 2 ;;
    --temp-dir) temp_dir="$2"; shift 2 ;;
    --timeout) timeout_s="$2"; shift 2 ;;
    --block) block=1; shift ;;
    --stop) stop=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "start_head.sh: unknown option: $1" >&2; usage >&2; exit 2 ;;
  esac
done

# Short default path on purpose: Ray's unix sockets live under it (limit ~107 chars).
temp_dir="${temp_dir:-/tmp/rth-${dash_port}}"
pid_file="${temp_dir}/head.pid"
log_file="${temp_dir}/head.log"

if [ "$stop" = 1 ]; then
  if [ ! -s "$pid_file" ]; then echo "no head recorded in $pid_file" >&2; exit 1; fi
  pid="$(cat "$pid_file")"
  if ! kill -0 "$pid" 2>/dev/null; then echo "head $pid is not running"; rm -f "$pid_file"; exit 0; fi
  kill -TERM "$pid"
  # Ray drains (RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S, 3 s here) before it stops its processes.
  for _ in $(seq 1 60); do
    if ! pgrep -s "$pid" >/dev/null 2>&1 && ! kill -0 "$pid" 2>/dev/null; then
      rm -f "$pid_file"; echo "head $pid stopped"; exit 0
    fi
    sleep 1
  done
  echo "head $pid still has processes after 60 s:" >&2
  pgrep -a -s "$pid" >&2 || true
  exit 1
fi

command -v ray >/dev/null || { echo "start_head.sh: 'ray' not on PATH (pip install 'ray[default]')" >&2; exit 1; }
py="$(command -v python3 || command -v python)"

# A token given through RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH wins; otherwise use (or
# create) ~/.ray/auth_token, the file every Ray CLI looks at by default.
if [ -z "${RAY_AUTH_TOKEN:-}" ] && [ -z "${RAY_AUTH_TOKEN_PATH:-}" ] && [ ! -s "$HOME/.ray/auth_token" ]; then
  ray get-auth-token --generate >/dev/null
fi
export RAY_AUTH_MODE=token
# On SIGTERM Ray first drains the node, waiting until every worker lease is returned;
# after a job has run that often means the full 30 s default. Draining protects Serve
# replicas during rolling upgrades, which a dev head does not have.
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-3}"
# The head must not inherit an address of some other cluster from the caller.
unset RAY_ADDRESS

mkdir -p "$temp_dir"
if [ -s "$pid_file" ] && kill -0 "$(cat "$pid_file")" 2>/dev/null; then
  echo "a head from this temp dir is already running (pid $(cat "$pid_file")); stop it with: $0 --stop --temp-dir $temp_dir" >&2
  exit 1
fi

# Bind-and-release gives ports free right now; the tiny race is acceptable for dev use.
read -r client_port agent_http agent_grpc metrics_port renv_port < <("$py" - <<'EOF'
import socket
socks = [socket.socket() for _ in range(5)]
for s in socks:
    s.bind(("", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
)

args=(start --head --block
      --port "$port"
      --dashboard-host "$dash_host" --dashboard-port "$dash_port" --include-dashboard=true
      --ray-client-server-port "$client_port"
      --dashboard-agent-listen-port "$agent_http" --dashboard-agent-grpc-port "$agent_grpc"
      --metrics-export-port "$metrics_port" --runtime-env-agent-port "$renv_port"
      --temp-dir "$temp_dir" --disable-usage-stats)
[ -n "$num_cpus" ] && args+=(--num-cpus "$num_cpus")
[ -n "$num_gpus" ] && args+=(--num-gpus "$num_gpus")

url_host="$dash_host"
case "$url_host" in 0.0.0.0|::|"") url_host=127.0.0.1 ;; esac
api="http://${url_host}:${dash_port}"
repo="$(cd "$(dirname "$0")/.." && pwd)"

print_usage() {
  cat <<EOF
Ray head: job API ${api}  (temp dir ${temp_dir}, pid $1)
Submit a job (the client needs RAY_AUTH_MODE=token to send the token):
  RAY_AUTH_MODE=token ray job submit --address ${api} --working-dir ${repo} -- python -m raytrain_ckpt run jobs/llama_debug_fsdp.yaml
Status / logs:
  RAY_AUTH_MODE=token ray job list --address ${api}
Connect a driver directly (GCS address is in ${temp_dir}/ray_current_cluster):
  RAY_AUTH_MODE=token RAY_ADDRESS=\$(cat ${temp_dir}/ray_current_cluster) python -m raytrain_ckpt run jobs/llama_debug_fsdp.yaml
EOF
}

if [ "$block" = 1 ]; then
  echo "$$" > "$pid_file"
  print_usage "$$"
  echo "Blocking; Ctrl-C or SIGTERM to pid $$ stops this head."
  # exec keeps the pid: a SIGTERM to it reaches `ray start --block` directly.
  exec ray "${args[@]}"
fi

# Background mode still runs `ray start --block`, detached in its own session, so that
# the recorded pid is a single handle that stops exactly this head.
setsid nohup ray "${args[@]}" >"$log_file" 2>&1 < /dev/null &
pid=$!
echo "$pid" > "$pid_file"

# /api/gcs_healthz answers without a token once the GCS is up; the jobs endpoint needs
# the token and the job agent, so both together mean `ray job submit` will work.
deadline=$(( $(date +%s) + timeout_s ))
until "$py" - "$api" <<'EOF' 2>/dev/null
import sys, urllib.request
from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled
api = sys.argv[1]
urllib.request.urlopen(api + "/api/gcs_healthz", timeout=2)
req = urllib.request.Request(api + "/api/jobs/", headers=get_auth_headers_if_auth_enabled({}))
urllib.request.urlopen(req, timeout=2)
EOF
do
  if ! kill -0 "$pid" 2>/dev/null; then
    echo "ray start exited; log: $log_file" >&2; tail -n 30 "$log_file" >&2; rm -f "$pid_file"; exit 1
  fi
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "job API not ready after ${timeout_s}s; log: $log_file (stopping the head)" >&2
    kill -TERM "$pid" 2>/dev/null || true
    exit 1
  fi
  sleep 1
done

print_usage "$pid"
echo "Stop it with: $0 --stop --temp-dir ${temp_dir}   (SIGTERM to pid $pid)"
