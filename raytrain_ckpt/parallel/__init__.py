"""Parallelism: device mesh, FSDP2 sharding and pipeline stages."""

from raytrain_ckpt.parallel.fsdp import apply_fsdp, build_mesh, param_dtype_for, release_mesh

__all__ = ["apply_fsdp", "build_mesh", "param_dtype_for", "release_mesh"]
