#!/usr/bin/env bash
# Set up (if needed) and run the demo job: the debug Llama, FSDP2 over 2 CPU workers, on a
# local Ray started for the run. Extra arguments go to `raytrain-ckpt run`, e.g. --set training.steps=10
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m raytrain_ckpt run jobs/llama_debug_fsdp.yaml "$@"
