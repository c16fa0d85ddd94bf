"""Model definitions and construction (presets and user factories).

``Llama`` and ``num_params`` are imported on first use: checking a spec's model section
(``describe_model``, ``PRESETS``) needs no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raytrain_ckpt.models.config import PRESETS, LlamaConfig
from raytrain_ckpt.models.factory import build_model, describe_model, resolve_factory

if TYPE_CHECKING:
    from raytrain_ckpt.models.llama import Llama, num_params

__all__ = [
    "PRESETS",
    "Llama",
    "LlamaConfig",
    "build_model",
    "describe_model",
    "num_params",
    "resolve_factory",
]


def __getattr__(name: str) -> Any:
    if name in ("Llama", "num_params"):
        from raytrain_ckpt.models import llama

        return getattr(llama, name)
    raise AttributeError(f"module 'raytrain_ckpt.models' has no attribute {name!r}")
