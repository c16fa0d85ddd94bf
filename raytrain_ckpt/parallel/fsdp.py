"""FSDP2 (``fully_shard``) applied per transformer block and at the root."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

logger = logging.getLogger(__name__)

__all__ = ["apply_fsdp", "build_mesh", "param_dtype_for", "release_mesh"]


def build_mesh(device_type: str, dp_shard: int, pp: int = 1) -> DeviceMesh:
    """A 1-D ``(dp_shard,)`` mesh, or ``(pp, dp_shard)`` with pipeline parallelism.

    Rank ``r`` is pipeline rank ``r // dp_shard`` and shard ``r % dp_shard``: the ranks of
    one stage are consecutive, so on a multi-GPU node FSDP's collectives stay within a node
    and only the pipeline's point-to-point sends cross nodes.
    """
    if pp == 1:
        return init_device_mesh(device_type, (dp_shard,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(device_type, (pp, dp_shard), mesh_dim_names=("pp", "dp_shard"))


def param_dtype_for(mixed_precision: str, use_gpu: bool) -> torch.dtype:
    """Compute dtype for parameters: ``auto`` picks bf16 on GPU and fp32 on CPU."""
    if mixed_precision == "bf16" or (mixed_precision == "auto" and use_gpu):
        return torch.bfloat16
    return torch.float32


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype) -> nn.Module:
    """Shard every child of ``model.layers`` and then the root with FSDP2.

    Sharding blocks one by one lets FSDP2 all-gather block i+1 while block i computes.
    A model without ``layers`` is sharded as one unit at the root. Gradients are always
    reduced in fp32 so bf16 compute does not lose precision in the reduce-scatter.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    blocks = getattr(model, "layers", None)
    children = list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks or [])
    for i, block in enumerate(children):
        # The last block is not resharded after forward: backward needs it right away.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(children) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    logger.debug("fully_shard applied to %d blocks and the root", len(children))
    return model


def release_mesh(mesh: DeviceMesh) -> None:
    """Drop the process groups a mesh holds, so ``destroy_process_group`` really closes them.

    A DeviceMesh keeps its ProcessGroup objects in a registry shared with its root mesh, and
    meshes live on in DTensor's sharding-propagation cache after the model is gone. Without
    this, a rank leaving a failed attempt keeps its gloo connections open and a peer blocked
    in a collective with it waits for the full collective timeout.
    """
    from torch.distributed.tensor import DTensor

    root_of = getattr(mesh, "_get_root_mesh", None)
    for m in {id(x): x for x in (mesh, root_of() if root_of else None) if x is not None}.values():
        registry = getattr(m, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()
    propagate = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
    if hasattr(propagate, "cache_clear"):
        propagate.cache_clear()
