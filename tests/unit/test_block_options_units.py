"""Per-block activation checkpointing and compile on a tiny Llama: what they save and what they keep."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from raytrain_ckpt.models import Llama, describe_model
from raytrain_ckpt.parallel.blocks import apply_block_options, checkpointed_blocks

CFG = dataclasses.replace(describe_model("debug", {"dim": 64}), max_seq_len=32)


def _model(mode: str, compile_blocks: bool = False) -> Llama:
    torch.manual_seed(0)
    return apply_block_options(Llama(CFG), mode, compile_blocks)


def _saved_bytes(model: Llama) -> int:
    """Bytes autograd keeps for backward during one forward."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        tokens = torch.randint(0, CFG.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
        model(tokens).sum().backward()
    return total


@pytest.mark.parametrize(("mode", "expected"), [("none", []), ("full", [0, 1, 2, 3]), ("selective", [0, 2])])
def test_which_blocks_are_checkpointed(mode, expected):
    assert checkpointed_blocks(4, mode) == expected


def test_checkpointing_keeps_less_and_computes_the_same_gradients():
    plain, sel, full = _model("none"), _model("selective"), _model("full")
    assert _saved_bytes(full) < _saved_bytes(sel) < _saved_bytes(plain)
    for (name, a), b, c in zip(plain.named_parameters(), sel.parameters(), full.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad) and torch.equal(a.grad, c.grad), name


def test_options_do_not_rename_parameters():
    plain = _model("none")
    both = _model("full", compile_blocks=True)
    assert list(both.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in both.named_parameters()] == [n for n, _ in plain.named_parameters()]
