"""Parallelism: device mesh, FSDP2 sharding and pipeline stages."""

from raytrain_ckpt.parallel.blocks import apply_block_options
from raytrain_ckpt.parallel.fsdp import apply_fsdp, build_mesh, param_dtype_for, release_mesh
from raytrain_ckpt.parallel.materialise import PartBuilder, supports_deferred_init

__all__ = [
    "PartBuilder",
    "apply_block_options",
    "apply_fsdp",
    "build_mesh",
    "param_dtype_for",
    "release_mesh",
    "supports_deferred_init",
]
