#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: unit, real multi-process gloo, and
# real Ray cluster tests. Extra arguments go to pytest, e.g. -k spec or tests/unit
#
# Files run on two pytest-xdist workers (each with its own session Ray, results and staging
# directories; docs/ARCHITECTURE.md, "Testing"). RAYTRAIN_TEST_WORKERS=N sets another count;
# 0 runs in this process (what a debugger wants), as does an explicit -n of your own.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
workers=(-n "${RAYTRAIN_TEST_WORKERS:-2}" --dist loadfile)
for arg in "$@"; do
    case "$arg" in -n|-n*|--numprocesses|--numprocesses=*) workers=() ;; esac
done
exec .venv/bin/python -m pytest "${workers[@]}" "$@"
