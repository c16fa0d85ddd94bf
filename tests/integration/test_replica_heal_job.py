"""A failure local to one replica group ends that group only: the others train on, the group is
replaced and healed from a live one at the rejoin step the membership rule fixes (a real Ray job,
dp_replicate=2 x dp_shard=2, a rank of the second group killed by a real exit)."""

from __future__ import annotations

import pytest

from raytrain_ckpt.common.faults import ENV_VAR
from raytrain_ckpt.control.controller import JobState
from raytrain_ckpt.control.driver import run_job
from raytrain_ckpt.control.preflight import load_spec

pytestmark = pytest.mark.integration

DEMO = "jobs/llama_debug_fsdp.yaml"
STEPS, FAIL_AT, HEAL = 24, 8, 6
JOB = [f"training.steps={STEPS}", "training.log_every_steps=1", "lr_scheduler.warmup_steps=2",
       "resources.num_workers=4", "resources.cpus_per_worker=0.5", "parallelism.dp_replicate=2",
       "parallelism.dp_shard=2", f"fault_tolerance.heal_steps={HEAL}", "fault_tolerance.max_restarts=1",
       "checkpoint.enabled=false"]


def _run(monkeypatch, name: str, fault: str = "exit"):
    monkeypatch.setenv(ENV_VAR, f"{fault}@step:rank=3,step={FAIL_AT}")  # rank 1 of replica group 1, at step index 8
    result = run_job(load_spec(DEMO, [*JOB, f"name={name}"]))
    monkeypatch.delenv(ENV_VAR)
    return result


@pytest.mark.parametrize("fault, kind", [("exit", "crash"), ("nan", "rollback"), ("hang", "hang")])
def test_a_failed_replica_group_is_replaced_and_healed_while_the_other_trains_on(ray_cluster, monkeypatch, fault, kind):
    """A crash (a real exit), or a NaN loss that trips the training guard in the second group (a
    group that does not save has no rollback of its own: a live group's state replaces its own)."""
    first = _run(monkeypatch, f"heal-{fault}", fault)
    assert first.state is JobState.SUCCEEDED, first.error
    # one attempt: the healthy group never went back to an earlier step
    assert first.attempts == 1
    assert [f.kind for f in first.failures] == [kind] and first.failures[0].rank == 3
    assert [(h["replica"], h["rank"], h["kind"]) for h in first.heals] == [(1, 3, kind)]
    assert first.heals[0]["healed_s"] > 0  # the failure's detection -> the replacement trained a step
    by_rank = {r.rank: r for r in first.results}
    assert sorted(by_rank) == [0, 1, 2, 3] and all(r.steps == STEPS for r in by_rank.values())
    # both groups end with the same shards, bit for bit (rank k of one group = rank k of the other)
    assert by_rank[0].fingerprint == by_rank[2].fingerprint != by_rank[1].fingerprint == by_rank[3].fingerprint
    # the rule: the group failed in step FAIL_AT+1 (1-based), is out of it and of the H steps after,
    # and its replacement was healed at step FAIL_AT+1+H
    s = FAIL_AT + 1
    skipped = [(step, g) for step, g in by_rank[0].replicas["skipped"]]
    assert skipped == [(step, 1) for step in range(s, s + HEAL + 1)]
    assert by_rank[2].replicas["healed_at"] == s + HEAL and by_rank[0].replicas["healed_at"] is None
    assert by_rank[2].replicas["skipped"] == by_rank[0].replicas["skipped"]
    # every sample accounted for: tokens seen are the trained ones, the skipped share named above
    job = load_spec(DEMO, [*JOB, "name=heal-x"])
    t = job.training
    per_group = t.global_batch_size // 2
    assert by_rank[0].tokens_seen == (STEPS * t.global_batch_size - len(skipped) * per_group) * t.seq_len
    assert by_rank[2].tokens_seen == by_rank[0].tokens_seen
    # the samples each skipped share held: the second half of every skipped step's global batch
    assert by_rank[0].replicas["skipped_samples"] == [(step, 1, (step - 1) * t.global_batch_size + per_group,
                                                      step * t.global_batch_size) for step, _ in skipped]
    if fault != "exit":
        return
    # the same fault again: the same membership, the same parameters, bit for bit
    second = _run(monkeypatch, "heal-again")
    assert second.state is JobState.SUCCEEDED, second.error
    assert [r.fingerprint for r in second.results] == [r.fingerprint for r in first.results]
    assert second.results[0].replicas["skipped"] == first.results[0].replicas["skipped"]
