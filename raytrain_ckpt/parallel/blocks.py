"""Per-block activation checkpointing and ``torch.compile``, without renaming any parameter.

Wrappers (``checkpoint_wrapper``, ``torch.compile(module)``) insert ``_checkpoint_wrapped_module.``
or ``_orig_mod.`` into every FQN below them, and this project's checkpoints, fingerprints and
exports are keyed by FQN. So both options act in place on each block instead: activation
checkpointing replaces the block instance's ``forward`` with a checkpointed call of the
original, and compile uses ``nn.Module.compile()``, which compiles the call without a wrapper
module. A checkpoint therefore loads with the options on or off.

``activation_checkpointing``:

- ``none``: every block keeps its activations for backward;
- ``full``: every block keeps only its input and recomputes the rest in backward;
- ``selective``: every other block (``layers`` positions 0, 2, 4 ...) is checkpointed, about half
  the activation memory of ``none`` for about half the recompute of ``full``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Literal

from torch import nn
from torch.utils.checkpoint import checkpoint

logger = logging.getLogger(__name__)

__all__ = ["ActivationCheckpointing", "apply_block_options", "checkpointed_blocks", "model_blocks"]

ActivationCheckpointing = Literal["none", "full", "selective"]


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The entries of ``model.layers`` (ModuleDict or ModuleList); empty without ``layers``."""
    blocks = getattr(model, "layers", None)
    if isinstance(blocks, nn.ModuleDict):
        return list(blocks.values())
    return list(blocks) if isinstance(blocks, nn.ModuleList) else []


def checkpointed_blocks(num_blocks: int, mode: ActivationCheckpointing) -> list[int]:
    """Positions of the blocks that ``mode`` checkpoints."""
    if mode == "full":
        return list(range(num_blocks))
    if mode == "selective":
        return list(range(0, num_blocks, 2))
    return []


def apply_block_options(model: nn.Module, activation_checkpointing: ActivationCheckpointing,
                        compile_blocks: bool) -> nn.Module:
    """Apply the options to every block of ``model`` in place (before FSDP2 sharding)."""
    blocks = model_blocks(model)
    if not blocks and (activation_checkpointing != "none" or compile_blocks):
        logger.warning("model %s has no 'layers' blocks: activation checkpointing and compile are not applied",
                       type(model).__name__)
    for i in checkpointed_blocks(len(blocks), activation_checkpointing):
        blocks[i].forward = _checkpointed(blocks[i].forward)
    if compile_blocks:
        for block in blocks:
            block.compile()
    return model


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` whose intermediate activations are recomputed in backward instead of kept."""

    def run(*args: Any, **kwargs: Any) -> Any:
        # Non-reentrant: works with keyword arguments, FSDP2's hooks and torch.compile.
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
