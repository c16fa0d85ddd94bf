"""A save's calls into the CheckpointActor, one per node, and as many as thousands of ranks make: a
real CheckpointActor as a Ray actor, each node's ``NodeCourier`` (what runs in the node's writer) sending its ranks' hand-offs, reports
and stalls to it, real DCP plans of the debug model, real (sparse) files.

The actor counts ranks, not calls: a node's report missing one rank leaves the step uncommitted
(every rank's answer is "pending", none "committed"), the missing rank's report commits it.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import ray

from bench.scale_ranks import local_plan, template, write_results
from raytrain_ckpt.checkpoint.format.rankresults import RankResults
from raytrain_ckpt.checkpoint.errors import StepAborted
from raytrain_ckpt.checkpoint.format.plannumbers import SharedPlan, difference_from, own_central
from raytrain_ckpt.checkpoint.policy.retention import RetentionPolicy
from raytrain_ckpt.checkpoint.records import CentralPlan, GroupLayout, RankReport, StepPhase
from raytrain_ckpt.checkpoint.roles.actor import CheckpointActor, actor_concurrency
from raytrain_ckpt.checkpoint.roles.courier import NodeCourier
from raytrain_ckpt.control.preflight import load_spec
from raytrain_ckpt.models.config import PRESETS

pytestmark = pytest.mark.integration

NODES, PER_NODE = 2, 4
WORLD = NODES * PER_NODE


def _report(central, step: int, rank: int, tmp: str) -> RankReport:
    """Rank ``rank``'s files of ``step`` written (sparse: their sizes, not their bytes) and its report."""
    results = write_results(central.plan, step)
    name = results[0].storage_data.relative_path
    size = results[-1].storage_data.offset + results[-1].storage_data.length
    with open(os.path.join(tmp, name), "wb") as f:
        f.truncate(size)
    return RankReport(step, rank, 0, central.plan_id, RankResults.of(results), {name: {"size": size, "crc32c": 0}})


def test_a_node_report_missing_one_rank_leaves_the_step_uncommitted(ray_cluster, tmp_path: Path) -> None:
    shape = template(load_spec("jobs/llama_debug_fsdp.yaml", []), PRESETS["debug"])
    actor = ray.remote(CheckpointActor).options(num_cpus=0).remote(str(tmp_path), RetentionPolicy(None))
    try:
        ray.get(actor.configure.remote(GroupLayout(WORLD, WORLD, "h", None)))
        # Each rank's plan as the ranks send it (rank 0's whole, the others' differences from it)
        # and each rank's central plan made from the answer, as ``planning.py`` does.
        plans = [local_plan(shape, r, WORLD) for r in range(WORLD)]
        sent = [SharedPlan(plans[0])] + [difference_from(plans[0], p, 0) or p for p in plans[1:]]
        answers = ray.get([actor.plan.remote(0, 10, r, sent[r], 60) for r in range(WORLD)])
        centrals = [CentralPlan(own_central(a.plan, plans[r]), a.plan_id) for r, a in enumerate(answers)]
        couriers = [NodeCourier(lambda batch: ray.get(actor.node_report.remote(batch)), lambda: None)
                    for _ in range(NODES)]
        for node, courier in enumerate(couriers):
            for rank in range(node * PER_NODE, (node + 1) * PER_NODE):
                courier.expect(0, rank)
        node_of = {r: couriers[r // PER_NODE] for r in range(WORLD)}

        with ThreadPoolExecutor(WORLD) as pool:  # each rank's hand-off and report on a thread of its own, as in the writer
            tmps = list(pool.map(lambda r: node_of[r].accepted(10, r, 0), range(WORLD)))
            assert len(set(tmps)) == 1 and ray.get(actor.open_step.remote(10, 0)) == tmps[0]
            assert [c.calls for c in couriers] == [1] * NODES  # one call per node for its ranks' hand-offs
            for r in range(WORLD):
                node_of[r].stall(10, r, 0.01 * (r + 1))
            reports = {r: _report(centrals[r], 10, r, tmps[0]) for r in range(WORLD)}
            # The last node's last rank never reports: its node's call carries the other three.
            outcomes = list(pool.map(lambda r: node_of[r].report(reports[r]), range(WORLD - 1)))
        assert outcomes == ["pending"] * (WORLD - 1)
        assert [c.calls for c in couriers] == [2] * NODES
        status = ray.get(actor.status.remote())
        assert status.committed == [] and status.inflight.phase is StepPhase.WRITING
        assert sum(v == 2 for v in status.inflight.ranks.values()) == WORLD - 1
        with pytest.raises(Exception, match="Timeout"):
            ray.get(actor.wait_committed.remote(10, 0.3))

        assert node_of[WORLD - 1].report(reports[WORLD - 1]) == "committed"
        ray.get(actor.wait_committed.remote(10, 10))
        status = ray.get(actor.status.remote())
        assert status.committed == [10]
        assert status.steps[10].wall["stall_s"] == pytest.approx(0.01 * WORLD)  # the stalls rode with the reports
        # A stall of a step the node already reported (a save that waited for its commit) goes at once.
        node_of[0].stall(10, 0, 5.0)
        deadline = time.monotonic() + 3.0
        while ray.get(actor.status.remote()).steps[10].wall["stall_s"] != 5.0:
            assert time.monotonic() < deadline, "the late stall did not go at once"
            time.sleep(0.1)

        # An entry's error is its own caller's: a hand-off of a step aborted meanwhile raises there.
        ray.get(actor.abort.remote(20, "a rank failed", 0))
        with pytest.raises(StepAborted, match="aborted"):
            couriers[0].accepted(20, 0, 0)
    finally:
        ray.kill(actor)


def test_a_first_save_of_more_ranks_than_rays_default_concurrency_plans(ray_cluster, tmp_path: Path) -> None:
    """Every rank's ``plan`` waits in the actor for every other rank's. Ray runs 1,000 calls of an
    async actor at once unless told otherwise, so with more ranks than that the first 1,000 waited
    for ranks queued behind them until the plan's timeout. The actor as the service creates it
    (``actor_concurrency``) takes them all; with Ray's default, the same plan times out."""
    world = 1100
    shape = template(load_spec("jobs/llama_debug_fsdp.yaml", []), PRESETS["debug"])
    first = local_plan(shape, 0, world)
    sent = [SharedPlan(first)] + [difference_from(first, local_plan(shape, r, world), 0) or local_plan(shape, r, world)
                                  for r in range(1, world)]

    def planned(concurrency: int | None, timeout_s: float) -> list:
        options = {"num_cpus": 0} | ({"max_concurrency": concurrency} if concurrency else {})
        actor = ray.remote(CheckpointActor).options(**options).remote(str(tmp_path / str(concurrency)),
                                                                      RetentionPolicy(None))
        try:
            ray.get(actor.configure.remote(GroupLayout(world, world, "h", None)))
            return ray.get([actor.plan.remote(0, 10, r, sent[r], timeout_s) for r in range(world)])
        finally:
            ray.kill(actor)

    answers = planned(actor_concurrency(world), 300)
    assert len({a.plan_id for a in answers}) == 1 and len(answers) == world
    with pytest.raises(StepAborted, match=f"only ranks .* of {world} arrived"):
        planned(None, 20)
