"""Unit tests for raytrain_ckpt.models (CPU only, no process group)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from raytrain_ckpt.data import SyntheticTokens, local_micro_batches
from raytrain_ckpt.models import (
    PRESETS,
    Llama,
    LlamaConfig,
    build_model,
    describe_model,
    num_params,
    resolve_factory,
)
from raytrain_ckpt.models.llama import _apply_rope

TINY = LlamaConfig(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_dim=64, max_seq_len=32
)


def _tiny(**changes: object) -> Llama:
    torch.manual_seed(0)
    return Llama(dataclasses.replace(TINY, **changes))


def test_debug_preset_param_count() -> None:
    model = build_model("debug", {})
    assert 500_000 <= num_params(model) <= 2_000_000


def test_small_preset_param_count() -> None:
    with torch.device("meta"):
        model = build_model("small", {})
    assert 20e6 <= num_params(model) <= 30e6


def test_8b_preset_on_meta_device() -> None:
    with torch.device("meta"):
        model = build_model("8b", {})
    assert all(p.is_meta for p in model.parameters())
    # Llama 3 8B: 8.03e9 parameters.
    assert abs(num_params(model) - 8.03e9) < 0.02e9


@pytest.mark.parametrize("cfg", [
    *PRESETS.values(),
    TINY,
    dataclasses.replace(TINY, n_kv_heads=4, ffn_dim=48, vocab_size=37),  # no GQA, odd vocab
    dataclasses.replace(TINY, dim=48, n_heads=6, n_kv_heads=1, n_layers=3),  # one kv head
], ids=[*PRESETS, "tiny", "tiny-mha", "tiny-mqa"])
def test_config_counts_the_parameters_the_model_has(cfg: LlamaConfig) -> None:
    # The spec's memory check uses the arithmetic count so that `validate` needs no torch.
    with torch.device("meta"):
        model = Llama(cfg)
    assert cfg.num_params == num_params(model)


def test_forward_shape_and_dtype() -> None:
    model = _tiny()
    tokens = torch.randint(0, TINY.vocab_size, (3, 10))
    logits = model(tokens)
    assert logits.shape == (3, 10, TINY.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_forward_rejects_too_long_sequence() -> None:
    model = _tiny()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, TINY.max_seq_len + 1, dtype=torch.long))


def test_causal_future_token_does_not_change_past() -> None:
    model = _tiny().eval()
    tokens = torch.randint(0, TINY.vocab_size, (2, 12))
    changed = tokens.clone()
    changed[:, 8] = (changed[:, 8] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_position_matters() -> None:
    # With one layer, causal attention at the last position is a set function
    # of the earlier tokens unless RoPE injects position: swapping two earlier
    # tokens must change the last logits.
    model = _tiny(n_layers=1).eval()
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6]])
    swapped = torch.tensor([[2, 1, 3, 4, 5, 6]])
    with torch.no_grad():
        assert not torch.allclose(model(tokens)[0, -1], model(swapped)[0, -1], atol=1e-6)


def test_rope_scores_depend_on_relative_position() -> None:
    model = _tiny()
    head_dim = TINY.dim // TINY.n_heads
    q, k = torch.randn(2, head_dim)

    def score(m: int, n: int) -> torch.Tensor:
        def rot(x: torch.Tensor, pos: int) -> torch.Tensor:
            seq = torch.zeros(1, pos + 1, 1, head_dim)
            seq[0, pos, 0] = x
            return _apply_rope(seq, model.rope_cos[: pos + 1], model.rope_sin[: pos + 1])[0, pos, 0]

        return rot(q, m) @ rot(k, n)

    torch.testing.assert_close(score(5, 2), score(13, 10))
    torch.testing.assert_close(score(0, 0), q @ k)
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_init_is_deterministic_under_manual_seed() -> None:
    a, b = _tiny().state_dict(), _tiny().state_dict()
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)
    torch.manual_seed(1)
    c = Llama(TINY).state_dict()
    assert not torch.equal(a["tok_embeddings.weight"], c["tok_embeddings.weight"])


def test_init_weights_values() -> None:
    model = _tiny()
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))
    wq = model.layers["0"].attention.wq.weight
    wo = model.layers["0"].attention.wo.weight
    assert 0.015 < wq.std().item() < 0.025
    # Residual projections are scaled down by 1/sqrt(2 * n_layers) = 0.5.
    assert 0.0075 < wo.std().item() < 0.0125


def test_rope_buffers_not_in_state_dict() -> None:
    model = _tiny()
    keys = set(model.state_dict())
    assert not any("rope" in k for k in keys)
    assert model.rope_cos.shape == (TINY.max_seq_len, TINY.dim // TINY.n_heads)


def test_meta_materialisation_matches_eager() -> None:
    # Deferred init: meta -> to_empty -> init_weights must give a working model
    # identical to an eager one re-initialised from the same RNG state (this
    # also covers the non-persistent RoPE tables, which to_empty leaves garbage).
    with torch.device("meta"):
        meta_model = Llama(TINY)
    meta_model.to_empty(device="cpu")
    torch.manual_seed(0)
    meta_model.init_weights()
    eager = _tiny()
    torch.manual_seed(0)
    eager.init_weights()
    tokens = torch.randint(0, TINY.vocab_size, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(meta_model(tokens), eager(tokens))


@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_gqa_head_layouts(n_kv_heads: int) -> None:
    model = _tiny(n_kv_heads=n_kv_heads)
    head_dim = TINY.dim // TINY.n_heads
    assert model.layers["0"].attention.wk.weight.shape == (n_kv_heads * head_dim, TINY.dim)
    assert model(torch.randint(0, TINY.vocab_size, (2, 5))).shape == (2, 5, TINY.vocab_size)


def test_no_shared_parameters_between_blocks() -> None:
    # FSDP2 per-block sharding requires every parameter to belong to one group.
    model = _tiny()
    ids = [id(p) for _, p in model.named_parameters(remove_duplicate=False)]
    assert len(ids) == len(set(ids))
    assert model.output.weight is not model.tok_embeddings.weight


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"dim": 30}, "divisible by n_heads"),
        ({"n_kv_heads": 3}, "n_kv_heads"),
        ({"dim": 12, "n_heads": 4}, "even for RoPE"),
        ({"n_layers": 0}, "n_layers must be positive"),
        ({"norm_eps": -1.0}, "norm_eps"),
    ],
)
def test_config_validate_errors(changes: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(TINY, **changes).validate()


def test_all_presets_validate() -> None:
    assert {"debug", "small", "1b", "8b"} <= set(PRESETS)
    for cfg in PRESETS.values():
        cfg.validate()


def test_build_model_applies_overrides() -> None:
    model = build_model("debug", {"n_layers": 2, "max_seq_len": 64})
    assert isinstance(model, Llama)
    assert len(model.layers) == 2
    assert model.cfg.max_seq_len == 64


def test_unknown_override_key_names_key_and_valid_keys() -> None:
    with pytest.raises(ValueError, match="n_layerz") as info:
        build_model("debug", {"n_layerz": 2})
    assert "n_layers" in str(info.value)


def test_invalid_override_value() -> None:
    with pytest.raises(ValueError, match="n_heads"):
        build_model("debug", {"n_heads": 3})


def test_unknown_model_name_lists_presets() -> None:
    with pytest.raises(ValueError, match="debug"):
        build_model("nonexistent", {})


def test_describe_model() -> None:
    cfg = describe_model("debug", {"vocab_size": 512})
    assert cfg is not None and cfg.vocab_size == 512 and cfg.max_seq_len == 512
    assert describe_model("tests.user_models:tiny_mlp_lm", {}) is None
    with pytest.raises(ValueError, match="bogus"):
        describe_model("debug", {"bogus": 1})


@pytest.mark.parametrize(
    ("path", "match"),
    [
        ("no_colon_here", "expected 'package.module:function'"),
        ("a:b:c", "expected 'package.module:function'"),
        (":tiny_mlp_lm", "expected 'package.module:function'"),
        ("tests.no_such_module_xyz:f", "No module named"),
        ("tests.user_models:missing_fn", "missing_fn"),
        ("tests.user_models:NOT_CALLABLE", "not a callable"),
    ],
)
def test_resolve_factory_errors(path: str, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        resolve_factory(path)
    assert path in str(info.value)


def test_factory_builds_user_model() -> None:
    model = build_model("tests.user_models:tiny_mlp_lm", {"vocab_size": 64, "n_layers": 3})
    assert isinstance(model, nn.Module)
    assert len(model.layers) == 3
    assert model(torch.randint(0, 64, (2, 7))).shape == (2, 7, 64)


def test_factory_must_return_module() -> None:
    with pytest.raises(ValueError, match="nn.Module"):
        build_model("tests.user_models:not_a_module", {})


def test_factory_bad_kwarg() -> None:
    with pytest.raises(ValueError, match="widht"):
        build_model("tests.user_models:tiny_mlp_lm", {"widht": 3})


@pytest.fixture
def single_thread() -> Iterator[None]:
    # Intra-op thread pools thrash on a loaded 2-core CI box; one thread is
    # both faster and steadier for a model this small.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("single_thread")
def test_debug_model_learns_synthetic_data() -> None:
    torch.manual_seed(0)
    model = build_model("debug", {})
    source = SyntheticTokens(vocab_size=256, seq_len=16, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        ((inputs, targets),) = local_micro_batches(
            source, step=step, global_batch_size=16, micro_batch_size=16, dp_rank=0, dp_size=1
        )
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # Starts near ln(256) = 5.55; must fall clearly, not just fluctuate.
    assert losses[0] > 5.0
    assert sum(losses[-3:]) / 3 < losses[0] - 0.7
