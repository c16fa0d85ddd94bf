"""raytrain_ckpt: Ray-orchestrated, fault-tolerant PyTorch training jobs.

    import raytrain_ckpt
    result = raytrain_ckpt.run("jobs/llama_debug_fsdp.yaml", ["training.steps=20"])
    raytrain_ckpt.ls("checkpoints/llama-debug-fsdp")

Everything is imported on first use: ``import raytrain_ckpt`` loads neither torch nor Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["JobResult", "JobSpec", "JobState", "SpecError", "load_spec", "ls", "resolve_spec", "run", "status",
           "verify", "__version__"]

__version__ = "0.1.0"

if TYPE_CHECKING:
    from raytrain_ckpt.api import ls, resolve_spec, run, status, verify
    from raytrain_ckpt.control.controller import JobResult, JobState
    from raytrain_ckpt.spec import JobSpec, SpecError
    from raytrain_ckpt.control.preflight import load_spec

_HOMES = {"JobSpec": "spec", "SpecError": "spec", "load_spec": "control.preflight",
          "JobResult": "control.controller", "JobState": "control.controller",
          "ls": "api", "resolve_spec": "api", "run": "api", "status": "api", "verify": "api"}


def __getattr__(name: str) -> Any:
    # Lazy, so that torch-only parts (staging, models, data) import without the spec's
    # dependencies, e.g. on a GPU box that has torch and nothing else, and so that the CLI's
    # offline commands start fast.
    if name in _HOMES:
        return getattr(importlib.import_module(f"raytrain_ckpt.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'raytrain_ckpt' has no attribute {name!r}")
