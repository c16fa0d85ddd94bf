"""The training guard on real gloo process groups (no Ray): a NaN on one rank trips every rank
before any optimizer step; without the guard the same fault poisons the parameters; a rollback
(load the certified step, skip the window) equals a run that never read the window; random tokens
in a token shard trip the spike guard exactly at the steps that read them."""

from __future__ import annotations

import pytest
import torch

from raytrain_ckpt.control.preflight import load_spec
from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.distributed


def _spec(*extra: str) -> str:
    base = ["training.log_every_steps=1", "lr_scheduler.warmup_steps=1", "resources.num_workers=2",
            "training.global_batch_size=8", "training.micro_batch_size=2", "training.seq_len=32"]
    return load_spec("jobs/llama_debug_fsdp.yaml", base + list(extra)).model_dump_json()


def nan_at_step(spec_json: str, guarded: bool, fault: str) -> dict:
    import os

    import torch.distributed as dist

    from raytrain_ckpt.common.faults import ENV_VAR
    from raytrain_ckpt.rank.guard import GuardTrip, LossGuard
    from raytrain_ckpt.spec import JobSpec
    from raytrain_ckpt.rank.trainer import Trainer

    os.environ[ENV_VAR] = fault
    torch.set_num_threads(1)
    spec = JobSpec.model_validate_json(spec_json)
    trainer = Trainer(spec, torch.device("cpu"))
    if guarded:
        trainer.guard = LossGuard(spec.training.guard, dist.get_rank(), 0, torch.device("cpu"))
    for _ in range(2):
        trainer.train_step()
    before = {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters()}
    trip = None
    try:
        trainer.train_step()  # step index 2: the fault's step
    except GuardTrip as exc:
        trip = exc.trip
    after = {n: p.full_tensor().clone() for n, p in trainer.model.named_parameters()}
    return {"trip": trip, "step": trainer.state.step, "unchanged": all(torch.equal(before[n], after[n]) for n in before),
            "finite": all(bool(torch.isfinite(t).all()) for t in after.values())}


def test_nan_on_one_rank_trips_every_rank_before_the_optimizer_step():
    out = run_ranks(nan_at_step, 2, _spec(), True, "nan@step:rank=1,step=2")
    for r in out:  # both ranks learn the trip, with rank 1 and the metric named
        assert r["trip"] is not None and (r["trip"].rank, r["trip"].step, r["trip"].metric) == (1, 2, "non-finite loss")
        assert r["step"] == 2 and r["unchanged"] and r["finite"]


def test_the_same_fault_without_the_guard_poisons_the_parameters():
    out = run_ranks(nan_at_step, 2, _spec(), False, "nan@step:rank=1,step=2")
    assert all(r["trip"] is None and r["step"] == 3 and not r["finite"] for r in out)


def roll_back_in_place(spec_json: str, ckpt_dir: str, windows: list[list[int]] | None) -> str:
    """Train 16 steps with a NaN on rank 1 at step 9, saving step 6 with DCP and rolling back to it as
    the worker does (load, skip the window); or, with ``windows``, an uninterrupted run skipping them."""
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from raytrain_ckpt.checkpoint.recovery.state import app_state, load_app_state
    from raytrain_ckpt.data.skips import SampleSkips
    from raytrain_ckpt.common.faults import ENV_VAR
    from raytrain_ckpt.rank.guard import GuardTrip, LossGuard
    from raytrain_ckpt.spec import JobSpec
    from raytrain_ckpt.rank.trainer import Trainer

    torch.set_num_threads(1)
    spec = JobSpec.model_validate_json(spec_json)
    trainer = Trainer(spec, torch.device("cpu"))
    trainer.guard = LossGuard(spec.training.guard, dist.get_rank(), 0, torch.device("cpu"))
    if windows is not None:
        trainer.skips = SampleSkips.from_lists(spec.training.global_batch_size, windows)
    else:
        os.environ[ENV_VAR] = "nan@step:rank=1,step=9"
    while trainer.state.step < 16:
        try:
            trainer.train_step()
        except GuardTrip as exc:
            for opt in trainer.optimizers:
                opt.zero_grad(set_to_none=True)
            load_app_state(trainer, ckpt_dir, same_world_size=True)
            trainer.skips.skip(trainer.state.step, exc.trip.step)
            continue
        if trainer.state.step == 6 and windows is None:
            dcp.save(app_state(trainer), checkpoint_id=ckpt_dir)
    return trainer.fingerprint()


