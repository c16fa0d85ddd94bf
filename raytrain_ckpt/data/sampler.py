"""Mapping of (step, dp rank) to global sample indices and micro batches.

The global batch of step ``s`` is the contiguous index range
``[start_index + s * gbs, start_index + (s + 1) * gbs)``. Data-parallel rank
``r`` of ``dp_size`` takes the ``r``-th contiguous slice of it, so the union
over ranks (in rank order) is the same global batch for every ``dp_size``.
"""

from __future__ import annotations

import logging

import torch

from raytrain_ckpt.data.sources import TokenSource

logger = logging.getLogger(__name__)

__all__ = ["first_sample_of_step", "local_micro_batches", "local_sample_range"]


def first_sample_of_step(step: int, global_batch_size: int, start_index: int = 0) -> int:
    """Return the global index of the first sample of ``step``.

    Args:
        step: Zero-based optimizer step.
        global_batch_size: Samples per step over all data-parallel ranks.
        start_index: Global index of the first sample of step 0.

    Returns:
        ``start_index + step * global_batch_size``.

    Raises:
        ValueError: If an argument is negative or the batch size is not positive.
    """
    if step < 0 or start_index < 0:
        raise ValueError(f"step ({step}) and start_index ({start_index}) must be >= 0")
    if global_batch_size <= 0:
        raise ValueError(f"global_batch_size must be positive, got {global_batch_size}")
    return start_index + step * global_batch_size


def _validate_split(
    global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int
) -> int:
    """Check the batch split and return the per-rank sample count."""
    if dp_size <= 0:
        raise ValueError(f"dp_size must be positive, got {dp_size}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    if micro_batch_size <= 0:
        raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
    if global_batch_size <= 0 or global_batch_size % dp_size != 0:
        raise ValueError(
            f"global_batch_size ({global_batch_size}) must be a positive multiple of "
            f"dp_size ({dp_size})"
        )
    local = global_batch_size // dp_size
    if local % micro_batch_size != 0:
        raise ValueError(
            f"per-rank batch global_batch_size / dp_size = {local} must be a multiple of "
            f"micro_batch_size ({micro_batch_size})"
        )
    return local


def local_sample_range(
    *, step: int, global_batch_size: int, dp_rank: int, dp_size: int, start_index: int = 0
) -> range:
    """Return the global sample indices rank ``dp_rank`` consumes at ``step``.

    Args:
        step: Zero-based optimizer step.
        global_batch_size: Samples per step over all ranks; divisible by ``dp_size``.
        dp_rank: This rank's data-parallel index.
        dp_size: Number of data-parallel ranks.
        start_index: Global index of the first sample of step 0.

    Returns:
        A contiguous ``range`` of ``global_batch_size // dp_size`` indices.
    """
    if dp_size <= 0 or global_batch_size % dp_size != 0 or not 0 <= dp_rank < dp_size:
        raise ValueError(
            f"invalid split: global_batch_size={global_batch_size}, dp_rank={dp_rank}, "
            f"dp_size={dp_size}"
        )
    local = global_batch_size // dp_size
    first = first_sample_of_step(step, global_batch_size, start_index) + dp_rank * local
    return range(first, first + local)


def local_micro_batches(
    source: TokenSource,
    *,
    step: int,
    global_batch_size: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    start_index: int = 0,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Materialise this rank's micro batches for ``step``.

    Args:
        source: Index-addressed token source.
        step: Zero-based optimizer step.
        global_batch_size: Samples per step over all ranks.
        micro_batch_size: Samples per forward/backward pass on one rank.
        dp_rank: This rank's data-parallel index.
        dp_size: Number of data-parallel ranks.
        start_index: Global index of the first sample of step 0 (a resumed
            job may start elsewhere).

    Returns:
        ``(global_batch_size // dp_size) // micro_batch_size`` pairs
        ``(inputs, targets)``, each a LongTensor ``[micro_batch_size, seq_len]``;
        ``targets`` is ``inputs`` shifted left by one token.

    Raises:
        ValueError: If the sizes do not divide evenly or are out of range.
    """
    _validate_split(global_batch_size, micro_batch_size, dp_rank, dp_size)
    indices = local_sample_range(
        step=step,
        global_batch_size=global_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        start_index=start_index,
    )
    batches: list[tuple[torch.Tensor, torch.Tensor]] = []
    for lo in range(0, len(indices), micro_batch_size):
        samples = torch.stack([source.sample(i) for i in indices[lo : lo + micro_batch_size]])
        batches.append((samples[:, :-1].contiguous(), samples[:, 1:].contiguous()))
    return batches
