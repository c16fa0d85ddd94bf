"""Activation checkpointing and compile keep checkpoints compatible (real gloo ranks, real DCP
files): a checkpoint saved with the options on resumes with them off and the other way round,
bit-identical on CPU, and no wrapper prefix reaches the checkpoint's keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raytrain_ckpt.control.preflight import load_spec
from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.distributed

STEPS, SAVE_AT = 4, 2


def _spec(*extra: str) -> str:
    base = ["training.steps=4", "training.log_every_steps=1", "lr_scheduler.warmup_steps=1",
            "resources.num_workers=2", "parallelism.dp_shard=-1", "training.global_batch_size=4",
            "training.micro_batch_size=2", "training.seq_len=32", "model.overrides.dim=64"]
    return load_spec("jobs/llama_debug_fsdp.yaml", base + list(extra)).model_dump_json()


def _trainer(spec_json: str):
    from raytrain_ckpt.spec import JobSpec
    from raytrain_ckpt.rank.trainer import Trainer

    torch.set_num_threads(1)
    return Trainer(JobSpec.model_validate_json(spec_json), torch.device("cpu"))


def save_then_resume(save_spec: str, resume_spec: str, path: str, resume_steps: int, save_at: int = SAVE_AT) -> dict:
    """Train ``save_spec`` to SAVE_AT, save, finish; load the save into ``resume_spec`` and train on."""
    import torch.distributed.checkpoint as dcp

    from raytrain_ckpt.checkpoint.recovery.state import app_state, load_app_state

    saver = _trainer(save_spec)
    for _ in range(save_at):
        saver.train_step()
    state = app_state(saver)
    dcp.save(state, checkpoint_id=path)
    saved_print = saver.fingerprint()
    for _ in range(resume_steps):
        saver.train_step()
    resumed = _trainer(resume_spec)
    load_app_state(resumed, path, same_world_size=True)
    loaded_print = resumed.fingerprint()
    for _ in range(resume_steps):
        resumed.train_step()
    names = sorted(n for part in resumed.model_parts for n, _ in part.named_parameters())
    return {"saved": saved_print, "loaded": loaded_print, "names": names,
            "full": (saver.state.losses, saver.fingerprint()),
            "resumed": (resumed.state.losses, resumed.fingerprint())}


def _metadata_keys(path: Path) -> set[str]:
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


@pytest.mark.parametrize(("on", "off"), [(("training.activation_checkpointing=full",), ()),
                                         ((), ("training.activation_checkpointing=selective",))],
                         ids=["full-to-none", "none-to-selective"])
def test_activation_checkpointing_resumes_bit_identical_either_way(tmp_path, on, off):
    path = tmp_path / "step-2"
    ranks = run_ranks(save_then_resume, 2, _spec(*on), _spec(*off), str(path), STEPS - SAVE_AT)
    for r in ranks:
        assert r["loaded"] == r["saved"]
        full_losses, full_print = r["full"]
        resumed_losses, resumed_print = r["resumed"]
        assert resumed_print == full_print
        assert all(resumed_losses[s] == full_losses[s] for s in resumed_losses) and resumed_losses
    assert not any("_checkpoint_wrapped_module" in k or "_orig_mod" in k for k in _metadata_keys(path))


def test_compile_and_ac_checkpoints_load_with_both_off_and_back(tmp_path):
    # Loading is checked bit for bit both ways on the state of a fresh model: no compiled step
    # runs, because compiling the blocks takes over a minute per rank on this CPU. The names a
    # checkpoint holds come from the module tree, which is what compile and AC could change.
    both = _spec("training.activation_checkpointing=full", "training.compile=true")
    plain = _spec()
    ranks = run_ranks(save_then_resume, 2, both, plain, str(tmp_path / "a"), 0, 0)
    for r in ranks:
        assert r["loaded"] == r["saved"]
    ranks = run_ranks(save_then_resume, 2, plain, both, str(tmp_path / "b"), 0, 0)
    for r in ranks:
        assert r["loaded"] == r["saved"]
        assert not any("_orig_mod" in n or "_checkpoint_wrapped" in n for n in r["names"])
    assert _metadata_keys(tmp_path / "a") == _metadata_keys(tmp_path / "b")
