"""The CheckpointActor at many ranks keeps the commit protocol (real actor object, real DCP files).

``bench/scale.py`` drives the actor with simulated ranks (``bench/scale_ranks.py``); what it
made cheaper per call (each rank's progress published alone, the cached plan's metadata shared
rather than copied per commit) must not weaken a guarantee: a step commits only when every rank
reported, one missing report leaves it uncommitted until ``settle`` aborts it, and the progress
series say exactly what the full view says.
"""

from __future__ import annotations

import asyncio
import os
import pickle
from pathlib import Path

import pytest

from bench.scale_ranks import local_plan, template, write_results
from raytrain_ckpt import metrics
from raytrain_ckpt.checkpoint.errors import StepAborted
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy
from raytrain_ckpt.checkpoint.records import GroupLayout, RankReport, StepPhase
from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor
from raytrain_ckpt.models.config import PRESETS
from raytrain_ckpt.preflight import load_spec

N = 32


@pytest.fixture(scope="module")
def plans() -> list:
    spec = load_spec("jobs/llama_debug_fsdp.yaml", [])
    shape = template(spec, PRESETS["debug"])
    return [local_plan(shape, r, N) for r in range(N)]


def _gauge(name: str, **tags: str) -> float:
    """The value the actor last set on gauge ``name`` with ``tags``."""
    return metrics._gauges[(name, tuple(sorted(tags.items())))]


async def _hand_off(actor: CheckpointActor, step: int, centrals: list,
                    skip: set[int]) -> tuple[str, list[str]]:
    """Every rank hands ``step`` off; every rank not in ``skip`` reports its files (sparse, real).
    Returns the step's temporary directory and the reports' outcomes."""
    tmp = await actor.open_step(step, 0)
    outcomes = []
    for rank in range(N):
        await actor.accepted(step, rank, 0, None)
    for rank in range(N):
        if rank in skip:
            continue
        results = write_results(centrals[rank].plan, step)
        name = results[0].storage_data.relative_path
        size = results[-1].storage_data.offset + results[-1].storage_data.length
        with open(os.path.join(tmp, name), "wb") as f:
            f.truncate(size)
        outcomes.append(await actor.report(RankReport(step, rank, 0, centrals[rank].plan_id, results,
                                                      {name: {"size": size, "crc32c": 0}})))
    return tmp, outcomes


def test_one_missing_report_of_many_ranks_still_aborts_the_step(tmp_path: Path, plans: list) -> None:
    actor = CheckpointActor(str(tmp_path), RetentionPolicy(None))
    asyncio.run(actor.configure(GroupLayout(N, N, "h", None)))
    job = actor.layout.name

    async def scenario() -> None:
        centrals = await asyncio.gather(*(actor.plan(0, 10, r, plans[r], 30) for r in range(N)))
        assert (await _hand_off(actor, 10, centrals, set()))[1] == ["pending"] * (N - 1) + ["committed"]
        # The next save of the attempt reuses the plan; rank 17's report never comes.
        tmp, outcomes = await _hand_off(actor, 20, centrals, {17})
        assert outcomes == ["pending"] * (N - 1)
        assert actor.steps.phase_of(20) is StepPhase.WRITING
        # The per-rank series, published one rank at a time, equal the full view.
        view = actor.steps.inflight([])
        assert view.step == 20 and view.ranks[17] == 1 and sum(v == 2 for v in view.ranks.values()) == N - 1
        for rank in range(N):
            assert _gauge("checkpoint_rank_progress", job=job, rank=str(rank)) == view.ranks[rank], rank
        assert _gauge("checkpoint_inflight_ranks", job=job, stage="written") == N - 1
        assert _gauge("checkpoint_inflight_phase", job=job, phase="writing") == 1
        with pytest.raises(asyncio.TimeoutError):
            await actor.wait_committed(20, 0.2)
        await actor.settle(0.5)
        with pytest.raises(StepAborted):
            await actor.wait_committed(20, 0.2)
        assert not Path(tmp).exists()

    asyncio.run(scenario())
    assert sorted(actor.committed) == [10]
    assert actor.steps.failed[20].startswith("not committed within")
    # The committed step's .metadata holds every rank's items, read back as DCP reads it.
    meta = pickle.loads((actor.layout.step_dir(10) / ".metadata").read_bytes())
    assert len(meta.storage_data) == len({i.index for p in plans for i in p.items})
