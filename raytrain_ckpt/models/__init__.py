"""Model definitions and construction (presets and user factories)."""

from raytrain_ckpt.models.factory import build_model, describe_model, resolve_factory
from raytrain_ckpt.models.llama import PRESETS, Llama, LlamaConfig, num_params

__all__ = [
    "PRESETS",
    "Llama",
    "LlamaConfig",
    "build_model",
    "describe_model",
    "num_params",
    "resolve_factory",
]
