"""The Trainer on real gloo process groups (no Ray): determinism and data-parallel equivalence."""

from __future__ import annotations

import pytest
import torch

from raytrain_ckpt.control.preflight import load_spec
from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.distributed


def train(spec_json: str, steps: int) -> dict:
    from raytrain_ckpt.spec import JobSpec
    from raytrain_ckpt.rank.trainer import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(JobSpec.model_validate_json(spec_json), torch.device("cpu"))
    for _ in range(steps):
        trainer.train_step()
    full = {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters()}
    return {"losses": trainer.state.losses, "fingerprint": trainer.fingerprint(), "params": full,
            "tokens": trainer.state.tokens_seen}


def _spec(workers: int, *extra: str) -> str:
    base = ["training.steps=5", "training.log_every_steps=1", "lr_scheduler.warmup_steps=1",
            f"resources.num_workers={workers}", "parallelism.dp_shard=-1", "training.global_batch_size=8",
            "training.micro_batch_size=2", "training.seq_len=64"]
    return load_spec("jobs/llama_debug_fsdp.yaml", base + list(extra)).model_dump_json()


def test_two_runs_same_seed_are_bit_identical():
    a = run_ranks(train, 2, _spec(2), 5)
    b = run_ranks(train, 2, _spec(2), 5)
    assert a[0]["losses"] == b[0]["losses"] and len(a[0]["losses"]) == 5
    assert [r["fingerprint"] for r in a] == [r["fingerprint"] for r in b]
    for name, tensor in a[0]["params"].items():
        assert torch.equal(tensor, b[0]["params"][name]), name


def test_dp_sizes_compute_the_same_training_within_float_tolerance():
    # The global batch is fixed by the global sample index, so 1, 2 or 4 ranks see the
    # same samples per step; only the reduction order differs.
    one = run_ranks(train, 1, _spec(1), 5)[0]
    for world in (2, 4):
        many = run_ranks(train, world, _spec(world), 5)[0]
        assert many["tokens"] == one["tokens"]
        for step, loss in one["losses"].items():
            assert many["losses"][step] == pytest.approx(loss, rel=1e-4, abs=1e-5)
        for name, tensor in one["params"].items():
            torch.testing.assert_close(many["params"][name], tensor, rtol=2e-4, atol=2e-5)


def test_grad_accumulation_matches_one_big_micro_batch():
    # SGD: its update is proportional to the gradient, so a mis-scaled accumulation shows (AdamW
    # normalises the scale away), and rounding noise in near-zero gradients is not amplified to a
    # full-size step as AdamW's m / sqrt(v) amplifies it.
    sgd = ("optimizer.name=sgd", "optimizer.lr=0.05")
    small = run_ranks(train, 2, _spec(2, "training.micro_batch_size=1", *sgd), 3)[0]
    big = run_ranks(train, 2, _spec(2, "training.micro_batch_size=4", *sgd), 3)[0]
    for name, tensor in big["params"].items():
        torch.testing.assert_close(small["params"][name], tensor, rtol=2e-4, atol=2e-5)
