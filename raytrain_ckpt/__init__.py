"""raytrain_ckpt: Ray-orchestrated, fault-tolerant PyTorch training jobs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["JobSpec", "SpecError", "load_spec", "__version__"]

__version__ = "0.1.0"

if TYPE_CHECKING:
    from raytrain_ckpt.spec import JobSpec, SpecError, load_spec


def __getattr__(name: str) -> Any:
    # Lazy, so that torch-only parts (staging, models, data) import without the spec's
    # dependencies, e.g. on a GPU box that has torch and nothing else.
    if name in ("JobSpec", "SpecError", "load_spec"):
        from raytrain_ckpt import spec

        return getattr(spec, name)
    raise AttributeError(f"module 'raytrain_ckpt' has no attribute {name!r}")
