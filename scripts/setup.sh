#!/usr/bin/env bash
# Create .venv and install raytrain_ckpt with its test extras. Idempotent and quick when
# nothing changed. torch is installed first, pinned, so the resolver keeps that build
# (an unpinned torch would pull the multi-GB CUDA build on a CPU-only machine).
# Override with TORCH_SPEC (e.g. TORCH_SPEC="torch==2.13.0" on a CUDA machine with internet).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
stamp=".venv/.raytrain_ckpt-installed"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
echo "setup: installing $TORCH_SPEC"
.venv/bin/python -m pip install -q "$TORCH_SPEC"
echo "setup: installing raytrain_ckpt and its dependencies"
.venv/bin/python -m pip install -q -e ".[test]"
echo "$want" > "$stamp"
