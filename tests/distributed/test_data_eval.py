"""Token-shard data, evaluation and optimizers other than AdamW on real gloo process groups (no Ray)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from raytrain_ckpt.control.preflight import load_spec
from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.distributed

STEPS, SAVE_AT = 6, 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Counting sequences with random starts: learnable, and every window is different."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.default_rng(0)
    starts = rng.integers(0, 256, size=400)
    tokens = np.concatenate([(s + np.arange(40)) % 256 for s in starts]).astype(np.uint16)
    tokens.tofile(root / "part-0.bin")
    return root


def _spec(corpus: Path, workers: int, *extra: str) -> str:
    base = [f"training.steps={STEPS}", "training.log_every_steps=1", "lr_scheduler.warmup_steps=1",
            f"resources.num_workers={workers}", "parallelism.dp_shard=-1", "training.global_batch_size=8",
            "training.micro_batch_size=2", "training.seq_len=32", "data.source=tokens", f"data.path={corpus}",
            "data.eval_fraction=0.1", "eval.every_steps=2", "eval.batches=2", "checkpoint.enabled=false"]
    return load_spec("jobs/llama_debug_fsdp.yaml", base + list(extra)).model_dump_json()


def _trainer(spec_json: str):
    from raytrain_ckpt.spec import JobSpec
    from raytrain_ckpt.rank.trainer import Trainer

    torch.set_num_threads(1)
    return Trainer(JobSpec.model_validate_json(spec_json), torch.device("cpu"))


def _optim_state(trainer) -> dict[str, torch.Tensor]:
    from raytrain_ckpt.checkpoint.recovery.state import app_state

    return {k: v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
            for k, v in app_state(trainer)["optim"].items() if isinstance(v, torch.Tensor)}


class _Recording:
    """A trainer's token source that keeps a copy of every sample it hands out, by global index."""

    def __init__(self, source) -> None:
        self.source, self.seen = source, {}

    def sample(self, index: int) -> torch.Tensor:
        tokens = self.source.sample(index)
        self.seen[index] = tokens.clone()
        return tokens

    def __getattr__(self, name: str):
        return getattr(self.source, name)


def train(spec_json: str, save_path: str = "") -> dict:
    """Train STEPS; with ``save_path`` also save at SAVE_AT."""
    import torch.distributed.checkpoint as dcp

    from raytrain_ckpt.checkpoint.recovery.state import app_state

    trainer = _trainer(spec_json)
    trainer.source = recording = _Recording(trainer.source)
    saved = None
    for _ in range(STEPS):
        trainer.train_step()
        if save_path and trainer.state.step == SAVE_AT:
            dcp.save(app_state(trainer), checkpoint_id=save_path)
            saved = _optim_state(trainer)
    again = trainer.evaluate()
    return {"losses": trainer.state.losses, "eval": trainer.state.eval_losses, "again": again, "saved": saved,
            "seen": recording.seen}


def resume(spec_json: str, path: str) -> dict:
    from raytrain_ckpt.checkpoint.recovery.state import load_app_state

    trainer = _trainer(spec_json)
    trainer.source = recording = _Recording(trainer.source)
    load_app_state(trainer, path, same_world_size=False)
    loaded, start = _optim_state(trainer), trainer.state.step
    while trainer.state.step < STEPS:
        trainer.train_step()
    return {"losses": trainer.state.losses, "eval": trainer.state.eval_losses, "loaded": loaded, "start": start,
            "seen": recording.seen}


def test_eval_is_the_same_samples_on_every_layout_and_every_call(corpus):
    one = run_ranks(train, 1, _spec(corpus, 1))[0]
    two = run_ranks(train, 2, _spec(corpus, 2))[0]
    assert sorted(one["eval"]) == [2, 4, 6]
    assert one["again"] == one["eval"][6]  # the same held-out samples, the same weights: the same loss
    for step, loss in one["eval"].items():
        assert two["eval"][step] == pytest.approx(loss, rel=1e-4, abs=1e-5)
    for step, loss in one["losses"].items():
        assert two["losses"][step] == pytest.approx(loss, rel=1e-4, abs=1e-5)
    assert one["eval"][6] < one["eval"][2]  # held-out loss falls: the model learns the counting


