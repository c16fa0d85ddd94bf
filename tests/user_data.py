"""Example user data, loss and optimizer factories, referenced by import path in tests and jobs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["counting_dataset", "not_a_dataset", "not_an_optimizer", "plain_sgd", "scaled_cross_entropy", "unreduced_loss"]


def counting_dataset(items: int = 64, length: int = 65, vocab: int = 1000) -> list[list[int]]:
    """Item ``i`` counts up from ``100 * i`` (modulo ``vocab``): a learnable map-style dataset."""
    return [[(100 * i + t) % vocab for t in range(length)] for i in range(items)]


def not_a_dataset() -> int:
    """A factory returning the wrong type."""
    return 3


def scaled_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy times 2: a loss that differs visibly from the built-in."""
    return 2.0 * F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def unreduced_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A mistake: the per-token loss, not reduced to a scalar."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")


def plain_sgd(params: list[torch.nn.Parameter], lr: float, momentum: float = 0.0) -> torch.optim.Optimizer:
    """An optimizer factory: SGD with the given momentum."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


def not_an_optimizer(params: list[torch.nn.Parameter], lr: float) -> list[torch.nn.Parameter]:
    """A mistake: returns the parameters, not an optimizer."""
    return params
