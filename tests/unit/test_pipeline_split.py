"""Splitting models into pipeline stages (no process group): balance, FQNs, chained forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raytrain_ckpt.models import build_model
from raytrain_ckpt.parallel.pipeline import balance, layer_bounds, split_model, stage_indices


@pytest.mark.parametrize(("costs", "stages", "expected"), [
    ([1, 1, 1, 1], 2, [0, 2]),
    ([5, 1, 1, 1, 1, 1], 2, [0, 1]),   # a heavy first layer gets a stage of its own
    ([1, 1, 1, 9], 3, [0, 1, 3]),      # ties: the earliest boundaries
    ([3, 3, 3], 3, [0, 1, 2]),
])
def test_balance_minimises_the_heaviest_stage(costs, stages, expected):
    assert balance(costs, stages) == expected


def test_balance_needs_a_layer_per_stage():
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        balance([1, 1], 3)


def test_interleaved_ranks_hold_stages_round_robin():
    assert [stage_indices(r, 2, 2) for r in range(2)] == [[0, 2], [1, 3]]


def _chain(parts: list[nn.Module], tokens: torch.Tensor) -> torch.Tensor:
    h = tokens
    for part in parts:
        h = part(h)
    return h


@pytest.mark.parametrize("stages", [2, 4])
def test_llama_stages_keep_fqns_and_compute_the_full_forward(stages):
    torch.manual_seed(0)
    model = build_model("debug", {"dim": 64, "n_layers": 4, "max_seq_len": 32}).eval()
    bounds = layer_bounds(model, stages, [])
    parts = [split_model(model, s, stages, bounds) for s in range(stages)]
    names = [set(n for n, _ in p.named_parameters()) for p in parts]
    # disjoint, together exactly the full model's FQNs
    assert sum(len(n) for n in names) == len(set().union(*names))
    assert set().union(*names) == {n for n, _ in model.named_parameters()}
    assert "tok_embeddings.weight" in names[0] and "output.weight" in names[-1] and "norm.weight" in names[-1]
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        assert torch.equal(_chain(parts, tokens), model(tokens))


def test_user_model_split_points():
    model = build_model("tests.user_models:staged_mlp_lm", {"n_layers": 4}).eval()
    bounds = layer_bounds(model, 2, ["layers.3"])
    assert bounds == [(0, 3), (3, 4)]
    parts = [split_model(model, s, 2, bounds) for s in range(2)]
    assert [list(p.layers.keys()) for p in parts] == [["0", "1", "2"], ["3"]]
    tokens = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        assert torch.equal(_chain(parts, tokens), model(tokens))


def test_bad_split_points_name_the_field():
    model = build_model("tests.user_models:staged_mlp_lm", {"n_layers": 4})
    with pytest.raises(ValueError, match="pp_split_points: 'blocks.1' is not a layer"):
        layer_bounds(model, 2, ["blocks.1"])


def test_model_without_a_layers_dict_is_refused_with_the_fix():
    model = build_model("tests.user_models:tiny_mlp_lm", {})  # layers is a ModuleList
    with pytest.raises(ValueError, match="needs a 'layers' nn.ModuleDict .* or a method split_for_pipeline"):
        layer_bounds(model, 2, [])


def test_a_split_hook_builds_the_stage():
    class Hooked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def split_for_pipeline(self, stage: int, num_stages: int) -> nn.Module:
            return self.a if stage == 0 else self.b

    model = Hooked()
    assert split_model(model, 1, 2, []) is model.b
