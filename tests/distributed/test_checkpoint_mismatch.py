"""A checkpoint of a deeper model is refused, not loaded in part (real gloo ranks, real DCP files).

DCP loads only the entries it is asked for, so without a check a 4-layer checkpoint "loads" into a
2-layer model: its first two layers arrive and the rest is dropped silently. The check sees the
whole group's FQNs, so a pipeline rank (which holds only its stages') neither misses an extra
entry nor mistakes its peer stage's layers for one.
"""

from __future__ import annotations

import pytest
import torch

from raytrain_ckpt.control.preflight import load_spec
from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.distributed


def _spec(*extra: str) -> str:
    base = ["training.steps=2", "lr_scheduler.warmup_steps=1", "resources.num_workers=2", "parallelism.dp_shard=-1",
            "training.global_batch_size=4", "training.micro_batch_size=2", "training.seq_len=16",
            "model.overrides.dim=32"]
    return load_spec("jobs/llama_debug_fsdp.yaml", base + list(extra)).model_dump_json()


def _trainer(spec_json: str):
    from raytrain_ckpt.spec import JobSpec
    from raytrain_ckpt.rank.trainer import Trainer

    torch.set_num_threads(1)
    return Trainer(JobSpec.model_validate_json(spec_json), torch.device("cpu"))


def save_then_load(saver: str, loaders: dict[str, str], root: str) -> dict[str, str]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from raytrain_ckpt.checkpoint.errors import CheckpointMismatch

    from raytrain_ckpt.checkpoint.recovery.state import app_state, load_app_state

    trainer = _trainer(saver)
    trainer.train_step()
    dcp.save(app_state(trainer), checkpoint_id=f"{root}/full")
    dcp.save({"model": get_model_state_dict(trainer.model_parts[0])}, checkpoint_id=f"{root}/weights")
    out = {}
    for kind in ("full", "weights"):
        for name, spec_json in loaders.items():
            try:
                load_app_state(_trainer(spec_json), f"{root}/{kind}", same_world_size=True)
                out[f"{kind}/{name}"] = "loaded"
            except CheckpointMismatch as exc:
                out[f"{kind}/{name}"] = f"refused: {exc}"
    return out


def test_a_deeper_models_checkpoint_is_refused_at_every_layout(tmp_path):
    loaders = {"shallower": _spec("model.overrides.n_layers=2"),
               "shallower_pp2": _spec("model.overrides.n_layers=2", "parallelism.pp=2"),
               "same_model_pp2": _spec("model.overrides.n_layers=4", "parallelism.pp=2")}
    ranks = run_ranks(save_then_load, 2, _spec("model.overrides.n_layers=4"), loaders, str(tmp_path))
    for kind in ("full", "weights"):
        for r in ranks:
            assert r[f"{kind}/same_model_pp2"] == "loaded", kind
            for name in ("shallower", "shallower_pp2"):
                assert r[f"{kind}/{name}"].startswith("refused: "), (kind, name, r[f"{kind}/{name}"])
                assert "model entries this model does not have (e.g. model.layers.2." in r[f"{kind}/{name}"]
