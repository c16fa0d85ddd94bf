"""Parallelism: device mesh and FSDP2 sharding."""

from raytrain_ckpt.parallel.fsdp import apply_fsdp, build_mesh, param_dtype_for, release_mesh

__all__ = ["apply_fsdp", "build_mesh", "param_dtype_for", "release_mesh"]
