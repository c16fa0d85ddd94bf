"""Deferred (meta-device) initialisation on real gloo process groups: every rank allocates only
its shards, and the initial parameters equal a model built whole on one CPU, tensor by tensor,
at 1, 2 and 4 ranks and with a 2-stage pipeline. The vocabulary is large enough that the
embedding and the head span several independently seeded blocks and the shard boundaries fall
inside blocks."""

from __future__ import annotations

import pytest
import torch

from raytrain_ckpt.models import Llama, describe_model
from raytrain_ckpt.spec import JobSpec
from raytrain_ckpt.control.preflight import load_spec
from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.distributed

SEED = 3


def _spec(workers: int, *extra: str) -> str:
    base = [f"resources.num_workers={workers}", "parallelism.dp_shard=-1", "training.global_batch_size=8",
            "training.micro_batch_size=2", "training.seq_len=32", "model.overrides.dim=64",
            f"training.seed={SEED}", "model.overrides.vocab_size=20000"]
    return load_spec("jobs/llama_debug_fsdp.yaml", base + list(extra)).model_dump_json()


def initial_params(spec_json: str) -> dict:
    """This rank's parameters right after the Trainer is built, unsharded (collective over dp)."""
    from raytrain_ckpt.rank.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(JobSpec.model_validate_json(spec_json), torch.device("cpu"))
    params = {}
    for part in trainer.model_parts:
        for name, param in part.named_parameters():
            local = param.to_local()
            params[name] = (param.full_tensor().clone(), local.numel(), local.untyped_storage().nbytes())
    rope = getattr(trainer.model, "rope_cos", None)
    return {"deferred": trainer.deferred_init, "params": params, "rope_cos": rope}


def _eager(spec_json: str) -> Llama:
    spec = JobSpec.model_validate_json(spec_json)
    torch.manual_seed(SEED)
    return Llama(describe_model(spec.model.name, dict(spec.model.overrides)))


@pytest.mark.parametrize(("world", "extra"), [(1, ()), (2, ()), (4, ()), (2, ("parallelism.pp=2",)),
                                              (4, ("parallelism.pp=2",))],
                         ids=["dp1", "dp2", "dp4", "pp2", "pp2xdp2"])
def test_meta_init_equals_the_eager_cpu_model(world, extra):
    spec = _spec(world, *extra)
    ranks = run_ranks(initial_params, world, spec)
    eager = _eager(spec)
    expected = dict(eager.named_parameters())
    seen: dict[str, torch.Tensor] = {}
    for r in ranks:
        assert r["deferred"]
        torch.testing.assert_close(r["rope_cos"], eager.rope_cos, rtol=0, atol=0)
        for name, (full, local_numel, _) in r["params"].items():
            seen[name] = full
            dp = world // (2 if extra else 1)
            # only the shard is allocated: about 1/dp of the full tensor on each rank
            assert local_numel <= -(-full.shape[0] // dp) * full[0].numel(), name
    assert set(seen) == set(expected)
    assert expected["output.weight"].numel() > 1 << 20
    for name, tensor in expected.items():
        assert torch.equal(seen[name], tensor.detach()), name


def test_another_seed_gives_other_parameters():
    a = run_ranks(initial_params, 1, _spec(1))[0]["params"]
    b = run_ranks(initial_params, 1, _spec(1, "training.seed=4"))[0]["params"]
    assert not torch.equal(a["tok_embeddings.weight"][0], b["tok_embeddings.weight"][0])


def test_a_factory_without_init_weights_is_built_eagerly():
    ranks = run_ranks(initial_params, 2, _spec(2, "model.name=tests.user_models:staged_mlp_lm"))
    assert not ranks[0]["deferred"]


def restored_params(spec_json: str, path: str) -> dict:
    """Build a trainer as a fresh attempt would (parameters drawn), save its model with DCP, then
    build one as a resuming attempt does (``restoring``) and load that checkpoint into it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from raytrain_ckpt.rank.trainer import Trainer

    torch.set_num_threads(1)
    spec = JobSpec.model_validate_json(spec_json)
    fresh = Trainer(spec, torch.device("cpu"))
    dcp.save({"model": get_model_state_dict(fresh.model)}, checkpoint_id=path)
    drawn = []
    original = Llama.init_parameter
    Llama.init_parameter = lambda self, fqn, *a: (drawn.append(fqn), original(self, fqn, *a))[1]
    try:
        restored = Trainer(spec, torch.device("cpu"), restoring=True)
    finally:
        Llama.init_parameter = original
    rope = restored.model.rope_cos.clone()
    sd = get_model_state_dict(restored.model)
    dcp.load({"model": sd}, checkpoint_id=path)
    set_model_state_dict(restored.model, sd)
    same = all(torch.equal(a.full_tensor(), b.full_tensor())
               for a, b in zip(fresh.model.parameters(), restored.model.parameters(), strict=True))
    return {"drawn": drawn, "rope_cos": rope, "same": same}


def test_a_restoring_build_draws_no_parameters_and_the_load_overwrites_them_all(tmp_path):
    # A resuming attempt skips drawing initial values (the load overwrites every parameter) but
    # must still compute the non-persistent RoPE tables, which no checkpoint holds.
    spec = _spec(2)
    ranks = run_ranks(restored_params, 2, spec, str(tmp_path / "ckpt"))
    eager = _eager(spec)
    for r in ranks:
        assert r["drawn"] == []
        torch.testing.assert_close(r["rope_cos"], eager.rope_cos, rtol=0, atol=0)
        assert r["same"]
