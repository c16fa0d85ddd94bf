"""Pipeline parallelism on real gloo process groups (no Ray): every schedule against a
single-process reference, exact resume at the same layout, and resharding a pp=2 checkpoint
to pp=1 x dp=2, pp=2 x dp=2 and an interleaved layout (real DCP files)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raytrain_ckpt.control.preflight import load_spec
from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.distributed

STEPS, SAVE_AT = 4, 2
SCHEDULES = {"gpipe": [], "1f1b": [], "interleaved_1f1b": ["parallelism.virtual_stages=2"]}


def _spec(workers: int, *extra: str) -> str:
    base = ["training.steps=4", "training.log_every_steps=1", "lr_scheduler.warmup_steps=1",
            f"resources.num_workers={workers}", "parallelism.dp_shard=-1", "training.global_batch_size=8",
            "training.micro_batch_size=2", "training.seq_len=32", "model.overrides.dim=64"]
    return load_spec("jobs/llama_debug_fsdp.yaml", base + list(extra)).model_dump_json()


def _trainer(spec_json: str):
    from raytrain_ckpt.spec import JobSpec
    from raytrain_ckpt.rank.trainer import Trainer

    torch.set_num_threads(1)
    return Trainer(JobSpec.model_validate_json(spec_json), torch.device("cpu"))


def _full_state(trainer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor of this rank's stages, unsharded (collective over dp)."""
    out = {}
    for part, opt in zip(trainer.model_parts, trainer.optimizers, strict=True):
        for name, param in part.named_parameters():
            out[f"param/{name}"] = param.full_tensor().clone()
            for key, value in sorted(opt.state.get(param, {}).items()):
                if isinstance(value, torch.Tensor):
                    full = value.full_tensor() if hasattr(value, "full_tensor") else value
                    out[f"optim/{name}/{key}"] = full.clone()
    return out


def _train(trainer, steps: int) -> None:
    for _ in range(steps):
        trainer.train_step()


def train(specs: dict[str, str], save_as: str | None = None, path: str = "") -> dict[str, dict]:
    """Train each spec for STEPS; the run named ``save_as`` also saves at SAVE_AT, and a fresh
    trainer loads that save and finishes the run (the resumed run)."""
    import torch.distributed.checkpoint as dcp

    from raytrain_ckpt.checkpoint.recovery.state import app_state, load_app_state

    out = {}
    for name, spec_json in specs.items():
        trainer = _trainer(spec_json)
        _train(trainer, SAVE_AT)
        if name == save_as:
            dcp.save(app_state(trainer), checkpoint_id=path)
            out["saved"] = _full_state(trainer)
        _train(trainer, STEPS - SAVE_AT)
        out[name] = {"losses": trainer.state.losses, "state": _full_state(trainer), "fingerprint": trainer.fingerprint()}
    if save_as is not None:
        resumed = _trainer(specs[save_as])
        load_app_state(resumed, path, same_world_size=True)
        start = resumed.state.step
        _train(resumed, STEPS - SAVE_AT)
        out["resumed"] = {"losses": resumed.state.losses, "fingerprint": resumed.fingerprint(), "start": start}
    return out