@pytest.mark.parametrize("extra", [
    ("optimizer.name=sgd", "optimizer.momentum=0.9", "optimizer.lr=0.05"),
    ("optimizer.name=tests.user_data:plain_sgd", "optimizer.kwargs.momentum=0.5", "optimizer.lr=0.05",
     "training.loss=tests.user_data:scaled_cross_entropy"),
])
def test_sgd_momentum_is_saved_and_resharded(corpus, tmp_path, extra):
    path = str(tmp_path / "ckpt")
    full = run_ranks(train, 2, _spec(corpus, 2, *extra), path)
    saved = full[0]["saved"]
    assert any(k.endswith("momentum_buffer") for k in saved), sorted(saved)[:5]
    resumed = run_ranks(resume, 1, _spec(corpus, 1, *extra), path)[0]
    for key, tensor in saved.items():
        assert torch.equal(resumed["loaded"][key], tensor), key
    for step in range(SAVE_AT + 1, STEPS + 1):
        assert resumed["losses"][step] == pytest.approx(full[0]["losses"][step], rel=1e-4, abs=1e-5)
    assert resumed["eval"][6] == pytest.approx(full[0]["eval"][6], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("extra", [
    ("parallelism.pp=2",),
    ("parallelism.pp=2", "parallelism.pp_schedule=interleaved_1f1b", "parallelism.virtual_stages=2"),
])
def test_eval_through_a_pipeline_equals_the_single_process_eval(corpus, extra):
    one = run_ranks(train, 1, _spec(corpus, 1))[0]
    pp = run_ranks(train, 2, _spec(corpus, 2, *extra))
    assert sorted(pp[0]["eval"]) == [2, 4, 6]
    assert pp[0]["eval"] == pp[1]["eval"]  # every rank gets the global value
    for step, loss in one["eval"].items():
        assert pp[0]["eval"][step] == pytest.approx(loss, rel=1e-4, abs=1e-5)


def _union(results: list[dict]) -> dict[int, torch.Tensor]:
    out: dict[int, torch.Tensor] = {}
    for r in results:
        assert not set(out) & set(r["seen"]), "two ranks read the same sample"
        out.update(r["seen"])
    return out


@pytest.mark.parametrize("workers", [1, 4])
def test_tokens_reshard_resume_reads_the_same_samples(corpus, tmp_path, workers):
    # 2 workers train and save at SAVE_AT; 1 or 4 workers resume from it: the same global samples
    # from SAVE_AT on, token for token, the optimizer state as saved, the losses within float tolerance
    path = str(tmp_path / "ckpt")
    full = run_ranks(train, 2, _spec(corpus, 2), path)
    resumed = run_ranks(resume, workers, _spec(corpus, workers), path)
    gbs = 8
    want = {i: t for i, t in _union(full).items() if i >= SAVE_AT * gbs}
    got = _union(resumed)
    assert all(r["start"] == SAVE_AT for r in resumed)
    assert sorted(got) == list(range(SAVE_AT * gbs, STEPS * gbs)) == sorted(want)
    assert all(torch.equal(got[i], want[i]) for i in want)
    for key, tensor in full[0]["saved"].items():
        assert torch.equal(resumed[0]["loaded"][key], tensor), key
    for step in range(SAVE_AT + 1, STEPS + 1):
        assert resumed[0]["losses"][step] == pytest.approx(full[0]["losses"][step], rel=1e-4, abs=1e-5), step
    assert resumed[0]["eval"][6] == pytest.approx(full[0]["eval"][6], rel=1e-4, abs=1e-5)


def test_user_data_loss_and_optimizer_train_checkpoint_and_resume_exactly(tmp_path):
    # every part by import path; resumed at the same world size, the run continues bit for bit
    spec = load_spec("jobs/llama_debug_fsdp.yaml", [
        f"training.steps={STEPS}", "training.log_every_steps=1", "lr_scheduler.warmup_steps=1",
        "resources.num_workers=2", "training.global_batch_size=8", "training.micro_batch_size=2",
        "training.seq_len=32", "data.source=tests.user_data:counting_dataset", "data.kwargs.items=120",
        "data.kwargs.length=33", "data.kwargs.vocab=256", "data.eval_fraction=0.1", "eval.every_steps=2",
        "eval.batches=1", "checkpoint.enabled=false", "optimizer.name=tests.user_data:plain_sgd",
        "optimizer.kwargs.momentum=0.5", "optimizer.lr=0.05", "training.loss=tests.user_data:scaled_cross_entropy",
    ]).model_dump_json()
    path = str(tmp_path / "ckpt")
    full = run_ranks(train, 2, spec, path)
    resumed = run_ranks(resume, 2, spec, path)
    assert all(r["start"] == SAVE_AT for r in resumed)
    for rank in range(2):
        for key, tensor in full[rank]["saved"].items():
            assert torch.equal(resumed[rank]["loaded"][key], tensor), key
    assert {s: v for s, v in full[0]["losses"].items() if s > SAVE_AT} == resumed[0]["losses"]
    assert {s: v for s, v in full[0]["eval"].items() if s > SAVE_AT} == resumed[0]["eval"]
    want = {i: t for i, t in _union(full).items() if i >= SAVE_AT * 8}
    got = _union(resumed)
    assert sorted(got) == sorted(want) and all(torch.equal(got[i], want[i]) for i in want)
    assert full[0]["losses"][STEPS] < full[0]["losses"][1]  # it learns the counting items
