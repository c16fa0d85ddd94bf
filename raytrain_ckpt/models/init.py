"""Layout-independent parameter initialisation: every value is a pure function of (seed, name).

A model built on the meta device and sharded (FSDP2, pipeline stages) holds only its local
shards. To give those shards the same values as a model built whole on one CPU, each
parameter is drawn on its full logical shape from its own generator, seeded from the
training seed and the parameter's fully-qualified name (FSDP2 and pipeline splits keep
FQNs), and only the local shard is kept. The cost is one transient full-size tensor per
parameter, never the whole model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["ParamInit", "init_parameters", "param_generator"]

ParamInit = Callable[[str, torch.Tensor, torch.Generator], None]
"""Fills a full-shape CPU tensor for the parameter ``fqn`` in place from ``generator``."""


def param_generator(seed: int, fqn: str) -> torch.Generator:
    """A CPU generator seeded from ``seed`` and ``fqn`` (the same on every rank and layout)."""
    digest = hashlib.sha256(f"{seed}:{fqn}".encode()).digest()
    # manual_seed wants a value that fits in a signed 64-bit int.
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


@torch.no_grad()
def init_parameters(module: nn.Module, seed: int, init: ParamInit) -> None:
    """Initialise every parameter of ``module`` (plain tensors or DTensor shards) by ``init``.

    Args:
        module: A whole model, a pipeline stage or an FSDP2-sharded module, already
            materialised (``to_empty``) on its device.
        seed: The training seed.
        init: Fills the full logical tensor of one parameter.
    """
    for fqn, param in module.named_parameters():
        if param.is_meta:
            continue  # built on the meta device: initialised after to_empty
        full = torch.empty(param.shape, dtype=param.dtype, device="cpu")
        init(fqn, full, param_generator(seed, fqn))
        _copy_local(param, full)


def _copy_local(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of ``full`` into ``param``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        # src_data_rank=None: every rank holds the same full tensor, so each slices its own
        # shard locally instead of receiving a scatter.
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(local)
        return
    param.copy_(full)
