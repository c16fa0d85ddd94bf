"""Shared fixtures: one local Ray cluster for the whole session."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray (4 logical CPUs so 2-4 rank worlds fit on a 2-core machine)."""
    import ray

    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": path}},
             log_to_driver=True)
    yield ray
    ray.shutdown()


# Ray forwards actors' log lines to the driver's stderr on its own schedule, so a test that runs
# the CLI in the same process after a Ray job may find them mixed into what it captured.
_RAY_FORWARDED = re.compile(r"^(\x1b\[\d+m)?\((raylet[^)]*|\w+(\(.*\))? pid=\d+[^)]*)\)")


@pytest.fixture
def cli_stderr(capsys):
    """What the CLI itself wrote to stderr, without lines Ray forwarded from actors."""
    def read() -> str:
        err = capsys.readouterr().err
        return "".join(line for line in err.splitlines(keepends=True) if not _RAY_FORWARDED.match(line))
    return read
