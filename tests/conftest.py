"""Shared fixtures: one local Ray cluster for the whole session."""

from __future__ import annotations

import os
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
