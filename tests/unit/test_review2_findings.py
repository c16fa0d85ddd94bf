"""Findings of the second review of the commits after c41d943 (each a failing test, then its fix)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

from raytrain_ckpt.checkpoint.errors import StepAborted
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy
from raytrain_ckpt.checkpoint.records import GroupLayout


# --- coordinator.plan: a retried call after the gather was dropped ---------------------------

W = 2


@pytest.fixture(scope="module")
def small_plans() -> list:
    from bench.scale_ranks import local_plan, template
    from raytrain_ckpt.control.preflight import load_spec
    from raytrain_ckpt.models.config import PRESETS

    spec = load_spec("jobs/llama_debug_fsdp.yaml", [])
    shape = template(spec, PRESETS["debug"])
    return [local_plan(shape, r, W) for r in range(W)]


def test_a_retried_plan_call_after_every_rank_took_its_plan_gets_it_again(tmp_path: Path, small_plans: list) -> None:
    """``CheckpointClient._ensure_layout`` calls ``plan`` through ``call_restarting``: on
    ActorUnavailableError (the reply lost, the actor still the same) it calls again. Before the
    gather was dropped, the retry found the central plan at once. Now, once every rank took its
    plan, the retry opens a new gather that no other rank joins: it waits ``commit_timeout_s``
    (while the other ranks wait for it in their collectives) and the save is aborted."""
    from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor

    actor = CheckpointActor(str(tmp_path / "job"), RetentionPolicy(None))
    asyncio.run(actor.configure(GroupLayout(W, W, "h", None)))

    async def scenario() -> None:
        first = await asyncio.gather(*(actor.plan(0, 10, r, small_plans[r], 30) for r in range(W)))
        t0 = time.monotonic()
        again = await actor.plan(0, 10, 1, small_plans[1], 1.0)  # rank 1's call, sent again
        assert time.monotonic() - t0 < 0.5
        assert again.plan_id == first[1].plan_id and again.plan.items == first[1].plan.items
        assert again.plan.storage_data == first[1].plan.storage_data

    asyncio.run(scenario())
