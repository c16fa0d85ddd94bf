"""Layout-independent parameter initialisation: every value is a pure function of (seed, name, position).

A model built on the meta device and sharded (FSDP2, pipeline stages) holds only its local
shards. To give those shards the same values as a model built whole on one CPU, each
parameter's flattened values are cut into fixed blocks of ``BLOCK`` elements, and block ``b``
of parameter ``fqn`` is drawn from its own generator seeded from (seed, fqn, b). FSDP2 and the
pipeline split keep FQNs, and FSDP2 shards dim 0 of a row-major tensor, so a rank's shard is
one contiguous range of the flattened values: it draws only the blocks that overlap it, and
its peak memory is its shard plus one block, never a full parameter.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["BLOCK", "ParamInit", "init_parameters", "param_generator"]

BLOCK = 1 << 20
"""Elements per independently seeded block (4 MiB in fp32)."""

ParamInit = Callable[[str, torch.Tensor, torch.Generator], None]
"""Fills ``values`` (a 1-D block of parameter ``fqn``) in place from ``generator``; element-wise
rules only (normal, uniform, constant), since a block does not know its position in the shape."""


def param_generator(seed: int, fqn: str, block: int) -> torch.Generator:
    """A CPU generator seeded from ``seed``, ``fqn`` and ``block`` (the same on every rank and layout)."""
    digest = hashlib.sha256(f"{seed}:{fqn}:{block}".encode()).digest()
    # manual_seed wants a value that fits in a signed 64-bit int.
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, init: ParamInit) -> None:
    """Initialise every parameter of ``module`` (plain tensors or DTensor shards) by ``init``.

    Args:
        module: A whole model, a pipeline stage or an FSDP2-sharded module, already
            materialised (``to_empty``) on its device. Meta parameters are skipped.
        seed: The training seed.
        init: Fills one block of one parameter.
    """
    for fqn, param in module.named_parameters():
        if param.is_meta:
            continue  # built on the meta device: initialised after to_empty
        span = _flat_range(param)
        if span is None:
            full = torch.empty(param.numel(), dtype=param.dtype)
            _fill(full, fqn, seed, init, 0, param.numel())
            _copy_from_full(param, full.view(param.shape))
            continue
        local = param.to_local() if hasattr(param, "to_local") else param
        _fill(local.view(-1), fqn, seed, init, *span)


def _fill(out: torch.Tensor, fqn: str, seed: int, init: ParamInit, start: int, end: int) -> None:
    """Write the flattened values ``[start, end)`` of parameter ``fqn`` into ``out``, block by block."""
    values = torch.empty(BLOCK, dtype=out.dtype)
    for block in range(start // BLOCK, -(-end // BLOCK)):
        lo, hi = block * BLOCK, (block + 1) * BLOCK
        init(fqn, values, param_generator(seed, fqn, block))
        a, b = max(lo, start), min(hi, end)
        out[a - start:b - start].copy_(values[a - lo:b - lo])


def _flat_range(param: torch.Tensor) -> tuple[int, int] | None:
    """This rank's ``[start, end)`` of the flattened parameter, or None if it is not one range."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return 0, param.numel()
    if param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),) or param.dim() == 0:
        return None
    # torch.chunk semantics, as DTensor and FSDP2 shard dim 0: ceil-sized chunks, the last ones short.
    # From the shape only: indexing a sharded DTensor would all-gather it.
    rows, row = param.shape[0], math.prod(param.shape[1:])
    chunk = -(-rows // param.device_mesh.size())
    first = min(rows, chunk * param.device_mesh.get_local_rank())
    last = min(rows, first + chunk)
    if (last - first) * row != param.to_local().numel():
        return None  # another sharding than expected: take the general path
    return first * row, last * row


def _copy_from_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` into a DTensor ``param`` of any placement."""
    from torch.distributed.tensor import distribute_tensor

    # src_data_rank=None: every rank holds the same full tensor and slices its own shard locally.
    local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    param.to_local().copy_(local)
