#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: unit, real multi-process gloo, and
# real Ray cluster tests. Extra arguments go to pytest, e.g. -k spec or tests/unit
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/python -m pytest "$@"