def test_a_rollback_matches_a_run_that_never_read_the_window(tmp_path):
    rolled = run_ranks(roll_back_in_place, 2, _spec(), str(tmp_path / "step-6"), None)
    clean = run_ranks(roll_back_in_place, 2, _spec(), str(tmp_path / "unused"), [[6, 48, 80]])
    assert rolled == clean


def _corpus(path, bad_windows: tuple[int, ...], n_windows: int = 600, seq: int = 32) -> None:
    """A token shard that repeats 0..63 (learnt in a few steps), but for ``bad_windows`` of random tokens."""
    import numpy as np

    tokens = np.tile(np.arange(64, dtype=np.uint16), n_windows * seq // 64 + 1)[: n_windows * seq + 1]
    rng = np.random.default_rng(0)
    for w in bad_windows:
        tokens[w * seq: (w + 1) * seq + 1] = rng.integers(0, 512, seq + 1, dtype=np.uint16)
    path.mkdir(parents=True, exist_ok=True)
    tokens.tofile(path / "shard.bin")


def spike_steps(spec_json: str, steps: int) -> dict:
    """Which steps read a random window, and at which steps the spike guard trips (a trip skips the step)."""
    import torch.distributed as dist

    from raytrain_ckpt.rank.guard import GuardTrip, LossGuard
    from raytrain_ckpt.spec import JobSpec
    from raytrain_ckpt.rank.trainer import Trainer

    torch.set_num_threads(1)
    spec = JobSpec.model_validate_json(spec_json)
    trainer = Trainer(spec, torch.device("cpu"))
    trainer.guard = LossGuard(spec.training.guard, dist.get_rank(), 0, torch.device("cpu"))
    gbs = spec.training.global_batch_size
    bad = set()
    for i in range(steps * gbs):
        s = trainer.source.sample(i)
        if not bool((((s[1:] - s[:-1]) % 64) == 1).all()):
            bad.add(i // gbs)
    trips, losses = [], []
    while trainer.state.step < steps:
        try:
            losses.append(trainer.train_step().loss)
        except GuardTrip as exc:
            trips.append((exc.trip.step, exc.trip.metric))
            for opt in trainer.optimizers:
                opt.zero_grad(set_to_none=True)
            trainer.skips.skip(trainer.state.step, trainer.state.step)  # skip the step's samples, as a rollback would
    return {"bad": sorted(bad), "trips": trips, "losses": losses}


def test_random_tokens_in_the_token_shard_trip_the_spike_guard(tmp_path):
    _corpus(tmp_path / "corpus", bad_windows=(137, 411, 523, 58))
    spec = load_spec("jobs/llama_debug_fsdp.yaml", [
        "data.source=tokens", f"data.path={tmp_path / 'corpus'}", "data.dtype=uint16", "model.overrides={vocab_size: 512}",
        "training.seq_len=32", "training.log_every_steps=1", "lr_scheduler.warmup_steps=2", "resources.num_workers=2", "optimizer.lr=1.0e-2",
        "training.global_batch_size=8", "training.micro_batch_size=2",
        "training.guard.spike=true", "training.guard.spike_window=8"]).model_dump_json()
    out = run_ranks(spike_steps, 2, spec, 60)[0]
    # detected: the guard trips only at steps that read a window of random tokens (no false alarm in
    # 60 steps of a falling loss), once the loss has settled enough for the spike to stand out
    assert out["trips"] and all(metric == "loss spike" and step in out["bad"] for step, metric in out["trips"])
    assert len(out["losses"]) == 60 and out["losses"][-1] < 1.0  # skipped, the job learnt on to the end
