"""Example user model factory, referenced as ``tests.user_models:tiny_mlp_lm``."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["not_a_module", "staged_mlp_lm", "tiny_mlp_lm"]


class _ResidualMLP(nn.Module):
    """Position-wise residual MLP block (no attention: deliberately trivial)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the block to ``x`` of shape ``[B, T, dim]``."""
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class _TinyMLPLM(nn.Module):
    """Embedding, a stack of residual MLP blocks and an output head."""

    def __init__(self, vocab_size: int, dim: int, n_layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(_ResidualMLP(dim) for _ in range(n_layers))
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Map ``[B, T]`` token ids to ``[B, T, vocab_size]`` logits."""
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def tiny_mlp_lm(vocab_size: int = 256, dim: int = 32, n_layers: int = 2) -> nn.Module:
    """Build a tiny token-wise MLP language model.

    Args:
        vocab_size: Number of token ids.
        dim: Hidden width.
        n_layers: Number of residual MLP blocks in ``.layers``.

    Returns:
        The module.
    """
    return _TinyMLPLM(vocab_size, dim, n_layers)


class _StagedMLPLM(nn.Module):
    """The same model written to be split into pipeline stages: ``layers`` is a ModuleDict
    and forward skips the parts a stage does not hold (None)."""

    def __init__(self, vocab_size: int, dim: int, n_layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleDict({str(i): _ResidualMLP(dim) for i in range(n_layers)})
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (or a previous stage's hidden state) to logits (or this stage's hidden state)."""
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.head(h) if self.head is not None else h


def staged_mlp_lm(vocab_size: int = 256, dim: int = 32, n_layers: int = 4) -> nn.Module:
    """A tiny MLP language model that pipeline parallelism can split (see ``_StagedMLPLM``)."""
    return _StagedMLPLM(vocab_size, dim, n_layers)


def not_a_module() -> object:
    """A factory that breaks the contract, for error-path tests."""
    return object()


NOT_CALLABLE = 42