def _merged(ranks: list[dict]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in ranks:
        out.update(r)
    return out


USER = ("model.name=tests.user_models:staged_mlp_lm",)


@pytest.fixture(scope="module")
def references() -> dict:
    return run_ranks(train, 1, {"ref": _spec(1), "user": _spec(1, *USER)})[0]


@pytest.fixture(scope="module")
def reference(references) -> dict:
    return references["ref"]


@pytest.fixture(scope="module")
def pp_runs(tmp_path_factory) -> tuple[Path, list[dict]]:
    """pp=2 runs of every schedule; the 1f1b run saves at SAVE_AT and is resumed from there."""
    path = tmp_path_factory.mktemp("pp2") / "step-2"
    specs = {name: _spec(2, "parallelism.pp=2", f"parallelism.pp_schedule={name}", *extra)
             for name, extra in SCHEDULES.items()}
    # a user model (layers ModuleDict, forward skips None) split at an explicit point
    specs["user"] = _spec(2, "parallelism.pp=2", "parallelism.pp_split_points=[layers.3]", *USER)
    return path, run_ranks(train, 2, specs, "1f1b", str(path))


def test_every_schedule_matches_the_single_process_reference(reference, pp_runs):
    _, ranks = pp_runs
    for name in SCHEDULES:
        # the loss comes from the last stage and is the same on every rank
        assert ranks[0][name]["losses"] == ranks[1][name]["losses"], name
        for step, loss in reference["losses"].items():
            assert ranks[0][name]["losses"][step] == pytest.approx(loss, rel=1e-5, abs=1e-6), (name, step)
        state = _merged([r[name]["state"] for r in ranks])
        assert set(state) == set(reference["state"]), name
        for key, tensor in reference["state"].items():
            torch.testing.assert_close(state[key], tensor, rtol=2e-4, atol=2e-5, msg=lambda m, k=key: f"{name} {k}: {m}")


def test_a_user_model_split_at_a_point_matches_its_reference(references, pp_runs):
    _, ranks = pp_runs
    ref = references["user"]
    for step, loss in ref["losses"].items():
        assert ranks[0]["user"]["losses"][step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    # stage 0 holds the embedding and layers 0-2, stage 1 layer 3 and the head
    assert {k.split("/")[1].split(".")[0] for k in ranks[1]["user"]["state"]} == {"layers", "head"}
    assert not any(k.startswith("param/layers.3") for k in ranks[0]["user"]["state"])
    state = _merged([r["user"]["state"] for r in ranks])
    assert set(state) == set(ref["state"])
    for key, tensor in ref["state"].items():
        torch.testing.assert_close(state[key], tensor, rtol=2e-4, atol=2e-5)


def test_resume_at_the_same_layout_is_bit_identical(pp_runs):
    _, ranks = pp_runs
    for r in ranks:
        assert r["resumed"]["start"] == SAVE_AT
        assert r["resumed"]["fingerprint"] == r["1f1b"]["fingerprint"]
        assert r["resumed"]["losses"] == {s: v for s, v in r["1f1b"]["losses"].items() if s > SAVE_AT}


def load_other_layouts(specs: dict[str, str], path: str) -> dict:
    from raytrain_ckpt.checkpoint.errors import CheckpointMismatch
    from raytrain_ckpt.checkpoint.recovery.state import load_app_state

    out = {}
    for name, spec_json in specs.items():
        trainer = _trainer(spec_json)
        if name == "other_model":
            with pytest.raises(CheckpointMismatch, match="shape"):
                load_app_state(trainer, path, same_world_size=False)
            out[name] = "refused"
            continue
        load_app_state(trainer, path, same_world_size=False)
        loaded = _full_state(trainer)
        _train(trainer, STEPS - SAVE_AT)
        out[name] = {"loaded": loaded, "losses": trainer.state.losses, "lr": trainer.scheduler.get_last_lr()}
    return out


@pytest.mark.parametrize(("world", "extra"), [
    (2, ()),                                         # pp=1 x dp=2, then interleaved pp=2 x 2 chunks
    (4, ("parallelism.pp=2",)),                      # pp=2 x dp=2
])
def test_a_pp2_checkpoint_reshards_to_other_layouts(pp_runs, world, extra):
    path, saver = pp_runs
    saved = _merged([r["saved"] for r in saver])
    expected = {s: v for s, v in saver[0]["1f1b"]["losses"].items() if s > SAVE_AT}
    specs = {"main": _spec(world, *extra)}
    if world == 2:
        specs["interleaved"] = _spec(2, "parallelism.pp=2", "parallelism.pp_schedule=interleaved_1f1b",
                                     "parallelism.virtual_stages=2")
        specs["other_model"] = _spec(2, "model.overrides.dim=32")
    ranks = run_ranks(load_other_layouts, world, specs, str(path))
    for name in specs:
        if name == "other_model":
            assert all(r[name] == "refused" for r in ranks)
            continue
        loaded = _merged([r[name]["loaded"] for r in ranks])
        # model and optimizer state arrive exactly as saved, only cut differently
        assert set(loaded) == set(saved), name
        for key, tensor in saved.items():
            assert torch.equal(loaded[key], tensor), (name, key)
        # and training continues where the uninterrupted pp=2 run went (float reduction order aside)
        for step, loss in expected.items():
            assert ranks[0][name]["losses"][step] == pytest.approx(loss, rel=1e-5, abs=1e-6), (name, step)
