"""``interval_steps: auto`` on real gloo ranks whose step times and save costs differ: every rank
still saves the same steps (decisions come from values all ranks share)."""

from __future__ import annotations

import time

import pytest

from tests.distributed.launch import run_ranks

pytestmark = pytest.mark.distributed


def _schedule(steps: int) -> list[tuple[int, int]]:
    import torch
    import torch.distributed as dist

    from raytrain_ckpt.checkpoint.roles.client import CheckpointClient
    from raytrain_ckpt.checkpoint.policy.interval import IntervalHistory
    from raytrain_ckpt.spec import CheckpointSpec

    rank = dist.get_rank()
    cfg = CheckpointSpec(enabled=True, interval_steps="auto", save_final=False)
    # actor=None: no CheckpointActor; the decision itself needs only the process group
    client = CheckpointClient(cfg, rank, 0, steps, actor=None, writer=None, device=torch.device("cpu"),
                              prior_mtbf_s=2.0, history=IntervalHistory(cost_s=0.01, step_time_s=0.01))
    saved = []
    for step in range(1, steps + 1):
        time.sleep(0.002 * (rank + 1) * (1 + step % 3))  # the ranks' step times differ
        if client.due(step):
            stall = 0.003 * (rank + 1)  # and so do their stalls
            client.stats.stall_s += stall
            client.interval.saved(stall)
            saved.append((step, client.schedule.interval_steps))
    return saved


def test_ranks_with_different_costs_save_the_same_steps():
    ranks = run_ranks(_schedule, 2, 60)
    assert ranks[0] == ranks[1]
    assert len(ranks[0]) >= 2, ranks[0]  # at least one re-plan from the shared measurements
