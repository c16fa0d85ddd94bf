"""The training guard's pure parts: the robust z-score, certification, the rollback policy, the
sample windows a rollback skips, retention of the certified step, the nan@step fault's grammar, and
the manifest fields that record it all."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from raytrain_ckpt.checkpoint.errors import InvalidCheckpoint
from raytrain_ckpt.checkpoint.format.fingerprints import diff_steps, tensor_stats
from raytrain_ckpt.checkpoint.format.manifest import Manifest
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy, newest_certified
from raytrain_ckpt.data.skips import SampleSkips, SkipWindow
from raytrain_ckpt.common.faults import ENV_VAR, parse_faults, take_nan
from raytrain_ckpt.rank.guard import LossGuard, RollbackFacts, RollbackPolicy, RollbackRecord, Trip, failure_report, robust_z
from raytrain_ckpt.spec.sections import GuardSpec


def test_robust_z_ignores_one_outlier_in_the_window_and_flags_a_spike():
    history = [2.0, 2.1, 1.9, 2.0, 2.05, 1.95, 9.0]  # one earlier outlier barely moves median and MAD
    assert abs(robust_z(2.0, history)) < 1
    assert robust_z(6.0, history) > 20
    assert robust_z(3.0, [2.0] * 5) == math.inf and robust_z(2.0, [2.0] * 5) == 0.0


def _guard(**kw) -> LossGuard:
    return LossGuard(GuardSpec(**kw), 0, 0, torch.device("cpu"))


def test_a_step_is_certified_after_n_healthy_steps_and_a_rollback_forgets_the_steps_after_it():
    g = _guard(certify_after_steps=3)
    told: list[int] = []
    g.on_certified = told.append
    for step in range(10):  # saves at 2, 4, 6, 8
        g.healthy(step)
        if (step + 1) % 2 == 0:
            g.saved_step(step + 1)
    assert g.certified() == 6 and g.certified_steps() == [6, 4, 2] and told == [2, 4, 6]
    g.rolled_back(RollbackRecord(Trip(10, 1, "non-finite loss"), 6, (96, 176)))
    assert g.saved == [2, 4, 6] and g.certified() == 6
    g.healthy(6)
    g.saved_step(8)  # the new path's step 8 is not certified until 3 healthy steps follow it
    assert g.certified() == 6
    for step in (7, 8, 9, 10):
        g.healthy(step)
    assert g.certified() == 8


def test_a_save_lost_after_it_began_is_never_certified():
    """The save of step 4 began, then its write failed (the checkpoint client calls ``lost_step``):
    step 4 is neither certified nor a rollback target; step 2 stays the certified step."""
    g = _guard(certify_after_steps=3)
    g.saved_step(2)
    g.saved_step(4)
    g.lost_step(4)
    g.lost_step(5)  # a step never saved: nothing to forget
    for step in range(10):
        g.healthy(step)
    assert g.certified_steps() == [2] and g.saved == [2]


def _facts(certified, rollbacks=(), max_rollbacks=3, metric="non-finite loss", earlier=0) -> RollbackFacts:
    return RollbackFacts(Trip(20, 1, metric), certified, tuple(rollbacks), max_rollbacks, earlier)


_EARLIER = RollbackRecord(Trip(12, 0, "non-finite loss"), 10, (160, 208))


@pytest.mark.parametrize(("facts", "why"), [
    (_facts(10), ""),
    (_facts(None), "no certified step"),
    (_facts(14, [_EARLIER]), ""),                                   # a newer step certified since: a new trip
    (_facts(10, [_EARLIER]), "recurred right after skipping samples [160, 208)"),
    (_facts(10, [_EARLIER], metric="loss spike"), ""),              # another metric: not the same trip
    (_facts(14, [_EARLIER], max_rollbacks=1), "max_rollbacks=1 rollbacks spent"),
    (_facts(14, max_rollbacks=0), "max_rollbacks=0"),
    # the budget is per job: rollbacks of earlier attempts count
    (_facts(14, [_EARLIER], max_rollbacks=3, earlier=2), "max_rollbacks=3 rollbacks spent (2 in earlier attempts)"),
    (_facts(14, max_rollbacks=2, earlier=2), "max_rollbacks=2 rollbacks spent (2 in earlier attempts)"),
    (_facts(14, max_rollbacks=3, earlier=2), ""),
])
def test_rollback_policy(facts, why):
    decided = RollbackPolicy.decide(facts)
    assert (decided == "") if not why else (why in decided)


def test_the_failure_report_names_step_rank_metric_and_samples():
    report = failure_report(Trip(20, 1, "loss spike"), "spent", (320, 336), [_EARLIER])
    assert report.splitlines()[0] == ("training guard: loss spike on rank 1 at step 21 (samples [320, 336)); "
                                      "not rolled back: spent")
    assert "earlier rollback 1: non-finite loss on rank 0 at step 13: rolled back to certified step 10" in report


def test_skipped_windows_shift_every_later_step_and_add_up():
    skips = SampleSkips(16)
    assert skips.first_sample(7) == 112
    w = skips.skip(6, 9)  # steps 6..9 read [96, 160)
    assert (w.lo, w.hi) == (96, 160)
    assert [skips.first_sample(s) for s in (5, 6, 7)] == [80, 160, 176]
    w2 = skips.skip(8, 8)  # the new step 8 read [192, 208)
    assert (w2.lo, w2.hi) == (192, 208) and skips.first_sample(8) == 208
    again = SampleSkips.from_lists(16, skips.as_lists())
    assert again == skips and again.windows == [SkipWindow(6, 96, 160), SkipWindow(8, 192, 208)]
    with pytest.raises(ValueError, match="a rollback goes back"):
        skips.skip(9, 8)


@pytest.mark.parametrize(("committed", "certified", "keep_k", "deleted"), [
    ([2, 4, 6, 8], None, 1, [2, 4, 6]),
    ([2, 4, 6, 8], 4, 1, [2, 6]),      # the newest certified step survives keep_latest_k
    ([2, 4, 6, 8], 8, 1, [2, 4, 6]),
])
def test_retention_never_deletes_the_newest_certified_step(committed, certified, keep_k, deleted):
    assert RetentionPolicy(keep_k).to_delete(committed, certified=certified) == deleted


def test_newest_certified_is_the_newest_recorded_among_committed_steps():
    assert newest_certified({4: None, 6: 2, 8: 4}) == 4
    assert newest_certified({2: None, 6: 2, 8: 5}) == 2  # step 5 is not committed (moved aside, never saved)
    assert newest_certified({6: 2, 8: 4}) is None
    assert newest_certified({8: None}) is None


def test_the_nan_fault_parses_at_step_only_and_fires_once(monkeypatch):
    assert parse_faults("nan@step:rank=1,step=9")[0].kind == "nan"
    with pytest.raises(ValueError, match="applies at step only"):
        parse_faults("nan@persist:rank=1,step=9")
    monkeypatch.setenv(ENV_VAR, "nan@step:rank=1,step=9")
    assert not take_nan(0, 9, 0) and not take_nan(1, 8, 0) and not take_nan(1, 9, 1)
    assert take_nan(1, 9, 0)
    assert not take_nan(1, 9, 0)  # once per job: the replay after a rollback runs clean


def test_the_manifest_records_the_certified_step_and_the_skipped_windows():
    m = Manifest(step=16, world_size=2, dp_size=2, spec_hash="x", files={}, certified_step=12,
                 skipped_samples=[[6, 96, 160]])
    again = Manifest.from_json(m.to_json())
    assert (again.certified_step, again.skipped_samples) == (12, [[6, 96, 160]])
    assert "skipped_samples" not in Manifest(step=1, world_size=1, dp_size=1, spec_hash="x", files={}).to_json()
    with pytest.raises(InvalidCheckpoint, match="skipped_samples"):
        Manifest.parse({**m.model_dump(mode="json"), "skipped_samples": [[6, 96]]})


def test_fingerprints_see_nan_and_diff_names_the_changed_tensors():
    a = {"w": tensor_stats(torch.ones(3)), "b": tensor_stats(torch.zeros(2))}
    assert a["w"].finite and (a["w"].numel, a["w"].sum) == (3, 3.0)
    poisoned = tensor_stats(torch.tensor([1.0, math.nan, math.inf]))
    assert (poisoned.nan, poisoned.inf, poisoned.finite) == (1, 1, False)
    assert diff_steps(a, a) == []
    b = {"w": tensor_stats(torch.tensor([1.0, 1.0, 2.0])), "b": a["b"], "c": a["b"]}
    assert [(d.name, d.a is None) for d in diff_steps(a, b)] == [("c", True), ("w", False)]


def test_the_checkpoint_actor_keeps_the_newest_certified_step_whatever_keep_latest_k_says(tmp_path):
    """Real saves through a CheckpointActor (no Ray) with keep_latest_k=1: the step the trainers
    reported certified, then the one a manifest records, survive the commits after them."""
    import asyncio
    from dataclasses import replace

    from raytrain_ckpt.checkpoint.records import TrainingPoint
    from tests.unit.test_checkpoint_actor import _save, _single_rank_actor

    actor = _single_rank_actor(tmp_path, 1)
    asyncio.run(_save(actor, 2))
    asyncio.run(actor.certify(2))
    for step in (4, 6):
        asyncio.run(_save(actor, step))
    assert sorted(actor.committed) == [2, 6]  # 4 went, as keep_latest_k=1 says; 2 is certified

    async def save_recording(step: int, certified: int) -> None:  # a report whose manifest records it
        original = actor.report

        async def report(r):
            return await original(replace(r, point=TrainingPoint(certified_step=certified)))
        actor.report = report
        try:
            await _save(actor, step)
        finally:
            actor.report = original
    asyncio.run(save_recording(8, 6))
    assert actor.committed[8].certified_step == 6
    assert sorted(actor.committed) == [6, 8]  # 6 is the newest certified now: 2 may go
    asyncio.run(_save(actor, 10))
    assert sorted(actor.committed) == [6, 10]


@pytest.mark.parametrize("where", ["local", "object store"])
def test_a_resume_keeps_skipping_the_windows_its_step_recorded_wherever_the_step_lives(tmp_path, where):
    """The skipped windows are in the manifest of the step a resume loads, on a local root or an
    object store (fsspec's memory://, the gs:// code path): the resumed stream skips them too."""
    import types
    import uuid

    from raytrain_ckpt.checkpoint.storage.backends import open_storage
    from raytrain_ckpt.rank.rollback import adopt_manifest
    from raytrain_ckpt.spec import JobSpec

    spec = JobSpec.model_validate({"name": "j", "model": {"name": "debug"},
                                   "training": {"global_batch_size": 16, "micro_batch_size": 2}})
    manifest = Manifest(step=8, world_size=2, dp_size=2, spec_hash="x", files={}, certified_step=6,
                        skipped_samples=[[6, 96, 160]])
    step = str(tmp_path / "step-00000008") if where == "local" else f"memory://ckpt-{uuid.uuid4().hex[:8]}/j/step-00000008"
    storage = open_storage(step)
    storage.makedirs(step)
    storage.write_bytes(storage.join(step, "manifest.json"), manifest.to_json().encode())
    trainer = types.SimpleNamespace(spec=spec, rank=0, skips=SampleSkips.from_lists(16, []))
    guard = _guard()
    adopt_manifest(trainer, guard, step)
    assert trainer.skips.as_lists() == [[6, 96, 160]]
    assert guard.last_certified == 6


# --- who is named when a rollback fails ----------------------------------------------------------

class _Rank0:
    rank = 0


def test_a_failed_rollback_names_the_rank_that_tripped_not_rank_0_that_reports():
    from raytrain_ckpt.control.group import guard_failure
    from raytrain_ckpt.rank.guard import GuardFailed
    from raytrain_ckpt.rank.rollback import _fail
    from raytrain_ckpt.rank.worker import WorkerFailure

    trip = Trip(step=7, rank=3, metric="non-finite loss")
    with pytest.raises(GuardFailed) as raised:
        _fail(_Rank0(), trip, "the rollback budget is spent", (112, 128), _guard())
    assert raised.value.rank == 3
    assert pickle.loads(pickle.dumps(raised.value)).rank == 3  # it crosses the actor boundary
    # what the worker of rank 0 raises, and what the controller records
    failure = guard_failure(1, 0, WorkerFailure(raised.value.rank, 1, raised.value.report, guard=raised.value.report))
    assert failure.rank == 3 and failure.kind == "rollback"
    assert str(failure).startswith("attempt 1 rollback: rank 3: training guard: non-finite loss on rank 3 at step 8")


def test_a_checkpoint_actor_killed_mid_rollback_is_named():
    import ray

    from raytrain_ckpt.checkpoint.roles.client_asks import ClientAsks
    from raytrain_ckpt.rank.rollback import RollbackInterrupted, _lease_certified

    class _Dead:
        def remote(self, *args):
            raise ray.exceptions.ActorDiedError()  # what a call on a killed actor's handle raises

    class _Ckpt:
        asks = ClientAsks(type("Actor", (), {"acquire": _Dead()})(), None)

        def wait_committed(self) -> None:
            pass

    class _Trainer(_Rank0):
        spec = type("Spec", (), {"checkpoint": type("C", (), {"verify_on_load": "size"})()})()

    guard = _guard()
    guard.certified_steps = lambda: [40]
    trip = Trip(step=47, rank=1, metric="loss spike")
    with pytest.raises(RollbackInterrupted, match=r"checkpoint actor died during the rollback of loss spike on rank 1 "
                                                  r"at step 48 \(leasing certified step 40\)"):
        _lease_certified(_Trainer(), _Ckpt(), guard, "rollback-0", trip)
