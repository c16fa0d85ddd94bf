"""Turn a model part (whole model or pipeline stage) into this rank's sharded, initialised part.

Deferred initialisation: the model is built on the meta device (no memory), the block options
and FSDP2 are applied to the meta part, then ``to_empty`` allocates only this rank's shards on
the target device and the model's ``init_weights()`` fills them. The built-in Llama draws every
parameter from a generator seeded by (seed, name) and keeps its shard (``models/init.py``), so
the values equal a model built whole on CPU at any world size or pipeline layout.

Eager initialisation (a model without ``init_weights``): the part was built whole on CPU under
the seed and is moved to the device before sharding, as before.

Restoring (an attempt that resumes from a checkpoint): every parameter and persistent buffer is
overwritten by the load, or the load fails, so drawing initial values is wasted work (0.08 s of
a 0.12 s build on the demo, on the restart's critical path). A part that also defines
``init_buffers()`` (what ``init_weights`` does to its non-persistent buffers, e.g. RoPE tables)
gets only that call; a part without it still gets ``init_weights()``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from raytrain_ckpt.parallel.blocks import ActivationCheckpointing, apply_block_options
from raytrain_ckpt.parallel.fsdp import apply_fsdp

logger = logging.getLogger(__name__)

__all__ = ["BUFFERS_HOOK", "INIT_HOOK", "PartBuilder", "supports_deferred_init"]

INIT_HOOK = "init_weights"
BUFFERS_HOOK = "init_buffers"


def supports_deferred_init(model: nn.Module) -> bool:
    """Whether ``model`` can be built on the meta device: it defines ``init_weights()``."""
    return callable(getattr(model, INIT_HOOK, None))


@dataclass(frozen=True)
class PartBuilder:
    """How every model part of this rank is prepared; call it on each part."""

    device: torch.device
    param_dtype: torch.dtype
    seed: int
    deferred: bool
    """True: parts are on the meta device and are initialised after sharding."""
    activation_checkpointing: ActivationCheckpointing = "none"
    compile: bool = False
    restoring: bool = False
    """True: a checkpoint load will overwrite every parameter; only non-persistent buffers are set."""

    def __call__(self, part: nn.Module, mesh: DeviceMesh) -> nn.Module:
        """Apply block options and FSDP2 to ``part``, then materialise it (deferred) on ``device``."""
        apply_block_options(part, self.activation_checkpointing, self.compile)
        if not self.deferred:
            return apply_fsdp(part.to(self.device), mesh, self.param_dtype)
        if not supports_deferred_init(part):
            raise ValueError(f"model part {type(part).__name__} built on the meta device has no "
                             f"{INIT_HOOK}(); define it on the stage module or on the model")
        apply_fsdp(part, mesh, self.param_dtype)
        part.to_empty(device=self.device)
        # The hooks' contract: called with no arguments right after torch.manual_seed(seed).
        torch.manual_seed(self.seed)
        hook = BUFFERS_HOOK if self.restoring and callable(getattr(part, BUFFERS_HOOK, None)) else INIT_HOOK
        with torch.no_grad():
            getattr(part, hook)()
        return part
