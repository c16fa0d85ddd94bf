#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: unit, real multi-process gloo, and
# real Ray cluster tests. Extra arguments go to pytest, e.g. -k spec or tests/unit
#
# Files run longest first (tests/file_seconds.json). RAYTRAIN_TEST_WORKERS=N runs them on N
# pytest-xdist workers, each with its own session Ray, results and staging directories
# (docs/ARCHITECTURE.md, "Testing"); the default, 0, runs them in this process, one at a time.
# An explicit -n of your own wins.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
workers=()
if [ "${RAYTRAIN_TEST_WORKERS:-0}" != 0 ]; then
    workers=(-n "$RAYTRAIN_TEST_WORKERS" --dist loadfile --no-loadscope-reorder)
fi
for arg in "$@"; do
    case "$arg" in -n|-n*|--numprocesses|--numprocesses=*) workers=() ;; esac
done
exec .venv/bin/python -m pytest "${workers[@]}" "$@"
